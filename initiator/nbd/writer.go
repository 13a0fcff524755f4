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
type replyWriter struct {
	wmu     sync.Mutex
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
}

func (c *conn) initWriter() {
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
