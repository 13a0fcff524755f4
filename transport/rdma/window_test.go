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
)

// fakeWindowConn is a heldConn with a region registered for windows;
// without mw, ibv_alloc_mw fails with EOPNOTSUPP.
func fakeWindowConn(t *testing.T, mw bool) (*conn, *region, *fakeFabric) {
	t.Helper()
	c, f := heldConn(t, Options{SendQueueDepth: 8, RecvQueueDepth: 8}, 4)
	if !mw {
		f.failOn("alloc_mw", func(int) error { return fmt.Errorf("ibv_alloc_mw: %w", syscall.EOPNOTSUPP) })
	}
	reg, err := c.Register(memory(t, 1<<20), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		t.Fatal(err)
	}
	return c, reg.(*region), f
}

// liveMWs is the number of memory windows allocated and not deallocated.
func liveMWs(f *fakeFabric) int {
	made, gone := f.counts("mw")
	return made - gone
}

// nextMWPost waits for the next window request posted on the fake QP after
// the first seen ones, and returns its wr_id.
func nextMWPost(t *testing.T, c *conn, seen int) uint64 {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		sends, _, _ := fakeQPOf(c).posted()
		if len(sends) > seen {
			id := sends[seen]
			if id&mwBit == 0 || id&recvBit != 0 {
				t.Fatalf("posted wr_id %#x is not a window request's", id)
			}
			return id
		}
		if time.Now().After(deadline) {
			t.Fatalf("no window request posted after %d", seen)
		}
		time.Sleep(time.Millisecond)
	}
}

type bindResult struct {
	w   transport.Window
	err error
}

func bindAsync(ctx context.Context, c *conn, r *region, off, n int) chan bindResult {
	ch := make(chan bindResult, 1)
	go func() {
		w, err := c.BindWindow(ctx, r, off, n, transport.AccessRemoteRead|transport.AccessRemoteWrite)
		ch <- bindResult{w, err}
	}()
	return ch
}

// TestWindowCompletionsStayInside: bind and invalidate post on the QP, their
// completions wake the caller and never reach the rings Poll returns from;
// the memory window is pooled and its key moves on.
func TestWindowCompletionsStayInside(t *testing.T) {
	c, r, f := fakeWindowConn(t, true)
	var rkeys []uint32
	for i := range 3 {
		res := bindAsync(context.Background(), c, r, 4096*i, 4096)
		id := nextMWPost(t, c, 2*i)
		if err := c.completeMW(id, transport.StatusSuccess, 0); err != nil {
			t.Fatal(err)
		}
		b := <-res
		if b.err != nil {
			t.Fatalf("bind %d: %v", i, b.err)
		}
		if b.w.Addr() != r.addr+uint64(4096*i) {
			t.Errorf("window at %#x, want %#x", b.w.Addr(), r.addr+uint64(4096*i))
		}
		rkeys = append(rkeys, b.w.RKey())
		if live, alloc := c.WindowStats(); live != 1 || alloc != 1 {
			t.Errorf("bound: %d live, %d allocated; want 1, 1", live, alloc)
		}
		inv := make(chan error, 1)
		go func() { inv <- b.w.Invalidate(context.Background()) }()
		id = nextMWPost(t, c, 2*i+1)
		if err := c.completeMW(id, transport.StatusSuccess, 0); err != nil {
			t.Fatal(err)
		}
		if err := <-inv; err != nil {
			t.Fatalf("invalidate %d: %v", i, err)
		}
		if err := b.w.Invalidate(context.Background()); err != nil {
			t.Errorf("second invalidate: %v", err)
		}
	}
	if rkeys[0] == rkeys[1] || rkeys[1] == rkeys[2] || rkeys[0]>>8 != rkeys[2]>>8 {
		t.Errorf("rkeys %#x: want one memory window (same index), a new key each bind", rkeys)
	}
	if live, alloc := c.WindowStats(); live != 0 || alloc != 1 || liveMWs(f) != 1 || len(c.mwSem) != 0 {
		t.Errorf("after the cycles: %d live, %d allocated, %d fake MWs, %d slots taken; want 0, 1, 1, 0",
			live, alloc, liveMWs(f), len(c.mwSem))
	}
	if k := c.emit(make([]transport.Completion, 8)); k != 0 || c.sq.tail != 0 {
		t.Errorf("the link's rings got %d completions (send tail %d): window requests leaked into them", k, c.sq.tail)
	}
	c.destroyWindows()
	if liveMWs(f) != 0 {
		t.Errorf("%d memory windows left after the teardown", liveMWs(f))
	}
}

// TestWindowBindAbandoned: BindWindow's ctx ends while the bind is in
// flight. It returns ctx.Err(); the slot and the memory window stay taken
// until the bind completes, and then the window is invalidated at once.
func TestWindowBindAbandoned(t *testing.T) {
	c, r, _ := fakeWindowConn(t, true)
	ctx, cancel := context.WithCancel(context.Background())
	res := bindAsync(ctx, c, r, 0, 4096)
	bindID := nextMWPost(t, c, 0)
	cancel()
	if b := <-res; !errors.Is(b.err, context.Canceled) {
		t.Fatalf("bind with its ctx canceled: %v, %v; want canceled", b.w, b.err)
	}
	if live, _ := c.WindowStats(); live != 1 || len(c.mwSem) != 1 || len(c.mwFree) != 0 {
		t.Fatalf("abandoned bind in flight: %d live, %d slots, %d pooled; want 1, 1, 0", live, len(c.mwSem), len(c.mwFree))
	}
	if err := c.completeMW(bindID, transport.StatusSuccess, 0); err != nil {
		t.Fatal(err)
	}
	invID := nextMWPost(t, c, 1)
	if len(c.mwSem) != 1 || len(c.mwFree) != 0 {
		t.Fatalf("abandoned bind completed: %d slots, %d pooled; want its invalidation in flight", len(c.mwSem), len(c.mwFree))
	}
	if err := c.completeMW(invID, transport.StatusSuccess, 0); err != nil {
		t.Fatal(err)
	}
	if live, alloc := c.WindowStats(); live != 0 || alloc != 1 || len(c.mwSem) != 0 || len(c.mwFree) != 1 {
		t.Errorf("after the invalidation: %d live, %d allocated, %d slots, %d pooled; want 0, 1, 0, 1", live, alloc, len(c.mwSem), len(c.mwFree))
	}
}

// TestWindowSlots: binds in flight take the reserved slots, never the
// link's send queue; one more waits for a slot (here until its ctx ends).
func TestWindowSlots(t *testing.T) {
	c, r, _ := fakeWindowConn(t, true)
	var ids []uint64
	var results []chan bindResult
	for i := range windowSlots {
		results = append(results, bindAsync(context.Background(), c, r, 4096*i, 4096))
		ids = append(ids, nextMWPost(t, c, i))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c.BindWindow(ctx, r, 0, 4096, transport.AccessRemoteRead); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("bind with every slot taken: %v, want deadline exceeded", err)
	}
	if sends, _, _ := fakeQPOf(c).posted(); len(sends) != windowSlots {
		t.Errorf("%d requests posted, want %d", len(sends), windowSlots)
	}
	// The link still posts its full depth.
	for i := range len(c.sq.ents) {
		if err := c.PostSend(transport.WorkRequest{ID: uint64(i), Op: transport.OpSend}); err != nil {
			t.Fatalf("link post %d with the window slots taken: %v", i, err)
		}
	}
	for i, id := range ids {
		if err := c.completeMW(id, transport.StatusSuccess, 0); err != nil {
			t.Fatal(err)
		}
		if b := <-results[i]; b.err != nil {
			t.Fatal(b.err)
		}
	}
}

// TestWindowFailuresAndClose: a failed bind breaks the connection; binds in
// flight at the teardown return ErrClosed; Invalidate on a broken conn is
// nil and frees the memory window; the teardown deallocates everything.
func TestWindowFailuresAndClose(t *testing.T) {
	c, r, f := fakeWindowConn(t, true)
	res := bindAsync(context.Background(), c, r, 0, 4096)
	id := nextMWPost(t, c, 0)
	if err := c.completeMW(id, transport.StatusSuccess, 0); err != nil {
		t.Fatal(err)
	}
	w := (<-res).w
	res = bindAsync(context.Background(), c, r, 4096, 4096)
	id = nextMWPost(t, c, 1)
	if err := c.completeMW(id, transport.StatusRemoteInvalidRequest, 0); err == nil {
		t.Error("a failed bind reported no failure")
	}
	if b := <-res; b.err == nil || errors.Is(b.err, transport.ErrUnsupported) {
		t.Errorf("failed bind: %v", b.err)
	}
	c.breakConn(errors.New("test"))
	if err := w.Invalidate(context.Background()); err != nil {
		t.Errorf("invalidate on a broken conn: %v, want nil", err)
	}
	if live, alloc := c.WindowStats(); live != 0 || alloc != 0 || liveMWs(f) != 0 {
		t.Errorf("broken: %d live, %d allocated, %d fake MWs; want none", live, alloc, liveMWs(f))
	}
	if _, err := c.BindWindow(context.Background(), r, 0, 4096, transport.AccessRemoteRead); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("bind on a broken conn: %v, want ErrClosed", err)
	}

	// A bind in flight when the conn is torn down.
	c2, r2, f2 := fakeWindowConn(t, true)
	res = bindAsync(context.Background(), c2, r2, 0, 4096)
	nextMWPost(t, c2, 0)
	c2.destroyWindows()
	if b := <-res; !errors.Is(b.err, transport.ErrClosed) {
		t.Errorf("bind in flight at the teardown: %v, want ErrClosed", b.err)
	}
	if liveMWs(f2) != 0 {
		t.Errorf("%d memory windows left after the teardown", liveMWs(f2))
	}
}

// TestWindowUnsupported: without memory windows BindWindow says so with
// ErrUnsupported, whether the device attributes or ibv_alloc_mw told.
func TestWindowUnsupported(t *testing.T) {
	c, r, _ := fakeWindowConn(t, false)
	for i := range 2 { // ibv_alloc_mw fails, then the conn knows
		if _, err := c.BindWindow(context.Background(), r, 0, 4096, transport.AccessRemoteRead); !errors.Is(err, transport.ErrUnsupported) {
			t.Errorf("bind %d without memory windows: %v, want ErrUnsupported", i+1, err)
		}
	}
	if len(c.mwSem) != 0 {
		t.Error("a slot leaked")
	}
}

// TestWindowDeregisterRegion: deregistering a region deallocates its bound
// windows first (rxe refuses to deregister an MR with windows bound), and
// refuses while a bind over it is in flight.
func TestWindowDeregisterRegion(t *testing.T) {
	c, r, f := fakeWindowConn(t, true)
	res := bindAsync(context.Background(), c, r, 0, 4096)
	id := nextMWPost(t, c, 0)
	if err := r.Deregister(); !errors.Is(err, transport.ErrDeregisterFailed) {
		t.Errorf("deregister with a bind in flight: %v, want ErrDeregisterFailed", err)
	}
	r.dead.Store(false) // (Deregister marked it: this test binds over it again below)
	if err := c.completeMW(id, transport.StatusSuccess, 0); err != nil {
		t.Fatal(err)
	}
	w := (<-res).w
	if err := r.Deregister(); err != nil {
		t.Fatalf("deregister with a window bound: %v", err)
	}
	if err := w.Invalidate(context.Background()); err != nil {
		t.Errorf("invalidate after the region went: %v", err)
	}
	if live, alloc := c.WindowStats(); live != 0 || alloc != 0 || liveMWs(f) != 0 {
		t.Errorf("%d live, %d allocated, %d fake MWs; want none", live, alloc, liveMWs(f))
	}
}
