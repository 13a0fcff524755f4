package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/blockdev"
)

// ErrProtocol is wrapped by the error ServeConn and ServeTransmission return
// when the client broke the protocol (bad magic, oversize option or request,
// unknown client flags…); the connection was closed.
var ErrProtocol = errors.New("nbd: protocol violation")

// Reasons a connection ends; the ones ServeConn reports as nil.
var (
	errClientDisc     = errors.New("client sent NBD_CMD_DISC")
	errClientAbort    = errors.New("client sent NBD_OPT_ABORT")
	errClientGone     = errors.New("client closed the connection")
	errClosedByServer = errors.New("server closed")
	errRefused        = errors.New("nbd: refused")
)

// shutdownWriteGrace bounds how long replies of in-flight requests may take
// to leave once the connection is being shut down, so that a client that
// stopped reading cannot hold Close forever.
const shutdownWriteGrace = 30 * time.Second

// readBufferSize is the reader's buffer: a request header and a small
// WRITE's payload come in one read, and several pipelined requests too.
const readBufferSize = 64 << 10

// conn is one client connection.
type conn struct {
	s       *Server
	nc      net.Conn
	br      *bufio.Reader   // nc's reads, all of them
	ctx     context.Context // the backend's context
	log     *zap.Logger
	stopCtx func() bool
	export  *export
	index   int // the connection's number on its server, from 0

	closing   atomic.Bool
	reasonMu  sync.Mutex
	reason    error // the first reason for the end wins
	reasonSet bool

	// Used by the reader goroutine only.
	rhdr     [requestSize]byte
	scratch  []byte // for discarding payloads, made on first use
	work     chan *request
	nworkers int
	be       Backend            // the export's backend, or its queue for this connection
	sub      blockdev.Submitter // be, if it is one
	pl       blockdev.Plugger   // sub, if it is one
	// plugged: pl holds back what was submitted (plug, unplug).
	plugged bool

	workers sync.WaitGroup
	reqs    sync.WaitGroup // requests read and not finished
	// inFlight counts the requests read and not finished; the reader
	// waits on slotFree when it would exceed MaxInFlight.
	inFlight atomic.Int64
	slotFree chan struct{}

	replyWriter
}

// request is the pooled state of one request.
type request struct {
	c          *conn
	typ, flags uint16
	cookie     uint64
	off        uint64
	length     uint32
	errno      uint32 // set when the request was refused before the backend
	buf        *Buffer
	start      time.Time

	hdr  [replySize]byte
	iov  [][]byte    // backing array of bufs, reused
	bufs net.Buffers // consumed by WriteTo; a field so that it does not escape per call
}

func (s *Server) getRequest() *request {
	s.reqMu.Lock()
	defer s.reqMu.Unlock()
	if n := len(s.freeReq); n > 0 {
		r := s.freeReq[n-1]
		s.freeReq = s.freeReq[:n-1]
		return r
	}
	return new(request)
}

func (s *Server) putRequest(r *request) {
	clear(r.iov)
	r.iov = r.iov[:0]
	r.bufs = nil
	r.buf = nil
	r.errno = 0
	r.c = nil
	s.reqMu.Lock()
	s.freeReq = append(s.freeReq, r)
	s.reqMu.Unlock()
}

// setReason records why the connection ends, unless a reason is known
// already, and returns the one in force.
func (c *conn) setReason(err error) error {
	c.reasonMu.Lock()
	defer c.reasonMu.Unlock()
	if !c.reasonSet && err != nil {
		c.reason, c.reasonSet = err, true
	}
	return c.reason
}

// shutdown makes the connection stop reading requests: the reader wakes up
// with a deadline error, lets the requests in flight finish and closes.
// Safe from any goroutine, any number of times.
func (c *conn) shutdown(reason error) {
	c.setReason(reason)
	if c.closing.Swap(true) {
		return
	}
	if err := c.nc.SetReadDeadline(time.Now()); err != nil {
		c.nc.Close() // no deadlines on this conn: closing is the only way
		return
	}
	_ = c.nc.SetWriteDeadline(time.Now().Add(shutdownWriteGrace))
}

// finish closes the socket, logs the end and turns the reason into what
// ServeConn returns.
func (c *conn) finish(err error) error {
	reason := c.setReason(err)
	c.closing.Store(true)
	c.nc.Close()
	clean := errors.Is(reason, errClientDisc) || errors.Is(reason, errClientAbort) ||
		errors.Is(reason, errClientGone) || errors.Is(reason, errClosedByServer)
	if clean {
		c.log.Info("nbd: disconnected", zap.String("reason", reason.Error()))
		return nil
	}
	if errors.Is(reason, context.Canceled) || errors.Is(reason, context.DeadlineExceeded) {
		c.log.Info("nbd: disconnected", zap.String("reason", "context ended: "+reason.Error()))
		if err := c.ctx.Err(); err != nil {
			return err
		}
		return reason
	}
	c.log.Warn("nbd: disconnected", zap.String("reason", reason.Error()))
	return reason
}

// clientGone tells the errors of a peer that went away.
func clientGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// readErr classifies an error reading from the socket.
func (c *conn) readErr(err error, what string) error {
	switch {
	case c.closing.Load():
		return errClosedByServer // the reason given to shutdown wins anyway
	case clientGone(err):
		return errClientGone
	}
	return fmt.Errorf("%s: %w", what, err)
}

// writeErr classifies an error writing to the socket.
func (c *conn) writeErr(err error, what string) error {
	switch {
	case c.closing.Load():
		return errClosedByServer
	case clientGone(err):
		return errClientGone
	}
	return fmt.Errorf("%s: %w", what, err)
}

// transmit runs the transmission phase: this goroutine reads requests, a
// worker goroutine per request in flight serves it. It returns once every
// request read has been answered (or its reply failed).
func (c *conn) transmit(x *export) error {
	c.export = x
	c.work = make(chan *request)
	c.slotFree = make(chan struct{}, 1)
	c.be = x.Backend
	if q, ok := x.Backend.(blockdev.Queuer); ok {
		c.be = q.Queue(c.index)
	}
	c.sub, _ = c.be.(blockdev.Submitter)
	c.pl, _ = c.sub.(blockdev.Plugger)
	c.startWriter()
	err := c.readLoop(x)
	close(c.work)
	c.workers.Wait()
	c.reqs.Wait()
	c.stopWriter()
	return err
}

// readLoop reads requests and starts them. While more requests are in
// its buffer, what it submits is plugged (blockdev.Plugger): the requests
// of one read of the socket start together (one doorbell on RDMA). It
// unplugs before anything that may block: reading the socket, waiting for
// a slot (admit) or a worker (dispatch).
func (c *conn) readLoop(x *export) error {
	defer c.unplug()
	for {
		if c.br.Buffered() < requestSize {
			c.unplug()
		}
		if _, err := io.ReadFull(c.br, c.rhdr[:]); err != nil {
			return c.readErr(err, "reading a request")
		}
		h := &c.rhdr
		if m := binary.BigEndian.Uint32(h[0:]); m != magicRequest {
			return fmt.Errorf("%w: bad request magic %#08x", ErrProtocol, m)
		}
		typ := binary.BigEndian.Uint16(h[6:])
		if typ == cmdDisc {
			// Recorded now: a reply that fails while the requests in flight
			// drain (the kernel shuts its socket right after DISC) must not
			// replace the clean reason.
			return c.setReason(errClientDisc)
		}
		length := binary.BigEndian.Uint32(h[24:])
		if typ == cmdWrite && length > hardMaxBlock {
			return fmt.Errorf("%w: WRITE of %d bytes, over the hard limit of %d", ErrProtocol, length, hardMaxBlock)
		}
		if m := c.s.metrics; m != nil {
			m.inFlight.Inc() // read, not answered: held here while MaxInFlight are
		}
		c.admit()
		r := c.s.getRequest()
		r.c = c
		r.typ = typ
		r.flags = binary.BigEndian.Uint16(h[4:])
		r.cookie = binary.BigEndian.Uint64(h[8:])
		r.off = binary.BigEndian.Uint64(h[16:])
		r.length = length
		r.errno = 0
		r.start = time.Now()
		if typ == cmdWrite {
			if err := c.readWrite(x, r); err != nil {
				c.s.putRequest(r)
				c.release()
				if m := c.s.metrics; m != nil {
					m.inFlight.Dec()
				}
				return err
			}
		} else {
			r.errno = c.check(x, r)
		}
		c.reqs.Add(1)
		if c.submit(r) {
			continue
		}
		c.unplug()
		c.dispatch(r)
	}
}

// plug makes the backend hold back what is submitted until unplug, if
// more requests are in the buffer to go with it.
func (c *conn) plug() {
	if c.pl != nil && !c.plugged && c.br.Buffered() >= requestSize {
		c.plugged = true
		c.pl.Plug()
	}
}

// unplug starts what the backend held back since plug.
func (c *conn) unplug() {
	if c.plugged {
		c.plugged = false
		c.pl.Unplug()
	}
}

// admit counts a request in flight, first waiting while MaxInFlight are.
func (c *conn) admit() {
	if c.inFlight.Add(1) > int64(c.s.maxInFlight) {
		c.unplug()   // (what would free a slot may be held back)
		<-c.slotFree // from the release that brings the count back to the limit
	}
}

// release uncounts a request in flight (see admit).
func (c *conn) release() {
	if c.inFlight.Add(-1) >= int64(c.s.maxInFlight) {
		c.slotFree <- struct{}{} // the reader waits for it: cap 1, never full here
	}
}

// submit starts a valid READ or WRITE on a backend that is a
// blockdev.Submitter, from the reader: the backend completes it (Complete)
// without a worker. It reports false for a request a worker must serve.
func (c *conn) submit(r *request) bool {
	if c.sub == nil || r.errno != 0 || r.length == 0 {
		return false
	}
	switch r.typ {
	case cmdRead:
		b, err := c.be.Alloc(c.ctx, int(r.length))
		if err != nil || !sized(b, r.length) {
			if b != nil {
				c.be.Free(b)
			}
			return false // the worker reports it
		}
		r.buf = b
		c.plug()
		c.sub.SubmitRead(c.ctx, b, r.off, r)
		return true
	case cmdWrite:
		if r.buf == nil {
			return false
		}
		c.plug()
		c.sub.SubmitWrite(c.ctx, r.buf, r.off, r.flags&cmdFlagFUA != 0, r)
		return true
	}
	return false
}

// Complete ends a request started with submit (blockdev.Completion); it
// may run on the backend's completion path, and does not block: the reply
// is written at once if the socket takes it, else by the writer goroutine.
func (r *request) Complete(err error) {
	r.prepareResult(err)
	r.c.send(r)
}

// CompleteBatched ends a request started with submit, as Complete, but its
// reply waits in the connection's batch for the Flusher it returns
// (blockdev.BatchCompletion): the replies of a batch go out in one writev.
func (r *request) CompleteBatched(err error) blockdev.Flusher {
	r.prepareResult(err)
	return r.c.batchReply(r)
}

// prepareResult makes the reply of a request started with submit for the
// backend's result err.
func (r *request) prepareResult(err error) {
	errno := uint32(0)
	if err != nil {
		errno = r.c.errnoOf(err, errIO)
	}
	r.c.prepareReply(r, errno, err == nil && r.typ == cmdRead)
}

// inRange tells whether [off, off+length) lies within the export.
func inRange(x *export, off uint64, length uint32) bool {
	size := x.size()
	return uint64(length) <= size && off <= size-uint64(length)
}

// check validates a request without payload; it returns the error to reply
// with, or 0.
func (c *conn) check(x *export, r *request) uint32 {
	allowed := uint16(0)
	if x.CanFUA {
		allowed |= cmdFlagFUA // valid on every command once negotiated
	}
	switch r.typ {
	case cmdRead:
		switch {
		case r.flags&^allowed != 0, r.length > x.max, !inRange(x, r.off, r.length):
			return errInval
		}
	case cmdFlush:
		if !x.CanFlush || r.flags&^allowed != 0 {
			return errInval
		}
	case cmdTrim:
		switch {
		case x.ReadOnly:
			return errPerm
		case !x.CanTrim, r.flags&^allowed != 0, !inRange(x, r.off, r.length):
			return errInval
		}
	case cmdWriteZeroes:
		switch {
		case x.ReadOnly:
			return errPerm
		case !x.CanZero, r.flags&^(allowed|cmdFlagNoHole) != 0:
			return errInval
		case !inRange(x, r.off, r.length):
			return errNoSpc
		}
	default:
		return errInval
	}
	return 0
}

// readWrite validates a WRITE and reads its payload: into a buffer of the
// backend when the request is valid, into the void otherwise. An error means
// the connection must end.
func (c *conn) readWrite(x *export, r *request) error {
	allowed := uint16(0)
	if x.CanFUA {
		allowed |= cmdFlagFUA
	}
	switch {
	case x.ReadOnly:
		r.errno = errPerm
	case r.flags&^allowed != 0, r.length > x.max:
		r.errno = errInval
	case !inRange(x, r.off, r.length):
		r.errno = errNoSpc
	case r.length == 0:
		return nil
	default:
		b, err := c.be.Alloc(c.ctx, int(r.length))
		switch {
		case err != nil:
			r.errno = c.errnoOf(err, errNoMem)
		case !sized(b, r.length):
			if b != nil {
				c.be.Free(b)
			}
			c.log.Error("nbd: backend lent a buffer of the wrong size", zap.Uint32("want", r.length))
			r.errno = errIO
		default:
			r.buf = b
			for _, seg := range b.Segs {
				if c.br.Buffered() < len(seg) {
					c.unplug() // (the read may block)
				}
				if _, err := io.ReadFull(c.br, seg); err != nil {
					c.be.Free(b)
					r.buf = nil
					return c.readErr(err, "reading a WRITE payload")
				}
			}
			return nil
		}
	}
	return c.discard(r.length)
}

// sized tells whether b's segments add up to n bytes.
func sized(b *Buffer, n uint32) bool {
	if b == nil {
		return false
	}
	var t uint64
	for _, s := range b.Segs {
		t += uint64(len(s))
	}
	return t == uint64(n)
}

// discard consumes n payload bytes of a refused WRITE.
func (c *conn) discard(n uint32) error {
	if n == 0 {
		return nil
	}
	c.unplug() // (the reads may block)
	if c.scratch == nil {
		c.scratch = make([]byte, 64<<10)
	}
	for n > 0 {
		k := min(n, uint32(len(c.scratch)))
		if _, err := io.ReadFull(c.br, c.scratch[:k]); err != nil {
			return c.readErr(err, "discarding a WRITE payload")
		}
		n -= k
	}
	return nil
}

// dispatch hands r to an idle worker, starts a new one while fewer than
// MaxInFlight exist, and otherwise waits for one to become idle: the reader
// stops reading then, which is the backpressure on the client. Workers live
// as long as the connection, so a request costs no goroutine start.
func (c *conn) dispatch(r *request) {
	select {
	case c.work <- r:
		return
	default:
	}
	if c.nworkers < c.s.maxInFlight {
		c.nworkers++
		c.workers.Add(1)
		go c.worker(r)
		return
	}
	c.work <- r
}

func (c *conn) worker(r *request) {
	defer c.workers.Done()
	for {
		c.serve(r)
		var ok bool
		if r, ok = <-c.work; !ok {
			return
		}
	}
}

// serve runs one request against the backend and replies.
func (c *conn) serve(r *request) {
	be := c.be
	errno := r.errno
	data := false
	if errno == 0 {
		var err error
		fua := r.flags&cmdFlagFUA != 0
		switch r.typ {
		case cmdRead:
			if r.length == 0 {
				break
			}
			b, aerr := be.Alloc(c.ctx, int(r.length))
			switch {
			case aerr != nil:
				errno = c.errnoOf(aerr, errNoMem)
			case !sized(b, r.length):
				if b != nil {
					be.Free(b)
				}
				c.log.Error("nbd: backend lent a buffer of the wrong size", zap.Uint32("want", r.length))
				errno = errIO
			default:
				r.buf = b
				if err = be.ReadAt(c.ctx, b, r.off); err == nil {
					data = true
				}
			}
		case cmdWrite:
			if r.buf != nil {
				err = be.WriteAt(c.ctx, r.buf, r.off, fua)
			}
		case cmdFlush:
			err = be.Flush(c.ctx)
		case cmdTrim:
			if r.length > 0 {
				err = be.Trim(c.ctx, r.off, uint64(r.length), fua)
			}
		case cmdWriteZeroes:
			if r.length > 0 {
				err = be.WriteZeroes(c.ctx, r.off, uint64(r.length), r.flags&cmdFlagNoHole != 0, fua)
			}
		}
		if err != nil {
			errno = c.errnoOf(err, errIO)
		}
	}
	c.reply(r, errno, data)
}

// done ends r once its reply was sent (or could not be): the buffer goes
// back to the backend, r to the pool.
func (c *conn) done(r *request) {
	if r.buf != nil {
		c.be.Free(r.buf)
	}
	c.s.putRequest(r)
	c.release()
	c.reqs.Done()
}

// reply sends the simple reply of r, followed by its data for a successful
// READ, in one writev (see replyWriter), then ends r.
func (c *conn) reply(r *request, errno uint32, data bool) {
	c.prepareReply(r, errno, data)
	c.send(r)
}

// prepareReply makes r's reply (r.bufs) and counts r as finished.
func (c *conn) prepareReply(r *request, errno uint32, data bool) {
	binary.BigEndian.PutUint32(r.hdr[0:], magicSimpleReply)
	binary.BigEndian.PutUint32(r.hdr[4:], errno)
	binary.BigEndian.PutUint64(r.hdr[8:], r.cookie)
	r.iov = append(r.iov[:0], r.hdr[:])
	if data {
		r.iov = append(r.iov, r.buf.Segs...)
	}
	r.bufs = r.iov
	r.errno = errno
	// Counted before the client can see the reply.
	if m := c.s.metrics; m != nil {
		m.inFlight.Dec()
		m.done(r.typ, errno == 0, r.length, r.start)
	}
}

// errnoOf maps a backend error to an NBD error: the errno it wraps when NBD
// defines that one, ESHUTDOWN when the context ended, def otherwise.
func (c *conn) errnoOf(err error, def uint32) uint32 {
	var e syscall.Errno
	if errors.As(err, &e) {
		if w, ok := wireErrno(e); ok {
			return w
		}
	}
	if (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) && c.ctx.Err() != nil {
		return errShutdown
	}
	return def
}

// wireErrno maps a host errno to the NBD value, when NBD defines it.
func wireErrno(e syscall.Errno) (uint32, bool) {
	switch e {
	case syscall.EPERM:
		return errPerm, true
	case syscall.EIO:
		return errIO, true
	case syscall.ENOMEM:
		return errNoMem, true
	case syscall.EINVAL:
		return errInval, true
	case syscall.ENOSPC:
		return errNoSpc, true
	case syscall.EOVERFLOW:
		return errOverflow, true
	case syscall.ENOTSUP:
		return errNotSup, true
	case syscall.ESHUTDOWN:
		return errShutdown, true
	}
	return 0, false
}
