package initiator

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// slots is the number of free slots of each class in p, cached ones not
// counted.
func (p *bufPool) slots() [3]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return [3]int{len(p.small), len(p.mid), len(p.big)}
}

func (p *bufPool) cached(q int) int {
	c := &p.caches[q%len(p.caches)]
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.small) + len(c.mid)
}

// TestPoolClasses: a request takes a slot of the smallest class that
// holds it, lends from a larger class when its own has none, and a large
// one takes all the big slots it needs at once.
func TestPoolClasses(t *testing.T) {
	p := newBufPool(make([]byte, DefaultPoolSize), 1)
	all := p.slots()
	if all[0] == 0 || all[1] == 0 || all[2]*bigSlot < MaxRequest {
		t.Fatalf("slots %v: want every class, the big one holding MaxRequest", all)
	}
	ctx := context.Background()
	for _, c := range []struct {
		n, class, segs int
	}{{1, smallSlot, 1}, {smallSlot, smallSlot, 1}, {smallSlot + 1, midSlot, 1}, {midSlot, midSlot, 1},
		{midSlot + 1, bigSlot, 1}, {bigSlot + 1, bigSlot, 2}, {MaxRequest, bigSlot, MaxRequest / bigSlot}} {
		b, err := p.alloc(ctx, c.n, nil)
		if err != nil {
			t.Fatalf("alloc %d: %v", c.n, err)
		}
		if b.class != c.class || len(b.Segs) != c.segs || bufLen(b) != uint64(c.n) {
			t.Errorf("alloc %d: class %d, %d segments of %d bytes; want class %d, %d segments", c.n, b.class, len(b.Segs), bufLen(b), c.class, c.segs)
		}
		p.release(b)
	}
	if got := p.slots(); got != all {
		t.Fatalf("after releasing all: slots %v, want %v", got, all)
	}
	if _, err := p.alloc(ctx, p.capacity()+1, nil); err == nil {
		t.Fatal("alloc beyond the pool's capacity succeeded")
	}
}

// TestPoolQueueCache: a queue's small buffers come back through its cache
// without reaching the pool, up to the cache's limit; an alloc that would
// wait first takes back what every cache holds, and a waiter is woken by
// a release through a cache.
func TestPoolQueueCache(t *testing.T) {
	p := newBufPool(make([]byte, DefaultPoolSize), 2)
	all := p.slots()
	if p.cacheLimit <= 0 {
		t.Fatalf("cache limit %d", p.cacheLimit)
	}
	ctx := context.Background()
	b, err := p.allocQ(ctx, 0, 4096, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.releaseQ(0, b)
	if p.cached(0) != 1 {
		t.Fatalf("queue 0 caches %d buffers after one release, want 1", p.cached(0))
	}
	b2, err := p.allocQ(ctx, 0, 512, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b2 != b || p.cached(0) != 0 || bufLen(b2) != 512 {
		t.Fatalf("alloc on queue 0 did not take its cached buffer (same %v, cached %d, %d bytes)", b2 == b, p.cached(0), bufLen(b2))
	}
	p.releaseQ(0, b2)

	// Take every slot through queue 0, give them all back through queue
	// 1: its cache keeps its limit of each small class, the rest goes to
	// the pool.
	total := all[0] + all[1] + all[2]
	var bufs []*ioBuf
	for range total {
		b, err := p.allocQ(ctx, 0, 4096, nil)
		if err != nil {
			t.Fatal(err)
		}
		bufs = append(bufs, b)
	}
	for _, b := range bufs {
		p.releaseQ(1, b)
	}
	if got := p.cached(1); got != 2*p.cacheLimit {
		t.Fatalf("queue 1 caches %d buffers, want %d (its limit of each small class)", got, 2*p.cacheLimit)
	}
	// Every slot is there to be had again by queue 0: those cached by
	// queue 1 come back when the pool runs short.
	bufs = bufs[:0]
	for i := range total {
		tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		b, err := p.allocQ(tctx, 0, 4096, nil)
		cancel()
		if err != nil {
			t.Fatalf("alloc %d of %d: %v (cached by queue 1: %d)", i+1, total, err, p.cached(1))
		}
		bufs = append(bufs, b)
	}
	// The pool is empty now: the next alloc waits, and a release through
	// a cache wakes it rather than stashing the slot.
	got := make(chan error, 1)
	go func() {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		b, err := p.allocQ(tctx, 1, 4096, nil)
		if err == nil {
			p.release(b)
		}
		got <- err
	}()
	waitWaiter(t, p, "the alloc on an empty pool did not wait")
	p.releaseQ(0, bufs[0])
	if err := <-got; err != nil {
		t.Fatalf("the waiting alloc: %v", err)
	}
	for _, b := range bufs[1:] {
		p.releaseQ(0, b)
	}
	// An alloc that gives up leaves nothing behind.
	p.reclaim()
	if got := p.slots(); got != all {
		t.Fatalf("after releasing all and reclaiming: slots %v, want %v", got, all)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	var held []*ioBuf
	for range all[2] {
		b, err := p.alloc(ctx, bigSlot, nil)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, b)
	}
	if _, err := p.allocQ(cctx, 0, bigSlot, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("alloc of a big slot on a pool without one, canceled: %v", err)
	}
	for _, b := range held {
		p.releaseQ(0, b)
	}
	if got := p.slots(); got != all {
		t.Fatalf("at the end: slots %v, want %v", got, all)
	}
}

// unplugRecorder is an unplugger that counts its calls.
type unplugRecorder struct{ calls atomic.Int32 }

func (u *unplugRecorder) Unplug() { u.calls.Add(1) }

// TestAllocUnplugsBeforeWaiting: an alloc that must wait for a buffer
// unplugs its submitter first (the requests whose end would free one may
// be held back by the plug), once; one that does not wait leaves the plug
// alone.
func TestAllocUnplugsBeforeWaiting(t *testing.T) {
	p := newBufPool(make([]byte, DefaultPoolSize), 1)
	ctx := context.Background()
	u := &unplugRecorder{}
	b, err := p.alloc(ctx, p.capacity(), u)
	if err != nil {
		t.Fatal(err)
	}
	if n := u.calls.Load(); n != 0 {
		t.Fatalf("an alloc that did not wait unplugged %d times", n)
	}
	// The big slots are all taken: the next one waits, after unplugging.
	got := make(chan error, 1)
	go func() {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		b2, err := p.alloc(tctx, bigSlot, u)
		if err == nil {
			p.release(b2)
		}
		got <- err
	}()
	waitWaiter(t, p, "the alloc on a pool without a big slot did not wait")
	p.release(b)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if n := u.calls.Load(); n != 1 {
		t.Fatalf("an alloc that waited unplugged %d times, want 1", n)
	}
}

// waitWaiter waits until an alloc waits on p, or fails with what.
func waitWaiter(t *testing.T, p *bufPool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for p.waiting.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal(what)
		}
		time.Sleep(time.Millisecond)
	}
}
