package transporttest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rblk/rblk/transport"
)

// signalTests are the subtests of Run about selective signaling
// (WorkRequest.Unsignaled) and transport.CompletionHandler.
var signalTests = []struct {
	name string
	fn   func(e *env)
}{
	{"UnsignaledChain", testUnsignaledChain},
	{"UnsignaledRemoteFailure", testUnsignaledRemoteFailure},
	{"UnsignaledLocalFailure", testUnsignaledLocalFailure},
	{"UnsignaledQueueDepth", testUnsignaledQueueDepth},
	{"HandlerTraffic", testHandlerTraffic},
	{"HandlerPingPong", testHandlerPingPong},
	{"HandlerFailure", testHandlerFailure},
	{"HandlerCloseInside", testHandlerCloseInside},
	{"HandlerConcurrent", testHandlerConcurrent},
}

func unsignaled(wr transport.WorkRequest) transport.WorkRequest {
	wr.Unsignaled = true
	return wr
}

// sendSide splits completions into those of the send queue and the
// receives.
func sendSide(cs []transport.Completion) (sends, recvs []transport.Completion) {
	for _, c := range cs {
		if c.Op == transport.OpRecv || c.Op == transport.OpRecvWriteImm {
			recvs = append(recvs, c)
		} else {
			sends = append(sends, c)
		}
	}
	return sends, recvs
}

// unsignaledChain posts, from a, n unsignaled WRITEs of size bytes into
// dst, n unsignaled READs of them back into the second half of src, and a
// signaled SEND with id; b has a receive posted for it.
func (e *env) unsignaledChain(src, dst, ctlA, ctlB transport.Region, n, size int, id uint64, seed uint64) {
	e.t.Helper()
	fill(src.Bytes()[:n*size], seed)
	clear(src.Bytes()[n*size:])
	e.postRecv(e.b, recvRR(id, ctlB, 0, 16))
	var wrs []transport.WorkRequest
	for i := range n {
		wrs = append(wrs, unsignaled(rdmaWR(uint64(1000+i), transport.OpWrite, src, i*size, size, dst, i*size)))
	}
	for i := range n {
		wrs = append(wrs, unsignaled(rdmaWR(uint64(2000+i), transport.OpRead, src, (n+i)*size, size, dst, i*size)))
	}
	wrs = append(wrs, sendWR(id, ctlA, 0, 1))
	e.postSend(e.a, wrs...)
}

// chainLen is how many WRITEs (and as many READs) a chain has, so that a
// chain and its SEND fit in the send queue.
func (e *env) chainLen() int {
	return max(1, min(16, (e.a.Limits().SendQueueDepth-1)/2))
}

// testUnsignaledChain: unsignaled WRITEs and READs followed by a signaled
// SEND complete with the SEND alone, with every byte in place; the peer
// gets the receive. Rounds in a row check that the room the chain took is
// free again.
func testUnsignaledChain(e *env) {
	const size = 4096
	n := e.chainLen()
	src := e.region(e.a, 2*n*size, rw)
	dst := e.region(e.b, n*size, all)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	for round := range 2 * e.a.Limits().SendQueueDepth / (2*n + 1) {
		id := uint64(round)
		e.unsignaledChain(src, dst, ctlA, ctlB, n, size, id, uint64(round+40))
		e.check(e.wait(e.b, 1)[0], id, transport.OpRecv, transport.StatusSuccess)
		// Send-queue completions come in order: one of an unsignaled
		// request would come before the SEND's.
		e.check(e.wait(e.a, 1)[0], id, transport.OpSend, transport.StatusSuccess)
		if !bytes.Equal(dst.Bytes(), src.Bytes()[:n*size]) {
			e.t.Fatalf("round %d: the data of the unsignaled WRITEs is not in place when the receive of the SEND after them completes", round)
		}
		if !bytes.Equal(src.Bytes()[n*size:], src.Bytes()[:n*size]) {
			e.t.Fatalf("round %d: the data of the unsignaled READs is not in place when the SEND after them completes", round)
		}
	}
	// Nothing else was queued: the next completion is that of a new
	// signaled request.
	e.postSend(e.a, rdmaWR(99, transport.OpWrite, src, 0, 8, dst, 0))
	e.check(e.wait(e.a, 1)[0], 99, transport.OpWrite, transport.StatusSuccess)
}

// testUnsignaledRemoteFailure: of unsignaled requests around one the peer
// refuses, the one before (which succeeded) is not reported, the refused
// one completes with its error and every later one is flushed, signaled
// or not; then the connection is broken.
func testUnsignaledRemoteFailure(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	rbuf := e.region(e.b, 64, rw)
	abuf := e.region(e.a, 64, rw)
	e.postRecv(e.b, recvRR(50, rbuf, 0, 64))
	e.postRecv(e.a, recvRR(60, abuf, 0, 64))
	bad := rdmaWR(2, transport.OpWrite, la, 0, 8, rb, 0)
	bad.RKey ^= 0x5a5a5a5a
	e.postSend(e.a,
		unsignaled(rdmaWR(1, transport.OpWrite, la, 0, 8, rb, 0)),
		unsignaled(bad),
		unsignaled(rdmaWR(3, transport.OpWrite, la, 0, 8, rb, 0)),
		unsignaled(rdmaWR(4, transport.OpRead, la, 0, 8, rb, 0)),
		sendWR(5, la, 0, 8))
	sends, recvs := sendSide(e.drain(e.a))
	e.expectFailed(sends, 2, transport.OpWrite, transport.StatusRemoteAccessError,
		[]transport.Opcode{transport.OpWrite, transport.OpRead, transport.OpSend})
	if len(recvs) != 1 || recvs[0].ID != 60 || recvs[0].Status != transport.StatusFlushed {
		e.t.Errorf("receives of a %+v, want 60 flushed", recvs)
	}
	e.broken(0, 1)
}

// testUnsignaledLocalFailure: the same with an unsignaled request whose
// local buffer is outside its region.
func testUnsignaledLocalFailure(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	e.postSend(e.a,
		unsignaled(rdmaWR(1, transport.OpWrite, la, 0, 8, rb, 0)),
		unsignaled(rdmaWR(2, transport.OpWrite, la, 4000, 200, rb, 0)),
		unsignaled(rdmaWR(3, transport.OpWrite, la, 0, 8, rb, 0)),
		rdmaWR(4, transport.OpWrite, la, 0, 8, rb, 0))
	sends, _ := sendSide(e.drain(e.a))
	e.expectFailed(sends, 2, transport.OpWrite, transport.StatusLocalProtectionError,
		[]transport.Opcode{transport.OpWrite, transport.OpWrite})
	e.broken(0, 0)
}

// expectFailed checks send-queue completions: id failed with st, then the
// requests after it (ids id+1, … with ops) were flushed, and nothing else.
func (e *env) expectFailed(got []transport.Completion, id uint64, op transport.Opcode, st transport.Status, after []transport.Opcode) {
	e.t.Helper()
	if len(got) != 1+len(after) {
		e.t.Fatalf("send completions %+v, want request %d failed and %d flushed after it (nothing for the unsignaled request that succeeded)", got, id, len(after))
	}
	e.check(got[0], id, op, st)
	for i, op := range after {
		e.check(got[1+i], id+1+uint64(i), op, transport.StatusFlushed)
	}
}

// testUnsignaledQueueDepth: unsignaled requests take room in the send
// queue until a later signaled request's completion is polled. What is
// checked does not depend on when the requests execute: room is only
// freed by polling.
func testUnsignaledQueueDepth(e *env) {
	depth := e.a.Limits().SendQueueDepth
	if depth < 3 {
		e.t.Skipf("send queue depth %d", depth)
	}
	la := e.region(e.a, 64, rw)
	rb := e.region(e.b, 64, all)
	w := func(id uint64, signaled bool) transport.WorkRequest {
		wr := rdmaWR(id, transport.OpWrite, la, 0, 1, rb, 0)
		wr.Unsignaled = !signaled
		return wr
	}
	// k unsignaled, A, m unsignaled, B: the whole queue.
	k := depth / 2
	m := depth - k - 2
	var wrs []transport.WorkRequest
	for i := range k {
		wrs = append(wrs, w(uint64(100+i), false))
	}
	wrs = append(wrs, w(1, true))
	for i := range m {
		wrs = append(wrs, w(uint64(200+i), false))
	}
	wrs = append(wrs, w(2, true))
	e.postSend(e.a, wrs...)
	full := func(when string) {
		e.t.Helper()
		if err := e.a.PostSend(w(999, true)); !errors.Is(err, transport.ErrQueueFull) {
			e.t.Fatalf("%s: post send: %v, want ErrQueueFull", when, err)
		}
	}
	full("a queue of unsignaled requests and their signaled ones")
	// Polling A frees A and the k before it, not the m after it.
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWrite, transport.StatusSuccess)
	wrs = wrs[:0]
	for i := range k {
		wrs = append(wrs, w(uint64(300+i), false))
	}
	wrs = append(wrs, w(3, true))
	e.postSend(e.a, wrs...)
	full("after the completion that covered the first requests")
	e.check(e.wait(e.a, 1)[0], 2, transport.OpWrite, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], 3, transport.OpWrite, transport.StatusSuccess)
	// All free again.
	wrs = wrs[:0]
	for i := range depth - 1 {
		wrs = append(wrs, w(uint64(400+i), false))
	}
	wrs = append(wrs, w(4, true))
	e.postSend(e.a, wrs...)
	full("a queue of unsignaled requests and a signaled one again")
	e.check(e.wait(e.a, 1)[0], 4, transport.OpWrite, transport.StatusSuccess)
}

// recorder is a completion handler that records what it is given. It
// checks that it is called from one goroutine at a time and that nothing
// comes after the final call.
type recorder struct {
	name   string
	inside atomic.Int32
	signal chan struct{} // a token after each call
	final  chan struct{} // closed by the final call

	mu         sync.Mutex
	comps      []transport.Completion
	finals     int
	finalErr   error
	compsAtEnd int // len(comps) at the final call
	problems   []string
	// hook, if set, runs in each call with completions, outside mu.
	hook func(cs []transport.Completion)
}

func newRecorder(name string) *recorder {
	return &recorder{name: name, signal: make(chan struct{}, 1), final: make(chan struct{})}
}

func (r *recorder) problem(s string) {
	r.mu.Lock()
	r.problems = append(r.problems, s)
	r.mu.Unlock()
}

func (r *recorder) handle(cs []transport.Completion, err error) {
	if r.inside.Add(1) != 1 {
		r.problem("called from two goroutines at once")
	}
	defer r.inside.Add(-1)
	r.mu.Lock()
	switch {
	case r.finals > 0:
		r.problems = append(r.problems, "called after the final call")
	case err != nil:
		if cs != nil {
			r.problems = append(r.problems, "final call with completions")
		}
		r.finals++
		r.finalErr = err
		r.compsAtEnd = len(r.comps)
		close(r.final)
	default:
		if len(cs) == 0 {
			r.problems = append(r.problems, "called with no completion and no error")
		}
		r.comps = append(r.comps, cs...)
	}
	hook := r.hook
	r.mu.Unlock()
	if err == nil && hook != nil {
		hook(cs)
	}
	select {
	case r.signal <- struct{}{}:
	default:
	}
}

// install makes r the handler of c, or skips the test.
func (e *env) install(c transport.Conn, r *recorder) {
	e.t.Helper()
	h, ok := c.(transport.CompletionHandler)
	if !ok {
		e.t.Skipf("SKIP: %T does not implement transport.CompletionHandler", c)
	}
	h.HandleCompletions(r.handle)
}

// waitComps waits until r has recorded n completions and returns them.
func (e *env) waitComps(r *recorder, n int) []transport.Completion {
	e.t.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		got := append([]transport.Completion(nil), r.comps...)
		finals := r.finals
		r.mu.Unlock()
		if len(got) >= n {
			return got
		}
		if finals > 0 {
			e.t.Fatalf("%s: the final call came after %d completions %+v, want %d", r.name, len(got), got, n)
		}
		select {
		case <-r.signal:
		case <-deadline.C:
			e.t.Fatalf("%s: %d completions %+v after %v, want %d", r.name, len(got), got, waitTimeout, n)
		}
	}
}

// waitFinal waits for the final call of r and checks it: once, with an
// error matching ErrClosed, after every completion. It returns the
// completions.
func (e *env) waitFinal(r *recorder) []transport.Completion {
	e.t.Helper()
	select {
	case <-r.final:
	case <-time.After(waitTimeout):
		e.t.Fatalf("%s: no final call after %v", r.name, waitTimeout)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !errors.Is(r.finalErr, transport.ErrClosed) {
		e.t.Errorf("%s: final call with %v, want ErrClosed", r.name, r.finalErr)
	}
	e.checkRecorderLocked(r)
	return append([]transport.Completion(nil), r.comps...)
}

func (e *env) checkRecorderLocked(r *recorder) {
	e.t.Helper()
	for _, p := range r.problems {
		e.t.Errorf("%s: handler %s", r.name, p)
	}
	r.problems = nil
	if r.finals > 0 && r.compsAtEnd != len(r.comps) {
		e.t.Errorf("%s: %d completions after the final call", r.name, len(r.comps)-r.compsAtEnd)
	}
}

// testHandlerTraffic: the traffic of testUnsignaledChain, with each side's
// completions delivered to a handler; b's is installed once a's SEND
// completed (its receive may be queued already: it is delivered first).
func testHandlerTraffic(e *env) {
	const size = 4096
	n := e.chainLen()
	src := e.region(e.a, 2*n*size, rw)
	dst := e.region(e.b, n*size, all)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	ra, rb := newRecorder("a"), newRecorder("b")
	e.install(e.a, ra)
	e.unsignaledChain(src, dst, ctlA, ctlB, n, size, 7, 50)
	got := e.waitComps(ra, 1)
	e.check(got[0], 7, transport.OpSend, transport.StatusSuccess)
	e.install(e.b, rb)
	e.check(e.waitComps(rb, 1)[0], 7, transport.OpRecv, transport.StatusSuccess)
	if !bytes.Equal(dst.Bytes(), src.Bytes()[:n*size]) || !bytes.Equal(src.Bytes()[n*size:], src.Bytes()[:n*size]) {
		e.t.Fatal("the data of the unsignaled WRITEs and READs is not in place after the SEND completed")
	}
	// And a second round, both handlers in place.
	e.unsignaledChain(src, dst, ctlA, ctlB, n, size, 8, 51)
	e.check(e.waitComps(rb, 2)[1], 8, transport.OpRecv, transport.StatusSuccess)
	e.check(e.waitComps(ra, 2)[1], 8, transport.OpSend, transport.StatusSuccess)
	if !bytes.Equal(dst.Bytes(), src.Bytes()[:n*size]) || !bytes.Equal(src.Bytes()[n*size:], src.Bytes()[:n*size]) {
		e.t.Fatal("round 2: the data is not in place after the SEND completed")
	}
	// Close a: its posted receives are flushed before its final call, and
	// b's final call comes once it sees the break.
	e.postRecv(e.a, recvRR(70, ctlA, 0, 16), recvRR(71, ctlA, 0, 16))
	if err := e.a.Close(); err != nil {
		e.t.Fatal(err)
	}
	all := e.waitFinal(ra)
	if len(all) != 4 {
		e.t.Fatalf("a: completions %+v, want 2 SENDs and 2 flushed receives", all)
	}
	e.check(all[2], 70, transport.OpRecv, transport.StatusFlushed)
	e.check(all[3], 71, transport.OpRecv, transport.StatusFlushed)
	if got := e.waitFinal(rb); len(got) != 2 {
		e.t.Errorf("b: completions %+v, want its 2 receives and nothing after the break", got)
	}
}

// testHandlerPingPong: a ping-pong driven entirely from the handlers: each
// reposts its receive and posts the next message from inside the call.
// b's handler also registers and deregisters memory on the first ping.
func testHandlerPingPong(e *env) {
	const rounds, size = 200, 8
	ra, rb := newRecorder("a"), newRecorder("b")
	bufA := e.region(e.a, 2*size, rw) // [0, size) out, [size, 2*size) in
	bufB := e.region(e.b, 2*size, rw)
	extra, err := transport.AllocMemory(4096, false)
	if err != nil {
		e.t.Fatal(err)
	}
	e.mu.Lock()
	e.mems = append(e.mems, extra)
	e.mu.Unlock()
	done := make(chan struct{})
	var next atomic.Uint64 // next ping number a sends
	ra.hook = func(cs []transport.Completion) {
		for _, c := range cs {
			if c.Op != transport.OpRecv || c.Status == transport.StatusFlushed {
				continue // flushed: the end, after the last round
			}
			if c.Status != transport.StatusSuccess {
				ra.problem("receive failed: " + c.Status.String())
				return
			}
			got := binary.LittleEndian.Uint64(bufA.Bytes()[size:])
			if want := next.Load() - 1; got != want {
				ra.problem("pong carries the wrong number")
			}
			if next.Load() == rounds {
				close(done)
				return
			}
			if err := e.a.PostRecv(recvRR(1, bufA, size, size)); err != nil {
				ra.problem("post recv: " + err.Error())
			}
			binary.LittleEndian.PutUint64(bufA.Bytes(), next.Add(1)-1)
			if err := e.a.PostSend(sendWR(2, bufA, 0, size)); err != nil {
				ra.problem("post send: " + err.Error())
			}
		}
	}
	first := true
	rb.hook = func(cs []transport.Completion) {
		for _, c := range cs {
			if c.Op != transport.OpRecv || c.Status == transport.StatusFlushed {
				continue // flushed: the end, after the last round
			}
			if c.Status != transport.StatusSuccess {
				rb.problem("receive failed: " + c.Status.String())
				return
			}
			if first {
				first = false
				r, err := e.b.Register(extra.Bytes(), rw)
				if err != nil {
					rb.problem("register: " + err.Error())
				} else if err := r.Deregister(); err != nil {
					rb.problem("deregister: " + err.Error())
				}
			}
			if err := e.b.PostRecv(recvRR(3, bufB, size, size)); err != nil {
				rb.problem("post recv: " + err.Error())
			}
			copy(bufB.Bytes()[:size], bufB.Bytes()[size:])
			if err := e.b.PostSend(sendWR(4, bufB, 0, size)); err != nil {
				rb.problem("post send: " + err.Error())
			}
		}
	}
	e.install(e.a, ra)
	e.install(e.b, rb)
	e.postRecv(e.b, recvRR(3, bufB, size, size))
	e.postRecv(e.a, recvRR(1, bufA, size, size))
	binary.LittleEndian.PutUint64(bufA.Bytes(), next.Add(1)-1)
	e.postSend(e.a, sendWR(2, bufA, 0, size))
	select {
	case <-done:
	case <-time.After(waitTimeout):
		e.t.Fatalf("ping-pong stalled after %d rounds", next.Load())
	}
	// a's last SEND completion may still be on its way; b's as well.
	gotA := e.waitComps(ra, 2*rounds)
	gotB := e.waitComps(rb, 2*rounds)
	for _, got := range [][]transport.Completion{gotA, gotB} {
		for _, c := range got {
			if c.Status != transport.StatusSuccess {
				e.t.Errorf("completion %+v", c)
			}
		}
	}
	e.a.Close()
	e.waitFinal(ra)
	e.waitFinal(rb)
}

// testHandlerFailure: the failure of testUnsignaledRemoteFailure, seen
// through handlers: the error, the flushed requests and receives, then
// the final call.
func testHandlerFailure(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	rbuf := e.region(e.b, 64, rw)
	abuf := e.region(e.a, 64, rw)
	ra, rr := newRecorder("a"), newRecorder("b")
	e.install(e.a, ra)
	e.install(e.b, rr)
	e.postRecv(e.b, recvRR(50, rbuf, 0, 64))
	e.postRecv(e.a, recvRR(60, abuf, 0, 64))
	bad := rdmaWR(2, transport.OpRead, la, 0, 8, rb, 0)
	bad.RKey ^= 0x5a5a5a5a
	e.postSend(e.a,
		unsignaled(rdmaWR(1, transport.OpWrite, la, 0, 8, rb, 0)),
		unsignaled(bad),
		unsignaled(rdmaWR(3, transport.OpWrite, la, 0, 8, rb, 0)),
		sendWR(4, la, 0, 8))
	sends, recvs := sendSide(e.waitFinal(ra))
	e.expectFailed(sends, 2, transport.OpRead, transport.StatusRemoteAccessError,
		[]transport.Opcode{transport.OpWrite, transport.OpSend})
	if len(recvs) != 1 || recvs[0].ID != 60 || recvs[0].Status != transport.StatusFlushed {
		e.t.Errorf("receives of a %+v, want 60 flushed", recvs)
	}
	got := e.waitFinal(rr)
	if len(got) != 1 || got[0].ID != 50 || got[0].Status != transport.StatusFlushed {
		e.t.Errorf("b: %+v, want its receive flushed", got)
	}
	if err := e.a.PostSend(sendWR(5, la, 0, 8)); !errors.Is(err, transport.ErrClosed) {
		e.t.Errorf("post send after the break: %v, want ErrClosed", err)
	}
}

// testHandlerCloseInside: a handler closes its own conn from inside the
// call; what was outstanding is flushed and the final call comes after
// the call returns.
func testHandlerCloseInside(e *env) {
	src := e.region(e.a, 64, rw)
	bbuf := e.region(e.b, 64, rw)
	ra, rb := newRecorder("a"), newRecorder("b")
	closed := make(chan error, 1)
	rb.hook = func(cs []transport.Completion) {
		for _, c := range cs {
			if c.ID == 1 && c.Status == transport.StatusSuccess {
				closed <- e.b.Close()
			}
		}
	}
	e.install(e.a, ra)
	e.install(e.b, rb)
	e.postRecv(e.b, recvRR(1, bbuf, 0, 16), recvRR(2, bbuf, 16, 16), recvRR(3, bbuf, 32, 16))
	e.postSend(e.a, sendWR(10, src, 0, 8))
	select {
	case err := <-closed:
		if err != nil {
			e.t.Errorf("close from the handler: %v", err)
		}
	case <-time.After(waitTimeout):
		e.t.Fatal("the handler did not get the receive")
	}
	got := e.waitFinal(rb)
	if len(got) != 3 {
		e.t.Fatalf("b: %+v, want the receive and two flushed", got)
	}
	e.check(got[0], 1, transport.OpRecv, transport.StatusSuccess)
	e.check(got[1], 2, transport.OpRecv, transport.StatusFlushed)
	e.check(got[2], 3, transport.OpRecv, transport.StatusFlushed)
	// a's SEND was delivered: it completes, successfully or flushed if the
	// close overtook its acknowledgement.
	gotA := e.waitFinal(ra)
	if len(gotA) != 1 || gotA[0].ID != 10 || (gotA[0].Status != transport.StatusSuccess && gotA[0].Status != transport.StatusFlushed) {
		e.t.Errorf("a: %+v, want its SEND completed or flushed", gotA)
	}
}
