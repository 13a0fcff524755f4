//go:build linux

package rdma

import (
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// A device in Go for the tests: an RDMA CM (bind, listen, resolve,
// connect, accept, reject, disconnect, its events on channels whose fds are
// eventfds, so the provider waits for them through Go's poller as for real
// ones) and RC queue pairs that execute SEND, RECV, RDMA WRITE (with
// immediate), RDMA READ, memory-window BIND and LOCAL_INV on registered
// memory, completing in order on completion queues whose channels are
// eventfds too. A request the peer has no receive for waits (RNR retried
// forever); a failed request moves its QP to the error state, which
// flushes everything outstanding; the peer learns of it when the provider
// disconnects. Private data arrives zero-padded to the CM field's size,
// as over InfiniBand and RoCE.
//
// It counts every object made and destroyed, fails the test on a double
// destroy, an out-of-order destroy (a PD with its MRs, a CQ with its QP or
// unacknowledged events, an id before its QP, a QP with windows bound),
// an overflowing CQ or send queue, and reports what leaked (checkClean).
// Tests make any call fail (failOn, refusePost), deliver events (removal,
// the accept's outcome) and observe the requests posted (qp.posted).

const (
	fakeDevName = "fake0"
	fakeMaxQPWR = 4096
	fakeMaxCQE  = 16384
	// fakeInline is the inline data the device has.
	fakeInline = 64
	// The sizes of the private data fields of the IB CM messages.
	fakeConnectPD = MaxConnectPrivateData
	fakeAcceptPD  = MaxAcceptPrivateData
	fakeRejectPD  = MaxRejectPrivateData + 1
)

var fakeAddr = netip.MustParseAddr("192.0.2.1")

// fakeFabric is one device and its RDMA CM.
type fakeFabric struct {
	t    testing.TB
	mu   sync.Mutex
	attr verbs.DeviceAttr
	// unsigFlushes: a flushed request posted without IBV_SEND_SIGNALED
	// completes too (rxe and mlx5 do).
	unsigFlushes bool
	vectors      int
	removed      bool

	listeners map[netip.AddrPort]*fakeID
	ids       map[*fakeID]struct{}
	nextPort  uint16
	nextKey   uint32
	nextQPN   uint32
	mws       map[uint32]*fakeMW // by key index
	mrs       map[uint32]*fakeMR // by key index

	live      map[any]string
	created   map[string]int
	destroyed map[string]int
	problems  []string

	calls     map[string]int
	errHooks  map[string]func(call int) error
	postHooks map[string]func(call, n int) (int, error)
	// acceptEvent, if set, says what the acceptor gets instead of
	// ESTABLISHED after rdma_accept (the dialer then gets CONNECT_ERROR).
	acceptEvent func() (verbs.EventType, int)
	// qpCreated is told of each QP made.
	qpCreated func(*fakeQP)
	// execHook, if set, may fail a send-queue request when the device
	// executes it: it completes with status instead (mu held).
	execHook func(wr verbs.WR) (status uint32, fail bool)
}

// newFakeFabric returns a device with type-2 memory windows, of a vendor
// whose devices report flushed unsignaled requests and check window spans
// (Mellanox); the test fails at its end if an object leaked.
func newFakeFabric(t testing.TB) *fakeFabric {
	f := &fakeFabric{
		t: t,
		attr: verbs.DeviceAttr{
			MaxQPWR: fakeMaxQPWR, MaxCQE: fakeMaxCQE, MaxSGE: 1, MaxQPRdAtom: 16, MaxQPInitRdAtom: 16,
			MaxMRSize: 1 << 40, MemWindowType2: true, MaxMW: 1 << 16, VendorID: mellanoxVendorID,
		},
		unsigFlushes: true,
		vectors:      4,
		listeners:    map[netip.AddrPort]*fakeID{},
		ids:          map[*fakeID]struct{}{},
		nextPort:     20000,
		nextQPN:      100,
		mws:          map[uint32]*fakeMW{},
		mrs:          map[uint32]*fakeMR{},
		live:         map[any]string{},
		created:      map[string]int{},
		destroyed:    map[string]int{},
		calls:        map[string]int{},
		errHooks:     map[string]func(int) error{},
		postHooks:    map[string]func(int, int) (int, error){},
	}
	t.Cleanup(f.checkClean)
	return f
}

// problem records a misuse of the device (mu held) and fails the test.
func (f *fakeFabric) problem(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	f.problems = append(f.problems, s)
	f.t.Errorf("fake device: %s", s)
}

func (f *fakeFabric) made(obj any, kind string) {
	f.live[obj] = kind
	f.created[kind]++
}

// gone records the destruction of obj (mu held); false if it was not
// live (a double destroy, reported).
func (f *fakeFabric) gone(obj any, kind string) bool {
	if _, ok := f.live[obj]; !ok {
		f.problem("%s destroyed twice (or never made)", kind)
		return false
	}
	delete(f.live, obj)
	f.destroyed[kind]++
	return true
}

// leaks lists the objects alive, by kind.
func (f *fakeFabric) leaks() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]int{}
	for _, k := range f.live {
		out[k]++
	}
	return out
}

// waitClean waits until every object is destroyed (the provider releases
// some in the background, after a device removal) and fails the test if
// that does not happen.
func (f *fakeFabric) waitClean(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l := f.leaks()
		if len(l) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("fake device: objects never destroyed: %v", l)
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// checkClean fails the test if an object was not destroyed.
func (f *fakeFabric) checkClean() { f.waitClean(f.t) }

// counts returns how many objects of kind were made and destroyed.
func (f *fakeFabric) counts(kind string) (made, destroyed int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.created[kind], f.destroyed[kind]
}

// failOn makes the calls of op fail with what fn returns (nil: the call
// goes through); call counts the calls of op from 1. fn runs without the
// device's lock: it may block. The ops: create_event_channel, create_id,
// bind, listen, resolve_addr, resolve_route, migrate, create_qp, connect,
// accept, reject, disconnect, qp_to_error, query_device, alloc_pd,
// create_comp_channel, create_cq, reg_mr, dereg_mr, alloc_mw, dealloc_mw,
// bind_mw, local_inv, post_drain, poll_cq, get_event, get_cq_event.
func (f *fakeFabric) failOn(op string, fn func(call int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errHooks[op] = fn
}

// refusePost makes ibv_post_send ("post_send") or ibv_post_recv
// ("post_recv") of a chain of n take only the first k and fail with err,
// for the (k, err) fn returns; a nil err posts the whole chain.
func (f *fakeFabric) refusePost(op string, fn func(call, n int) (k int, err error)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.postHooks[op] = fn
}

// hook counts a call of op and runs its hook, if any, outside the lock.
func (f *fakeFabric) hook(op string) error {
	f.mu.Lock()
	f.calls[op]++
	n := f.calls[op]
	fn := f.errHooks[op]
	f.mu.Unlock()
	if fn == nil {
		return nil
	}
	return fn(n)
}

func (f *fakeFabric) postHook(op string, n int) (int, error) {
	f.mu.Lock()
	f.calls[op]++
	call := f.calls[op]
	fn := f.postHooks[op]
	f.mu.Unlock()
	if fn == nil {
		return n, nil
	}
	k, err := fn(call, n)
	if err == nil {
		return n, nil
	}
	return min(max(k, 0), n), err
}

// errno is an error as the cgo layer makes them.
func errno(op string, e syscall.Errno) error { return fmt.Errorf("%s: %w", op, e) }

// fakeEventFD is an eventfd in semaphore mode: readable while its count
// is positive, each read taking one.
type fakeEventFD int

func newFakeEventFD(t testing.TB) fakeEventFD {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC|unix.EFD_SEMAPHORE)
	if err != nil {
		t.Fatalf("eventfd: %v", err)
	}
	return fakeEventFD(fd)
}

func (e fakeEventFD) post() {
	one := uint64(1)
	// (The raw system call: unix.Write's race annotations make the buffer
	// escape, and the tests of allocations count on none here.)
	unix.Syscall(unix.SYS_WRITE, uintptr(e), uintptr(unsafe.Pointer(&one)), 8)
}

// take consumes one count; false if there was none.
func (e fakeEventFD) take() bool {
	var v uint64
	n, _, errno := unix.Syscall(unix.SYS_READ, uintptr(e), uintptr(unsafe.Pointer(&v)), 8)
	return errno == 0 && n == 8
}

func (e fakeEventFD) close() { unix.Close(int(e)) }

// Stack.

func (f *fakeFabric) NewEventChannel() (verbs.EventChannel, error) {
	if err := f.hook("create_event_channel"); err != nil {
		return nil, err
	}
	ch := &fakeChannel{f: f, efd: newFakeEventFD(f.t)}
	f.mu.Lock()
	f.made(ch, "event channel")
	f.mu.Unlock()
	return ch, nil
}

func (f *fakeFabric) NewID(ch verbs.EventChannel) (verbs.CMID, error) {
	if err := f.hook("create_id"); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	id := &fakeID{f: f, ch: ch.(*fakeChannel)}
	id.ch.ids++
	f.ids[id] = struct{}{}
	f.made(id, "id")
	return id, nil
}

// fakeChannel is an RDMA CM event channel.
type fakeChannel struct {
	f    *fakeFabric
	efd  fakeEventFD
	q    []verbs.Event
	ids  int
	dead bool
}

func (ch *fakeChannel) Fd() int { return int(ch.efd) }

// push queues an event (mu held).
func (ch *fakeChannel) push(ev verbs.Event) {
	if ch.dead {
		return
	}
	ch.q = append(ch.q, ev)
	ch.efd.post()
}

func (ch *fakeChannel) GetEvent() (verbs.Event, error) {
	if err := ch.f.hook("get_event"); err != nil {
		return verbs.Event{}, err
	}
	ch.f.mu.Lock()
	defer ch.f.mu.Unlock()
	if ch.dead {
		ch.f.problem("event channel used after its destroy")
		return verbs.Event{}, syscall.EBADF
	}
	if len(ch.q) == 0 {
		return verbs.Event{}, syscall.EAGAIN
	}
	ev := ch.q[0]
	ch.q = ch.q[1:]
	ch.efd.take()
	if ev.Type == verbs.EventConnectRequest {
		ev.ID.(*fakeID).taken = true
	}
	return ev, nil
}

func (ch *fakeChannel) Destroy() {
	f := ch.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.gone(ch, "event channel") {
		return
	}
	if ch.ids > 0 {
		f.problem("event channel destroyed with %d ids on it", ch.ids)
	}
	ch.dead = true
	ch.efd.close()
}

// idState is where a fake id is.
type idState uint8

const (
	idIdle idState = iota
	idBound
	idListening
	idAddrResolved
	idRouteResolved
	idConnecting // active: connect sent
	idRequest    // passive: connect request received
	idConnected
	idDisconnected
	idRejected
	idDead
)

// fakeID is an rdma_cm_id.
type fakeID struct {
	f     *fakeFabric
	ch    *fakeChannel
	state idState
	local netip.AddrPort
	peer  netip.AddrPort
	dev   bool // bound to the device
	qp    *fakeQP
	// remote is the other end of a connection being made or made.
	remote *fakeID
	// listener is the listening id of a passive id whose request event
	// was not taken yet; taken says it was.
	listener *fakeID
	taken    bool
	param    verbs.ConnParam
	// disconnects counts the calls of Disconnect.
	disconnects int
}

// deadLocked reports a call on a destroyed id (mu held): a use after
// free in C.
func (id *fakeID) deadLocked(op string) bool {
	if id.state == idDead {
		id.f.problem("%s on a destroyed id", op)
		return true
	}
	return false
}

func (id *fakeID) Bind(ap netip.AddrPort) error {
	if err := id.f.hook("bind"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_bind_addr") {
		return errno("rdma_bind_addr", syscall.EBADF)
	}
	switch {
	case id.state != idIdle:
		return errno("rdma_bind_addr", syscall.EINVAL)
	case ap.Addr().IsUnspecified():
	case ap.Addr() == fakeAddr:
		id.dev = true
	default:
		return errno("rdma_bind_addr "+ap.String(), syscall.EADDRNOTAVAIL)
	}
	if ap.Port() == 0 {
		f.nextPort++
		ap = netip.AddrPortFrom(ap.Addr(), f.nextPort)
	}
	for l := range f.listeners {
		if l.Port() == ap.Port() {
			return errno("rdma_bind_addr "+ap.String(), syscall.EADDRINUSE)
		}
	}
	id.local = ap
	id.state = idBound
	return nil
}

func (id *fakeID) Listen(int) error {
	if err := id.f.hook("listen"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_listen") {
		return errno("rdma_listen", syscall.EBADF)
	}
	if id.state != idBound {
		return errno("rdma_listen", syscall.EINVAL)
	}
	id.state = idListening
	f.listeners[id.local] = id
	return nil
}

func (id *fakeID) ResolveAddr(dst netip.AddrPort, _ time.Duration) error {
	if err := id.f.hook("resolve_addr"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_resolve_addr") {
		return errno("rdma_resolve_addr", syscall.EBADF)
	}
	if id.state != idIdle {
		return errno("rdma_resolve_addr", syscall.EINVAL)
	}
	if dst.Addr() != fakeAddr || f.removed {
		id.ch.push(verbs.Event{Type: verbs.EventAddrError, Status: -int(syscall.EHOSTUNREACH)})
		return nil
	}
	f.nextPort++
	id.local = netip.AddrPortFrom(fakeAddr, f.nextPort)
	id.peer = dst
	id.dev = true
	id.state = idAddrResolved
	id.ch.push(verbs.Event{Type: verbs.EventAddrResolved})
	return nil
}

func (id *fakeID) ResolveRoute(time.Duration) error {
	if err := id.f.hook("resolve_route"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_resolve_route") {
		return errno("rdma_resolve_route", syscall.EBADF)
	}
	if id.state != idAddrResolved {
		return errno("rdma_resolve_route", syscall.EINVAL)
	}
	id.state = idRouteResolved
	id.ch.push(verbs.Event{Type: verbs.EventRouteResolved})
	return nil
}

func (id *fakeID) Migrate(ch verbs.EventChannel) error {
	if err := id.f.hook("migrate"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_migrate_id") {
		return errno("rdma_migrate_id", syscall.EBADF)
	}
	id.ch.ids--
	id.ch = ch.(*fakeChannel)
	id.ch.ids++
	id.listener = nil
	return nil
}

// pad is private data as the CM delivers it: the whole field, zero-padded.
func pad(pd []byte, field int) []byte {
	out := make([]byte, field)
	copy(out, pd)
	return out
}

func (id *fakeID) CreateQP(pd verbs.PD, cq verbs.CQ, want verbs.QPCaps, chunk int) (verbs.QP, error) {
	if err := id.f.hook("create_qp"); err != nil {
		return nil, err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_create_qp") {
		return nil, errno("rdma_create_qp", syscall.EBADF)
	}
	if !id.dev || id.qp != nil {
		return nil, errno("rdma_create_qp", syscall.EINVAL)
	}
	if want.SendWR > f.attr.MaxQPWR || want.RecvWR > f.attr.MaxQPWR || want.InlineData > fakeInline {
		return nil, errno("rdma_create_qp", syscall.EINVAL)
	}
	f.nextQPN++
	qp := &fakeQP{
		f: f, id: id, pd: pd.(*fakePD), cq: cq.(*fakeCQ), num: f.nextQPN, caps: want,
		sendBuf: make([]verbs.WR, chunk), recvBuf: make([]verbs.WR, chunk),
	}
	qp.pd.users++
	qp.cq.users++
	id.qp = qp
	f.made(qp, "qp")
	if f.qpCreated != nil {
		f.qpCreated(qp)
	}
	return qp, nil
}

func (id *fakeID) Connect(p verbs.ConnParam) error {
	if err := id.f.hook("connect"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_connect") {
		return errno("rdma_connect", syscall.EBADF)
	}
	if id.state != idRouteResolved || id.qp == nil {
		return errno("rdma_connect", syscall.EINVAL)
	}
	if len(p.PrivateData) > fakeConnectPD {
		return errno("rdma_connect", syscall.EINVAL)
	}
	l := f.listeners[id.peer]
	if l == nil {
		l = f.listeners[netip.AddrPortFrom(netip.IPv4Unspecified(), id.peer.Port())]
	}
	id.state = idConnecting
	if l == nil || l.state != idListening {
		// Invalid service ID: nothing listens on that port.
		id.state = idRejected
		id.ch.push(verbs.Event{Type: verbs.EventRejected, Status: 8, Conn: verbs.ConnParam{PrivateData: pad(nil, fakeRejectPD)}})
		return nil
	}
	req := &fakeID{f: f, ch: l.ch, state: idRequest, local: netip.AddrPortFrom(fakeAddr, l.local.Port()), peer: id.local,
		dev: true, remote: id, listener: l, param: p}
	req.ch.ids++
	f.ids[req] = struct{}{}
	f.made(req, "id")
	id.remote = req
	param := p
	param.PrivateData = pad(p.PrivateData, fakeConnectPD)
	l.ch.push(verbs.Event{Type: verbs.EventConnectRequest, ID: req, ListenID: l, Conn: param})
	return nil
}

// connectQPs joins the QPs of an accepted connection (mu held).
func connectQPs(a, b *fakeID) {
	a.qp.peer, b.qp.peer = b.qp, a.qp
	for _, qp := range []*fakeQP{a.qp, b.qp} {
		if qp.state == qpInit {
			qp.state = qpRTS
		}
	}
}

func (id *fakeID) Accept(p verbs.ConnParam) error {
	if err := id.f.hook("accept"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_accept") {
		return errno("rdma_accept", syscall.EBADF)
	}
	if id.state != idRequest || id.qp == nil || len(p.PrivateData) > fakeAcceptPD {
		return errno("rdma_accept", syscall.EINVAL)
	}
	d := id.remote
	if d == nil || d.state != idConnecting {
		// The dialer is gone: the REP times out.
		id.ch.push(verbs.Event{Type: verbs.EventUnreachable, Status: -int(syscall.ETIMEDOUT)})
		id.state = idRejected
		return nil
	}
	if f.acceptEvent != nil {
		ty, st := f.acceptEvent()
		id.state, d.state = idRejected, idRejected
		id.ch.push(verbs.Event{Type: ty, Status: st})
		d.ch.push(verbs.Event{Type: verbs.EventConnectError, Status: -int(syscall.ECONNRESET)})
		return nil
	}
	id.state, d.state = idConnected, idConnected
	connectQPs(id, d)
	param := p
	param.PrivateData = pad(p.PrivateData, fakeAcceptPD)
	d.ch.push(verbs.Event{Type: verbs.EventEstablished, Conn: param})
	id.ch.push(verbs.Event{Type: verbs.EventEstablished})
	return nil
}

func (id *fakeID) Reject(pd []byte) error {
	if err := id.f.hook("reject"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_reject") {
		return errno("rdma_reject", syscall.EBADF)
	}
	if id.state != idRequest || len(pd) > fakeRejectPD {
		return errno("rdma_reject", syscall.EINVAL)
	}
	id.state = idRejected
	if d := id.remote; d != nil && d.state == idConnecting {
		d.state = idRejected
		d.ch.push(verbs.Event{Type: verbs.EventRejected, Status: rejectConsumerDefined, Conn: verbs.ConnParam{PrivateData: pad(pd, fakeRejectPD)}})
	}
	return nil
}

func (id *fakeID) Disconnect() error {
	if err := id.f.hook("disconnect"); err != nil {
		return err
	}
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if id.deadLocked("rdma_disconnect") {
		return errno("rdma_disconnect", syscall.EBADF)
	}
	id.disconnects++
	if id.qp != nil {
		id.qp.toError()
	}
	if id.state != idConnected {
		return errno("rdma_disconnect", syscall.EINVAL)
	}
	id.disconnectLocked()
	return nil
}

// disconnectLocked ends a connection: both ends get DISCONNECTED (mu held).
func (id *fakeID) disconnectLocked() {
	id.state = idDisconnected
	id.ch.push(verbs.Event{Type: verbs.EventDisconnected})
	if r := id.remote; r != nil && r.state == idConnected {
		r.state = idDisconnected
		r.ch.push(verbs.Event{Type: verbs.EventDisconnected})
	}
}

func (id *fakeID) Destroy() error {
	f := id.f
	f.mu.Lock()
	defer f.mu.Unlock()
	id.destroyLocked()
	return nil
}

func (id *fakeID) destroyLocked() {
	f := id.f
	if !f.gone(id, "id") {
		return
	}
	delete(f.ids, id)
	if id.qp != nil && id.qp.state != qpDestroyed {
		f.problem("id destroyed before its QP")
	}
	switch id.state {
	case idConnected:
		// The kernel sends a DREQ.
		if r := id.remote; r != nil && r.state == idConnected {
			r.state = idDisconnected
			r.ch.push(verbs.Event{Type: verbs.EventDisconnected})
		}
	case idRequest:
		// A request never answered: the dialer is rejected.
		if d := id.remote; d != nil && d.state == idConnecting {
			d.state = idRejected
			d.ch.push(verbs.Event{Type: verbs.EventRejected, Status: rejectConsumerDefined, Conn: verbs.ConnParam{PrivateData: pad(nil, fakeRejectPD)}})
		}
	case idListening:
		delete(f.listeners, id.local)
		// The requests whose events were not taken go with it.
		var left []verbs.Event
		for _, ev := range id.ch.q {
			if r, ok := ev.ID.(*fakeID); ok && ev.Type == verbs.EventConnectRequest && r.listener == id && !r.taken {
				id.ch.efd.take()
				r.destroyLocked()
				continue
			}
			left = append(left, ev)
		}
		id.ch.q = left
	}
	if id.remote != nil && id.remote.remote == id {
		id.remote.remote = nil
	}
	id.state = idDead
	id.ch.ids--
}

func (id *fakeID) Context() verbs.Context {
	if !id.dev {
		return nil
	}
	return &fakeContext{f: id.f}
}

func (id *fakeID) LocalAddr() netip.AddrPort { return id.local }
func (id *fakeID) PeerAddr() netip.AddrPort  { return id.peer }
func (id *fakeID) Port() int                 { return 1 }
func (id *fakeID) SGID() [16]byte            { return netip.AddrFrom4(fakeAddr.As4()).As16() }

func (id *fakeID) DeviceName() string {
	if !id.dev {
		return ""
	}
	return fakeDevName
}

// removeDevice removes the device: every id on it gets DEVICE_REMOVAL,
// and it executes and completes nothing more.
func (f *fakeFabric) removeDevice() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removed = true
	for id := range f.ids {
		if id.dev || id.state == idListening {
			id.ch.push(verbs.Event{Type: verbs.EventDeviceRemoval})
		}
	}
}

// disconnectPeer does what rdma_disconnect on the peer of c would: c's
// peer QP moves to the error state and both ends get DISCONNECTED.
func (f *fakeFabric) disconnectPeer(c *conn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := c.id.(*fakeID).remote
	if r == nil {
		f.t.Fatal("disconnectPeer: the conn has no peer")
	}
	if r.qp != nil {
		r.qp.toError()
	}
	if r.state == idConnected {
		r.disconnectLocked()
	}
}

// fakeContext is the device context.
type fakeContext struct{ f *fakeFabric }

func (c *fakeContext) QueryDevice() (verbs.DeviceAttr, error) {
	if err := c.f.hook("query_device"); err != nil {
		return verbs.DeviceAttr{}, err
	}
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	return c.f.attr, nil
}

func (c *fakeContext) NumCompVectors() int { return c.f.vectors }

func (c *fakeContext) AllocPD() (verbs.PD, error) {
	if err := c.f.hook("alloc_pd"); err != nil {
		return nil, err
	}
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	pd := &fakePD{f: c.f}
	c.f.made(pd, "pd")
	return pd, nil
}

func (c *fakeContext) NewCompChannel() (verbs.CompChannel, error) {
	if err := c.f.hook("create_comp_channel"); err != nil {
		return nil, err
	}
	cc := &fakeCompChannel{f: c.f, efd: newFakeEventFD(c.f.t)}
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	c.f.made(cc, "comp channel")
	return cc, nil
}

func (c *fakeContext) NewCQ(cqe int, ch verbs.CompChannel, batch, vector int) (verbs.CQ, error) {
	if err := c.f.hook("create_cq"); err != nil {
		return nil, err
	}
	f := c.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if cqe > f.attr.MaxCQE || vector < 0 || vector >= f.vectors {
		return nil, errno("ibv_create_cq", syscall.EINVAL)
	}
	cq := &fakeCQ{f: f, cc: ch.(*fakeCompChannel), cqe: cqe, wcs: make([]verbs.WC, batch), vector: vector}
	cq.cc.users++
	f.made(cq, "cq")
	return cq, nil
}

// fakePD is a protection domain.
type fakePD struct {
	f     *fakeFabric
	users int // MRs, MWs and QPs on it
}

func (pd *fakePD) Dealloc() error {
	f := pd.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if pd.users > 0 {
		f.problem("PD deallocated with %d MRs, MWs or QPs on it", pd.users)
		return errno("ibv_dealloc_pd", syscall.EBUSY)
	}
	f.gone(pd, "pd")
	return nil
}

func (pd *fakePD) RegMR(addr unsafe.Pointer, length int, access int) (verbs.MR, error) {
	if err := pd.f.hook("reg_mr"); err != nil {
		return nil, err
	}
	f := pd.f
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextKey++
	mr := &fakeMR{pd: pd, base: addr, length: length, access: access, key: f.nextKey<<8 | 0x11}
	f.mrs[f.nextKey] = mr
	pd.users++
	f.made(mr, "mr")
	return mr, nil
}

// fakeMR is a registered region.
type fakeMR struct {
	pd     *fakePD
	base   unsafe.Pointer
	length int
	access int
	key    uint32
	dead   bool
	mws    int // windows bound over it
}

func (mr *fakeMR) LKey() uint32 { return mr.key }
func (mr *fakeMR) RKey() uint32 { return mr.key }

func (mr *fakeMR) Dereg() error {
	f := mr.pd.f
	if err := f.hook("dereg_mr"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if mr.dead {
		return nil
	}
	if mr.mws > 0 {
		// As rxe: an MR with windows bound is busy.
		return errno("ibv_dereg_mr", syscall.EBUSY)
	}
	mr.dead = true
	delete(f.mrs, mr.key>>8)
	mr.pd.users--
	f.gone(mr, "mr")
	return nil
}

// bytes is [off, off+n) of the region's memory.
func (mr *fakeMR) bytes(off uint64, n int) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(mr.base, off)), n)
}

func (pd *fakePD) AllocMW() (verbs.MW, error) {
	if err := pd.f.hook("alloc_mw"); err != nil {
		return nil, err
	}
	f := pd.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.attr.MemWindowType2 {
		return nil, errno("ibv_alloc_mw", syscall.EOPNOTSUPP)
	}
	f.nextKey++
	mw := &fakeMW{pd: pd, rkey: f.nextKey << 8}
	f.mws[f.nextKey] = mw
	pd.users++
	f.made(mw, "mw")
	return mw, nil
}

// fakeMW is a type-2 memory window.
type fakeMW struct {
	pd   *fakePD
	rkey uint32
	dead bool
	// Bound: to qp over [addr, addr+length) of mr.
	qp     *fakeQP
	mr     *fakeMR
	addr   uint64
	length uint64
	access int
}

func (mw *fakeMW) RKey() uint32 {
	mw.pd.f.mu.Lock()
	defer mw.pd.f.mu.Unlock()
	return mw.rkey
}

func (mw *fakeMW) unbind() {
	if mw.qp != nil {
		mw.qp.mws--
		mw.mr.mws--
		mw.qp, mw.mr = nil, nil
	}
}

func (mw *fakeMW) Dealloc() error {
	f := mw.pd.f
	if err := f.hook("dealloc_mw"); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if mw.dead {
		return nil
	}
	mw.unbind()
	mw.dead = true
	delete(f.mws, mw.rkey>>8)
	mw.pd.users--
	f.gone(mw, "mw")
	return nil
}

// fakeCompChannel is a completion channel.
type fakeCompChannel struct {
	f      *fakeFabric
	efd    fakeEventFD
	users  int // CQs on it
	events int // notifications taken and not acknowledged, over its CQs
}

func (cc *fakeCompChannel) Fd() int { return int(cc.efd) }

func (cc *fakeCompChannel) GetEvent() (bool, error) {
	if err := cc.f.hook("get_cq_event"); err != nil {
		return false, err
	}
	cc.f.mu.Lock()
	defer cc.f.mu.Unlock()
	if !cc.efd.take() {
		return false, nil
	}
	cc.events++
	return true, nil
}

func (cc *fakeCompChannel) Destroy() error {
	f := cc.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if cc.users > 0 {
		f.problem("completion channel destroyed with its CQ")
		return errno("ibv_destroy_comp_channel", syscall.EBUSY)
	}
	if f.gone(cc, "comp channel") {
		cc.efd.close()
	}
	return nil
}

// fakeCQ is a completion queue.
type fakeCQ struct {
	f      *fakeFabric
	cc     *fakeCompChannel
	cqe    int
	vector int
	q      []verbs.WC
	wcs    []verbs.WC
	armed  bool
	users  int // QPs on it
	acked  int
	dead   bool
}

// push adds a completion (mu held), and notifies the channel if the CQ is
// armed.
func (cq *fakeCQ) push(wc verbs.WC) {
	if cq.dead {
		return
	}
	if len(cq.q) >= cq.cqe {
		cq.f.problem("CQ overflow: %d entries", cq.cqe)
		return
	}
	cq.q = append(cq.q, wc)
	if cq.armed {
		cq.armed = false
		cq.cc.efd.post()
	}
}

func (cq *fakeCQ) Poll(max int, arm bool) (int, error) {
	if err := cq.f.hook("poll_cq"); err != nil {
		return 0, err
	}
	f := cq.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if cq.dead {
		f.problem("CQ polled after its destroy")
		return 0, errno("ibv_poll_cq", syscall.EINVAL)
	}
	k := copy(cq.wcs[:min(max, len(cq.wcs))], cq.q)
	cq.q = dropFront(cq.q, k)
	if k == 0 && arm && !f.removed {
		cq.armed = true
	}
	return k, nil
}

func (cq *fakeCQ) PollSpin(max int, budget time.Duration) (int, error) {
	deadline := time.Now().Add(budget)
	for {
		k, err := cq.Poll(max, false)
		if k > 0 || err != nil || time.Now().After(deadline) {
			return k, err
		}
		runtime.Gosched()
	}
}

func (cq *fakeCQ) WCs() []verbs.WC { return cq.wcs }

func (cq *fakeCQ) AckEvents(n int) {
	cq.f.mu.Lock()
	defer cq.f.mu.Unlock()
	cq.acked += n
	if cq.acked > cq.cc.events {
		cq.f.problem("%d completion events acknowledged, %d taken", cq.acked, cq.cc.events)
	}
}

func (cq *fakeCQ) Destroy() error {
	f := cq.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if cq.users > 0 {
		f.problem("CQ destroyed with its QP")
		return errno("ibv_destroy_cq", syscall.EBUSY)
	}
	if cq.acked != cq.cc.events {
		// ibv_destroy_cq would wait forever.
		f.problem("CQ destroyed with %d completion events not acknowledged", cq.cc.events-cq.acked)
	}
	if f.gone(cq, "cq") {
		cq.dead = true
		cq.cc.users--
	}
	return nil
}

// dropFront removes the first k elements of q in place, keeping its
// array: a queue taken from the front and appended to at the back grows
// once, and then allocates no more.
func dropFront[T any](q []T, k int) []T {
	return q[:copy(q, q[k:])]
}

// qpState is the state of a fake QP.
type qpState uint8

const (
	qpInit qpState = iota
	qpRTS
	qpError
	qpDestroyed
)

// fakeWR is a send-queue request waiting to execute.
type fakeWR struct {
	verbs.WR
	// For a bind: the window and region.
	mw     *fakeMW
	mr     *fakeMR
	length uint64
	access int
}

// fakeQP is an RC queue pair.
type fakeQP struct {
	f       *fakeFabric
	id      *fakeID
	pd      *fakePD
	cq      *fakeCQ
	num     uint32
	caps    verbs.QPCaps
	sendBuf []verbs.WR
	recvBuf []verbs.WR
	state   qpState
	peer    *fakeQP
	sq      []fakeWR   // posted, not executed (waiting for a receive)
	rq      []verbs.WR // posted receives
	mws     int        // windows bound to it
	// sends and recvs are the wr_ids posted, in order; sendFlags the
	// send_flags of each send; postCalls the calls of PostSend and
	// PostRecv.
	sends, recvs         []uint64
	sendFlags            []uint32
	sendCalls, recvCalls int
	// hold: the QP takes requests and executes, completes and flushes
	// nothing (the test completes them itself); norecord: posts are only
	// counted (no allocation); nolog: posts execute, their wr_ids and
	// flags are not recorded (with the queues reused in place, no
	// allocation once they grew).
	hold     bool
	norecord bool
	nolog    bool
	// toErrors counts the calls of ToError.
	toErrors int
}

// stops returns how many times the provider stopped the QP of c:
// rdma_disconnect calls on its id, and ToError calls on the QP.
func (f *fakeFabric) stops(c *conn) (disconnects, toErrors int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return c.id.(*fakeID).disconnects, c.qp.(*fakeQP).toErrors
}

// setHold holds the QP (see hold) or lets it go on: a QP let go in the
// error state flushes what it holds.
func (qp *fakeQP) setHold(on bool) {
	qp.f.mu.Lock()
	defer qp.f.mu.Unlock()
	qp.hold = on
	if !on {
		if qp.state == qpError {
			qp.flush()
		}
		qp.run()
	}
}

func (qp *fakeQP) Num() uint32         { return qp.num }
func (qp *fakeQP) Caps() verbs.QPCaps  { return qp.caps }
func (qp *fakeQP) SendBuf() []verbs.WR { return qp.sendBuf }
func (qp *fakeQP) RecvBuf() []verbs.WR { return qp.recvBuf }

// posted returns the wr_ids and send flags posted so far.
func (qp *fakeQP) posted() (sends, recvs []uint64, flags []uint32) {
	qp.f.mu.Lock()
	defer qp.f.mu.Unlock()
	return slices.Clone(qp.sends), slices.Clone(qp.recvs), slices.Clone(qp.sendFlags)
}

func (qp *fakeQP) postCalls() (sends, recvs int) {
	qp.f.mu.Lock()
	defer qp.f.mu.Unlock()
	return qp.sendCalls, qp.recvCalls
}

func (qp *fakeQP) usable(op string) error {
	switch {
	case qp.state == qpDestroyed:
		qp.f.problem("%s on a destroyed QP", op)
		return errno(op, syscall.EINVAL)
	case qp.f.removed:
		// A device that is gone takes the requests and does nothing.
		return nil
	}
	return nil
}

func (qp *fakeQP) PostSend(n int) (int, error) {
	k, err := qp.f.postHook("post_send", n)
	f := qp.f
	f.mu.Lock()
	defer f.mu.Unlock()
	qp.sendCalls++
	if err := qp.usable("ibv_post_send"); err != nil {
		return 0, err
	}
	if qp.state == qpInit {
		return 0, errno("ibv_post_send", syscall.EINVAL)
	}
	for i := range k {
		if len(qp.sq) >= qp.caps.SendWR {
			qp.run()
			if len(qp.sq) >= qp.caps.SendWR {
				f.problem("send queue overflow: %d requests outstanding", len(qp.sq))
				return i, errno("ibv_post_send", syscall.ENOMEM)
			}
		}
		wr := qp.sendBuf[i]
		if qp.norecord {
			continue
		}
		qp.sq = append(qp.sq, fakeWR{WR: wr})
		if qp.nolog {
			continue
		}
		qp.sends = append(qp.sends, wr.ID)
		qp.sendFlags = append(qp.sendFlags, wr.Flags)
	}
	qp.run()
	if err != nil {
		return k, err
	}
	return n, nil
}

func (qp *fakeQP) PostRecv(n int) (int, error) {
	k, err := qp.f.postHook("post_recv", n)
	f := qp.f
	f.mu.Lock()
	defer f.mu.Unlock()
	qp.recvCalls++
	if err := qp.usable("ibv_post_recv"); err != nil {
		return 0, err
	}
	for i := range k {
		if len(qp.rq) >= qp.caps.RecvWR {
			f.problem("receive queue overflow: %d receives outstanding", len(qp.rq))
			return i, errno("ibv_post_recv", syscall.ENOMEM)
		}
		if qp.norecord {
			continue
		}
		qp.rq = append(qp.rq, qp.recvBuf[i])
		if !qp.nolog {
			qp.recvs = append(qp.recvs, qp.recvBuf[i].ID)
		}
	}
	if qp.state == qpError {
		qp.flush()
	} else if qp.peer != nil {
		qp.peer.run()
	}
	if err != nil {
		return k, err
	}
	return n, nil
}

// postOne posts a request built outside SendBuf (mu not held).
func (qp *fakeQP) postOne(op string, wr fakeWR) error {
	if err := qp.f.hook(op); err != nil {
		return err
	}
	f := qp.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := qp.usable("ibv_post_send"); err != nil {
		return err
	}
	if qp.state == qpInit {
		return errno("ibv_post_send", syscall.EINVAL)
	}
	qp.sq = append(qp.sq, wr)
	qp.sends = append(qp.sends, wr.ID)
	qp.sendFlags = append(qp.sendFlags, wr.Flags)
	qp.run()
	return nil
}

func (qp *fakeQP) PostBindMW(id uint64, mw verbs.MW, mr verbs.MR, addr, length uint64, access int, rkey uint32) error {
	fmw := mw.(*fakeMW)
	if err := qp.postOne("bind_mw", fakeWR{WR: verbs.WR{ID: id, Opcode: verbs.WRBindMW, Flags: verbs.FlagSignaled, RAddr: addr, RKey: rkey},
		mw: fmw, mr: mr.(*fakeMR), length: length, access: access}); err != nil {
		return err
	}
	qp.f.mu.Lock()
	fmw.rkey = rkey
	qp.f.mu.Unlock()
	return nil
}

func (qp *fakeQP) PostLocalInv(id uint64, rkey uint32) error {
	return qp.postOne("local_inv", fakeWR{WR: verbs.WR{ID: id, Opcode: verbs.WRLocalInv, Flags: verbs.FlagSignaled, RKey: rkey}})
}

func (qp *fakeQP) PostDrain(id uint64) error {
	return qp.postOne("post_drain", fakeWR{WR: verbs.WR{ID: id, Opcode: verbs.WRRDMAWrite, Flags: verbs.FlagSignaled}})
}

func (qp *fakeQP) SetMinRNRTimer(uint8) error { return nil }

func (qp *fakeQP) ToError() error {
	if err := qp.f.hook("qp_to_error"); err != nil {
		return err
	}
	f := qp.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := qp.usable("ibv_modify_qp"); err != nil {
		return err
	}
	qp.toErrors++
	qp.toError()
	return nil
}

func (qp *fakeQP) Destroy() error {
	f := qp.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.gone(qp, "qp") {
		return nil
	}
	if qp.mws > 0 {
		f.problem("QP destroyed with %d memory windows bound to it", qp.mws)
	}
	qp.state = qpDestroyed
	qp.sq, qp.rq = nil, nil
	qp.pd.users--
	qp.cq.users--
	if qp.peer != nil {
		qp.peer.peer = nil
	}
	return nil
}

// toError moves the QP to the error state and flushes it (mu held).
func (qp *fakeQP) toError() {
	if qp.state == qpDestroyed {
		return
	}
	qp.state = qpError
	qp.flush()
}

// flush completes everything outstanding as flushed (mu held), on a
// device that is still there.
func (qp *fakeQP) flush() {
	if qp.f.removed || qp.hold {
		return
	}
	for _, wr := range qp.sq {
		if wr.Flags&verbs.FlagSignaled != 0 || qp.f.unsigFlushes {
			qp.cq.push(verbs.WC{ID: wr.ID, Status: verbs.WCWRFlushErr})
		}
	}
	qp.sq = nil
	for _, wr := range qp.rq {
		qp.cq.push(verbs.WC{ID: wr.ID, Status: verbs.WCWRFlushErr, Opcode: verbs.WCRecv})
	}
	qp.rq = nil
}

// sge resolves a local SGE (lkey, addr, length) of the QP's PD.
func (qp *fakeQP) sge(lkey uint32, addr uint64, n uint32, write bool) ([]byte, bool) {
	if n == 0 {
		return nil, true
	}
	mr := qp.f.mrs[lkey>>8]
	if mr == nil || mr.key != lkey || mr.pd != qp.pd || (write && mr.access&verbs.AccessLocalWrite == 0) {
		return nil, false
	}
	base := uint64(uintptr(mr.base))
	if addr < base || addr+uint64(n) > base+uint64(mr.length) {
		return nil, false
	}
	return mr.bytes(addr-base, int(n)), true
}

// remote resolves the peer memory [addr, addr+n) under rkey with access,
// through an MR or a memory window bound to the QP (mu held).
func (qp *fakeQP) remote(rkey uint32, addr uint64, n uint32, access int) ([]byte, bool) {
	if mr := qp.f.mrs[rkey>>8]; mr != nil && mr.key == rkey && mr.pd == qp.pd {
		base := uint64(uintptr(mr.base))
		if mr.access&access == 0 || addr < base || addr+uint64(n) > base+uint64(mr.length) {
			return nil, false
		}
		return mr.bytes(addr-base, int(n)), true
	}
	mw := qp.f.mws[rkey>>8]
	if mw == nil || mw.rkey != rkey || mw.qp != qp || mw.access&access == 0 {
		return nil, false
	}
	lo, hi := mw.addr, mw.addr+mw.length
	base := uint64(uintptr(mw.mr.base))
	if qp.f.attr.VendorID == rxeVendorID {
		// rxe checks against the window's MR, not its span.
		lo, hi = base, base+uint64(mw.mr.length)
	}
	if addr < lo || addr+uint64(n) > hi {
		return nil, false
	}
	return mw.mr.bytes(addr-base, int(n)), true
}

// complete reports a send-queue request's success (if signaled) or
// failure (mu held).
func (qp *fakeQP) complete(wr fakeWR, status uint32, opcode uint32) {
	if status != verbs.WCSuccess || wr.Flags&verbs.FlagSignaled != 0 {
		qp.cq.push(verbs.WC{ID: wr.ID, Status: status, Opcode: opcode})
	}
	if status != verbs.WCSuccess {
		qp.toError()
	}
}

// run executes the send queue in order (mu held) until it is empty or a
// request waits for a receive of the peer.
func (qp *fakeQP) run() {
	for len(qp.sq) > 0 && !qp.hold {
		if qp.f.removed || qp.state != qpRTS {
			if qp.state == qpError {
				qp.flush()
			}
			return
		}
		wr := qp.sq[0]
		p := qp.peer
		needsRecv := wr.Opcode == verbs.WRSend || wr.Opcode == verbs.WRRDMAWriteImm
		if wr.Opcode != verbs.WRBindMW && wr.Opcode != verbs.WRLocalInv && !(wr.Opcode == verbs.WRRDMAWrite && wr.Length == 0) {
			if p == nil || p.state != qpRTS || (needsRecv && len(p.rq) == 0) {
				return // RNR, or a peer that is going: retried
			}
		}
		qp.sq = dropFront(qp.sq, 1)
		qp.exec(wr, p)
	}
}

// exec executes one request (mu held).
func (qp *fakeQP) exec(wr fakeWR, p *fakeQP) {
	if h := qp.f.execHook; h != nil {
		if st, fail := h(wr.WR); fail {
			qp.complete(wr, st, 0)
			return
		}
	}
	switch wr.Opcode {
	case verbs.WRBindMW:
		mw := wr.mw
		switch {
		case mw.dead || mw.pd != qp.pd || wr.mr.dead || wr.mr.access&verbs.AccessMWBind == 0 || mw.qp != nil ||
			wr.RKey>>8 != mw.rkey>>8 || (wr.access&verbs.AccessRemoteWrite != 0 && wr.mr.access&verbs.AccessLocalWrite == 0):
			qp.complete(wr, verbs.WCMWBindErr, verbs.WCBindMW)
		default:
			mw.qp, mw.mr, mw.addr, mw.length, mw.access = qp, wr.mr, wr.RAddr, wr.length, wr.access
			qp.mws++
			wr.mr.mws++
			qp.complete(wr, verbs.WCSuccess, verbs.WCBindMW)
		}
	case verbs.WRLocalInv:
		mw := qp.f.mws[wr.RKey>>8]
		if mw == nil || mw.rkey != wr.RKey || mw.qp != qp {
			qp.complete(wr, verbs.WCMWBindErr, verbs.WCLocalInv)
			return
		}
		mw.unbind()
		qp.complete(wr, verbs.WCSuccess, verbs.WCLocalInv)
	case verbs.WRSend:
		src, ok := qp.sge(wr.LKey, wr.Addr, wr.Length, false)
		if !ok {
			qp.complete(wr, verbs.WCLocProtErr, verbs.WCSend)
			return
		}
		r := p.rq[0]
		p.rq = dropFront(p.rq, 1)
		dst, ok := p.sge(r.LKey, r.Addr, r.Length, true)
		switch {
		case wr.Length > r.Length:
			st := uint32(verbs.WCLocLenErr)
			if qp.f.attr.VendorID == rxeVendorID {
				st = verbs.WCLocQPOpErr
			}
			p.cq.push(verbs.WC{ID: r.ID, Status: st, Opcode: verbs.WCRecv})
			p.toError()
			qp.complete(wr, verbs.WCRemInvReqErr, verbs.WCSend)
		case !ok:
			p.cq.push(verbs.WC{ID: r.ID, Status: verbs.WCLocProtErr, Opcode: verbs.WCRecv})
			p.toError()
			qp.complete(wr, verbs.WCRemOpErr, verbs.WCSend)
		default:
			copy(dst, src)
			p.cq.push(verbs.WC{ID: r.ID, Opcode: verbs.WCRecv, ByteLen: wr.Length})
			qp.complete(wr, verbs.WCSuccess, verbs.WCSend)
		}
	case verbs.WRRDMAWrite, verbs.WRRDMAWriteImm:
		src, ok := qp.sge(wr.LKey, wr.Addr, wr.Length, false)
		if !ok {
			qp.complete(wr, verbs.WCLocProtErr, verbs.WCRDMAWrite)
			return
		}
		if wr.Length > 0 {
			dst, ok := p.remote(wr.RKey, wr.RAddr, wr.Length, verbs.AccessRemoteWrite)
			if !ok {
				qp.complete(wr, verbs.WCRemAccessErr, verbs.WCRDMAWrite)
				return
			}
			copy(dst, src)
		}
		if wr.Opcode == verbs.WRRDMAWriteImm {
			r := p.rq[0]
			p.rq = dropFront(p.rq, 1)
			p.cq.push(verbs.WC{ID: r.ID, Opcode: verbs.WCRecvRDMAWithImm, ByteLen: wr.Length, Imm: wr.Imm, Flags: verbs.WCFlagWithImm})
		}
		qp.complete(wr, verbs.WCSuccess, verbs.WCRDMAWrite)
	case verbs.WRRDMARead:
		dst, ok := qp.sge(wr.LKey, wr.Addr, wr.Length, true)
		if !ok {
			qp.complete(wr, verbs.WCLocProtErr, verbs.WCRDMARead)
			return
		}
		if wr.Length > 0 {
			src, ok := p.remote(wr.RKey, wr.RAddr, wr.Length, verbs.AccessRemoteRead)
			if !ok {
				qp.complete(wr, verbs.WCRemAccessErr, verbs.WCRDMARead)
				return
			}
			copy(dst, src)
		}
		qp.complete(wr, verbs.WCSuccess, verbs.WCRDMARead)
	default:
		qp.complete(wr, verbs.WCLocQPOpErr, 0)
	}
}
