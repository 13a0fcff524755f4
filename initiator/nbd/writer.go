package nbd

import (
	"net"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/rawsock"
)

// maxIovecs bounds the segments of one inline writev; a reply with more
// goes in pieces.
const maxIovecs = 64

// replyWriter sends a connection's replies. A reply is written at once by
// the goroutine that completes its request, with one non-blocking writev,
// when no other reply is queued or being written: the usual case, with no
// goroutine switch. What the socket does not take then (it is full: the
// client is slow to read) is queued for the writer goroutine, which writes
// it blocking, in order. So a request's completion, which may run on the
// backend's completion path, never blocks on the client.
//
// A backend that completes requests in batches (blockdev.BatchCompletion)
// has their replies wait in batch until it calls Flush, which writes them
// the same way, all in one writev (up to maxIovecs segments each).
type replyWriter struct {
	wmu     sync.Mutex
	batch   []*request // replies waiting for Flush (CompleteBatched)
	wq      []*request // replies for the writer goroutine, in order
	wbusy   bool       // the writer goroutine is writing a batch of wq
	wbroken bool       // a reply failed to send; later ones are dropped
	wstop   bool
	wkick   chan struct{} // cap 1: wq has work, or stop
	wdone   chan struct{} // closed when the writer goroutine ended
	wbatch  []*request    // the writer goroutine's batch

	// The inline attempt (wmu held): nc's raw conn, if it has one, and the
	// state of tryWriteFd, a method value made once so that no attempt
	// allocates.
	raw      syscall.RawConn
	tryFn    func(fd uintptr) bool
	tryBufs  *net.Buffers
	tryN     int
	tryErrno syscall.Errno
	iovecs   [maxIovecs]unix.Iovec
	gather   net.Buffers // the segments of a batch's writev

	// Flush's: flushMu serializes them; flushing holds the batch being
	// written (flushMu held).
	flusher  batchFlusher
	flushMu  sync.Mutex
	flushing []*request
}

// batchFlusher is a connection's blockdev.Flusher.
type batchFlusher struct{ c *conn }

// Flush writes the replies waiting in the batch.
func (f *batchFlusher) Flush() { f.c.flushBatch() }

func (c *conn) initWriter() {
	c.flusher.c = c
	c.wkick = make(chan struct{}, 1)
	c.wdone = make(chan struct{})
	if raw, ok := rawsock.SyscallConn(c.nc); ok {
		c.raw = raw
		c.tryFn = c.tryWriteFd
	}
}

func (c *conn) startWriter() { go c.writeLoop() }

// stopWriter ends the writer goroutine once every reply is written.
func (c *conn) stopWriter() {
	c.wmu.Lock()
	c.wstop = true
	c.wmu.Unlock()
	select {
	case c.wkick <- struct{}{}:
	default:
	}
	<-c.wdone
}

// send writes r's reply (r.bufs) and ends r, now or from the writer
// goroutine.
func (c *conn) send(r *request) {
	c.wmu.Lock()
	if c.wbroken {
		c.wmu.Unlock()
		c.done(r)
		return
	}
	if !c.wbusy && len(c.wq) == 0 && c.raw != nil {
		if c.tryWrite(&r.bufs) {
			c.wmu.Unlock()
			c.done(r)
			return
		}
		if c.tryErrno != 0 && c.tryErrno != syscall.EAGAIN {
			// The socket is broken: the writer goroutine's write reports
			// it the usual way.
			c.tryErrno = 0
		}
	}
	c.wq = append(c.wq, r)
	c.wmu.Unlock()
	select {
	case c.wkick <- struct{}{}:
	default:
	}
}

// batchReply puts r's reply (r.bufs) in the batch and returns the Flusher
// that writes it, or ends r and returns nil when no reply can be sent.
func (c *conn) batchReply(r *request) *batchFlusher {
	c.wmu.Lock()
	if c.wbroken {
		c.wmu.Unlock()
		c.done(r)
		return nil
	}
	c.batch = append(c.batch, r)
	c.wmu.Unlock()
	return &c.flusher
}

// flushBatch writes the replies of the batch, as send writes one: at once
// with one non-blocking writev for as many as fit, when no reply is queued
// or being written; what the socket does not take, and everything when a
// reply is queued, goes to the writer goroutine, in order.
func (c *conn) flushBatch() {
	c.flushMu.Lock()
	defer c.flushMu.Unlock()
	c.wmu.Lock()
	c.batch, c.flushing = c.flushing[:0], c.batch
	rs := c.flushing
	written := 0
	switch {
	case c.wbroken:
		written = len(rs) // (not written: ended all the same)
	case !c.wbusy && len(c.wq) == 0 && c.raw != nil:
		written = c.tryWriteBatch(rs)
		if c.tryErrno != 0 && c.tryErrno != syscall.EAGAIN {
			// The socket is broken: the writer goroutine's write reports
			// it the usual way.
			c.tryErrno = 0
		}
	}
	kick := written < len(rs)
	if kick {
		c.wq = append(c.wq, rs[written:]...)
	}
	c.wmu.Unlock()
	if kick {
		select {
		case c.wkick <- struct{}{}:
		default:
		}
	}
	for _, r := range rs[:written] {
		c.done(r)
	}
	clear(rs)
	c.flushing = rs[:0]
}

// tryWriteBatch writes the replies rs in order with non-blocking writevs of
// up to maxIovecs segments each, while the socket takes all it is given,
// and returns how many were written whole; the next one may have been
// written in part (its bufs consumed). c.wmu is held.
func (c *conn) tryWriteBatch(rs []*request) int {
	whole := 0
	for whole < len(rs) {
		g := c.gather[:0]
		for _, r := range rs[whole:] {
			if len(g) > 0 && len(g)+len(r.bufs) > maxIovecs {
				break
			}
			g = append(g, r.bufs...)
		}
		all := g
		g = g[:min(len(g), maxIovecs)]
		c.gather = g
		given := 0
		for _, b := range g {
			given += len(b)
		}
		c.tryBufs, c.tryN, c.tryErrno = &c.gather, 0, 0
		err := c.raw.Write(c.tryFn)
		clear(all)
		c.gather = all[:0]
		n := c.tryN
		if err != nil || n <= 0 {
			return whole
		}
		for n > 0 {
			r := rs[whole]
			k := 0
			for _, b := range r.bufs {
				k += len(b)
			}
			if n < k {
				consume(&r.bufs, n)
				break
			}
			consume(&r.bufs, k)
			n -= k
			whole++
		}
		if c.tryN < given {
			return whole // the socket is full
		}
	}
	return whole
}

// tryWrite makes one non-blocking writev attempt of bufs, consuming what
// was written, and reports whether all of it was. c.wmu is held.
func (c *conn) tryWrite(bufs *net.Buffers) bool {
	for len(*bufs) > 0 {
		c.tryBufs, c.tryN, c.tryErrno = bufs, 0, 0
		if err := c.raw.Write(c.tryFn); err != nil || c.tryN <= 0 {
			return false
		}
		consume(bufs, c.tryN)
	}
	return true
}

// tryWriteFd is the function of raw.Write: one writev, never waiting (it
// returns true whatever happened, so raw.Write does not wait for the
// socket to take more).
func (c *conn) tryWriteFd(fd uintptr) bool {
	n := 0
	for _, b := range *c.tryBufs {
		if n == maxIovecs {
			break
		}
		if len(b) == 0 {
			continue
		}
		c.iovecs[n] = unix.Iovec{Base: &b[0]}
		c.iovecs[n].SetLen(len(b))
		n++
	}
	if n == 0 {
		return true
	}
	c.tryN, c.tryErrno = rawsock.Writev(fd, c.iovecs[:n])
	clear(c.iovecs[:n])
	if m := c.s.metrics; m != nil && c.tryN > 0 {
		m.replyWrites.Inc()
	}
	return true
}

// consume drops the first n bytes of bufs.
func consume(bufs *net.Buffers, n int) {
	for len(*bufs) > 0 && n >= len((*bufs)[0]) {
		n -= len((*bufs)[0])
		(*bufs)[0] = nil
		*bufs = (*bufs)[1:]
	}
	if n > 0 {
		(*bufs)[0] = (*bufs)[0][n:]
	}
}

// writeLoop writes the queued replies, blocking, in order.
func (c *conn) writeLoop() {
	defer close(c.wdone)
	for {
		c.wmu.Lock()
		for len(c.wq) == 0 {
			if c.wstop {
				c.wmu.Unlock()
				return
			}
			c.wmu.Unlock()
			<-c.wkick
			c.wmu.Lock()
		}
		c.wbatch = append(c.wbatch[:0], c.wq...)
		clear(c.wq)
		c.wq = c.wq[:0]
		c.wbusy = true
		c.wmu.Unlock()
		for i, r := range c.wbatch {
			c.wbatch[i] = nil
			c.wmu.Lock()
			broken := c.wbroken
			c.wmu.Unlock()
			if !broken {
				if m := c.s.metrics; m != nil {
					m.replyWrites.Inc()
				}
				if _, err := r.bufs.WriteTo(c.nc); err != nil {
					c.wmu.Lock()
					c.wbroken = true
					c.wmu.Unlock()
					// No reply can reach the client any more: stop
					// reading requests.
					c.shutdown(c.writeErr(err, "sending a reply"))
				}
			}
			c.done(r)
		}
		c.wmu.Lock()
		c.wbusy = false
		c.wmu.Unlock()
	}
}
