//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// pollAll polls c until it reports an error (ErrClosed once it is broken
// and empty) or 10 s pass, and returns the completions and the error.
func pollAll(t testing.TB, c transport.Conn) ([]transport.Completion, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []transport.Completion
	out := make([]transport.Completion, 16)
	for {
		n, err := c.Poll(ctx, out)
		got = append(got, out[:n]...)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("poll: no end after %+v", got)
			}
			return got, err
		}
	}
}

// nop is a zero-length RDMA WRITE: it executes without a key.
func nop(id uint64) transport.WorkRequest {
	return transport.WorkRequest{ID: id, Op: transport.OpWrite}
}

// refuseAt refuses the request at index at (counted over the QP's life)
// of the posts of op, once, with ENOMEM.
func refuseAt(f *fakeFabric, op string, at int) {
	total := 0
	f.refusePost(op, func(_, n int) (int, error) {
		if total <= at && at < total+n {
			k := at - total
			total += n
			return k, fmt.Errorf("ibv_post: %w", syscall.ENOMEM)
		}
		total += n
		return n, nil
	})
}

// TestPostSendPartialFailure: ibv_post_send refuses a request in the second
// chain of a call. Nothing after it may reach the QP (not the rest of that
// chain, not the chains after), and every request not posted must complete:
// the refused one with an error, the later ones flushed.
func TestPostSendPartialFailure(t *testing.T) {
	const chunk, n, failAt = 4, 11, 5
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{SendQueueDepth: 64, RecvQueueDepth: 64})
	p.chunk = chunk
	c, _ := fakePair(t, p)
	refuseAt(f, "post_send", failAt)
	wrs := make([]transport.WorkRequest, n)
	for i := range wrs {
		wrs[i] = nop(uint64(100 + i))
	}
	if err := c.PostSend(wrs...); err != nil {
		t.Fatalf("post send: %v, want the failure reported in the completions", err)
	}
	sends, _, _ := fakeQPOf(c).posted()
	if len(sends) != failAt {
		t.Fatalf("the QP took work requests %v, want only the %d before the refused one", sends, failAt)
	}
	for i, id := range sends {
		if id != uint64(i) {
			t.Errorf("QP took wr_id %d at %d, want %d", id, i, i)
		}
	}
	if err := c.PostSend(nop(999)); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post send after the refusal: %v, want ErrClosed", err)
	}
	if sends2, _, _ := fakeQPOf(c).posted(); len(sends2) != failAt {
		t.Errorf("the QP took %v after the refusal", sends2[failAt:])
	}
	got, err := pollAll(t, c)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll ended with %v, want ErrClosed", err)
	}
	if len(got) != n {
		t.Fatalf("%d completions %+v, want %d", len(got), got, n)
	}
	for i, comp := range got {
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
}

// TestPostRecvPartialFailure is TestPostSendPartialFailure for receives:
// the receives the QP took are flushed by the break, the others complete
// flushed by themselves.
func TestPostRecvPartialFailure(t *testing.T) {
	const chunk, n, failAt = 4, 11, 6
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{SendQueueDepth: 64, RecvQueueDepth: 64})
	p.chunk = chunk
	c, _ := fakePair(t, p)
	refuseAt(f, "post_recv", failAt)
	rrs := make([]transport.RecvRequest, n)
	for i := range rrs {
		rrs[i] = transport.RecvRequest{ID: uint64(100 + i)}
	}
	if err := c.PostRecv(rrs...); err != nil {
		t.Fatalf("post recv: %v, want the failure reported in the completions", err)
	}
	_, recvs, _ := fakeQPOf(c).posted()
	if len(recvs) != failAt {
		t.Fatalf("the QP took receives %v, want only the %d before the refused one", recvs, failAt)
	}
	if err := c.PostRecv(transport.RecvRequest{ID: 999}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post recv after the refusal: %v, want ErrClosed", err)
	}
	got, err := pollAll(t, c)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll ended with %v, want ErrClosed", err)
	}
	if len(got) != n {
		t.Fatalf("%d completions %+v, want %d", len(got), got, n)
	}
	for i, comp := range got {
		if comp.ID != uint64(100+i) || comp.Op != transport.OpRecv || comp.Status != transport.StatusFlushed {
			t.Errorf("completion %d: %+v, want receive %d flushed", i, comp, 100+i)
		}
	}
}

// TestPostSendRefusedWhole: a refusal of the first chain with nothing
// posted undoes the call and reports the queue full; the conn goes on.
func TestPostSendRefusedWhole(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{SendQueueDepth: 64, RecvQueueDepth: 64})
	p.chunk = 4
	c, _ := fakePair(t, p)
	refuseAt(f, "post_send", 0)
	err := c.PostSend(nop(1), nop(2))
	if !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("post send: %v, want ErrQueueFull", err)
	}
	c.sq.mu.Lock()
	head, tail := c.sq.head, c.sq.tail
	c.sq.mu.Unlock()
	if tail != head {
		t.Errorf("the call was not undone: queue [%d, %d)", head, tail)
	}
	if err := c.PostSend(nop(3)); err != nil {
		t.Fatalf("post send after the refusal: %v", err)
	}
	got := pollN(t, c, 1)
	if got[0].ID != 3 || got[0].Status != transport.StatusSuccess {
		t.Errorf("completion %+v, want 3 success", got[0])
	}
}

// pollN polls c until n completions came (or 10 s passed).
func pollN(t testing.TB, c transport.Conn, n int) []transport.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []transport.Completion
	out := make([]transport.Completion, 16)
	for len(got) < n {
		k, err := c.Poll(ctx, out[:min(len(out), n-len(got))])
		got = append(got, out[:k]...)
		if err != nil {
			t.Fatalf("poll: %v after %+v", err, got)
		}
	}
	return got
}

// TestDeregisterFailureQuarantines: when ibv_dereg_mr fails, the memory is
// still registered. Deregister must say so (every time, not only the first),
// the region must stay known to the conn, and its memory must not be
// registered again on that conn until a Deregister succeeds.
func TestDeregisterFailureQuarantines(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	c, _ := fakePair(t, p)
	mem := memory(t, 8192)
	buf := mem[:4096]
	reg, err := c.Register(buf, transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	r := reg.(*region)
	fail := true
	f.failOn("dereg_mr", func(int) error {
		if fail {
			return fmt.Errorf("ibv_dereg_mr: %w", syscall.EBUSY)
		}
		return nil
	})
	for i := range 2 {
		err := r.Deregister()
		if !errors.Is(err, transport.ErrDeregisterFailed) || !errors.Is(err, syscall.EBUSY) {
			t.Fatalf("deregister #%d while ibv_dereg_mr fails: %v, want ErrDeregisterFailed wrapping EBUSY", i+1, err)
		}
	}
	c.regMu.Lock()
	_, kept := c.regions[r]
	c.regMu.Unlock()
	if !kept {
		t.Fatal("the region whose deregistration failed was forgotten")
	}
	// Its memory, or part of it, may not be registered again.
	if _, err := c.Register(mem[2048:6144], transport.AccessLocalWrite); !errors.Is(err, transport.ErrDeregisterFailed) {
		t.Fatalf("register over quarantined memory: %v, want ErrDeregisterFailed", err)
	}
	// Nor used in new work requests.
	if err := c.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: r, Length: 16}}); err != nil {
		t.Fatal(err)
	}
	if got := pollN(t, c, 1); got[0].Status != transport.StatusLocalProtectionError {
		t.Errorf("send from a quarantined region: %+v, want a local protection error", got)
	}
	fail = false
	if err := r.Deregister(); err != nil {
		t.Fatalf("deregister once ibv_dereg_mr works: %v", err)
	}
	c.regMu.Lock()
	_, kept = c.regions[r]
	q := c.quarantinedOverlap(buf)
	c.regMu.Unlock()
	if kept {
		t.Error("the region is still kept after it was deregistered")
	}
	if q != nil {
		t.Error("the memory is still quarantined")
	}
}

// TestDeviceRemovalBreaksConn: RDMA_CM_EVENT_DEVICE_REMOVAL on an
// established conn. The device will never complete what was posted, so the
// conn must complete it (flushed) and report the end, instead of leaving
// Poll waiting forever; its verbs resources are released without waiting
// for its owner.
func TestDeviceRemovalBreaksConn(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	c, _ := fakePair(t, p)
	if err := c.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
		t.Fatal(err)
	}
	// SENDs the peer has no receive for: they wait (RNR).
	if err := c.PostSend(transport.WorkRequest{ID: 3, Op: transport.OpSend}, transport.WorkRequest{ID: 4, Op: transport.OpSend}); err != nil {
		t.Fatal(err)
	}
	f.removeDevice()
	got, err := pollAll(t, c)
	if len(got) != 4 {
		t.Fatalf("completions after the removal: %+v, want the 4 posted, flushed", got)
	}
	for _, comp := range got {
		if comp.Status != transport.StatusFlushed {
			t.Errorf("completion %+v, want flushed", comp)
		}
	}
	if !errors.Is(err, transport.ErrDeviceRemoved) || !errors.Is(err, transport.ErrClosed) {
		t.Errorf("end of the conn: %v, want ErrClosed and ErrDeviceRemoved", err)
	}
	if err := c.PostSend(transport.WorkRequest{ID: 5, Op: transport.OpSend}); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post send after the removal: %v, want ErrClosed", err)
	}
	// The conns release their resources by themselves, without Close.
	f.waitClean(t)
	c.Close()
	// And Poll reports the end at once.
	if _, err := c.Poll(context.Background(), make([]transport.Completion, 1)); !errors.Is(err, transport.ErrDeviceRemoved) {
		t.Errorf("poll after the removal: %v, want ErrDeviceRemoved", err)
	}
}

// TestListenerDeviceRemoval: the removal of the listener's device is no
// orderly close: Accept's error must not match ErrClosed (a server would
// then stop serving and exit 0), and must match ErrDeviceRemoved.
func TestListenerDeviceRemoval(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	l, err := p.Listen(context.Background(), fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	f.removeDevice()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 2 {
		_, err := l.Accept(ctx)
		if !errors.Is(err, transport.ErrDeviceRemoved) || errors.Is(err, transport.ErrClosed) {
			t.Errorf("accept #%d after the device was removed: %v, want ErrDeviceRemoved and not ErrClosed", i+1, err)
		}
	}
	ll := l.(*listener)
	for _, ty := range []verbs.EventType{verbs.EventAddrChange, verbs.EventTimewaitExit, verbs.EventDisconnected} {
		if err := ll.eventErr(verbs.Event{Type: ty}); err != nil {
			t.Errorf("%v on the listener: %v, want it ignored", ty, err)
		}
	}
}
