//go:build linux

package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

const (
	// postChunk is the longest chain posted with one ibv_post_send or
	// ibv_post_recv; longer ones take several calls.
	postChunk = 256
	// pollBatch is the most completions one ibv_poll_cq returns.
	pollBatch = 64
	// ackBatch is how many completion events are acknowledged at once.
	ackBatch = 32
	// maxInline is the inline data asked of the QP: SENDs and WRITEs up to
	// that size are copied into the work request at post time.
	maxInline = 64
	// flushTimeout bounds how long Close waits for the flush completions
	// of what is outstanding before it destroys the QP regardless.
	flushTimeout = 5 * time.Second
	// flushRetry is how soon Close polls again a CQ that failed to poll.
	flushRetry = 10 * time.Millisecond
	// maxMessage is the largest message (a limit of the IB spec).
	maxMessage = 1 << 31
	// recvBit marks the wr_id of receives.
	recvBit = 1 << 63
	// drainWRID is the wr_id of the drain request (postDrain).
	drainWRID = 1 << 61
	// drainSlots is the send-queue room kept for the drain request.
	drainSlots = 1
	// mellanoxVendorID is the vendor_id of Mellanox (NVIDIA) adapters,
	// mlx4 and mlx5.
	mellanoxVendorID = 0x02c9
)

var (
	errLocalClose = errors.New("closed locally")
	errPeerClose  = errors.New("disconnected by the peer")
)

// entry is a posted work request, from its post until its completion is
// returned by Poll.
type entry struct {
	seq  uint64
	id   uint64
	op   transport.Opcode
	hw   bool // posted to the QP, its completion not yet polled
	done bool // comp is final
	// unsig: the caller asked for no completion on success
	// (WorkRequest.Unsignaled); emit drops it if it succeeded.
	unsig bool
	// nosig: posted without IBV_SEND_SIGNALED: the device reports it only
	// if it fails; the completion of a later request covers it.
	nosig bool
	// synthetic: it failed the checks at post time and never reached the
	// QP; it completes with its status in its turn.
	synthetic bool
	comp      transport.Completion
}

// ring is a work queue: entries [head, tail) in posting order. Completions
// of a queue come in posting order, so an entry whose completion is polled
// is always the oldest one posted to the QP.
type ring struct {
	mu    sync.Mutex
	ents  []entry
	head  uint64
	tail  uint64
	hwOut int // entries posted to the QP whose completion is not polled
	// Send queue only:
	// scan: the entries before it are covered (none of them is hw).
	scan uint64
	// unsigRun: how many requests were posted without IBV_SEND_SIGNALED
	// since the last one with it (0: the last request posted is
	// signaled, and its completion will cover all before it).
	unsigRun int
}

func (r *ring) push(id uint64, op transport.Opcode) *entry {
	e := &r.ents[r.tail%uint64(len(r.ents))]
	*e = entry{seq: r.tail, id: id, op: op}
	r.tail++
	return e
}

func (r *ring) pushDone(id uint64, op transport.Opcode, st transport.Status) {
	e := r.push(id, op)
	e.done, e.synthetic = true, true
	e.comp = transport.Completion{ID: id, Op: op, Status: st}
}

// conn is one RC queue pair with its own protection domain, completion
// queue and completion channel, and its own RDMA CM event channel.
type conn struct {
	p   *provider
	log *zap.Logger

	id  verbs.CMID
	ch  verbs.EventChannel
	cmw *waiter
	pd  verbs.PD
	cc  verbs.CompChannel
	cqw *waiter
	cq  verbs.CQ
	qp  verbs.QP

	// hooks are the test hooks of the provider (nil in a program).
	hooks *testHooks

	inline    int
	respRes   uint8
	initDepth uint8
	busy      time.Duration

	limits transport.Limits
	peerPD []byte
	local  string
	remote string
	info   string

	sq ring
	rq ring

	// Selective signaling (sq.mu).
	// unsigFlushes: the device reports the flush of a request posted
	// without IBV_SEND_SIGNALED (the IBA requires it: rxe and mlx5 do).
	// Without it, unsignaled requests that a flushed completion covers
	// are reported flushed, as nothing tells whether they executed.
	unsigFlushes bool
	drain        drainState
	drainSeq     uint64 // sq.tail when the drain request was posted
	sigStats     sigStats
	// compVector is the completion vector of the CQ.
	compVector int

	pollSem chan struct{} // held by Poll and by Close's teardown
	unacked int           // completion events not acknowledged (pollSem)
	tryCQ   func(uintptr) bool

	// st is the connState (state.go), written by transition under
	// stateMu, with cause: why the conn broke or closed.
	stateMu sync.Mutex
	st      atomic.Uint32
	cause   error
	// closed is closed, once, by the one that moved the conn to
	// stateClosed, when it is destroyed.
	closed chan struct{}
	// cmMu is held by whoever reads the RDMA CM channel of the conn: an
	// Accept waiting for ESTABLISHED, then the CM goroutine for its life
	// (start hands it over); teardown takes it, after closing the
	// waiter, before it destroys the id and the channel.
	cmMu sync.Mutex

	// failureReported: a failed work request was reported (complete,
	// emit): a request refused at post time after it completes flushed,
	// and no other failure is logged.
	failureReported atomic.Bool

	regMu   sync.Mutex
	regions map[*region]struct{}

	// Memory windows (window.go).
	mwSupported atomic.Bool // the device has type-2 windows
	// mwSpanChecked: the device checks the peer's requests on a window
	// against the window's span (rxe does not: against its MR's).
	mwSpanChecked bool
	mwSem         chan struct{} // a token per slot in use
	mwMu          sync.Mutex    // after regMu and sq.mu
	mwOps         [windowSlots]*mwOp
	mwGen         uint64
	mwFree        []verbs.MW
	mwLeaked      []verbs.MW // ibv_dealloc_mw failed; teardown tries again
	mwAllocated   int
	windows       map[*window]struct{} // not dead
}

var _ transport.Conn = (*conn)(nil)

// drainState is where the drain request of a broken conn is (postDrain).
type drainState uint8

const (
	drainNone   drainState = iota // not posted
	drainPosted                   // posted, its completion not polled
	drainDone                     // completed, or not needed
)

// sigStats count what selective signaling did on a conn (sq.mu), for
// tests and logs.
type sigStats struct {
	// reported: completions the device gave for requests posted without
	// IBV_SEND_SIGNALED (failed or flushed ones).
	reported int
	// covered: requests completed by the completion of a later one.
	covered int
	// coveredFlushed: of those, the ones reported flushed (a device
	// without unsigFlushes).
	coveredFlushed int
	// hidden: unsignaled requests posted signaled (a run of
	// SendQueueDepth) whose success was not returned.
	hidden int
}

// newConn makes the verbs resources of a conn on id (whose address, and
// route, are resolved): PD, completion channel, CQ, QP. On failure it
// destroys what it made, but not id, ch and w.
func newConn(p *provider, id verbs.CMID, ch verbs.EventChannel, w *waiter) (*conn, error) {
	ctx := id.Context()
	if ctx == nil {
		return nil, errors.New("the RDMA CM id is bound to no device")
	}
	attr, err := ctx.QueryDevice()
	if err != nil {
		return nil, err
	}
	o := p.opts
	// Type-2 memory windows get send-queue room of their own.
	mwSlots := 0
	if attr.MemWindowType2 && attr.MaxQPWR > 2*windowSlots && attr.MaxCQE > 2*windowSlots {
		mwSlots = windowSlots
	}
	// The drain request has send-queue room of its own as well.
	extra := mwSlots + drainSlots
	sqDepth := min(o.SendQueueDepth, attr.MaxQPWR-extra)
	rqDepth := min(o.RecvQueueDepth, attr.MaxQPWR)
	if cqe := sqDepth + rqDepth; cqe > attr.MaxCQE-extra {
		sqDepth = sqDepth * (attr.MaxCQE - extra) / cqe
		rqDepth = attr.MaxCQE - extra - sqDepth
	}
	c := &conn{
		p:         p,
		log:       p.log,
		hooks:     p.hooks,
		id:        id,
		ch:        ch,
		cmw:       w,
		busy:      o.BusyPoll,
		respRes:   uint8(max(1, min(o.MaxReadsInFlight, attr.MaxQPRdAtom, 255))),
		initDepth: uint8(max(1, min(o.MaxReadsInFlight, attr.MaxQPInitRdAtom, 255))),
		pollSem:   make(chan struct{}, 1),
		closed:    make(chan struct{}),
		regions:   make(map[*region]struct{}),
	}
	c.tryCQ = c.tryCQEvent
	c.initWindows(mwSlots > 0)
	c.mwSpanChecked = attr.VendorID != rxeVendorID
	c.unsigFlushes = attr.VendorID == rxeVendorID || attr.VendorID == mellanoxVendorID
	c.compVector = p.nextCompVector(id.DeviceName(), ctx.NumCompVectors())
	c.sq.ents = make([]entry, sqDepth)
	c.rq.ents = make([]entry, rqDepth)
	// On failure, what was made is destroyed. (Not with named results:
	// a return nil, err would leave the cleanup a nil conn.)
	ok := false
	defer func() {
		if !ok {
			c.destroyVerbs()
		}
	}()
	if c.pd, err = ctx.AllocPD(); err != nil {
		return nil, memlockHint(err)
	}
	if c.cc, err = ctx.NewCompChannel(); err != nil {
		return nil, err
	}
	if c.cqw, err = newWaiter(c.cc.Fd(), "rdma-cq"); err != nil {
		return nil, err
	}
	if c.cq, err = ctx.NewCQ(sqDepth+rqDepth+extra, c.cc, pollBatch, c.compVector); err != nil {
		return nil, memlockHint(err)
	}
	want := verbs.QPCaps{SendWR: sqDepth + extra, RecvWR: rqDepth, InlineData: maxInline}
	chunk := min(p.chunk, max(sqDepth, rqDepth))
	if c.qp, err = id.CreateQP(c.pd, c.cq, want, chunk); err != nil {
		want.InlineData = 0
		if c.qp, err = id.CreateQP(c.pd, c.cq, want, chunk); err != nil {
			return nil, memlockHint(err)
		}
	}
	c.inline = c.qp.Caps().InlineData
	c.limits = transport.Limits{
		SendQueueDepth:   sqDepth,
		RecvQueueDepth:   rqDepth,
		MaxReadsInFlight: int(c.initDepth),
		MaxPrivateData:   MaxConnectPrivateData,
	}
	ok = true
	return c, nil
}

// start moves a conn whose peer confirmed the connection (ESTABLISHED)
// to established, and runs the goroutine that watches its RDMA CM events,
// which takes over cmMu from the caller (who holds it). It fails, and the
// caller keeps cmMu, if the conn was closed meanwhile (a conn of Prepare,
// closed by its owner).
func (c *conn) start() error {
	if from, ok := c.transition(stateEstablished, nil); !ok {
		return fmt.Errorf("the connection is %v: %w", from, transport.ErrClosed)
	}
	c.log.Debug("rdma connection established", zap.String("device", c.info), zap.String("remote", c.remote),
		zap.Uint32("qp", c.qp.Num()), zap.Int("send_queue", c.limits.SendQueueDepth),
		zap.Int("recv_queue", c.limits.RecvQueueDepth), zap.Int("reads_in_flight", c.limits.MaxReadsInFlight),
		zap.Int("inline", c.inline), zap.Duration("busy_poll", c.busy), zap.Int("comp_vector", c.compVector))
	go c.cmLoop()
	return nil
}

// setNames records the addresses and device of an established conn, for
// LocalAddr, RemoteAddr and DeviceInfo (before its owner gets it).
func (c *conn) setNames() {
	c.local = c.id.LocalAddr().String()
	if c.remote == "" {
		c.remote = c.id.PeerAddr().String()
	}
	c.info = idInfo(c.id)
}

// cmLoop reads the RDMA CM events of an established conn until teardown
// closes the waiter (or the device goes); it holds cmMu, from start.
func (c *conn) cmLoop() {
	defer c.cmMu.Unlock()
	for {
		ev, err := waitEvent(context.Background(), c.ch, c.cmw)
		if err != nil {
			if !errors.Is(err, errWaiterClosed) {
				c.breakConn(fmt.Errorf("RDMA CM events: %w", err))
			}
			return
		}
		if c.handleEvent(ev) {
			return
		}
	}
}

// handleEvent acts on an RDMA CM event of an established conn and reports
// whether the CM goroutine is to stop.
func (c *conn) handleEvent(ev verbs.Event) (stop bool) {
	switch ev.Type {
	case verbs.EventDisconnected:
		c.breakConn(errPeerClose)
	case verbs.EventDeviceRemoval:
		c.deviceRemoved()
		return true
	case verbs.EventTimewaitExit, verbs.EventAddrChange, verbs.EventEstablished:
	default:
		c.log.Debug("rdma connection event", zap.String("remote", c.remote), zap.Stringer("event", ev.Type), zap.Int("status", ev.Status))
	}
	return false
}

// deviceRemoved closes the conn whose device is gone. The device will not
// flush the work requests outstanding, so they complete flushed now (the
// window requests too), and Poll, which leaves the CQ to Close from now
// on, returns them and then an error matching transport.ErrDeviceRemoved
// (and ErrClosed). The verbs resources are released at once in the
// background, as the kernel waits for them to finish removing the device;
// the owner's Close waits for that. (If the owner's Close began already,
// the flush lets it go on at once.)
func (c *conn) deviceRemoved() {
	c.log.Warn("rdma: the RDMA device of the connection was removed; breaking it",
		zap.String("remote", c.remote), zap.String("device", c.info))
	_, began := c.transition(stateClosed, fmt.Errorf("%w (%s)", transport.ErrDeviceRemoved, c.info))
	c.flushOutstanding()
	c.cqw.kick()
	if began {
		go c.finishClose()
	}
}

// flushOutstanding completes every work request posted to the QP whose
// completion was not polled as flushed, and every window request, for a
// QP that will report nothing more (the conn is closed, or destroyed).
func (c *conn) flushOutstanding() {
	for _, r := range [2]*ring{&c.sq, &c.rq} {
		r.mu.Lock()
		for seq := r.head; seq < r.tail; seq++ {
			e := &r.ents[seq%uint64(len(r.ents))]
			if e.hw {
				e.hw, e.done = false, true
				op := e.op
				if r == &c.rq {
					op = transport.OpRecv
				}
				e.comp = transport.Completion{ID: e.id, Op: op, Status: transport.StatusFlushed}
			}
		}
		r.hwOut = 0
		if r == &c.sq {
			c.drain = drainDone
		}
		r.mu.Unlock()
	}
	c.flushWindows()
}

func (c *conn) PeerPrivateData() []byte  { return bytes.Clone(c.peerPD) }
func (c *conn) Limits() transport.Limits { return c.limits }
func (c *conn) LocalAddr() string        { return c.local }
func (c *conn) RemoteAddr() string       { return c.remote }

// DeviceInfo names the device, port and source GID the connection uses,
// and its local address: "rxe0 port 1 gid ::ffff:192.0.2.1 192.0.2.1:7480".
func (c *conn) DeviceInfo() string { return c.info }

// memlockHint explains the ENOMEM and EPERM of pinning memory.
func memlockHint(err error) error {
	if !errors.Is(err, syscall.ENOMEM) && !errors.Is(err, syscall.EPERM) {
		return err
	}
	var lim unix.Rlimit
	cur := "unknown"
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) == nil {
		if lim.Cur == unix.RLIM_INFINITY {
			// Not the memlock limit: the device itself is out of memory
			// (or of the objects asked for).
			return err
		}
		cur = fmt.Sprintf("%d KiB", lim.Cur>>10)
	}
	return fmt.Errorf("%w: the memory locked for RDMA exceeds the memlock limit (%s): raise the memlock limit (ulimit -l unlimited, or LimitMEMLOCK=infinity in the systemd unit)", err, cur)
}

// inGoHeap reports whether p points into an object of the Go heap:
// runtime.AddCleanup takes a pointer into any heap object, and panics for
// memory the Go runtime does not manage, such as AllocMemory's mappings.
func inGoHeap(p *byte) (heap bool) {
	defer func() {
		if recover() != nil {
			heap = false
		}
	}()
	cl := runtime.AddCleanup(p, func(int) {}, 0)
	cl.Stop()
	return cl != runtime.Cleanup{}
}

// Register registers buf with ibv_reg_mr on the conn's protection domain.
// buf must be outside the Go heap (from transport.AllocMemory): the device
// keeps its address, which the cgo rules forbid for Go memory; and it must
// not map a file (transport.CheckNotFileMapping). AccessBindWindow adds
// IBV_ACCESS_MW_BIND if the device has memory windows (without, it is
// dropped: BindWindow reports ErrUnsupported anyway).
func (c *conn) Register(buf []byte, access transport.Access) (transport.Region, error) {
	const all = transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite | transport.AccessBindWindow
	switch {
	case len(buf) == 0:
		return nil, errors.New("register: empty buffer")
	case access&^all != 0:
		return nil, fmt.Errorf("register: unknown access bits %#x", uint32(access&^all))
	case access&transport.AccessRemoteWrite != 0 && access&transport.AccessLocalWrite == 0:
		return nil, errors.New("register: remote write access requires local write access")
	case inGoHeap(&buf[0]):
		return nil, errors.New("register: the buffer is in the Go heap; RDMA needs memory from transport.AllocMemory")
	}
	if err := transport.CheckNotFileMapping(buf); err != nil {
		return nil, err
	}
	flags := 0
	if access&transport.AccessLocalWrite != 0 {
		flags |= verbs.AccessLocalWrite
	}
	if access&transport.AccessRemoteRead != 0 {
		flags |= verbs.AccessRemoteRead
	}
	if access&transport.AccessRemoteWrite != 0 {
		flags |= verbs.AccessRemoteWrite
	}
	if access&transport.AccessBindWindow != 0 && c.mwSupported.Load() {
		flags |= verbs.AccessMWBind
	}
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if st := c.state(); st >= stateClosed {
		return nil, fmt.Errorf("register: the connection is %v: %w", st, transport.ErrClosed)
	}
	if q := c.quarantinedOverlap(buf); q != nil {
		return nil, fmt.Errorf("register %d bytes: the memory overlaps a region whose deregistration failed (%d bytes at %#x): %w",
			len(buf), len(q.buf), q.addr, transport.ErrDeregisterFailed)
	}
	mr, err := c.pd.RegMR(unsafe.Pointer(&buf[0]), len(buf), flags)
	if err != nil {
		return nil, fmt.Errorf("register %d bytes: %w", len(buf), memlockHint(err))
	}
	r := &region{
		c:      c,
		buf:    buf,
		addr:   uint64(uintptr(unsafe.Pointer(&buf[0]))),
		mr:     mr,
		lkey:   mr.LKey(),
		rkey:   mr.RKey(),
		access: access,
	}
	c.regions[r] = struct{}{}
	return r, nil
}

// region is a memory region registered on one conn's protection domain.
type region struct {
	c      *conn
	buf    []byte
	addr   uint64
	mr     verbs.MR // nil once deregistered (c.regMu)
	lkey   uint32
	rkey   uint32
	access transport.Access
	dead   atomic.Bool
	// quarantined: a Deregister failed and the MR is still registered
	// (c.regMu).
	quarantined bool
	windows     map[*window]struct{} // bound over it, not dead (c.mwMu)
}

func (r *region) Bytes() []byte            { return r.buf }
func (r *region) Addr() uint64             { return r.addr }
func (r *region) LKey() uint32             { return r.lkey }
func (r *region) RKey() uint32             { return r.rkey }
func (r *region) Access() transport.Access { return r.access }

// Deregister deregisters the MR. If ibv_dereg_mr fails, the MR stays
// registered, so the peer may still reach the memory with its rkey: the
// region is quarantined (kept, its memory refused to Register on this conn)
// and the error, which matches transport.ErrDeregisterFailed, says so. A
// later Deregister tries again; Close tries once more.
func (r *region) Deregister() error {
	r.dead.Store(true)
	c := r.c
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if r.mr == nil {
		return nil
	}
	err := c.killWindowsLocked(r)
	if err == nil {
		err = r.mr.Dereg()
	}
	if err != nil {
		if !r.quarantined {
			c.log.Warn("rdma: deregistering a region failed; its memory is quarantined",
				zap.String("remote", c.remote), zap.Uint64("addr", r.addr), zap.Int("len", len(r.buf)), zap.Error(err))
		}
		r.quarantined = true
		return fmt.Errorf("deregister %d bytes at %#x: %w: %w", len(r.buf), r.addr, transport.ErrDeregisterFailed, err)
	}
	r.mr = nil
	r.quarantined = false
	delete(c.regions, r)
	return nil
}

// quarantinedOverlap reports whether buf overlaps a region whose
// deregistration failed (c.regMu held).
func (c *conn) quarantinedOverlap(buf []byte) *region {
	lo := uintptr(unsafe.Pointer(&buf[0]))
	hi := lo + uintptr(len(buf))
	for r := range c.regions {
		if !r.quarantined {
			continue
		}
		rlo := uintptr(r.addr)
		if lo < rlo+uintptr(len(r.buf)) && rlo < hi {
			return r
		}
	}
	return nil
}

// checkLocal checks a local SGE: a live region of this conn, within bounds, with
// local write access if write. A zero SGE is an empty buffer.
func (c *conn) checkLocal(s transport.SGE, write bool, w *verbs.WR) transport.Status {
	if s.Region == nil {
		if s.Offset == 0 && s.Length == 0 {
			w.Addr, w.Length, w.LKey = 0, 0, 0
			return transport.StatusSuccess
		}
		return transport.StatusLocalProtectionError
	}
	r, ok := s.Region.(*region)
	if !ok || r == nil || r.c != c || r.dead.Load() {
		return transport.StatusLocalProtectionError
	}
	if write && r.access&transport.AccessLocalWrite == 0 {
		return transport.StatusLocalProtectionError
	}
	if s.Offset < 0 || s.Length < 0 || s.Offset > len(r.buf) || s.Length > len(r.buf)-s.Offset {
		return transport.StatusLocalProtectionError
	}
	if s.Length >= maxMessage {
		return transport.StatusLocalLengthError
	}
	w.Addr = r.addr + uint64(s.Offset)
	w.Length = uint32(s.Length)
	w.LKey = r.lkey
	return transport.StatusSuccess
}

var wrOpcodes = [...]uint32{
	transport.OpSend:     verbs.WRSend,
	transport.OpWrite:    verbs.WRRDMAWrite,
	transport.OpWriteImm: verbs.WRRDMAWriteImm,
	transport.OpRead:     verbs.WRRDMARead,
}

// PostSend posts wrs in order, in chains of up to postChunk work requests
// per ibv_post_send. A request that fails the local checks (its SGE, its
// access rights) is not posted: it completes with
// StatusLocalProtectionError after those before it, and those after it are
// flushed, as the device would do. If ibv_post_send refuses a request after
// some of the call went to the QP, nothing after it is posted: it completes
// with StatusTransportError and every later one of the call is flushed.
func (c *conn) PostSend(wrs ...transport.WorkRequest) error {
	for i := range wrs {
		switch wrs[i].Op {
		case transport.OpSend, transport.OpWrite, transport.OpWriteImm, transport.OpRead:
		default:
			return fmt.Errorf("post send: invalid opcode %v", wrs[i].Op)
		}
	}
	r := &c.sq
	r.mu.Lock()
	switch c.state() {
	case stateEstablished:
	case stateConnecting:
		r.mu.Unlock()
		return fmt.Errorf("post send: %w", transport.ErrNotAccepted)
	default:
		r.mu.Unlock()
		return transport.ErrClosed
	}
	if int(r.tail-r.head)+len(wrs) > len(r.ents) {
		r.mu.Unlock()
		return transport.ErrQueueFull
	}
	buf := c.qp.SendBuf()
	start, startRun := r.tail, r.unsigRun
	posted := 0
	staged := 0
	var fail error
	bad := false
	for i := range wrs {
		wr := &wrs[i]
		if bad {
			r.pushDone(wr.ID, wr.Op, transport.StatusFlushed)
			continue
		}
		w := &buf[staged]
		if st := c.checkLocal(wr.Local, wr.Op == transport.OpRead, w); st != transport.StatusSuccess {
			bad = true
			fail = fmt.Errorf("%v request %d: local buffer refused: %v", wr.Op, wr.ID, st)
			r.pushDone(wr.ID, wr.Op, st)
			continue
		}
		e := r.push(wr.ID, wr.Op)
		e.hw = true
		e.unsig = wr.Unsignaled
		w.ID = e.seq
		w.RAddr, w.RKey, w.Imm = wr.RemoteAddr, wr.RKey, wr.Imm
		w.Opcode = wrOpcodes[wr.Op]
		// Unsignaled requests go without IBV_SEND_SIGNALED, but for the
		// one that would make a run as long as the queue: nothing would
		// ever cover that run, so it is signaled, and its success dropped.
		if wr.Unsignaled && r.unsigRun+1 < len(r.ents) {
			w.Flags = 0
			e.nosig = true
			r.unsigRun++
		} else {
			w.Flags = verbs.FlagSignaled
			r.unsigRun = 0
		}
		if wr.Op != transport.OpRead && w.Length > 0 && int(w.Length) <= c.inline {
			w.Flags |= verbs.FlagInline
		}
		staged++
		if staged == len(buf) {
			stopped, err := c.postStaged(r, staged, start, startRun, &posted)
			if err != nil {
				return err
			}
			staged = 0
			if stopped {
				// The rest of the call is flushed, never posted.
				bad = true
			}
		}
	}
	if staged > 0 {
		if _, err := c.postStaged(r, staged, start, startRun, &posted); err != nil {
			return err
		}
	}
	r.mu.Unlock()
	if bad && fail != nil {
		// The connection breaks when the refused request completes: those
		// before it may still complete normally.
		c.markBroken(fail)
	}
	return nil
}

// postStaged posts the n staged requests of the send queue r (r.mu held).
// If nothing of this PostSend got to the QP, a refusal undoes the whole
// call (r.mu released; the queue's tail back to start and its run of
// unsignaled requests to startRun) and returns the error; otherwise the
// requests not posted fail in their turn and break the connection, and
// postStaged reports stopped: the caller must post nothing more.
func (c *conn) postStaged(r *ring, n int, start uint64, startRun int, posted *int) (stopped bool, err error) {
	k, err := c.qp.PostSend(n)
	r.hwOut += k
	if err == nil {
		*posted += n
		return false, nil
	}
	if *posted == 0 && k == 0 {
		r.tail, r.unsigRun = start, startRun
		r.mu.Unlock()
		if errors.Is(err, syscall.ENOMEM) {
			return false, fmt.Errorf("post send: %w (%v)", transport.ErrQueueFull, err)
		}
		return false, fmt.Errorf("post send: %w", err)
	}
	// Requests from index posted+k of this call on did not reach the QP.
	*posted += k
	// Whether the last one that did is signaled is not tracked: have the
	// drain request cover them.
	r.unsigRun = max(r.unsigRun, 1)
	first := true
	for seq := start + uint64(*posted); seq < r.tail; seq++ {
		e := &r.ents[seq%uint64(len(r.ents))]
		if !e.hw {
			continue
		}
		e.hw, e.done, e.synthetic = false, true, true
		st := transport.StatusFlushed
		if first {
			st, first = transport.StatusTransportError, false
		}
		e.comp = transport.Completion{ID: e.id, Op: e.op, Status: st}
	}
	c.log.Warn("rdma: ibv_post_send refused a request; breaking the connection", zap.String("remote", c.remote), zap.Error(err))
	c.markBroken(fmt.Errorf("post send: %w", err))
	return true, nil
}

// PostRecv posts receives in chains of up to postChunk per ibv_post_recv. A
// receive whose buffer fails the local checks breaks the connection: it
// completes with StatusLocalProtectionError after the receives before it
// are flushed. If ibv_post_recv refuses a receive after some of the call
// went to the QP, nothing after it is posted: it and every later receive of
// the call complete flushed, and the connection breaks.
func (c *conn) PostRecv(rrs ...transport.RecvRequest) error {
	r := &c.rq
	r.mu.Lock()
	if c.state() > stateEstablished {
		r.mu.Unlock()
		return transport.ErrClosed
	}
	if int(r.tail-r.head)+len(rrs) > len(r.ents) {
		r.mu.Unlock()
		return transport.ErrQueueFull
	}
	buf := c.qp.RecvBuf()
	start := r.tail
	staged, posted := 0, 0
	var fail error
	stopped := false // a post was refused: post nothing more
	post := func() error {
		k, err := c.qp.PostRecv(staged)
		r.hwOut += k
		if err == nil {
			posted += staged
			return nil
		}
		if posted == 0 && k == 0 {
			r.tail = start
			if errors.Is(err, syscall.ENOMEM) {
				return fmt.Errorf("post recv: %w (%v)", transport.ErrQueueFull, err)
			}
			return fmt.Errorf("post recv: %w", err)
		}
		posted += k
		for seq := start + uint64(posted); seq < r.tail; seq++ {
			e := &r.ents[seq%uint64(len(r.ents))]
			if e.hw {
				e.hw, e.done, e.synthetic = false, true, true
				e.comp = transport.Completion{ID: e.id, Op: transport.OpRecv, Status: transport.StatusFlushed}
			}
		}
		if fail == nil {
			fail = fmt.Errorf("post recv: %w", err)
		}
		stopped = true
		return nil
	}
	for i := range rrs {
		rr := &rrs[i]
		if stopped {
			r.pushDone(rr.ID, transport.OpRecv, transport.StatusFlushed)
			continue
		}
		w := &buf[staged]
		if st := c.checkLocal(rr.Local, true, w); st != transport.StatusSuccess {
			r.pushDone(rr.ID, transport.OpRecv, st)
			if fail == nil {
				fail = fmt.Errorf("receive %d: local buffer refused: %v", rr.ID, st)
			}
			continue
		}
		e := r.push(rr.ID, transport.OpRecv)
		e.hw = true
		w.ID = e.seq | recvBit
		staged++
		if staged == len(buf) {
			if err := post(); err != nil {
				r.mu.Unlock()
				return err
			}
			staged = 0
		}
	}
	if staged > 0 {
		if err := post(); err != nil {
			r.mu.Unlock()
			return err
		}
	}
	r.mu.Unlock()
	if fail != nil {
		// The receives before it are flushed now, as a device flushes the
		// receive queue of a QP that breaks.
		c.breakConn(fail)
	}
	return nil
}

// markBroken stops posting without breaking the QP yet (stateFailing): a
// request refused at post time breaks it when it completes, after those
// before it.
func (c *conn) markBroken(cause error) {
	c.transition(stateFailing, cause)
	c.cqw.kick()
}

// breakConn breaks the connection (stateDraining): the QP moves to the
// error state, which flushes every outstanding work request, and the peer
// is told (rdma_disconnect); a Poll waiting is woken.
func (c *conn) breakConn(cause error) {
	c.transition(stateDraining, cause)
	c.cqw.kick()
}

// mapStatus maps an ibv_wc_status.
func mapStatus(s uint32) transport.Status {
	switch s {
	case verbs.WCSuccess:
		return transport.StatusSuccess
	case verbs.WCLocLenErr:
		return transport.StatusLocalLengthError
	case verbs.WCLocProtErr:
		return transport.StatusLocalProtectionError
	case verbs.WCRemAccessErr:
		return transport.StatusRemoteAccessError
	case verbs.WCRemInvReqErr:
		return transport.StatusRemoteInvalidRequest
	case verbs.WCRNRRetryExcErr:
		return transport.StatusRNRRetryExceeded
	case verbs.WCWRFlushErr:
		return transport.StatusFlushed
	}
	return transport.StatusTransportError
}

// coverLocked completes the send-queue entries before seq upto that are
// still posted (sq.mu held): requests posted without IBV_SEND_SIGNALED,
// which the device reports only if they fail. Send-queue completions come
// in order, and st is the status of the completion of a later request (or
// of the drain request): a success, or a failure, says every request
// before it succeeded (a failed one would have been reported first). So
// does a flush on a device that reports flushed unsignaled requests
// (unsigFlushes); on another, a flush leaves them unknown, and they are
// reported flushed.
func (c *conn) coverLocked(upto uint64, st transport.Status) {
	r := &c.sq
	cst := transport.StatusSuccess
	if st == transport.StatusFlushed && !c.unsigFlushes {
		cst = transport.StatusFlushed
	}
	for seq := max(r.scan, r.head); seq < upto; seq++ {
		e := &r.ents[seq%uint64(len(r.ents))]
		if !e.hw {
			continue
		}
		e.hw, e.done = false, true
		e.comp = transport.Completion{ID: e.id, Op: e.op, Status: cst}
		r.hwOut--
		c.sigStats.covered++
		if cst != transport.StatusSuccess {
			c.sigStats.coveredFlushed++
		}
	}
	r.scan = max(r.scan, upto)
}

// postDrain posts the drain request of a broken conn, once, if requests
// posted without IBV_SEND_SIGNALED may still be uncovered (the last one
// posted is one of them): nothing else would complete them when they
// succeeded (a device reports nothing of those), nor, on a device without
// unsigFlushes, when they were flushed. The drain request is a signaled
// zero-length RDMA WRITE posted after everything else (broken: nothing
// more is posted), so its completion, flushed on a QP in the error state,
// covers them all. pollSem held, the QP alive.
func (c *conn) postDrain() {
	r := &c.sq
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.drain != drainNone {
		return
	}
	if r.unsigRun == 0 || r.hwOut == 0 {
		c.drain = drainDone
		return
	}
	c.drainSeq = r.tail
	if err := c.qp.PostDrain(drainWRID); err != nil {
		// Those requests stay posted until Close gives up on them
		// (flushTimeout) and completes them flushed.
		c.drain = drainDone
		c.log.Warn("rdma: posting the drain request failed: unsignaled requests complete only at close",
			zap.String("remote", c.remote), zap.Error(err))
		return
	}
	c.drain = drainPosted
}

// complete records the completions just polled into the entries of their
// work requests (pollSem held).
func (c *conn) complete(wcs []verbs.WC) {
	var failure error
	flushed := false
	var mws [pollBatch]verbs.WC
	nmw := 0
	c.sq.mu.Lock()
	c.rq.mu.Lock()
	for _, wc := range wcs {
		if wc.ID == drainWRID {
			st := mapStatus(wc.Status)
			c.coverLocked(c.drainSeq, st)
			c.drain = drainDone
			switch st {
			case transport.StatusSuccess:
			case transport.StatusFlushed:
				flushed = true
			default:
				if failure == nil && !c.failureReported.Load() {
					failure = fmt.Errorf("the drain request failed: %s (vendor_err %#x)", verbs.StatusString(wc.Status), wc.VendorErr)
				}
			}
			continue
		}
		if wc.ID&(recvBit|mwBit) == mwBit {
			// A bind or invalidation: completeMW takes it, Poll never
			// returns it.
			mws[nmw] = wc
			nmw++
			continue
		}
		r := &c.sq
		if wc.ID&recvBit != 0 {
			r = &c.rq
		}
		seq := wc.ID &^ recvBit
		e := &r.ents[seq%uint64(len(r.ents))]
		if e.seq != seq || !e.hw {
			c.log.Error("rdma: completion of an unknown work request", zap.Uint64("wr_id", wc.ID), zap.Uint32("status", wc.Status))
			continue
		}
		comp := transport.Completion{ID: e.id, Op: e.op, Status: mapStatus(wc.Status)}
		if r == &c.sq {
			c.coverLocked(seq, comp.Status)
			if e.nosig {
				c.sigStats.reported++
			} else if e.unsig && comp.Status == transport.StatusSuccess {
				c.sigStats.hidden++
			}
		}
		if r == &c.rq {
			comp.Op = transport.OpRecv
			if wc.Status == verbs.WCLocQPOpErr {
				// Soft-RoCE reports a SEND longer than the receive buffer
				// so; the SGE of a receive is checked at post time, so the
				// length is what can be wrong with it.
				comp.Status = transport.StatusLocalLengthError
			}
			if comp.Status == transport.StatusSuccess {
				comp.ByteLen = int(wc.ByteLen)
				if wc.Opcode == verbs.WCRecvRDMAWithImm {
					comp.Op = transport.OpRecvWriteImm
					comp.Imm = wc.Imm
				}
			}
		}
		switch comp.Status {
		case transport.StatusSuccess:
		case transport.StatusFlushed:
			flushed = true
		default:
			comp.VendorErr = wc.Status<<24 | wc.VendorErr&0xffffff
			if failure == nil && !c.failureReported.Load() {
				failure = fmt.Errorf("%v request %d failed: %v (%s, vendor_err %#x)", comp.Op, comp.ID, comp.Status, verbs.StatusString(wc.Status), wc.VendorErr)
				c.log.Warn("rdma work request failed", zap.String("remote", c.remote), zap.Stringer("op", comp.Op),
					zap.Uint64("id", comp.ID), zap.String("status", verbs.StatusString(wc.Status)), zap.Uint32("vendor_err", wc.VendorErr))
			}
		}
		e.comp = comp
		e.hw, e.done = false, true
		r.hwOut--
	}
	c.rq.mu.Unlock()
	c.sq.mu.Unlock()
	for _, wc := range mws[:nmw] {
		st := mapStatus(wc.Status)
		if st == transport.StatusFlushed {
			flushed = true
		}
		if err := c.completeMW(wc.ID, st, wc.VendorErr); err != nil && failure == nil && !c.failureReported.Load() {
			failure = err
			c.log.Warn("rdma work request failed", zap.String("remote", c.remote), zap.Error(err))
		}
	}
	if failure != nil {
		c.failureReported.Store(true)
		c.breakConn(failure)
	} else if flushed && c.state() < stateDraining {
		c.breakConn(errors.New("work requests flushed: the queue pair is in the error state"))
	}
}

// emit moves the completions that are final, oldest first, from the queues
// into out. Once the connection is broken, the receives it flushed come
// after every completion of the send queue, whatever the order the device
// reported them in.
func (c *conn) emit(out []transport.Completion) int {
	n := 0
	var refused error
	sendsLeft := false
	for _, r := range [2]*ring{&c.sq, &c.rq} {
		r.mu.Lock()
		for n < len(out) && r.head < r.tail {
			e := &r.ents[r.head%uint64(len(r.ents))]
			if !e.done {
				break
			}
			if r == &c.rq && sendsLeft && e.comp.Status == transport.StatusFlushed {
				break
			}
			comp := e.comp
			if e.synthetic && comp.Status != transport.StatusFlushed {
				// A request refused at post time: flushed if the
				// connection failed before its turn, else it is the
				// failure that breaks it now.
				if c.failureReported.Swap(true) {
					comp.Status = transport.StatusFlushed
				} else if refused == nil {
					refused = fmt.Errorf("%v request %d: %v", comp.Op, comp.ID, comp.Status)
				}
			}
			if e.unsig && comp.Status == transport.StatusSuccess {
				// Unsignaled, and it succeeded: not returned.
				*e = entry{}
				r.head++
				continue
			}
			out[n] = comp
			n++
			*e = entry{}
			r.head++
		}
		if r == &c.sq {
			sendsLeft = r.head < r.tail
		}
		r.mu.Unlock()
	}
	if refused != nil {
		c.breakConn(refused)
	}
	return n
}

// finished reports whether the connection is broken and every completion
// was returned.
func (c *conn) finished() bool {
	if c.state() < stateFailing {
		return false
	}
	c.sq.mu.Lock()
	empty := c.sq.head == c.sq.tail
	c.sq.mu.Unlock()
	c.rq.mu.Lock()
	empty = empty && c.rq.head == c.rq.tail
	c.rq.mu.Unlock()
	return empty
}

func (c *conn) closedErr() error {
	c.stateMu.Lock()
	cause := c.cause
	c.stateMu.Unlock()
	if cause == nil || cause == errLocalClose {
		return transport.ErrClosed
	}
	return fmt.Errorf("%w: %w", transport.ErrClosed, cause)
}

// tryCQEvent consumes a completion event if one is queued (pollSem held).
func (c *conn) tryCQEvent(uintptr) bool {
	ok, err := c.cc.GetEvent()
	if err != nil {
		c.log.Error("rdma: ibv_get_cq_event", zap.Error(err))
		return true
	}
	if ok {
		c.unacked++
		if c.unacked >= ackBatch {
			c.cq.AckEvents(c.unacked)
			c.unacked = 0
		}
	}
	return ok
}

// pollCQ polls a batch of completions (pollSem held, the QP alive) and
// records them in their work requests, where emit finds them: a caller
// that takes fewer at a time gets the rest without another ibv_poll_cq.
// With arm, an empty CQ is armed and polled again.
func (c *conn) pollCQ(arm bool) (int, error) {
	k, err := c.cq.Poll(pollBatch, arm)
	if err != nil {
		return 0, err
	}
	if k > 0 {
		c.complete(c.cq.WCs()[:k])
	}
	return k, nil
}

// cqFailed closes a conn whose CQ cannot be polled (pollSem held): the
// device may still execute what is posted, so nothing is reported until
// the QP is destroyed; Close's teardown, run in the background, then
// completes it all flushed, and Poll returns that and an ErrClosed that
// says why.
func (c *conn) cqFailed(err error) {
	c.log.Warn("rdma: polling the completion queue failed; closing the connection", zap.String("remote", c.remote), zap.Error(err))
	if _, began := c.transition(stateClosed, fmt.Errorf("polling the completion queue: %w", err)); began {
		go c.finishClose()
	}
}

// Poll returns completions, oldest first per queue. When none is ready it
// optionally spins on the CQ (Options.BusyPoll), then arms the CQ, polls
// once more, and sleeps on the completion channel through Go's poller.
func (c *conn) Poll(ctx context.Context, out []transport.Completion) (int, error) {
	if len(out) == 0 {
		return 0, nil
	}
	if err := c.acquirePoll(ctx); err != nil {
		return 0, err
	}
	held := true
	defer func() {
		if held {
			<-c.pollSem
		}
	}()
	spun := false
	for {
		gen := c.cqw.gen.Load()
		if n := c.emit(out); n > 0 {
			return n, nil
		}
		st := c.state()
		if st == stateDestroyed || c.finished() {
			// (Destroyed: teardown completed everything, and emit
			// returned it.)
			return 0, c.closedErr()
		}
		if st == stateClosed {
			// Close collects the flush completions and destroys the QP;
			// what it collected is returned after it.
			<-c.pollSem
			held = false
			select {
			case <-c.closed:
			case <-ctx.Done():
				return 0, ctx.Err()
			}
			if err := c.acquirePoll(ctx); err != nil {
				return 0, err
			}
			held = true
			continue
		}
		if st >= stateFailing {
			c.postDrain()
		}
		// Without busy polling, an empty CQ is armed in the same call, and
		// polled again after that.
		arm := c.busy <= 0 || spun
		k, err := c.pollCQ(arm)
		if err != nil {
			c.cqFailed(err)
			continue
		}
		if k > 0 {
			continue
		}
		if c.finished() {
			return 0, c.closedErr()
		}
		if !arm {
			spun = true
			k, err := c.cq.PollSpin(pollBatch, c.busy)
			if err != nil {
				c.cqFailed(err)
			} else if k > 0 {
				c.complete(c.cq.WCs()[:k])
			}
			continue
		}
		err = c.cqw.wait(ctx, gen, c.tryCQ)
		switch {
		case err == nil, errors.Is(err, errKicked):
			spun = false
		case errors.Is(err, errWaiterClosed):
			return 0, c.closedErr()
		default:
			return 0, err
		}
	}
}

// acquirePoll takes pollSem, or gives up when ctx ends.
func (c *conn) acquirePoll(ctx context.Context) error {
	select {
	case c.pollSem <- struct{}{}:
		return nil
	default:
	}
	select {
	case c.pollSem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close disconnects (the QP flushes what is outstanding), collects the
// flush completions for Poll, destroys the QP, so that the device touches
// no buffer any more, and then the rest. It returns once that is done,
// whoever began it: it is safe to call twice, and concurrently.
func (c *conn) Close() error {
	if _, began := c.transition(stateClosed, errLocalClose); began {
		c.finishClose()
	}
	<-c.closed
	return nil
}

// finishClose does Close's work, once: in the goroutine that moved the
// conn to stateClosed (Close, or the background after a device removal
// or a CQ failure).
func (c *conn) finishClose() {
	c.cqw.kick() // a Poll asleep leaves the CQ to Close
	c.pollSem <- struct{}{}
	c.drainFlushes()
	c.teardown()
	<-c.pollSem
	close(c.closed)
}

// drainFlushes polls until every request posted to the QP has completed,
// or flushTimeout passed (pollSem held). A CQ that fails to poll is tried
// again every flushRetry.
func (c *conn) drainFlushes() {
	deadline := time.Now().Add(c.p.flushTimeout)
	for {
		// gen is read before what is outstanding is counted: a device
		// removal flushes everything and then kicks, and a kick after
		// this read interrupts the wait below. (Read after the count, a
		// removal between the two left the wait asleep until the
		// deadline, with nothing outstanding.)
		gen := c.cqw.gen.Load()
		c.postDrain()
		c.sq.mu.Lock()
		c.rq.mu.Lock()
		left := c.sq.hwOut + c.rq.hwOut
		if c.drain == drainPosted {
			left++
		}
		c.rq.mu.Unlock()
		c.sq.mu.Unlock()
		left += c.mwInFlight()
		if left == 0 {
			return
		}
		c.hooks.drainCounted(c)
		k, err := c.pollCQ(true)
		if k > 0 {
			continue
		}
		now := time.Now()
		if now.After(deadline) {
			c.log.Warn("rdma close: work requests not flushed in time; destroying the QP", zap.String("remote", c.remote), zap.Int("outstanding", left))
			return
		}
		until := deadline
		if err != nil && now.Add(flushRetry).Before(deadline) {
			until = now.Add(flushRetry)
		}
		ctx, cancel := context.WithDeadline(context.Background(), until)
		c.cqw.wait(ctx, gen, c.tryCQ)
		cancel()
	}
}

// teardown destroys everything in order (pollSem held, the conn closed):
// the QP first, then the CQ and its channel, the regions, the PD, the id
// and its channel. Requests still outstanding complete as flushed.
func (c *conn) teardown() {
	c.transition(stateDestroyed, nil)
	// A post that saw the conn alive holds its ring's lock: once each
	// lock was had, none is left, and every later post sees it
	// destroyed. (postMW posts under the send ring's lock too.)
	for _, r := range [2]*ring{&c.sq, &c.rq} {
		r.mu.Lock()
		//lint:ignore SA2001 an empty critical section: a barrier
		r.mu.Unlock()
	}
	c.cmw.close()
	// The CM goroutine, or an Accept waiting for ESTABLISHED, is gone.
	c.cmMu.Lock()
	defer c.cmMu.Unlock()
	c.destroyVerbs()
	c.flushOutstanding()
	if err := c.id.Destroy(); err != nil {
		c.log.Warn("rdma close", zap.Error(err))
	}
	c.ch.Destroy()
}

// destroyVerbs destroys the verbs resources of newConn, in order.
func (c *conn) destroyVerbs() {
	// The memory windows go first: a bound type-2 window holds a reference
	// on its QP (rxe waits for it in the QP's destroy, and warns after a
	// minute), and a device refuses to deregister an MR with windows
	// bound. The QP is in the error state by now: it executes nothing.
	c.destroyWindows()
	if c.qp != nil {
		c.qp.Destroy()
	}
	if c.cq != nil {
		c.cq.AckEvents(c.unacked)
		c.unacked = 0
		if err := c.cq.Destroy(); err != nil {
			c.log.Warn("rdma close", zap.Error(err))
		}
	}
	if c.cqw != nil {
		c.cqw.close()
	}
	if c.cc != nil {
		if err := c.cc.Destroy(); err != nil {
			c.log.Warn("rdma close", zap.Error(err))
		}
	}
	c.regMu.Lock()
	for r := range c.regions {
		if err := r.mr.Dereg(); err != nil {
			c.log.Warn("rdma close: deregistering a region failed", zap.Bool("quarantined_before", r.quarantined), zap.Error(err))
		}
		r.mr = nil
		r.dead.Store(true)
	}
	clear(c.regions)
	c.regMu.Unlock()
	if c.pd != nil {
		if err := c.pd.Dealloc(); err != nil {
			c.log.Warn("rdma close", zap.Error(err))
		}
	}
}
