package tcp

import (
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/rawsock"
	"github.com/rblk/rblk/transport"
)

var (
	errPeerClosed = errors.New("peer closed the connection")
	// errStopped ends the reader when the connection broke under it.
	errStopped = errors.New("connection stopped")
)

// protocolError is a frame from the peer that makes no sense.
type protocolError struct{ msg string }

func (e *protocolError) Error() string { return "protocol error: " + e.msg }

func protoErrorf(format string, args ...any) error {
	return &protocolError{msg: fmt.Sprintf(format, args...)}
}

// readLoop is the reader goroutine: the responder for the peer's requests
// and the receiver of acknowledgements and READ responses.
func (c *conn) readLoop() {
	defer c.wg.Done()
	err := c.serve()
	c.mu.Lock()
	c.breakLocked(err)
	c.readerGone = true
	c.quietCond.Broadcast()
	c.mu.Unlock()
}

// sockReader is what the reader's bufio.Reader reads from: the bytes the
// handshake read past its frames, then the socket, with beforeBlock run
// before each read(2). Payloads read straight into their destination go
// through it as well.
type sockReader struct {
	c      *conn
	pre    []byte
	full   bool // the last read filled the read buffer
	direct bool // a payload is read straight into its destination

	sock  io.Reader             // the socket: raw reads when it has a descriptor
	fn    func(fd uintptr) bool // rawRead, made once
	buf   []byte
	n     int
	errno unix.Errno
}

func (r *sockReader) Read(p []byte) (int, error) {
	if len(r.pre) > 0 {
		n := copy(p, r.pre)
		r.pre = r.pre[n:]
		return n, nil
	}
	c := r.c
	if r.full && !r.direct && c.rc != nil && c.blockWork() {
		// The last read filled the read buffer: the peer is streaming.
		// Try for more before acknowledging: the ACK (and the handler)
		// wait until the socket is empty, one per stream rather than
		// one per buffer. (Not within a payload read straight into
		// memory: it pauses often, and each pause would cost a read.)
		r.buf, r.n, r.errno = p, 0, 0
		if err := c.rc.Read(r.fn); err == nil && r.errno == 0 && r.n > 0 {
			r.full = r.n == len(p) && r.n >= readBufferSize
			r.buf = nil
			return r.n, nil
		}
		r.buf = nil
	}
	if err := c.beforeBlock(); err != nil {
		return 0, err
	}
	n, err := r.sock.Read(p)
	r.full = !r.direct && n == len(p) && n >= readBufferSize
	return n, err
}

// rawRead is the function of syscall.RawConn.Read: one read, returning
// true so that Read never waits for the socket to be readable.
func (r *sockReader) rawRead(fd uintptr) bool {
	r.n, r.errno = rawsock.Read(fd, r.buf)
	return true
}

// beforeBlock runs on the reader goroutine each time it may wait: before
// a read(2) on the socket that may wait (nothing is buffered, and the
// last read did not fill the buffer or a non-blocking try found the
// socket empty), and before it waits for a receive to be posted. It
// acknowledges what was executed (one cumulative ACK each time the peer
// stops sending, not one per request), calls the
// completion handler with what completed, and writes the output queued,
// if the stream is free, in one non-blocking attempt; the rest goes to
// the writer goroutine. Output that something may wait for (READ
// responses, whose windows an Invalidate waits for, a NAK, requests held
// back) is written before the handler runs; a lone ACK after it, so that
// what the handler posts carries it in the same write. It reports
// errStopped once the conn is closed (possibly by the handler): the
// reader must then touch nothing.
func (c *conn) beforeBlock() error {
	c.mu.Lock()
	if c.state == stateOpen && c.rseq > c.ackOut {
		c.ackOut = c.rseq
	}
	if c.handler != nil && c.cqHead < c.cqTail && !c.delivering {
		if c.rrHead < c.rrTail || c.nakPending || c.canTransmitLocked() {
			c.flushLocked()
		}
		c.deliverLocked(true)
	}
	c.flushLocked()
	c.mu.Unlock()
	if c.stopped.Load() {
		return errStopped
	}
	return nil
}

// blockWork reports whether beforeBlock has work to do: an ACK, the
// handler's completions or output to write.
func (c *conn) blockWork() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.state == stateOpen && c.rseq > c.ackOut ||
		c.handler != nil && c.cqHead < c.cqTail ||
		!c.writing && !c.writerWoken && c.hasOutputLocked()
}

func (c *conn) serve() error {
	draining := false
	h := &c.rh
	for {
		if c.stopped.Load() {
			return errStopped
		}
		if _, err := io.ReadFull(c.br, h[:]); err != nil {
			if draining {
				return nil
			}
			if err == io.EOF {
				return errPeerClosed
			}
			return fmt.Errorf("read: %w", err)
		}
		if err := h.check(); err != nil {
			return &protocolError{msg: err.Error()}
		}
		switch h.typ() {
		case frameSend, frameWrite, frameWriteImm, frameReadReq:
			if draining {
				if _, err := c.br.Discard(int(h.length())); err != nil {
					return nil
				}
				continue
			}
			if h.seq() != c.rseq+1 {
				return protoErrorf("%v with seq %d, want %d", h.typ(), h.seq(), c.rseq+1)
			}
			st, err := c.execute(h)
			if err != nil {
				return err
			}
			if st != transport.StatusSuccess {
				c.mu.Lock()
				c.drainLocked(h.seq(), st)
				draining = c.state == stateDraining
				c.mu.Unlock()
				if !draining {
					return errStopped
				}
				// A refused request's payload was not read: skip it to stay
				// in step with the frames behind it.
				if h.typ() != frameReadReq {
					if _, err := c.br.Discard(int(h.length())); err != nil {
						return nil
					}
				}
				continue
			}
			c.rseq = h.seq()
		case frameReadResp:
			if err := c.readResponse(h); err != nil {
				return err
			}
		case frameAck:
			if err := c.ack(h.seq()); err != nil {
				return err
			}
		case frameNak:
			if err := c.nak(h.seq(), transport.Status(h.status())); err != nil {
				return err
			}
			if !draining {
				return fmt.Errorf("peer refused request %d: %v", h.seq(), transport.Status(h.status()))
			}
		default:
			return protoErrorf("unexpected %v frame", h.typ())
		}
	}
}

// execute runs one request of the peer. A status other than success refuses
// it; an error means the stream failed.
func (c *conn) execute(h *header) (transport.Status, error) {
	n := h.length()
	switch h.typ() {
	case frameWrite, frameWriteImm:
		dst, w, ok := c.remoteSpan(h.rkey(), h.addr(), uint64(n), transport.AccessRemoteWrite)
		if !ok {
			return transport.StatusRemoteAccessError, nil
		}
		// An Invalidate of the window waits for the payload to be placed.
		defer w.release()
		if h.typ() == frameWriteImm {
			if _, st, err := c.takeRecv(); err != nil || st != transport.StatusSuccess {
				return st, err
			}
		}
		if err := c.readPayload(dst); err != nil {
			return 0, err
		}
		if h.typ() == frameWriteImm {
			c.completeRecv(transport.OpRecvWriteImm, transport.StatusSuccess, int(n), h.imm())
		}
	case frameSend:
		e, st, err := c.takeRecv()
		if err != nil || st != transport.StatusSuccess {
			return st, err
		}
		if int(n) > len(e.buf) {
			c.completeRecv(transport.OpRecv, transport.StatusLocalLengthError, int(n), 0)
			return transport.StatusRemoteInvalidRequest, nil
		}
		if err := c.readPayload(e.buf[:n]); err != nil {
			return 0, err
		}
		c.completeRecv(transport.OpRecv, transport.StatusSuccess, int(n), 0)
	case frameReadReq:
		size := h.imm()
		if size > maxPayload {
			return transport.StatusRemoteInvalidRequest, nil
		}
		src, w, ok := c.remoteSpan(h.rkey(), h.addr(), uint64(size), transport.AccessRemoteRead)
		if !ok {
			return transport.StatusRemoteAccessError, nil
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.rrTail-c.rrHead >= uint64(len(c.rr)) {
			// More READs than this side serves at once.
			w.release()
			return transport.StatusRemoteInvalidRequest, nil
		}
		// The window stays in use until the writer sent the data (an
		// Invalidate waits for that), or finalize dropped the response.
		// It is written at the next beforeBlock, with what else is queued,
		// unless more frames are buffered (a batch of requests is coming)
		// or more is queued than one attempt takes: the writer goroutine
		// starts on it then, while the reader goes on.
		c.rr[c.rrTail%uint64(len(c.rr))] = readResp{seq: h.seq(), data: src, win: w}
		c.rrTail++
		c.rrBytes += len(src)
		if c.rrBytes > inlineMax || c.br.Buffered() > 0 {
			c.kickWriterLocked()
		}
	}
	return transport.StatusSuccess, nil
}

// readPayload reads the payload of the current frame into dst: what the
// read buffer holds is copied, a large remainder is read from the socket
// straight into dst.
func (c *conn) readPayload(dst []byte) error {
	n := 0
	if b := c.br.Buffered(); b > 0 && len(dst) > 0 {
		n, _ = c.br.Read(dst[:min(b, len(dst))])
	}
	var err error
	if len(dst)-n >= directReadMin {
		c.sr.direct = true
		_, err = io.ReadFull(c.sr, dst[n:])
		c.sr.direct = false
	} else {
		_, err = io.ReadFull(c.br, dst[n:])
	}
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("read payload: %w", err)
	}
	return nil
}

// takeRecv returns the oldest posted receive, waiting up to RNRTimeout for
// one. It stays queued until completeRecv.
func (c *conn) takeRecv() (*rqEntry, transport.Status, error) {
	blocked, waiting := false, false
	for {
		c.mu.Lock()
		if c.state != stateOpen {
			c.mu.Unlock()
			return nil, 0, errStopped
		}
		if c.rqHead < c.rqTail {
			e := &c.rq[c.rqHead%uint64(len(c.rq))]
			c.mu.Unlock()
			if waiting {
				c.rnrTimer.Stop()
			}
			return e, transport.StatusSuccess, nil
		}
		c.mu.Unlock()
		if !blocked {
			// Acknowledge what is done and deliver the completions before
			// waiting: the peer may be waiting for those completions to
			// post more, and the handler may post the receive.
			blocked = true
			if err := c.beforeBlock(); err != nil {
				return nil, 0, err
			}
			continue
		}
		if !waiting {
			waiting = true
			if c.rnrTimer == nil {
				c.rnrTimer = time.NewTimer(c.opts.RNRTimeout)
			} else {
				c.rnrTimer.Reset(c.opts.RNRTimeout)
			}
		}
		select {
		case <-c.recvPosted:
		case <-c.rnrTimer.C:
			return nil, transport.StatusRNRRetryExceeded, nil
		case <-c.dying:
			c.rnrTimer.Stop()
			return nil, 0, errStopped
		}
	}
}

// completeRecv completes the oldest posted receive.
func (c *conn) completeRecv(op transport.Opcode, st transport.Status, n int, imm uint32) {
	c.mu.Lock()
	e := &c.rq[c.rqHead%uint64(len(c.rq))]
	c.pushLocked(transport.Completion{ID: e.id, Op: op, Status: st, ByteLen: n, Imm: imm}, 0)
	e.buf = nil
	c.rqHead++
	c.mu.Unlock()
}

// readResponse places the data of a READ response.
func (c *conn) readResponse(h *header) error {
	seq := h.seq()
	c.mu.Lock()
	if seq == 0 || seq-1 < c.sqHead || seq-1 >= c.sqTx {
		c.mu.Unlock()
		return protoErrorf("READ response for seq %d, outstanding (%d, %d]", seq, c.sqHead, c.sqTx)
	}
	e := &c.sq[(seq-1)%uint64(len(c.sq))]
	if e.op != transport.OpRead || e.done || len(e.buf) != int(h.length()) {
		c.mu.Unlock()
		return protoErrorf("READ response for seq %d (%v of %d bytes) with %d bytes", seq, e.op, len(e.buf), h.length())
	}
	buf := e.buf
	c.mu.Unlock()
	// The entry stays until it completes, which needs this goroutine.
	if err := c.readPayload(buf); err != nil {
		return err
	}
	c.mu.Lock()
	e.done = true
	c.readsInFlight--
	c.acked = max(c.acked, seq)
	c.advanceLocked()
	// A READ held back may go now: at the next beforeBlock.
	c.mu.Unlock()
	return nil
}

func (c *conn) ack(seq uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq > c.sqTx {
		return protoErrorf("ACK for seq %d, only %d sent", seq, c.sqTx)
	}
	if seq > c.acked {
		c.acked = seq
		c.advanceLocked()
	}
	return nil
}

// nak records that the peer refused request seq.
func (c *conn) nak(seq uint64, st transport.Status) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if seq == 0 || seq-1 < c.sqHead || seq-1 >= c.sqTx {
		return protoErrorf("NAK for seq %d, outstanding (%d, %d]", seq, c.sqHead, c.sqTx)
	}
	switch st {
	case transport.StatusSuccess, transport.StatusFlushed:
		st = transport.StatusRemoteInvalidRequest
	}
	c.acked = max(c.acked, seq-1)
	c.sq[(seq-1)%uint64(len(c.sq))].fail = st
	c.advanceLocked()
	return nil
}

// writeLoop is the writer goroutine: it writes, blocking, what the
// non-blocking attempts of posters and of the reader left: the rest of a
// batch they did not finish, and output queued while the stream was busy
// or where no attempt is made (a net.Conn without SyscallConn). It takes
// the stream only when no one else has it, and goes on as long as there
// is output, batching the frames of many requests into one writev.
func (c *conn) writeLoop() {
	defer c.wg.Done()
	c.mu.Lock()
	defer func() {
		c.writerGone = true
		c.quietCond.Broadcast()
		c.mu.Unlock()
	}()
	for {
		for c.state != stateBroken && (c.writing || (!c.wleft && !c.hasOutputLocked())) {
			if c.state == stateDraining && !c.writing {
				// The NAK is out: end our half of the stream.
				c.mu.Unlock()
				if cw, ok := c.nc.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
				c.mu.Lock()
				return
			}
			c.writerWoken = false
			c.writerCond.Wait()
		}
		if c.state == stateBroken {
			if !c.writing {
				c.releaseBatchLocked()
			}
			return
		}
		c.writing = true
		c.writerWoken = false
		if c.wleft {
			c.wleft = false
		} else {
			c.collectLocked()
		}
		c.mu.Unlock()
		_, err := c.wnb.WriteTo(c.nc)
		c.mu.Lock()
		c.writing = false
		c.releaseBatchLocked()
		c.quietCond.Broadcast()
		if err != nil {
			c.breakLocked(fmt.Errorf("write: %w", err))
			return
		}
	}
}

// flushLocked writes the output queued, if any, when the stream is free
// and the writer goroutine idle: one non-blocking writev (mu released
// during it). What it could not write, and what was queued meanwhile, is
// left to the writer goroutine, which is woken for it. Without a
// SyscallConn, or when the writer goroutine has a batch to finish, it
// only wakes the writer. A poster and the reader call it: neither blocks
// on the socket.
func (c *conn) flushLocked() {
	if c.writing || c.state == stateBroken {
		return // the holder of the stream looks for more output when done
	}
	if c.writerWoken {
		return // the writer goroutine is on its way: it takes it all
	}
	if c.wleft || c.rc == nil {
		c.kickWriterLocked()
		return
	}
	if !c.hasOutputLocked() {
		return
	}
	if !c.outputFitsLocked(inlineMax) {
		// Copying it would hold up the caller, and the batch would be
		// split: the writer goroutine writes it all, while the reader
		// goes on reading.
		c.kickWriterLocked()
		return
	}
	c.writing = true
	c.collectLocked()
	c.mu.Unlock()
	n, err := c.writeNonblocking()
	c.mu.Lock()
	c.writing = false
	if err == nil {
		consume(&c.wnb, n)
		if len(c.wnb) == 0 {
			c.releaseBatchLocked()
		} else {
			c.wleft = true
		}
	} else {
		c.releaseBatchLocked()
		c.breakLocked(fmt.Errorf("write: %w", err))
	}
	if c.state == stateBroken {
		c.releaseBatchLocked()
		c.wleft = false
	}
	if c.wleft || c.hasOutputLocked() || c.state == stateDraining {
		c.writerWoken = true
		c.writerCond.Signal()
	}
	c.quietCond.Broadcast()
}

// outputFitsLocked reports whether the output queued takes one batch of
// collectLocked with at most budget bytes of payload.
func (c *conn) outputFitsLocked(budget int) bool {
	budget -= c.rrBytes
	frames := int(c.rrTail - c.rrHead)
	if c.ackOut > c.ackSent {
		frames++
	}
	if c.nakPending {
		frames++
	}
	reads := c.readsInFlight
	for i := c.sqTx; i < c.sqTail && frames <= writeBatch && budget >= 0; i++ {
		e := &c.sq[i%uint64(len(c.sq))]
		if e.fail != transport.StatusSuccess {
			break
		}
		if e.op == transport.OpRead {
			if reads >= c.limits.MaxReadsInFlight {
				break
			}
			reads++
		} else {
			budget -= len(e.buf)
		}
		frames++
	}
	return budget >= 0 && frames <= writeBatch
}

// kickWriterLocked wakes the writer goroutine for output queued, unless
// the stream is taken: its holder looks for more output when done.
func (c *conn) kickWriterLocked() {
	if !c.writing && (c.wleft || c.hasOutputLocked()) {
		c.writerWoken = true
		c.writerCond.Signal()
	}
}

// releaseBatchLocked forgets the batch in wnb and releases the windows of
// its READ responses, written or dropped.
func (c *conn) releaseBatchLocked() {
	for i, w := range c.wwins {
		w.release()
		c.wwins[i] = nil
	}
	c.wwins = c.wwins[:0]
	clear(c.wbufs[:cap(c.wbufs)])
	c.wnb = nil
	c.wleft = false
}

// writeNonblocking makes one writev of c.wnb that does not wait for the
// socket: it returns what was written, 0 if the socket buffer is full.
func (c *conn) writeNonblocking() (int, error) {
	c.iov = c.iov[:0]
	for _, b := range c.wnb {
		if len(b) > 0 {
			v := unix.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			c.iov = append(c.iov, v)
		}
	}
	if len(c.iov) == 0 {
		return 0, nil
	}
	c.rawN, c.rawErr = 0, 0
	err := c.rc.Write(c.rawFn)
	clear(c.iov)
	if err != nil {
		return 0, err
	}
	switch c.rawErr {
	case 0:
		return c.rawN, nil
	case unix.EAGAIN:
		return 0, nil
	}
	return 0, c.rawErr
}

// rawWritev is the function of syscall.RawConn.Write: one writev,
// returning true so that Write never waits for the socket to be writable.
func (c *conn) rawWritev(fd uintptr) bool {
	c.rawN, c.rawErr = rawsock.Writev(fd, c.iov)
	return true
}

// consume drops the first n bytes of *v.
func consume(v *net.Buffers, n int) {
	for len(*v) > 0 {
		l := len((*v)[0])
		if n < l {
			(*v)[0] = (*v)[0][n:]
			return
		}
		n -= l
		*v = (*v)[1:]
	}
}

// canTransmitLocked reports whether the next send request may go out.
func (c *conn) canTransmitLocked() bool {
	if c.state != stateOpen || c.sqFailed || c.sqTx >= c.sqTail {
		return false
	}
	e := &c.sq[c.sqTx%uint64(len(c.sq))]
	if e.fail != transport.StatusSuccess {
		return false // never sent: it fails when its turn to complete comes
	}
	return e.op != transport.OpRead || c.readsInFlight < c.limits.MaxReadsInFlight
}

func (c *conn) hasOutputLocked() bool {
	return c.rrHead < c.rrTail || c.ackOut > c.ackSent || c.nakPending || c.canTransmitLocked()
}

// collectLocked builds the next batch of frames, at most writeBatch, into
// c.wbufs and c.wnb.
func (c *conn) collectLocked() {
	c.wbufs = c.wbufs[:0]
	n := 0
	frame := func(data []byte) {
		c.wbufs = append(c.wbufs, c.wh[n][:])
		if len(data) > 0 {
			c.wbufs = append(c.wbufs, data)
		}
		n++
	}
	for c.rrHead < c.rrTail && n < writeBatch {
		r := &c.rr[c.rrHead%uint64(len(c.rr))]
		c.wh[n].put(frameReadResp, 0, uint32(len(r.data)), r.seq, 0, 0, 0)
		frame(r.data)
		// The peer takes it for an ACK of r.seq as well.
		c.ackSent = max(c.ackSent, r.seq)
		if r.win != nil {
			c.wwins = append(c.wwins, r.win)
		}
		c.rrBytes -= len(r.data)
		r.data, r.win = nil, nil
		c.rrHead++
	}
	if c.rrHead < c.rrTail {
		c.wnb = c.wbufs
		return // responses first: the ACK and NAK follow them
	}
	if c.ackOut > c.ackSent && n < writeBatch {
		c.wh[n].put(frameAck, 0, 0, c.ackOut, 0, 0, 0)
		frame(nil)
		c.ackSent = c.ackOut
	}
	if c.nakPending && n < writeBatch {
		c.wh[n].put(frameNak, uint8(c.nakStatus), 0, c.nakSeq, 0, 0, 0)
		frame(nil)
		c.nakPending = false
	}
	size := uint64(len(c.sq))
	for n < writeBatch && c.canTransmitLocked() {
		e := &c.sq[c.sqTx%size]
		seq := c.sqTx + 1
		switch e.op {
		case transport.OpSend:
			c.wh[n].put(frameSend, 0, uint32(len(e.buf)), seq, 0, 0, 0)
			frame(e.buf)
		case transport.OpWrite:
			c.wh[n].put(frameWrite, 0, uint32(len(e.buf)), seq, e.raddr, e.rkey, 0)
			frame(e.buf)
		case transport.OpWriteImm:
			c.wh[n].put(frameWriteImm, 0, uint32(len(e.buf)), seq, e.raddr, e.rkey, e.imm)
			frame(e.buf)
		case transport.OpRead:
			c.wh[n].put(frameReadReq, 0, 0, seq, e.raddr, e.rkey, uint32(len(e.buf)))
			frame(nil)
			c.readsInFlight++
		}
		c.sqTx++
	}
	c.wnb = c.wbufs
}
