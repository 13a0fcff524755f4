//go:build linux && cgo && rdma

package rdma

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// fakeConn is a conn over a fake QP (no device): enough for the posting
// and completion bookkeeping, which is what these tests look at. It is
// marked started (sends are taken) but has no CM goroutine; breaking it
// does not call rdma_disconnect, and its teardown destroys only the QP.
func fakeConn(t *testing.T, cfg verbs.FakeQPConfig, sq, rq int) *conn {
	t.Helper()
	qp, err := verbs.NewFakeQP(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(qp.Destroy)
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	w, err := newWaiter(efd, "test-cq")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(w.close)
	cmw, err := newWaiter(efd, "test-cm")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cmw.close)
	c := &conn{
		p:            &provider{log: zap.NewNop()},
		log:          zap.NewNop(),
		id:           &verbs.CMID{},
		ch:           &verbs.EventChannel{},
		cmw:          cmw,
		qp:           qp,
		cqw:          w,
		pollSem:      make(chan struct{}, 1),
		closed:       make(chan struct{}),
		regions:      make(map[*region]struct{}),
		disconnected: true,
	}
	c.sq.ents = make([]entry, sq)
	c.rq.ents = make([]entry, rq)
	c.started.Store(true)
	return c
}

// takeDone marks the entries the QP took as completed successfully, as the
// device would, so that emit gets past them.
func takeDone(r *ring, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for seq := r.head; seq < r.head+uint64(n); seq++ {
		e := &r.ents[seq%uint64(len(r.ents))]
		e.hw, e.done = false, true
		e.comp = transport.Completion{ID: e.id, Op: e.op}
		r.hwOut--
	}
}

// TestPostSendPartialFailure: ibv_post_send refuses a request in the second
// chain of a call. Nothing after it may reach the QP (not the rest of that
// chain, not the chains after), and every request not posted must complete:
// the refused one with an error, the later ones flushed.
func TestPostSendPartialFailure(t *testing.T) {
	const chunk, n, failAt = 4, 11, 5
	c := fakeConn(t, verbs.FakeQPConfig{Chunk: chunk, FailSendAt: failAt, FailRecvAt: -1, Record: 64}, 64, 64)
	wrs := make([]transport.WorkRequest, n)
	for i := range wrs {
		wrs[i] = transport.WorkRequest{ID: uint64(100 + i), Op: transport.OpSend}
	}
	if err := c.PostSend(wrs...); err != nil {
		t.Fatalf("post send: %v, want the failure reported in the completions", err)
	}
	sends, _, _ := c.qp.FakePosted()
	if len(sends) != failAt {
		t.Fatalf("the QP took work requests %v, want only the %d before the refused one", sends, failAt)
	}
	for i, id := range sends {
		if id != uint64(i) {
			t.Errorf("QP took wr_id %d at %d, want %d", id, i, i)
		}
	}
	if err := c.PostSend(transport.WorkRequest{ID: 999, Op: transport.OpSend}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post send after the refusal: %v, want ErrClosed", err)
	}
	if sends2, _, _ := c.qp.FakePosted(); len(sends2) != failAt {
		t.Errorf("the QP took %v after the refusal", sends2[failAt:])
	}
	takeDone(&c.sq, failAt)
	out := make([]transport.Completion, 2*n)
	k := c.emit(out)
	if k != n {
		t.Fatalf("%d completions %+v, want %d", k, out[:k], n)
	}
	for i, comp := range out[:k] {
		want := transport.StatusSuccess
		switch {
		case i == failAt:
			want = transport.StatusTransportError
		case i > failAt:
			want = transport.StatusFlushed
		}
		if comp.ID != uint64(100+i) || comp.Status != want {
			t.Errorf("completion %d: %+v, want id %d %v", i, comp, 100+i, want)
		}
	}
	if !c.broken.Load() {
		t.Error("the connection is not broken")
	}
}

// TestPostRecvPartialFailure is TestPostSendPartialFailure for receives.
func TestPostRecvPartialFailure(t *testing.T) {
	const chunk, n, failAt = 4, 11, 6
	c := fakeConn(t, verbs.FakeQPConfig{Chunk: chunk, FailSendAt: -1, FailRecvAt: failAt, Record: 64}, 64, 64)
	rrs := make([]transport.RecvRequest, n)
	for i := range rrs {
		rrs[i] = transport.RecvRequest{ID: uint64(100 + i)}
	}
	if err := c.PostRecv(rrs...); err != nil {
		t.Fatalf("post recv: %v, want the failure reported in the completions", err)
	}
	_, recvs, _ := c.qp.FakePosted()
	if len(recvs) != failAt {
		t.Fatalf("the QP took receives %v, want only the %d before the refused one", recvs, failAt)
	}
	if !c.broken.Load() {
		t.Error("the connection is not broken")
	}
	if err := c.PostRecv(transport.RecvRequest{ID: 999}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post recv after the refusal: %v, want ErrClosed", err)
	}
	// The QP flushes what it took (the connection broke); the rest complete
	// flushed on their own.
	takeDone(&c.rq, failAt)
	out := make([]transport.Completion, 2*n)
	k := c.emit(out)
	if k != n {
		t.Fatalf("%d completions %+v, want %d", k, out[:k], n)
	}
	for i, comp := range out[:k] {
		if comp.ID != uint64(100+i) || comp.Op != transport.OpRecv || (i >= failAt && comp.Status != transport.StatusFlushed) {
			t.Errorf("completion %d: %+v", i, comp)
		}
	}
}

// TestPostSendRefusedWhole: a refusal of the first chain with nothing
// posted undoes the call and reports the queue full, as before.
func TestPostSendRefusedWhole(t *testing.T) {
	c := fakeConn(t, verbs.FakeQPConfig{Chunk: 4, FailSendAt: 0, FailRecvAt: -1, Errno: syscall.ENOMEM}, 64, 64)
	err := c.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend}, transport.WorkRequest{ID: 2, Op: transport.OpSend})
	if !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("post send: %v, want ErrQueueFull", err)
	}
	if c.sq.tail != c.sq.head || c.broken.Load() {
		t.Errorf("the call was not undone: queue [%d, %d), broken %v", c.sq.head, c.sq.tail, c.broken.Load())
	}
}

// TestDeregisterFailureQuarantines: when ibv_dereg_mr fails, the memory is
// still registered. Deregister must say so (every time, not only the first),
// the region must stay known to the conn, and its memory must not be
// registered again on that conn until a Deregister succeeds.
func TestDeregisterFailureQuarantines(t *testing.T) {
	c := fakeConn(t, verbs.FakeQPConfig{Chunk: 4, FailSendAt: -1, FailRecvAt: -1}, 8, 8)
	mem, err := transport.AllocMemory(8192, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	buf := mem.Bytes()[:4096]
	r := &region{c: c, buf: buf, addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), mr: &verbs.MR{}, access: transport.AccessLocalWrite}
	c.regions[r] = struct{}{}

	fail := true
	deregMR = func(mr *verbs.MR) error {
		if fail {
			return fmt.Errorf("ibv_dereg_mr: %w", syscall.EBUSY)
		}
		return mr.Dereg()
	}
	t.Cleanup(func() { deregMR = (*verbs.MR).Dereg })

	for i := range 2 {
		err := r.Deregister()
		if !errors.Is(err, transport.ErrDeregisterFailed) || !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("deregister #%d while ibv_dereg_mr fails: %v, want ErrDeregisterFailed wrapping EBUSY", i+1, err)
		}
	}
	if _, ok := c.regions[r]; !ok {
		t.Fatal("the region whose deregistration failed was forgotten")
	}
	// Its memory, or part of it, may not be registered again.
	if _, err := c.Register(mem.Bytes()[2048:6144], transport.AccessLocalWrite); !errors.Is(err, transport.ErrDeregisterFailed) {
		t.Fatalf("register over quarantined memory: %v, want ErrDeregisterFailed", err)
	}
	// Nor used in new work requests.
	if err := c.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: r, Length: 16}}); err != nil {
		t.Fatal(err)
	}
	out := make([]transport.Completion, 1)
	if k := c.emit(out); k != 1 || out[0].Status != transport.StatusLocalProtectionError {
		t.Errorf("send from a quarantined region: %+v, want a local protection error", out[:k])
	}

	fail = false
	if err := r.Deregister(); err != nil {
		t.Fatalf("deregister once ibv_dereg_mr works: %v", err)
	}
	if _, ok := c.regions[r]; ok {
		t.Error("the region is still kept after it was deregistered")
	}
	if r := c.quarantinedOverlap(buf); r != nil {
		t.Error("the memory is still quarantined")
	}
}

// TestDeviceRemovalBreaksConn: RDMA_CM_EVENT_DEVICE_REMOVAL on an
// established conn. The device will never complete what was posted, so the
// conn must complete it (flushed) and report the end, instead of leaving
// Poll waiting forever; its verbs resources are released without waiting
// for its owner.
func TestDeviceRemovalBreaksConn(t *testing.T) {
	c := fakeConn(t, verbs.FakeQPConfig{Chunk: 4, FailSendAt: -1, FailRecvAt: -1}, 8, 8)
	if err := c.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
		t.Fatal(err)
	}
	if err := c.PostSend(transport.WorkRequest{ID: 3, Op: transport.OpSend}, transport.WorkRequest{ID: 4, Op: transport.OpSend}); err != nil {
		t.Fatal(err)
	}
	if stop := c.handleEvent(verbs.Event{Type: verbs.EventDeviceRemoval}); !stop {
		t.Error("the CM goroutine goes on after the device was removed")
	}
	out := make([]transport.Completion, 8)
	k := c.emit(out)
	if k != 4 {
		t.Fatalf("completions after the removal: %+v, want the 4 posted, flushed", out[:k])
	}
	for _, comp := range out[:k] {
		if comp.Status != transport.StatusFlushed {
			t.Errorf("completion %+v, want flushed", comp)
		}
	}
	if !c.finished() {
		t.Error("the conn is not finished: Poll would wait")
	}
	err := c.closedErr()
	if !errors.Is(err, transport.ErrDeviceRemoved) || !errors.Is(err, transport.ErrClosed) {
		t.Errorf("end of the conn: %v, want ErrClosed and ErrDeviceRemoved", err)
	}
	if err := c.PostSend(transport.WorkRequest{ID: 5, Op: transport.OpSend}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post send after the removal: %v, want ErrClosed", err)
	}
	// The conn releases its resources by itself; Close waits for that.
	c.Close()
	if !c.destroyed.Load() {
		t.Error("the verbs resources were not released")
	}
	// And Poll reports the end at once.
	if _, err := c.Poll(context.Background(), out); !errors.Is(err, transport.ErrDeviceRemoved) {
		t.Errorf("poll after the removal: %v, want ErrDeviceRemoved", err)
	}
}

// TestListenerDeviceRemoval: the removal of the listener's device is no
// orderly close: Accept's error must not match ErrClosed (a server would
// then stop serving and exit 0), and must match ErrDeviceRemoved.
func TestListenerDeviceRemoval(t *testing.T) {
	l := &listener{p: &provider{log: zap.NewNop()}, addr: "192.0.2.1:7480", info: "rxe0 port 1"}
	err := l.eventErr(verbs.Event{Type: verbs.EventDeviceRemoval})
	if !errors.Is(err, transport.ErrDeviceRemoved) || errors.Is(err, transport.ErrClosed) {
		t.Errorf("device removal on the listener: %v, want ErrDeviceRemoved and not ErrClosed", err)
	}
	for _, ty := range []verbs.EventType{verbs.EventAddrChange, verbs.EventTimewaitExit, verbs.EventDisconnected} {
		if err := l.eventErr(verbs.Event{Type: ty}); err != nil {
			t.Errorf("%v on the listener: %v, want it ignored", ty, err)
		}
	}
}
