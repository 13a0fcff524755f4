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
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/rawsock"
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

// inlineMax bounds the payload bytes a poster or the reader writes in its
// non-blocking attempt: when more is queued, all of it is left to the
// writer goroutine, whose wakeup costs little next to the copy, which
// makes it while the reader goes on reading, and in one batch.
const inlineMax = 64 << 10

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
	// unsignaled: no completion on success (WorkRequest.Unsignaled).
	unsignaled bool
}

// rqEntry is a posted receive.
type rqEntry struct {
	id   uint64
	buf  []byte
	fail transport.Status
}

// cqEntry is a queued completion and the send-queue room it frees once
// polled or delivered: its own entry and those of the unsignaled requests
// it covers.
type cqEntry struct {
	comp   transport.Completion
	sqFree int32
}

// readResp is a READ response waiting to be written.
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
	rc     syscall.RawConn // for non-blocking writes; nil: the writer goroutine writes all
	sr     *sockReader     // under br: runs beforeBlock before each read(2)
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
	writerCond sync.Cond // the writer goroutine waits on it for output
	quietCond  sync.Cond // Close and finalize wait on it for the goroutines to let go
	state      connState
	stopped    atomic.Bool   // state is stateBroken: the reader stops at the next frame
	cause      error         // why the connection broke
	closedErr  error         // what Poll returns at the end
	dying      chan struct{} // closed when the state leaves stateOpen
	done       chan struct{} // closed when the goroutines are gone and all is flushed
	finalized  bool
	readerGone bool
	writerGone bool
	// quiet: closed, and no goroutine of the conn touches the memory of
	// requests any more (quietCh is closed then).
	quiet   bool
	quietCh chan struct{}
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
	sqOutstanding int  // posted and their room not yet freed by a polled completion
	sqUncovered   int  // unsignaled requests that succeeded, not yet covered by a completion
	sqFailed      bool // a request failed: nothing more runs
	acked         uint64
	readsInFlight int

	// Receive queue: [rqHead, rqTail) are posted and not completed.
	rq            []rqEntry
	rqHead        uint64
	rqTail        uint64
	rqOutstanding int
	recvPosted    chan struct{} // a token when a receive is posted (RNR wait)

	// Completion queue: [cqHead, cqTail) wait for Poll or the handler.
	cq      []cqEntry
	cqHead  uint64
	cqTail  uint64
	cqReady chan struct{} // a token when a completion is queued

	// Completion handler (HandleCompletions). One goroutine at a time
	// delivers (delivering), with mu released around the call.
	handler    func([]transport.Completion, error)
	delivering bool
	readerInFn bool // the reader goroutine is inside handler
	finalSent  bool // handler(nil, err) was called
	dbuf       []transport.Completion

	// Responder output, filled by the reader, emptied by whoever writes.
	rr         []readResp // ring: [rrHead, rrTail)
	rrHead     uint64
	rrTail     uint64
	rrBytes    int    // payload bytes of the responses in rr
	ackOut     uint64 // cumulative ACK to send
	ackSent    uint64
	nakPending bool
	nakSeq     uint64
	nakStatus  transport.Status

	// Reader goroutine only.
	rh       header
	rseq     uint64 // last request of the peer executed
	rnrTimer *time.Timer

	// The stream is written by one goroutine at a time, the one that set
	// writing: the writer goroutine, or a poster or the reader making one
	// non-blocking attempt. It owns the fields below until it clears
	// writing. wleft: wnb holds the rest of a batch that an attempt did
	// not finish; only the writer goroutine goes on with it.
	writing bool
	wleft   bool
	// writerWoken: the writer goroutine was signaled and has not yet
	// taken the stream or gone back to waiting; attempts leave the
	// output to it.
	writerWoken bool
	wh          [writeBatch]header
	wbufs       [][]byte
	wnb         net.Buffers
	wwins       []*window // windows of the READ responses in wnb
	iov         []unix.Iovec
	rawFn       func(fd uintptr) bool // c.rawWritev, made once
	rawN        int
	rawErr      syscall.Errno

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
	if opts.hideSyscallConn {
		nc = plainConn{nc}
	}
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
		cq:         make([]cqEntry, opts.SendQueueDepth+opts.RecvQueueDepth),
		cqReady:    make(chan struct{}, 1),
		quietCh:    make(chan struct{}),
		rr:         make([]readResp, opts.MaxReadsInFlight),
		wbufs:      make([][]byte, 0, 2*writeBatch),
	}
	c.writerCond.L = &c.mu
	c.quietCond.L = &c.mu
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	if rc, ok := rawsock.SyscallConn(nc); ok {
		c.rc = rc
		c.iov = make([]unix.Iovec, 0, 2*writeBatch)
		c.rawFn = c.rawWritev
	}
	// The reader reads through sr, which first hands out what the
	// handshake's reader had buffered past the handshake.
	c.sr = &sockReader{c: c, sock: nc}
	c.sr.fn = c.sr.rawRead
	if c.rc != nil {
		c.sr.sock = rawsock.NewReader(nc)
	}
	if n := br.Buffered(); n > 0 {
		pre, _ := br.Peek(n)
		c.sr.pre = bytes.Clone(pre)
	}
	c.br = bufio.NewReaderSize(c.sr, readBufferSize)
	return c
}

// plainConn is a net.Conn without SyscallConn (Options.hideSyscallConn).
type plainConn struct{ net.Conn }

func (p plainConn) CloseWrite() error {
	if cw, ok := p.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
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
		c.finalize(true)
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
		*e = sqEntry{id: wr.ID, op: wr.Op, buf: buf, raddr: wr.RemoteAddr, rkey: wr.RKey, imm: wr.Imm, unsignaled: wr.Unsignaled}
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
	switch {
	case c.readerInFn:
		// The reader writes it once the handler returns, in one writev
		// with whatever else the handler posted and the ACK.
	case c.sqHead < c.sqTx:
		// Requests in flight: the connection is busy, and the writer
		// goroutine batches what is posted while it wakes up and writes
		// (one write per post would also make the peer acknowledge each).
		c.kickWriterLocked()
	default:
		// Nothing in flight: write it now.
		c.flushLocked()
	}
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
		if c.handler != nil {
			c.mu.Unlock()
			return 0, errors.New("poll: the completions go to the handler of HandleCompletions")
		}
		if c.cqHead < c.cqTail {
			n := c.takeLocked(out)
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

// takeLocked moves queued completions to out and frees the room they
// stand for.
func (c *conn) takeLocked(out []transport.Completion) int {
	n := 0
	size := uint64(len(c.cq))
	for n < len(out) && c.cqHead < c.cqTail {
		e := &c.cq[c.cqHead%size]
		out[n] = e.comp
		if e.comp.Op == transport.OpRecv || e.comp.Op == transport.OpRecvWriteImm {
			c.rqOutstanding--
		} else {
			c.sqOutstanding -= int(e.sqFree)
		}
		c.cqHead++
		n++
	}
	return n
}

func (c *conn) notifyPoller() {
	select {
	case c.cqReady <- struct{}{}:
	default:
	}
}

// Close breaks the connection and returns once no goroutine of the conn
// touches the memory of its requests any more: see shut.
func (c *conn) Close() error {
	c.shut(transport.ErrClosed)
	return nil
}

// shut breaks the connection with cause and waits until it is quiet: the
// reader and the writer are gone and the requests flushed (finalize ran),
// or, when the reader is inside the completion handler (which may be the
// caller), the writer is gone, nobody writes, and the reader is bound to
// leave without touching anything once the handler returns. The
// completions still to come are then delivered after the handler returns.
func (c *conn) shut(cause error) {
	c.mu.Lock()
	c.closeLocked(cause)
	neverStarted := !c.started
	c.started = true // a conn closed before it started never starts
	c.mu.Unlock()
	if neverStarted {
		c.finalize(false)
		return
	}
	c.mu.Lock()
	for !c.quiet {
		if c.readerInFn && c.writerGone && !c.writing {
			c.dropOutputLocked()
			c.setQuietLocked()
			break
		}
		c.quietCond.Wait()
	}
	c.mu.Unlock()
	c.closeRegions()
}

// setQuietLocked records that no goroutine of the conn touches the memory
// of requests any more.
func (c *conn) setQuietLocked() {
	if !c.quiet {
		c.quiet = true
		close(c.quietCh)
		c.quietCond.Broadcast()
	}
}

// closeRegions takes every region and window out: Register fails from
// now on and the peer's keys reach nothing.
func (c *conn) closeRegions() {
	c.regMu.Lock()
	c.regClosed = true
	clear(c.regions)
	clear(c.windows)
	c.regMu.Unlock()
}

// pushLocked queues a completion that frees sqFree entries of the send
// queue once polled. The accounting of outstanding requests keeps the ring
// from overflowing.
func (c *conn) pushLocked(comp transport.Completion, sqFree int) {
	c.cq[c.cqTail%uint64(len(c.cq))] = cqEntry{comp: comp, sqFree: int32(sqFree)}
	c.cqTail++
	c.notifyPoller()
}

// pushSendLocked queues the completion of a send request; it covers the
// unsignaled requests that succeeded before it.
func (c *conn) pushSendLocked(comp transport.Completion) {
	c.pushLocked(comp, 1+c.sqUncovered)
	c.sqUncovered = 0
}

// advanceLocked completes, in order, the send requests that are done.
func (c *conn) advanceLocked() {
	n := uint64(len(c.sq))
	for !c.sqFailed && c.sqHead < c.sqTail {
		e := &c.sq[c.sqHead%n]
		if e.fail != transport.StatusSuccess {
			c.pushSendLocked(transport.Completion{ID: e.id, Op: e.op, Status: e.fail})
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
		if e.unsignaled {
			c.sqUncovered++
		} else {
			c.pushSendLocked(transport.Completion{ID: e.id, Op: e.op})
		}
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
	c.stopped.Store(true)
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

// finalize runs once both goroutines are gone (or at Close of a conn that
// never started): it flushes every request still outstanding and lets
// Poll report the end. With deliver, it delivers what is left to the
// handler, if any; a Close of a conn that never started is the caller's
// goroutine, which must not run the handler: a goroutine of its own does.
func (c *conn) finalize(deliver bool) {
	c.nc.Close()
	c.closeRegions()
	if c.rnrTimer != nil {
		c.rnrTimer.Stop()
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state == stateOpen {
		close(c.dying)
	}
	c.state = stateBroken
	c.stopped.Store(true)
	// A poster's write attempt finishes at once (it does not block).
	for c.writing {
		c.quietCond.Wait()
	}
	c.dropOutputLocked()
	n := uint64(len(c.sq))
	for ; c.sqHead < c.sqTail; c.sqHead++ {
		e := &c.sq[c.sqHead%n]
		st := transport.StatusFlushed
		if e.fail != transport.StatusSuccess && !c.sqFailed {
			st = e.fail
			c.sqFailed = true
		}
		c.pushSendLocked(transport.Completion{ID: e.id, Op: e.op, Status: st})
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
		c.pushLocked(transport.Completion{ID: e.id, Op: transport.OpRecv, Status: st}, 0)
		e.buf = nil
	}
	c.closedErr = transport.ErrClosed
	if c.cause != nil && c.cause != transport.ErrClosed {
		c.closedErr = fmt.Errorf("%w: %v", transport.ErrClosed, c.cause)
	}
	c.finalized = true
	close(c.done)
	c.setQuietLocked()
	c.notifyPoller()
	if c.handler != nil {
		if deliver {
			c.deliverLocked(false)
		} else if !c.delivering {
			go c.deliverAsync()
		}
	}
}

// dropOutputLocked drops the output nobody will write any more (the
// stream is closed and the writer gone or going): READ responses, and the
// rest of a batch left for the writer. Their windows are released.
func (c *conn) dropOutputLocked() {
	for ; c.rrHead < c.rrTail; c.rrHead++ {
		r := &c.rr[c.rrHead%uint64(len(c.rr))]
		r.win.release()
		r.data, r.win = nil, nil
	}
	c.rrHead, c.rrTail, c.rrBytes = 0, 0, 0
	if !c.writing {
		c.releaseBatchLocked()
	}
}

// HandleCompletions makes the conn deliver its completions to fn from now
// on: see transport.CompletionHandler. The reader goroutine calls fn with
// the completions it produced (ACKs complete SENDs and WRITEs, READ
// responses complete READs, the peer's SENDs complete receives) each time
// it is about to wait for the stream: before a read(2) on the socket that
// may wait (see beforeBlock) and before it waits for a receive to be
// posted (RNR). Completions that arise elsewhere (a request failing its
// local checks at post, the flushes of a broken connection) are delivered
// by the reader if it is delivering then, else by the goroutine that
// flushes the connection once the reader and writer are gone, and those
// queued before HandleCompletions by a goroutine of their own: never by a
// caller of PostSend, PostRecv, Close or HandleCompletions. While fn
// runs, the reader executes nothing of the peer's: fn must not block.
// Requests posted while the reader is in fn are written when it returns.
func (c *conn) HandleCompletions(fn func(cs []transport.Completion, err error)) {
	if fn == nil {
		panic("tcp: HandleCompletions with a nil function")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.handler != nil {
		panic("tcp: HandleCompletions called twice")
	}
	c.handler = fn
	c.dbuf = make([]transport.Completion, 64)
	if c.cqHead < c.cqTail || c.finalized {
		go c.deliverAsync()
	}
}

// deliverAsync delivers what is queued, on a goroutine of its own.
func (c *conn) deliverAsync() {
	c.mu.Lock()
	c.deliverLocked(false)
	c.mu.Unlock()
}

// deliverLocked calls the handler with the queued completions until none
// is left, and once the conn is finalized with the end, once; mu is
// released during each call. If another goroutine is delivering, it
// returns at once: that one takes what is queued, whenever it was queued,
// before it stops. reader says the caller is the reader goroutine.
func (c *conn) deliverLocked(reader bool) {
	if c.handler == nil || c.delivering {
		return
	}
	c.delivering = true
	fn := c.handler
	for {
		if c.cqHead < c.cqTail {
			n := c.takeLocked(c.dbuf)
			if reader {
				c.readerInFn = true
				c.quietCond.Broadcast()
			}
			c.mu.Unlock()
			fn(c.dbuf[:n], nil)
			c.mu.Lock()
			clear(c.dbuf[:n])
			c.readerInFn = false
			continue
		}
		if c.finalized && !c.finalSent {
			c.finalSent = true
			err := c.closedErr
			c.mu.Unlock()
			fn(nil, err)
			c.mu.Lock()
			continue
		}
		break
	}
	c.delivering = false
}
