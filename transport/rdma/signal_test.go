//go:build linux

package rdma

import (
	"errors"
	"testing"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// Selective signaling on a fake QP: which requests go signaled, and how
// the completions the device gives are turned into Poll's (the device's
// part is played by feeding complete the work completions it would
// report).

func unsig(id uint64) transport.WorkRequest {
	return transport.WorkRequest{ID: id, Op: transport.OpWrite, Unsignaled: true}
}

func signaled(id uint64) transport.WorkRequest {
	return transport.WorkRequest{ID: id, Op: transport.OpWrite}
}

// wc is the work completion of the send-queue request of sequence seq.
func wc(seq uint64, status uint32) verbs.WC { return verbs.WC{ID: seq, Status: status} }

func emitAll(c *conn) []transport.Completion {
	out := make([]transport.Completion, 64)
	return out[:c.emit(out)]
}

func wantCompletions(t *testing.T, got []transport.Completion, want ...transport.Completion) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("completions %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i].ID != want[i].ID || got[i].Status != want[i].Status {
			t.Errorf("completion %d: %+v, want id %d %v", i, got[i], want[i].ID, want[i].Status)
		}
	}
}

func ringEmpty(t *testing.T, c *conn) {
	t.Helper()
	c.sq.mu.Lock()
	defer c.sq.mu.Unlock()
	if c.sq.head != c.sq.tail || c.sq.hwOut != 0 {
		t.Errorf("send queue: [%d, %d), %d posted: want it empty", c.sq.head, c.sq.tail, c.sq.hwOut)
	}
}

// TestUnsignaledFlags: Unsignaled requests are posted without
// IBV_SEND_SIGNALED, the others with it; a success covers the unsignaled
// requests before it, which Poll does not return.
func TestUnsignaledFlags(t *testing.T) {
	c, _ := heldConn(t, Options{SendQueueDepth: 16, RecvQueueDepth: 16}, 16)
	if err := c.PostSend(unsig(10), unsig(11), signaled(12), unsig(13), signaled(14)); err != nil {
		t.Fatal(err)
	}
	_, _, flags := fakeQPOf(c).posted()
	want := []bool{false, false, true, false, true}
	if len(flags) != len(want) {
		t.Fatalf("the QP took %d requests, want %d", len(flags), len(want))
	}
	for i, f := range flags {
		if (f&verbs.FlagSignaled != 0) != want[i] {
			t.Errorf("request %d: send_flags %#x, want signaled %v", i, f, want[i])
		}
	}
	c.complete([]verbs.WC{wc(2, verbs.WCSuccess)})
	wantCompletions(t, emitAll(c), transport.Completion{ID: 12})
	c.complete([]verbs.WC{wc(4, verbs.WCSuccess)})
	wantCompletions(t, emitAll(c), transport.Completion{ID: 14})
	ringEmpty(t, c)
	if c.sigStats.covered != 3 || c.sigStats.reported != 0 {
		t.Errorf("stats %+v, want 3 covered", c.sigStats)
	}
}

// TestUnsignaledCountInDepth: unsignaled requests take room in the send
// queue until a later completion covers them, and a run of them as long
// as the queue is ended by one posted signaled, whose success is not
// returned either (else nothing would ever free the queue).
func TestUnsignaledCountInDepth(t *testing.T) {
	const depth = 4
	c, _ := heldConn(t, Options{SendQueueDepth: depth, RecvQueueDepth: 16}, 16)
	if err := c.PostSend(unsig(0), unsig(1), unsig(2)); err != nil {
		t.Fatal(err)
	}
	if err := c.PostSend(unsig(3)); err != nil {
		t.Fatal(err)
	}
	if err := c.PostSend(unsig(4)); !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("post beyond the depth with only unsignaled requests outstanding: %v, want ErrQueueFull", err)
	}
	_, _, flags := fakeQPOf(c).posted()
	for i, f := range flags {
		if sig := f&verbs.FlagSignaled != 0; sig != (i == depth-1) {
			t.Errorf("request %d: signaled %v", i, sig)
		}
	}
	c.complete([]verbs.WC{wc(depth-1, verbs.WCSuccess)})
	wantCompletions(t, emitAll(c))
	ringEmpty(t, c)
	if c.sigStats.hidden != 1 || c.sigStats.covered != depth-1 {
		t.Errorf("stats %+v, want 1 hidden, %d covered", c.sigStats, depth-1)
	}
	// The room is back.
	if err := c.PostSend(unsig(5), unsig(6), unsig(7), signaled(8)); err != nil {
		t.Fatal(err)
	}
	if err := c.PostSend(signaled(9)); !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("post beyond the depth: %v, want ErrQueueFull", err)
	}
}

// TestUnsignaledFailure: an unsignaled request fails (the device reports
// it, as it reports every failure); those before it succeeded and are not
// returned; it and every later one are, the flushed unsignaled ones
// included, and then the conn is finished.
func TestUnsignaledFailure(t *testing.T) {
	c, _ := heldConn(t, Options{SendQueueDepth: 16, RecvQueueDepth: 16}, 16)
	c.unsigFlushes = true
	if err := c.PostSend(unsig(10), unsig(11), unsig(12), unsig(13), signaled(14), unsig(15)); err != nil {
		t.Fatal(err)
	}
	c.complete([]verbs.WC{
		wc(2, verbs.WCRemAccessErr), wc(3, verbs.WCWRFlushErr), wc(4, verbs.WCWRFlushErr), wc(5, verbs.WCWRFlushErr),
	})
	wantCompletions(t, emitAll(c),
		transport.Completion{ID: 12, Status: transport.StatusRemoteAccessError},
		transport.Completion{ID: 13, Status: transport.StatusFlushed},
		transport.Completion{ID: 14, Status: transport.StatusFlushed},
		transport.Completion{ID: 15, Status: transport.StatusFlushed})
	ringEmpty(t, c)
	if !c.finished() {
		t.Error("the conn is not finished: Poll would not report ErrClosed")
	}
	if c.sigStats.reported != 3 || c.sigStats.covered != 2 {
		t.Errorf("stats %+v, want 3 reported, 2 covered", c.sigStats)
	}
}

// TestUnsignaledFlushNotReported: on a device that does not report flushed
// unsignaled requests, the ones a flushed completion covers may have been
// flushed: they are reported so.
func TestUnsignaledFlushNotReported(t *testing.T) {
	c, _ := heldConn(t, Options{SendQueueDepth: 16, RecvQueueDepth: 16}, 16)
	c.unsigFlushes = false
	if err := c.PostSend(unsig(10), signaled(11), unsig(12), unsig(13), signaled(14)); err != nil {
		t.Fatal(err)
	}
	c.complete([]verbs.WC{wc(1, verbs.WCSuccess), wc(4, verbs.WCWRFlushErr)})
	wantCompletions(t, emitAll(c),
		transport.Completion{ID: 11},
		transport.Completion{ID: 12, Status: transport.StatusFlushed},
		transport.Completion{ID: 13, Status: transport.StatusFlushed},
		transport.Completion{ID: 14, Status: transport.StatusFlushed})
	if c.sigStats.coveredFlushed != 2 {
		t.Errorf("stats %+v, want 2 covered as flushed", c.sigStats)
	}
}

// TestDrainAfterRefusal: a request refused at post time breaks the conn
// when its turn comes, after those before it; unsignaled ones before it
// that succeed complete nothing, so the drain request (posted by Poll once
// the conn is broken) must cover them, else the refused one is never
// reached.
func TestDrainAfterRefusal(t *testing.T) {
	c, _ := heldConn(t, Options{SendQueueDepth: 16, RecvQueueDepth: 16}, 16)
	if err := c.PostSend(unsig(10), unsig(11)); err != nil {
		t.Fatal(err)
	}
	bad := transport.WorkRequest{ID: 12, Op: transport.OpWrite, Unsignaled: true, Local: transport.SGE{Length: 8}}
	if err := c.PostSend(bad, unsig(13)); err != nil {
		t.Fatal(err)
	}
	if c.state() != stateFailing {
		t.Fatal("not broken after a refused request")
	}
	wantCompletions(t, emitAll(c))
	c.postDrain()
	sends, _, _ := fakeQPOf(c).posted()
	if c.drain != drainPosted || len(sends) != 3 || sends[2] != drainWRID {
		t.Fatalf("drain %v, the QP took %v: want the drain request after the two", c.drain, sends)
	}
	c.postDrain() // once only
	if sends, _, _ := fakeQPOf(c).posted(); len(sends) != 3 {
		t.Fatalf("the QP took %v", sends)
	}
	// The QP is still working: the drain request executes.
	c.complete([]verbs.WC{{ID: drainWRID, Status: verbs.WCSuccess}})
	wantCompletions(t, emitAll(c),
		transport.Completion{ID: 12, Status: transport.StatusLocalProtectionError},
		transport.Completion{ID: 13, Status: transport.StatusFlushed})
	ringEmpty(t, c)
	if c.drain != drainDone || !c.finished() {
		t.Errorf("drain %v, finished %v", c.drain, c.finished())
	}
}

// TestDrainNotNeeded: when the last request posted is signaled, its
// completion covers the rest: no drain request.
func TestDrainNotNeeded(t *testing.T) {
	c, _ := heldConn(t, Options{SendQueueDepth: 16, RecvQueueDepth: 16}, 16)
	c.unsigFlushes = true
	if err := c.PostSend(unsig(10), signaled(11)); err != nil {
		t.Fatal(err)
	}
	c.breakConn(errLocalClose)
	c.postDrain()
	if sends, _, _ := fakeQPOf(c).posted(); len(sends) != 2 || c.drain != drainDone {
		t.Fatalf("the QP took %v, drain %v: want no drain request", sends, c.drain)
	}
	c.complete([]verbs.WC{wc(1, verbs.WCWRFlushErr)})
	wantCompletions(t, emitAll(c), transport.Completion{ID: 11, Status: transport.StatusFlushed})
	if !c.finished() {
		t.Error("not finished")
	}
}

// TestPostOneCallPerChain: a call's requests go to the QP as one chain
// per ibv_post_send or ibv_post_recv (of up to the chunk), and posting
// allocates nothing.
func TestPostOneCallPerChain(t *testing.T) {
	const chunk = 16
	c, _ := heldConn(t, Options{SendQueueDepth: 256, RecvQueueDepth: 256}, chunk)
	wrs := make([]transport.WorkRequest, 10)
	for i := range wrs {
		wrs[i] = unsig(uint64(i))
	}
	wrs[len(wrs)-1].Unsignaled = false
	rrs := make([]transport.RecvRequest, 10)
	for i := range rrs {
		rrs[i] = transport.RecvRequest{ID: uint64(i)}
	}
	if err := c.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	if err := c.PostRecv(rrs...); err != nil {
		t.Fatal(err)
	}
	if s, r := fakeQPOf(c).postCalls(); s != 1 || r != 1 {
		t.Errorf("%d ibv_post_send and %d ibv_post_recv calls for 10 requests each, want 1 each", s, r)
	}
	long := make([]transport.WorkRequest, 2*chunk+1)
	for i := range long {
		long[i] = signaled(uint64(i))
	}
	if err := c.PostSend(long...); err != nil {
		t.Fatal(err)
	}
	if s, _ := fakeQPOf(c).postCalls(); s != 1+3 {
		t.Errorf("%d ibv_post_send calls for a chain of %d, want 3", s-1, len(long))
	}

	c2, _ := heldConn(t, Options{SendQueueDepth: 64, RecvQueueDepth: 64}, chunk)
	fakeQPOf(c2).norecord = true // (the fake would allocate)
	out := make([]transport.Completion, 16)
	recvs := make([]verbs.WC, len(rrs))
	var last uint64
	allocs := testing.AllocsPerRun(200, func() {
		if err := c2.PostSend(wrs...); err != nil {
			t.Fatal(err)
		}
		last = c2.sq.tail - 1
		c2.complete([]verbs.WC{wc(last, verbs.WCSuccess)})
		if n := c2.emit(out); n != 1 {
			t.Fatalf("%d completions", n)
		}
		if err := c2.PostRecv(rrs...); err != nil {
			t.Fatal(err)
		}
		for seq := c2.rq.tail - uint64(len(rrs)); seq < c2.rq.tail; seq++ {
			recvs[seq-(c2.rq.tail-uint64(len(rrs)))] = verbs.WC{ID: seq | recvBit, Opcode: verbs.WCRecv}
		}
		c2.complete(recvs[:len(rrs)])
		c2.emit(out)
	})
	if allocs != 0 {
		t.Errorf("%v allocations per post, completion and emit of a chain of 10 sends and 10 receives, want 0", allocs)
	}
}
