//go:build linux

package rdma

import (
	"context"
	"runtime"
	"testing"

	"github.com/rblk/rblk/transport"
)

// TestPollSleepAllocs: a SEND and its receive, the receiver's Poll asleep
// on the completion channel when the SEND comes, under a context that can
// end (as the link's poller has): nothing is allocated on the heap, by the
// poster nor by the sleeper. (Before, each sleep registered a
// context.AfterFunc for its context: three allocations per wake-up, so
// three per read and six per write through the initiator.)
func TestPollSleepAllocs(t *testing.T) {
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{SendQueueDepth: 16, RecvQueueDepth: 16})
	a, b := fakePair(t, p)
	fakeQPOf(a).nolog, fakeQPOf(b).nolog = true, true
	mem := memory(t, 2*4096)
	ra, err := a.Register(mem[:4096], transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Register(mem[4096:], transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	recv := transport.RecvRequest{ID: 7, Local: transport.SGE{Region: rb, Length: 4096}}
	if err := b.PostRecv(recv); err != nil {
		t.Fatal(err)
	}
	send := transport.WorkRequest{ID: 9, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: 512}}

	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	defer func() { cancel(); <-stopped }()
	// The receiver: Poll until the receive completes, post it again, tell
	// the sender; until ctx ends.
	got := make(chan error)
	go func() {
		defer close(stopped)
		out := make([]transport.Completion, 4)
		for {
			n, err := b.Poll(ctx, out)
			if err == nil && (n != 1 || out[0].ID != recv.ID || out[0].Status != transport.StatusSuccess) {
				t.Errorf("receiver polled %d: %+v", n, out[:n])
			}
			if err == nil {
				err = b.PostRecv(recv)
			}
			if ctx.Err() != nil {
				return
			}
			got <- err
		}
	}()
	// armed reports whether the receiver's Poll armed its CQ: it found it
	// empty and sleeps (or is about to) until the channel is readable.
	armed := func() bool {
		f.mu.Lock()
		defer f.mu.Unlock()
		return b.cq.(*fakeCQ).armed
	}
	sleeps := func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		return b.cc.(*fakeCompChannel).events
	}
	out := make([]transport.Completion, 4)
	one := func() {
		for !armed() {
			runtime.Gosched()
		}
		if err := a.PostSend(send); err != nil {
			t.Fatal(err)
		}
		if n, err := a.Poll(ctx, out); err != nil || n != 1 || out[0].ID != send.ID || out[0].Status != transport.StatusSuccess {
			t.Fatalf("sender polled %d, %v: %+v", n, err, out[:n])
		}
		if err := <-got; err != nil {
			t.Fatal(err)
		}
	}
	for range 50 { // the queues grown, the registrations made
		one()
	}
	before := sleeps()
	const runs = 500
	if n := testing.AllocsPerRun(runs, one); n != 0 {
		t.Errorf("%v allocations per SEND and wake-up of the receiver's Poll, want 0", n)
	}
	if woke := sleeps() - before; woke < runs {
		t.Errorf("the receiver's Poll slept %d times in %d runs: the test does not exercise the wait", woke, runs+1)
	}
}
