package tcp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/rblk/rblk/transport"
)

// connState is where a conn is in its life.
type connState uint8

const (
	// stateOpen: work flows.
	stateOpen connState = iota
	// stateDraining: this side refused a request of the peer. The writer
	// sends what is queued, the NAK last, then ends its half of the stream;
	// the reader discards requests and still takes acknowledgements, until
	// the peer closes or the linger time ends.
	stateDraining
	// stateBroken: the stream is closed; the goroutines are on their way out.
	stateBroken
)

// writeBatch is the most frames the writer hands to one writev.
const writeBatch = 64

// directReadMin is the smallest payload remainder read from the socket
// straight into its destination; smaller ones go through the read buffer,
// which lets one read(2) take in many small frames.
const directReadMin = 16 << 10

// sqEntry is a posted send work request.
type sqEntry struct {
	id    uint64
	op    transport.Opcode
	buf   []byte // the local span: source of SEND/WRITE, destination of READ
	raddr uint64
	rkey  uint32
	imm   uint32
	fail  transport.Status // a local error found at post, or the peer's NAK
	done  bool             // READ: the response is placed
}

// rqEntry is a posted receive.
type rqEntry struct {
	id   uint64
	buf  []byte
	fail transport.Status
}

// readResp is a READ response waiting for the writer.
type readResp struct {
	seq  uint64
	data []byte
	win  *window // the window data is read through, released once written
}

// conn is one emulated RC queue pair with its protection domain and CQ.
//
// Sequence numbers: the send work request at index i of the send queue (a
// count from 0 since the connection started) travels with seq i+1. The peer
// executes requests in seq order and acknowledges them cumulatively: ACK n
// says every request up to n is executed, a READ response for n says the
// same of every request before n, NAK n says those before n are executed and
// n failed.
type conn struct {
	opts   Options
	nc     net.Conn
	br     *bufio.Reader
	local  string
	remote string
	peerPD []byte
	limits transport.Limits

	regMu     sync.RWMutex
	regions   map[uint32]*region // by rkey (lkey is the same)
	windows   map[uint32]*window // by rkey, from the same key space
	regClosed bool
	keyBase   uint32
	keyNext   uint32

	mu         sync.Mutex
	writerCond sync.Cond // the writer waits on it for output
	state      connState
	cause      error         // why the connection broke
	closedErr  error         // what Poll returns at the end
	dying      chan struct{} // closed when the state leaves stateOpen
	done       chan struct{} // closed when the goroutines are gone and all is flushed
	finalized  bool
	// started: the goroutines run, or never will (closed before). A conn
	// of ConnRequest.Prepare is not started until it is accepted; until
	// then it takes receives but no sends.
	started bool

	// Send queue: [sqHead, sqTail) are posted and not completed,
	// [sqHead, sqTx) of them were transmitted.
	sq            []sqEntry
	sqHead        uint64
	sqTx          uint64
	sqTail        uint64
	sqOutstanding int  // posted and their completion not yet polled
	sqFailed      bool // a request failed: nothing more runs
	acked         uint64
	readsInFlight int

	// Receive queue: [rqHead, rqTail) are posted and not completed.
	rq            []rqEntry
	rqHead        uint64
	rqTail        uint64
	rqOutstanding int
	recvPosted    chan struct{} // a token when a receive is posted (RNR wait)

	// Completion queue: [cqHead, cqTail) wait for Poll.
	cq      []transport.Completion
	cqHead  uint64
	cqTail  uint64
	cqReady chan struct{} // a token when a completion is queued

	// Responder output, filled by the reader, emptied by the writer.
	rr         []readResp // ring: [rrHead, rrTail)
	rrHead     uint64
	rrTail     uint64
	ackOut     uint64 // cumulative ACK to send
	ackSent    uint64
	nakPending bool
	nakSeq     uint64
	nakStatus  transport.Status

	// Reader goroutine only.
	rh        header
	rseq      uint64 // last request of the peer executed
	ackQueued uint64
	rnrTimer  *time.Timer

	// Writer goroutine only.
	wh    [writeBatch]header
	wbufs [][]byte
	wnb   net.Buffers
	wwins []*window // windows of the READ responses being written

	wg sync.WaitGroup
}

var _ transport.Conn = (*conn)(nil)

// newConn starts a connection over nc, whose handshake is done. br holds
// what was read past the handshake. peerReads is the number of READs the
// peer serves at once.
func newConn(opts Options, nc net.Conn, br *bufio.Reader, peerPD []byte, peerReads int) *conn {
	c := makeConn(opts, nc, br, peerPD, peerReads)
	c.start()
	return c
}

// makeConn makes a connection over nc without starting it: it takes
// registrations and receives, and start makes the work flow.
func makeConn(opts Options, nc net.Conn, br *bufio.Reader, peerPD []byte, peerReads int) *conn {
	c := &conn{
		opts:   opts,
		nc:     nc,
		br:     br,
		local:  nc.LocalAddr().String(),
		remote: nc.RemoteAddr().String(),
		peerPD: peerPD,
		limits: transport.Limits{
			SendQueueDepth:   opts.SendQueueDepth,
			RecvQueueDepth:   opts.RecvQueueDepth,
			MaxReadsInFlight: min(opts.MaxReadsInFlight, peerReads),
			MaxPrivateData:   MaxConnectPrivateData,
		},
		regions:    make(map[uint32]*region),
		windows:    make(map[uint32]*window),
		keyBase:    rand.Uint32(),
		dying:      make(chan struct{}),
		done:       make(chan struct{}),
		sq:         make([]sqEntry, opts.SendQueueDepth),
		rq:         make([]rqEntry, opts.RecvQueueDepth),
		recvPosted: make(chan struct{}, 1),
		cq:         make([]transport.Completion, opts.SendQueueDepth+opts.RecvQueueDepth),
		cqReady:    make(chan struct{}, 1),
		rr:         make([]readResp, opts.MaxReadsInFlight),
		wbufs:      make([][]byte, 0, 2*writeBatch),
	}
	c.writerCond.L = &c.mu
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	return c
}

// start starts the goroutines of the connection; it reports false if the
// connection was closed before.
func (c *conn) start() bool {
	c.mu.Lock()
	if c.started {
		c.mu.Unlock()
		return false
	}
	c.started = true
	c.mu.Unlock()
	c.wg.Add(2)
	go c.readLoop()
	go c.writeLoop()
	go func() {
		c.wg.Wait()
		c.finalize()
	}()
	return true
}

func (c *conn) PeerPrivateData() []byte  { return bytes.Clone(c.peerPD) }
func (c *conn) Limits() transport.Limits { return c.limits }
func (c *conn) LocalAddr() string        { return c.local }
func (c *conn) RemoteAddr() string       { return c.remote }

// Register registers buf under a fresh key. Like a hardware provider it
// refuses memory that is a mapping of a file.
func (c *conn) Register(buf []byte, access transport.Access) (transport.Region, error) {
	const all = transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite | transport.AccessBindWindow
	switch {
	case len(buf) == 0:
		return nil, errors.New("register: empty buffer")
	case access&^all != 0:
		return nil, fmt.Errorf("register: unknown access bits %#x", uint32(access&^all))
	case access&transport.AccessRemoteWrite != 0 && access&transport.AccessLocalWrite == 0:
		return nil, errors.New("register: remote write access requires local write access")
	}
	if err := transport.CheckNotFileMapping(buf); err != nil {
		return nil, err
	}
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if c.regClosed {
		return nil, fmt.Errorf("register: %w", transport.ErrClosed)
	}
	key := c.newKeyLocked()
	r := &region{
		c:      c,
		buf:    buf,
		addr:   uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))),
		key:    key,
		access: access,
	}
	c.regions[key] = r
	return r, nil
}

// newKeyLocked returns a key that names no live region or window (regMu
// held).
func (c *conn) newKeyLocked() uint32 {
	for {
		// Multiplying by an odd constant is a bijection on uint32, so keys
		// repeat only after 2^32 registrations; the table check covers that.
		key := c.keyBase ^ (c.keyNext * 0x9e3779b1)
		c.keyNext++
		if key != 0 && c.regions[key] == nil && c.windows[key] == nil {
			return key
		}
	}
}

// region is a registered span of memory.
type region struct {
	c       *conn
	buf     []byte
	addr    uint64
	key     uint32
	access  transport.Access
	revoked atomic.Bool
	windows map[*window]struct{} // bound over it (c.regMu)
}

func (r *region) Bytes() []byte            { return r.buf }
func (r *region) Addr() uint64             { return r.addr }
func (r *region) LKey() uint32             { return r.key }
func (r *region) RKey() uint32             { return r.key }
func (r *region) Access() transport.Access { return r.access }

// Deregister revokes the region and the windows bound over it. (It does
// not wait for a request of the peer on a window to finish, as no
// Deregister waits for one on the region: the caller's duty.)
func (r *region) Deregister() error {
	r.revoked.Store(true)
	c := r.c
	c.regMu.Lock()
	if c.regions[r.key] == r {
		delete(c.regions, r.key)
	}
	wins := r.windows
	r.windows = nil
	for w := range wins {
		if c.windows[w.key] == w {
			delete(c.windows, w.key)
		}
	}
	c.regMu.Unlock()
	for w := range wins {
		w.mu.Lock()
		w.dead = true
		w.mu.Unlock()
	}
	return nil
}

// localSpan checks a local SGE: a live region of this conn, in bounds, with
// local write access if write.
func (c *conn) localSpan(s transport.SGE, write bool) ([]byte, bool) {
	r, ok := s.Region.(*region)
	if !ok || r == nil || r.c != c || r.revoked.Load() {
		return nil, false
	}
	if write && r.access&transport.AccessLocalWrite == 0 {
		return nil, false
	}
	if s.Offset < 0 || s.Length < 0 || s.Offset > len(r.buf) || s.Length > len(r.buf)-s.Offset {
		return nil, false
	}
	return r.buf[s.Offset : s.Offset+s.Length : s.Offset+s.Length], true
}

// remoteSpan checks a one-sided request of the peer. If rkey names a
// window, the window is returned too, in use until its release: the
// caller releases it once it no longer touches the span.
func (c *conn) remoteSpan(rkey uint32, addr, n uint64, need transport.Access) ([]byte, *window, bool) {
	c.regMu.RLock()
	r := c.regions[rkey]
	var w *window
	if r == nil {
		w = c.windows[rkey]
	}
	c.regMu.RUnlock()
	var buf []byte
	var base uint64
	switch {
	case r != nil && r.access&need != 0:
		buf, base = r.buf, r.addr
	case w != nil && w.access&need != 0:
		buf, base = w.buf, w.addr
	default:
		return nil, nil, false
	}
	size := uint64(len(buf))
	if addr < base {
		return nil, nil, false
	}
	off := addr - base
	if off > size || n > size-off {
		return nil, nil, false
	}
	if w != nil && !w.acquire() {
		return nil, nil, false
	}
	return buf[off : off+n : off+n], w, true
}

// PostSend queues work requests. A request whose local buffer fails the
// checks is queued as failed: it completes with its error in its turn and
// breaks the connection.
func (c *conn) PostSend(wrs ...transport.WorkRequest) error {
	for i := range wrs {
		switch wrs[i].Op {
		case transport.OpSend, transport.OpWrite, transport.OpWriteImm, transport.OpRead:
		default:
			return fmt.Errorf("post send: invalid opcode %v", wrs[i].Op)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateOpen {
		return transport.ErrClosed
	}
	if !c.started {
		return fmt.Errorf("post send: %w", transport.ErrNotAccepted)
	}
	if c.sqOutstanding+len(wrs) > len(c.sq) {
		return transport.ErrQueueFull
	}
	n := uint64(len(c.sq))
	for i := range wrs {
		wr := &wrs[i]
		buf, ok := c.localSpan(wr.Local, wr.Op == transport.OpRead)
		e := &c.sq[c.sqTail%n]
		*e = sqEntry{id: wr.ID, op: wr.Op, buf: buf, raddr: wr.RemoteAddr, rkey: wr.RKey, imm: wr.Imm}
		switch {
		case !ok:
			e.fail = transport.StatusLocalProtectionError
		case len(buf) > maxPayload:
			e.fail = transport.StatusLocalLengthError
		}
		c.sqTail++
	}
	c.sqOutstanding += len(wrs)
	c.advanceLocked()
	c.writerCond.Signal()
	return nil
}

// PostRecv queues receives. A receive whose buffer fails the checks breaks
// the connection and completes with StatusLocalProtectionError.
func (c *conn) PostRecv(rrs ...transport.RecvRequest) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state != stateOpen {
		return transport.ErrClosed
	}
	if c.rqOutstanding+len(rrs) > len(c.rq) {
		return transport.ErrQueueFull
	}
	n := uint64(len(c.rq))
	bad := false
	for i := range rrs {
		buf, ok := c.localSpan(rrs[i].Local, true)
		e := &c.rq[c.rqTail%n]
		*e = rqEntry{id: rrs[i].ID, buf: buf}
		if !ok {
			e.fail = transport.StatusLocalProtectionError
			bad = true
		}
		c.rqTail++
	}
	c.rqOutstanding += len(rrs)
	if bad {
		c.breakLocked(errors.New("receive posted with an invalid buffer"))
	}
	select {
	case c.recvPosted <- struct{}{}:
	default:
	}
	return nil
}

// Poll returns completions, waiting for at least one.
func (c *conn) Poll(ctx context.Context, out []transport.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	for {
		c.mu.Lock()
		if c.cqHead < c.cqTail {
			n := 0
			size := uint64(len(c.cq))
			for n < len(out) && c.cqHead < c.cqTail {
				comp := &c.cq[c.cqHead%size]
				out[n] = *comp
				if comp.Op == transport.OpRecv || comp.Op == transport.OpRecvWriteImm {
					c.rqOutstanding--
				} else {
					c.sqOutstanding--
				}
				c.cqHead++
				n++
			}
			more := c.cqHead < c.cqTail
			c.mu.Unlock()
			if more {
				c.notifyPoller()
			}
			return n, nil
		}
		if c.finalized {
			err := c.closedErr
			c.mu.Unlock()
			c.notifyPoller() // wake any other poller to see the end too
			return 0, err
		}
		c.mu.Unlock()
		select {
		case <-c.cqReady:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

func (c *conn) notifyPoller() {
	select {
	case c.cqReady <- struct{}{}:
	default:
	}
}

// Close breaks the connection, waits for its goroutines and flushes what was
// outstanding.
func (c *conn) Close() error {
	c.mu.Lock()
	c.closeLocked(transport.ErrClosed)
	neverStarted := !c.started
	c.started = true // a conn closed before it started never starts
	c.mu.Unlock()
	if neverStarted {
		c.finalize()
	}
	<-c.done
	return nil
}

// pushLocked queues a completion. The accounting of outstanding requests
// keeps the ring from overflowing.
func (c *conn) pushLocked(comp transport.Completion) {
	c.cq[c.cqTail%uint64(len(c.cq))] = comp
	c.cqTail++
	c.notifyPoller()
}

// advanceLocked completes, in order, the send requests that are done.
func (c *conn) advanceLocked() {
	n := uint64(len(c.sq))
	for !c.sqFailed && c.sqHead < c.sqTail {
		e := &c.sq[c.sqHead%n]
		if e.fail != transport.StatusSuccess {
			c.pushLocked(transport.Completion{ID: e.id, Op: e.op, Status: e.fail})
			c.sqFailed = true
			err := fmt.Errorf("%v request %d failed: %v", e.op, c.sqHead+1, e.fail)
			e.buf = nil
			c.sqHead++
			c.breakLocked(err)
			return
		}
		if c.sqHead >= c.sqTx {
			return
		}
		if e.op == transport.OpRead {
			if !e.done {
				return
			}
		} else if c.sqHead+1 > c.acked {
			return
		}
		c.pushLocked(transport.Completion{ID: e.id, Op: e.op})
		e.buf = nil
		c.sqHead++
	}
}

// breakLocked breaks an open connection at once: the stream is closed, the
// goroutines leave, and finalize flushes what is outstanding. A draining
// connection is left to finish draining.
func (c *conn) breakLocked(err error) {
	if c.state == stateOpen {
		c.closeLocked(err)
	}
}

// closeLocked closes the stream whatever the state.
func (c *conn) closeLocked(err error) {
	if c.state == stateBroken {
		return
	}
	if c.state == stateOpen {
		close(c.dying)
		c.cause = err
	}
	c.state = stateBroken
	c.nc.Close()
	c.writerCond.Broadcast()
}

// drainLocked moves an open connection to stateDraining after this side
// refused the peer's request seq with status.
func (c *conn) drainLocked(seq uint64, status transport.Status) {
	if c.state != stateOpen {
		return
	}
	c.state = stateDraining
	c.cause = fmt.Errorf("refused request %d of the peer: %v", seq, status)
	close(c.dying)
	c.nakPending, c.nakSeq, c.nakStatus = true, seq, status
	// The peer closes when it reads the NAK; a peer that does not is cut
	// off after the time it may spend itself waiting for a receive.
	c.nc.SetDeadline(time.Now().Add(c.opts.RNRTimeout + 2*time.Second))
	c.writerCond.Broadcast()
}

// finalize runs once both goroutines are gone: it flushes every request
// still outstanding and lets Poll report the end.
func (c *conn) finalize() {
	c.nc.Close()
	c.regMu.Lock()
	c.regClosed = true
	clear(c.regions)
	clear(c.windows)
	c.regMu.Unlock()
	if c.rnrTimer != nil {
		c.rnrTimer.Stop()
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state == stateOpen {
		close(c.dying)
	}
	c.state = stateBroken
	n := uint64(len(c.sq))
	for ; c.sqHead < c.sqTail; c.sqHead++ {
		e := &c.sq[c.sqHead%n]
		st := transport.StatusFlushed
		if e.fail != transport.StatusSuccess && !c.sqFailed {
			st = e.fail
			c.sqFailed = true
		}
		c.pushLocked(transport.Completion{ID: e.id, Op: e.op, Status: st})
		e.buf = nil
	}
	c.sqTx = c.sqHead
	n = uint64(len(c.rq))
	for ; c.rqHead < c.rqTail; c.rqHead++ {
		e := &c.rq[c.rqHead%n]
		st := transport.StatusFlushed
		if e.fail != transport.StatusSuccess {
			st = e.fail
		}
		c.pushLocked(transport.Completion{ID: e.id, Op: transport.OpRecv, Status: st})
		e.buf = nil
	}
	for ; c.rrHead < c.rrTail; c.rrHead++ {
		c.rr[c.rrHead%uint64(len(c.rr))].win.release()
	}
	clear(c.rr)
	c.rrHead, c.rrTail = 0, 0
	c.closedErr = transport.ErrClosed
	if c.cause != nil && c.cause != transport.ErrClosed {
		c.closedErr = fmt.Errorf("%w: %v", transport.ErrClosed, c.cause)
	}
	c.finalized = true
	close(c.done)
	c.notifyPoller()
}
