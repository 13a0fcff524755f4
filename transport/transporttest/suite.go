package transporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
)

// waitTimeout bounds every wait of the suite for a completion.
const waitTimeout = 20 * time.Second

// Run runs the data-path conformance tests: each subtest makes a fresh pair
// of connected Conns with newPair (a dialed, b accepted, or the other way
// round) and checks the semantics the transport package documents. newPair
// should register cleanups that close both; the suite closes them too, and
// checks that no goroutine outlives a subtest.
func Run(t *testing.T, newPair func(t *testing.T) (a, b transport.Conn)) {
	for _, tc := range []struct {
		name string
		fn   func(e *env)
	}{
		{"Limits", testLimits},
		{"Register", testRegister},
		{"SendRecv", testSendRecv},
		{"SendBeforeRecv", testSendBeforeRecv},
		{"Write", testWrite},
		{"Read", testRead},
		{"LargeWriteRead", testLargeWriteRead},
		{"WriteImm", testWriteImm},
		{"OrderWritesThenSend", testOrderWritesThenSend},
		{"OrderWriteThenRead", testOrderWriteThenRead},
		{"CompletionOrder", testCompletionOrder},
		{"ReadsBeyondLimit", testReadsBeyondLimit},
		{"BadRKey", testBadRKey},
		{"OutOfBounds", testOutOfBounds},
		{"ReadWithoutRemoteRead", testReadWithoutRemoteRead},
		{"WriteWithoutRemoteWrite", testWriteWithoutRemoteWrite},
		{"Deregistered", testDeregistered},
		{"SendTooLarge", testSendTooLarge},
		{"LocalProtection", testLocalProtection},
		{"ReadIntoReadOnly", testReadIntoReadOnly},
		{"RecvIntoReadOnly", testRecvIntoReadOnly},
		{"ForeignRegion", testForeignRegion},
		{"QueueFull", testQueueFull},
		{"Concurrent", testConcurrent},
		{"PollContext", testPollContext},
		{"CloseTwice", testCloseTwice},
		{"CloseFlushes", testCloseFlushes},
		{"PeerClose", testPeerClose},
		{"RegisterFileMapping", testRegisterFileMapping},
	} {
		t.Run(tc.name, func(t *testing.T) {
			CheckGoroutines(t)
			e := newEnv(t, newPair)
			tc.fn(e)
		})
	}
	for _, tc := range windowTests {
		t.Run(tc.name, func(t *testing.T) {
			CheckGoroutines(t)
			e := newEnv(t, newPair)
			tc.fn(e)
		})
	}
	for _, tc := range signalTests {
		t.Run(tc.name, func(t *testing.T) {
			CheckGoroutines(t)
			e := newEnv(t, newPair)
			tc.fn(e)
		})
	}
}

// env is one subtest's pair of conns and the memory it allocated.
type env struct {
	t       *testing.T
	a, b    transport.Conn
	newPair func(t *testing.T) (a, b transport.Conn)

	mu   sync.Mutex
	mems []*transport.Memory
}

func newEnv(t *testing.T, newPair func(t *testing.T) (a, b transport.Conn)) *env {
	a, b := newPair(t)
	e := &env{t: t, a: a, b: b, newPair: newPair}
	// One cleanup closes the conns before the memory they may touch goes.
	t.Cleanup(func() {
		a.Close()
		b.Close()
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, m := range e.mems {
			m.Free()
		}
	})
	return e
}

// sub makes a fresh env for a subtest.
func (e *env) sub(t *testing.T) *env { return newEnv(t, e.newPair) }

// region allocates size bytes of mmap'd memory and registers them on c.
func (e *env) region(c transport.Conn, size int, access transport.Access) transport.Region {
	e.t.Helper()
	m, err := transport.AllocMemory(size, false)
	if err != nil {
		e.t.Fatal(err)
	}
	e.mu.Lock()
	e.mems = append(e.mems, m)
	e.mu.Unlock()
	r, err := c.Register(m.Bytes()[:size], access)
	if err != nil {
		e.t.Fatalf("register %d bytes %v: %v", size, access, err)
	}
	return r
}

const (
	rw  = transport.AccessLocalWrite
	all = transport.AccessLocalWrite | transport.AccessRemoteRead | transport.AccessRemoteWrite
)

func (e *env) postSend(c transport.Conn, wrs ...transport.WorkRequest) {
	e.t.Helper()
	if err := c.PostSend(wrs...); err != nil {
		e.t.Fatalf("post send: %v", err)
	}
}

func (e *env) postRecv(c transport.Conn, rrs ...transport.RecvRequest) {
	e.t.Helper()
	if err := c.PostRecv(rrs...); err != nil {
		e.t.Fatalf("post recv: %v", err)
	}
}

// wait polls exactly n completions from c.
func (e *env) wait(c transport.Conn, n int) []transport.Completion {
	e.t.Helper()
	got, err := poll(c, n)
	if err != nil {
		e.t.Fatalf("poll after %d of %d completions %+v: %v", len(got), n, got, err)
	}
	return got
}

func poll(c transport.Conn, n int) ([]transport.Completion, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var got []transport.Completion
	buf := make([]transport.Completion, 16)
	for len(got) < n {
		k, err := c.Poll(ctx, buf[:min(len(buf), n-len(got))])
		if err != nil {
			return got, err
		}
		got = append(got, buf[:k]...)
	}
	return got, nil
}

// drain polls c until it reports ErrClosed and returns what came before.
func (e *env) drain(c transport.Conn) []transport.Completion {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var got []transport.Completion
	buf := make([]transport.Completion, 16)
	for {
		k, err := c.Poll(ctx, buf)
		got = append(got, buf[:k]...)
		if errors.Is(err, transport.ErrClosed) {
			return got
		}
		if err != nil {
			e.t.Fatalf("poll until closed, after %+v: %v", got, err)
		}
	}
}

func (e *env) check(c transport.Completion, id uint64, op transport.Opcode, st transport.Status) {
	e.t.Helper()
	if c.ID != id || c.Op != op || c.Status != st {
		e.t.Errorf("completion %+v, want id %d %v %v", c, id, op, st)
	}
}

// broken checks that both conns of e broke: later work fails, posted
// receives are flushed and Poll ends with ErrClosed.
func (e *env) broken(recvsA, recvsB int) {
	e.t.Helper()
	for _, side := range []struct {
		name  string
		c     transport.Conn
		recvs int
	}{{"a", e.a, recvsA}, {"b", e.b, recvsB}} {
		got := e.drain(side.c)
		n := 0
		for _, c := range got {
			if c.Op == transport.OpRecv || c.Op == transport.OpRecvWriteImm {
				n++
				if c.Status != transport.StatusFlushed {
					e.t.Errorf("%s: receive %+v after the break, want flushed", side.name, c)
				}
			}
		}
		if n != side.recvs {
			e.t.Errorf("%s: %d receives flushed, want %d", side.name, n, side.recvs)
		}
		if err := side.c.PostSend(transport.WorkRequest{ID: 99, Op: transport.OpSend}); !errors.Is(err, transport.ErrClosed) {
			e.t.Errorf("%s: post send on a broken conn: %v, want ErrClosed", side.name, err)
		}
		if _, err := side.c.Poll(context.Background(), make([]transport.Completion, 1)); !errors.Is(err, transport.ErrClosed) {
			e.t.Errorf("%s: poll on a broken conn: %v, want ErrClosed", side.name, err)
		}
	}
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func sendWR(id uint64, r transport.Region, off, n int) transport.WorkRequest {
	return transport.WorkRequest{ID: id, Op: transport.OpSend, Local: transport.SGE{Region: r, Offset: off, Length: n}}
}

func rdmaWR(id uint64, op transport.Opcode, r transport.Region, off, n int, remote transport.Region, roff int) transport.WorkRequest {
	return transport.WorkRequest{
		ID: id, Op: op,
		Local:      transport.SGE{Region: r, Offset: off, Length: n},
		RemoteAddr: remote.Addr() + uint64(roff),
		RKey:       remote.RKey(),
	}
}

func recvRR(id uint64, r transport.Region, off, n int) transport.RecvRequest {
	return transport.RecvRequest{ID: id, Local: transport.SGE{Region: r, Offset: off, Length: n}}
}

func testLimits(e *env) {
	for _, c := range []transport.Conn{e.a, e.b} {
		l := c.Limits()
		if l.SendQueueDepth <= 0 || l.RecvQueueDepth <= 0 || l.MaxReadsInFlight <= 0 || l.MaxPrivateData <= 0 {
			e.t.Errorf("limits %+v: every one must be positive", l)
		}
	}
}

func testRegister(e *env) {
	if _, err := e.a.Register(nil, rw); err == nil {
		e.t.Error("registering an empty buffer succeeded")
	}
	if _, err := e.a.Register(make([]byte, 10), transport.AccessRemoteWrite); err == nil {
		e.t.Error("remote write access without local write access was accepted")
	}
	r1 := e.region(e.a, 4096, all)
	r2 := e.region(e.a, 4096, all)
	if r1.RKey() == r2.RKey() || r1.LKey() == r2.LKey() {
		e.t.Errorf("two regions share a key: %#x/%#x and %#x/%#x", r1.LKey(), r1.RKey(), r2.LKey(), r2.RKey())
	}
	if len(r1.Bytes()) != 4096 || r1.Access() != all {
		e.t.Errorf("region of %d bytes with %v, want 4096 with %v", len(r1.Bytes()), r1.Access(), all)
	}
	if err := r1.Deregister(); err != nil {
		e.t.Error(err)
	}
	if err := r1.Deregister(); err != nil {
		e.t.Errorf("second deregister: %v", err)
	}
	heap := make([]byte, 100)
	r3, err := e.a.Register(heap, transport.AccessLocalWrite|transport.AccessRemoteRead)
	if err != nil {
		e.t.Logf("heap memory refused (a hardware provider may): %v", err)
	} else if len(r3.Bytes()) != 100 {
		e.t.Errorf("heap region of %d bytes", len(r3.Bytes()))
	}
}

func testSendRecv(e *env) {
	src := e.region(e.a, 4096, rw)
	dst := e.region(e.b, 4096, rw)
	fill(src.Bytes(), 1)
	e.postRecv(e.b, recvRR(10, dst, 0, 1024), recvRR(11, dst, 1024, 1024), recvRR(12, dst, 2048, 1024), recvRR(13, dst, 3072, 1024))
	sizes := []int{5, 0, 1024, 1}
	for i, n := range sizes {
		e.postSend(e.a, sendWR(uint64(i+1), src, 100*i, n))
	}
	got := e.wait(e.b, len(sizes))
	for i, n := range sizes {
		e.check(got[i], uint64(10+i), transport.OpRecv, transport.StatusSuccess)
		if got[i].ByteLen != n {
			e.t.Errorf("receive %d: %d bytes, want %d", i, got[i].ByteLen, n)
		}
		if !bytes.Equal(dst.Bytes()[1024*i:1024*i+n], src.Bytes()[100*i:100*i+n]) {
			e.t.Errorf("receive %d: data differs", i)
		}
	}
	for i, c := range e.wait(e.a, len(sizes)) {
		e.check(c, uint64(i+1), transport.OpSend, transport.StatusSuccess)
	}
	// And the other way.
	e.postRecv(e.a, recvRR(20, src, 0, 64))
	copy(dst.Bytes(), "pong")
	e.postSend(e.b, sendWR(21, dst, 0, 4))
	c := e.wait(e.a, 1)[0]
	e.check(c, 20, transport.OpRecv, transport.StatusSuccess)
	if c.ByteLen != 4 || string(src.Bytes()[:4]) != "pong" {
		e.t.Errorf("got %q (%d bytes), want pong", src.Bytes()[:4], c.ByteLen)
	}
	e.check(e.wait(e.b, 1)[0], 21, transport.OpSend, transport.StatusSuccess)
}

// testSendBeforeRecv: a SEND arriving before its RECV waits for it (RNR).
func testSendBeforeRecv(e *env) {
	src := e.region(e.a, 64, rw)
	dst := e.region(e.b, 64, rw)
	copy(src.Bytes(), "early")
	e.postSend(e.a, sendWR(1, src, 0, 5))
	time.Sleep(50 * time.Millisecond)
	e.postRecv(e.b, recvRR(2, dst, 0, 64))
	e.check(e.wait(e.b, 1)[0], 2, transport.OpRecv, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], 1, transport.OpSend, transport.StatusSuccess)
	if string(dst.Bytes()[:5]) != "early" {
		e.t.Errorf("got %q", dst.Bytes()[:5])
	}
}

// notify sends a one-byte message from a to b and waits for it: after it,
// everything a posted before is placed at b.
func (e *env) notify(src, dst transport.Region, id uint64) {
	e.t.Helper()
	e.postRecv(e.b, recvRR(id, dst, 0, len(dst.Bytes())))
	e.postSend(e.a, sendWR(id, src, 0, 1))
	e.check(e.wait(e.b, 1)[0], id, transport.OpRecv, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], id, transport.OpSend, transport.StatusSuccess)
}

func testWrite(e *env) {
	src := e.region(e.a, 16384, rw)
	dst := e.region(e.b, 16384, all)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	fill(src.Bytes(), 2)
	e.postSend(e.a, rdmaWR(1, transport.OpWrite, src, 10, 4096, dst, 100), rdmaWR(2, transport.OpWrite, src, 0, 0, dst, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWrite, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], 2, transport.OpWrite, transport.StatusSuccess)
	e.notify(ctlA, ctlB, 3)
	d := dst.Bytes()
	if !bytes.Equal(d[100:4196], src.Bytes()[10:4106]) {
		e.t.Error("written data differs")
	}
	if bytes.ContainsFunc(d[:100], func(r rune) bool { return r != 0 }) || bytes.ContainsFunc(d[4196:], func(r rune) bool { return r != 0 }) {
		e.t.Error("bytes outside the written span changed")
	}
	// The last byte of the region.
	e.postSend(e.a, rdmaWR(4, transport.OpWrite, src, 0, 1, dst, 16383))
	e.check(e.wait(e.a, 1)[0], 4, transport.OpWrite, transport.StatusSuccess)
	e.notify(ctlA, ctlB, 5)
	if d[16383] != src.Bytes()[0] {
		e.t.Error("last byte not written")
	}
}

func testRead(e *env) {
	src := e.region(e.b, 16384, transport.AccessRemoteRead)
	dst := e.region(e.a, 16384, rw)
	fill(src.Bytes(), 3)
	e.postSend(e.a, rdmaWR(1, transport.OpRead, dst, 5, 8192, src, 17), rdmaWR(2, transport.OpRead, dst, 9000, 1, src, 16383))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpRead, transport.StatusSuccess)
	e.check(e.wait(e.a, 1)[0], 2, transport.OpRead, transport.StatusSuccess)
	if !bytes.Equal(dst.Bytes()[5:8197], src.Bytes()[17:8209]) {
		e.t.Error("read data differs")
	}
	if dst.Bytes()[9000] != src.Bytes()[16383] {
		e.t.Error("last byte not read")
	}
	if dst.Bytes()[4] != 0 || dst.Bytes()[8197] != 0 {
		e.t.Error("bytes outside the read span changed")
	}
}

// testLargeWriteRead moves several MiB each way in one request.
func testLargeWriteRead(e *env) {
	const size = 4 << 20
	la := e.region(e.a, 2*size, rw)
	rb := e.region(e.b, size, all)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	fill(la.Bytes()[:size], 4)
	e.postSend(e.a, rdmaWR(1, transport.OpWrite, la, 0, size, rb, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWrite, transport.StatusSuccess)
	e.notify(ctlA, ctlB, 2)
	if !bytes.Equal(rb.Bytes(), la.Bytes()[:size]) {
		e.t.Fatal("large write: data differs")
	}
	fill(rb.Bytes(), 5)
	e.postSend(e.a, rdmaWR(3, transport.OpRead, la, size, size, rb, 0))
	e.check(e.wait(e.a, 1)[0], 3, transport.OpRead, transport.StatusSuccess)
	if !bytes.Equal(rb.Bytes(), la.Bytes()[size:]) {
		e.t.Fatal("large read: data differs")
	}
}

func testWriteImm(e *env) {
	src := e.region(e.a, 4096, rw)
	dst := e.region(e.b, 4096, all)
	rbuf := e.region(e.b, 16, rw)
	fill(src.Bytes(), 6)
	e.postRecv(e.b, recvRR(7, rbuf, 0, 16))
	wr := rdmaWR(1, transport.OpWriteImm, src, 0, 100, dst, 50)
	wr.Imm = 0xdeadbeef
	e.postSend(e.a, wr)
	c := e.wait(e.b, 1)[0]
	e.check(c, 7, transport.OpRecvWriteImm, transport.StatusSuccess)
	if c.ByteLen != 100 || c.Imm != 0xdeadbeef {
		e.t.Errorf("completion %+v, want 100 bytes with imm 0xdeadbeef", c)
	}
	if !bytes.Equal(dst.Bytes()[50:150], src.Bytes()[:100]) {
		e.t.Error("data of the write with immediate differs")
	}
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWriteImm, transport.StatusSuccess)
}

// testOrderWritesThenSend: when the RECV of a SEND posted after WRITEs
// completes, the data of all the WRITEs is placed.
func testOrderWritesThenSend(e *env) {
	const size = 4096
	n := min(64, e.a.Limits().SendQueueDepth-1)
	src := e.region(e.a, n*size, rw)
	dst := e.region(e.b, n*size, all)
	ctlA := e.region(e.a, 16, rw)
	ctlB := e.region(e.b, 16, rw)
	for round := range 3 {
		fill(src.Bytes(), uint64(10+round))
		e.postRecv(e.b, recvRR(1000, ctlB, 0, 16))
		for i := range n {
			e.postSend(e.a, rdmaWR(uint64(i), transport.OpWrite, src, i*size, size, dst, i*size))
		}
		e.postSend(e.a, sendWR(uint64(n), ctlA, 0, 1))
		e.check(e.wait(e.b, 1)[0], 1000, transport.OpRecv, transport.StatusSuccess)
		if !bytes.Equal(dst.Bytes(), src.Bytes()) {
			e.t.Fatalf("round %d: the SEND arrived before the data of the WRITEs before it", round)
		}
		for i, c := range e.wait(e.a, n+1) {
			op := transport.OpWrite
			if i == n {
				op = transport.OpSend
			}
			e.check(c, uint64(i), op, transport.StatusSuccess)
		}
	}
}

// testOrderWriteThenRead: a READ posted after a WRITE of the same span sees
// the written data.
func testOrderWriteThenRead(e *env) {
	la := e.region(e.a, 8192, rw)
	rb := e.region(e.b, 4096, all)
	for round := range 20 {
		fill(la.Bytes()[:4096], uint64(100+round))
		e.postSend(e.a,
			rdmaWR(1, transport.OpWrite, la, 0, 4096, rb, 0),
			rdmaWR(2, transport.OpRead, la, 4096, 4096, rb, 0))
		got := e.wait(e.a, 2)
		e.check(got[0], 1, transport.OpWrite, transport.StatusSuccess)
		e.check(got[1], 2, transport.OpRead, transport.StatusSuccess)
		if !bytes.Equal(la.Bytes()[:4096], la.Bytes()[4096:]) {
			e.t.Fatalf("round %d: the READ did not see the WRITE before it", round)
		}
	}
}

// testCompletionOrder: send-queue completions come in posting order, READs
// and WRITEs and SENDs mixed.
func testCompletionOrder(e *env) {
	la := e.region(e.a, 1<<20, rw)
	rb := e.region(e.b, 1<<20, all)
	rbuf := e.region(e.b, 64<<10, rw)
	var wrs []transport.WorkRequest
	recvs := 0
	for i := range min(200, e.a.Limits().SendQueueDepth) {
		id := uint64(i)
		kind := i % 4
		if kind >= 2 && recvs == e.b.Limits().RecvQueueDepth {
			kind -= 2 // no receive left for it
		}
		switch kind {
		case 0:
			wrs = append(wrs, rdmaWR(id, transport.OpRead, la, (1+i%15)*65536, 1+i*97%65535, rb, 0))
		case 1:
			wrs = append(wrs, rdmaWR(id, transport.OpWrite, la, 0, 1+i*31%4096, rb, 4096))
		case 2:
			wrs = append(wrs, sendWR(id, la, 0, i%64))
			recvs++
		case 3:
			wr := rdmaWR(id, transport.OpWriteImm, la, 0, 16, rb, 8192)
			wr.Imm = uint32(i)
			wrs = append(wrs, wr)
			recvs++
		}
	}
	for i := range recvs {
		e.postRecv(e.b, recvRR(uint64(i), rbuf, 0, 64))
	}
	e.postSend(e.a, wrs...)
	for i, c := range e.wait(e.a, len(wrs)) {
		e.check(c, wrs[i].ID, wrs[i].Op, transport.StatusSuccess)
	}
	for i, c := range e.wait(e.b, recvs) {
		if c.ID != uint64(i) || c.Status != transport.StatusSuccess {
			e.t.Errorf("receive %d: %+v", i, c)
		}
	}
}

// testReadsBeyondLimit posts more READs than MaxReadsInFlight at once: they
// all complete, in order.
func testReadsBeyondLimit(e *env) {
	n := min(e.a.Limits().MaxReadsInFlight*3+5, e.a.Limits().SendQueueDepth)
	la := e.region(e.a, n*64, rw)
	rb := e.region(e.b, n*64, transport.AccessRemoteRead)
	fill(rb.Bytes(), 7)
	wrs := make([]transport.WorkRequest, n)
	for i := range wrs {
		wrs[i] = rdmaWR(uint64(i), transport.OpRead, la, i*64, 64, rb, (n-1-i)*64)
	}
	e.postSend(e.a, wrs...)
	for i, c := range e.wait(e.a, n) {
		e.check(c, uint64(i), transport.OpRead, transport.StatusSuccess)
	}
	for i := range n {
		if !bytes.Equal(la.Bytes()[i*64:i*64+64], rb.Bytes()[(n-1-i)*64:(n-i)*64]) {
			e.t.Fatalf("read %d: data differs", i)
		}
	}
}

// refused posts [good WRITE, bad, good WRITE] and checks they complete
// success, remote access error, flushed; then that both sides broke.
func (e *env) refused(bad transport.WorkRequest, la transport.Region, rb transport.Region) {
	e.t.Helper()
	rbuf := e.region(e.b, 64, rw)
	abuf := e.region(e.a, 64, rw)
	e.postRecv(e.b, recvRR(50, rbuf, 0, 64), recvRR(51, rbuf, 0, 64))
	e.postRecv(e.a, recvRR(60, abuf, 0, 64))
	e.refusedBetween(bad, la, rb)
	e.broken(1, 2)
}

// refusedBetween posts [good WRITE, bad, good WRITE] from a and checks
// they complete success, remote access error, flushed.
func (e *env) refusedBetween(bad transport.WorkRequest, la, rb transport.Region) {
	e.t.Helper()
	good := rdmaWR(1, transport.OpWrite, la, 0, 8, rb, 0)
	bad.ID = 2
	after := rdmaWR(3, transport.OpWrite, la, 0, 8, rb, 0)
	e.postSend(e.a, good, bad, after)
	got := e.wait(e.a, 3)
	e.check(got[0], 1, transport.OpWrite, transport.StatusSuccess)
	e.check(got[1], 2, bad.Op, transport.StatusRemoteAccessError)
	if err := got[1].Err(); !errors.Is(err, transport.ErrRemoteAccess) {
		e.t.Errorf("completion error %v does not match ErrRemoteAccess", err)
	}
	e.check(got[2], 3, transport.OpWrite, transport.StatusFlushed)
}

func testBadRKey(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	bad := rdmaWR(0, transport.OpWrite, la, 0, 8, rb, 0)
	bad.RKey ^= 0x5a5a5a5a
	e.refused(bad, la, rb)
}

func testOutOfBounds(e *env) {
	for _, tc := range []struct {
		name    string
		op      transport.Opcode
		off     int
		n       int
		below   bool
		newPair bool
	}{
		{name: "WriteBeyondEnd", op: transport.OpWrite, off: 4096 - 10, n: 20},
		{name: "ReadBeyondEnd", op: transport.OpRead, off: 4090, n: 7},
		{name: "WriteBelowStart", op: transport.OpWrite, n: 8, below: true},
		{name: "ReadPastEnd", op: transport.OpRead, off: 4096, n: 1},
	} {
		e.t.Run(tc.name, func(t *testing.T) {
			// Each case breaks a connection: it needs a fresh pair.
			sub := e.sub(t)
			la := sub.region(sub.a, 4096, rw)
			rb := sub.region(sub.b, 4096, all)
			bad := rdmaWR(0, tc.op, la, 0, tc.n, rb, tc.off)
			if tc.below {
				bad.RemoteAddr = rb.Addr() - 4
			}
			sub.refused(bad, la, rb)
		})
	}
}

func testReadWithoutRemoteRead(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, transport.AccessLocalWrite|transport.AccessRemoteWrite)
	e.refused(rdmaWR(0, transport.OpRead, la, 0, 8, rb, 0), la, rb)
}

func testWriteWithoutRemoteWrite(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	ro := e.region(e.b, 4096, transport.AccessLocalWrite|transport.AccessRemoteRead)
	e.refused(rdmaWR(0, transport.OpWrite, la, 0, 8, ro, 0), la, rb)
}

func testDeregistered(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	gone := e.region(e.b, 4096, all)
	// It works while registered.
	e.postSend(e.a, rdmaWR(9, transport.OpRead, la, 0, 8, gone, 0))
	e.check(e.wait(e.a, 1)[0], 9, transport.OpRead, transport.StatusSuccess)
	if err := gone.Deregister(); err != nil {
		e.t.Fatal(err)
	}
	e.refused(rdmaWR(0, transport.OpWrite, la, 0, 8, gone, 0), la, rb)
}

func testSendTooLarge(e *env) {
	src := e.region(e.a, 64, rw)
	dst := e.region(e.b, 64, rw)
	e.postRecv(e.b, recvRR(1, dst, 0, 16), recvRR(2, dst, 16, 16))
	e.postSend(e.a, sendWR(10, src, 0, 32), sendWR(11, src, 0, 1))
	got := e.wait(e.a, 2)
	if got[0].ID != 10 || got[0].Status == transport.StatusSuccess || got[0].Status == transport.StatusFlushed {
		e.t.Errorf("oversized send completed %+v, want an error other than flushed", got[0])
	}
	e.check(got[1], 11, transport.OpSend, transport.StatusFlushed)
	rc := e.drain(e.b)
	if len(rc) != 2 {
		e.t.Fatalf("receiver got %+v, want 2 completions", rc)
	}
	e.check(rc[0], 1, transport.OpRecv, transport.StatusLocalLengthError)
	e.check(rc[1], 2, transport.OpRecv, transport.StatusFlushed)
	e.broken(0, 0)
}

// testLocalProtection: a local SGE outside its region fails the request
// with StatusLocalProtectionError and breaks the connection.
func testLocalProtection(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	bad := rdmaWR(2, transport.OpWrite, la, 4000, 200, rb, 0)
	e.postSend(e.a, rdmaWR(1, transport.OpWrite, la, 0, 8, rb, 0), bad, rdmaWR(3, transport.OpWrite, la, 0, 8, rb, 0))
	got := e.wait(e.a, 3)
	e.check(got[0], 1, transport.OpWrite, transport.StatusSuccess)
	e.check(got[1], 2, transport.OpWrite, transport.StatusLocalProtectionError)
	e.check(got[2], 3, transport.OpWrite, transport.StatusFlushed)
	e.broken(0, 0)
}

func testReadIntoReadOnly(e *env) {
	ro := e.region(e.a, 4096, transport.AccessRemoteRead)
	rb := e.region(e.b, 4096, all)
	e.postSend(e.a, rdmaWR(1, transport.OpRead, ro, 0, 8, rb, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpRead, transport.StatusLocalProtectionError)
	e.broken(0, 0)
}

func testRecvIntoReadOnly(e *env) {
	ro := e.region(e.b, 4096, transport.AccessRemoteRead)
	e.postRecv(e.b, recvRR(1, ro, 0, 64))
	got := e.drain(e.b)
	if len(got) != 1 {
		e.t.Fatalf("got %+v, want one completion", got)
	}
	e.check(got[0], 1, transport.OpRecv, transport.StatusLocalProtectionError)
	e.broken(0, 0)
}

// testForeignRegion: a region of one conn cannot be used through another.
func testForeignRegion(e *env) {
	foreign := e.region(e.b, 4096, all)
	rb := e.region(e.b, 4096, all)
	e.postSend(e.a, rdmaWR(1, transport.OpWrite, foreign, 0, 8, rb, 0))
	e.check(e.wait(e.a, 1)[0], 1, transport.OpWrite, transport.StatusLocalProtectionError)
	e.broken(0, 0)
}

func testQueueFull(e *env) {
	la := e.region(e.a, 4096, rw)
	rb := e.region(e.b, 4096, all)
	depth := e.a.Limits().SendQueueDepth
	for i := range depth {
		e.postSend(e.a, rdmaWR(uint64(i), transport.OpWrite, la, 0, 1, rb, 0))
	}
	if err := e.a.PostSend(rdmaWR(uint64(depth), transport.OpWrite, la, 0, 1, rb, 0)); !errors.Is(err, transport.ErrQueueFull) {
		e.t.Fatalf("post send past the depth %d: %v, want ErrQueueFull", depth, err)
	}
	for i, c := range e.wait(e.a, depth) {
		e.check(c, uint64(i), transport.OpWrite, transport.StatusSuccess)
	}
	e.postSend(e.a, rdmaWR(1, transport.OpWrite, la, 0, 1, rb, 0))
	e.wait(e.a, 1)

	rdepth := e.b.Limits().RecvQueueDepth
	for i := range rdepth {
		e.postRecv(e.b, recvRR(uint64(i), rb, 0, 1))
	}
	if err := e.b.PostRecv(recvRR(uint64(rdepth), rb, 0, 1)); !errors.Is(err, transport.ErrQueueFull) {
		e.t.Fatalf("post recv past the depth %d: %v, want ErrQueueFull", rdepth, err)
	}
}

// testConcurrent: goroutines post WRITEs and READs on one conn at once while
// one goroutine polls and dispatches completions.
func testConcurrent(e *env) {
	const workers, rounds = 8, 100
	done := make([]chan transport.Completion, workers)
	for i := range done {
		done[i] = make(chan transport.Completion, 4)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var pollErr error
	pollerDone := make(chan struct{})
	go func() {
		defer close(pollerDone)
		out := make([]transport.Completion, 32)
		for left := 2 * workers * rounds; left > 0; {
			n, err := e.a.Poll(ctx, out)
			if err != nil {
				pollErr = err
				return
			}
			for _, c := range out[:n] {
				done[c.ID>>32] <- c
			}
			left -= n
		}
	}()
	e.concurrent(workers, rounds, done, pollerDone, func() error { return pollErr })
	cancel()
	<-pollerDone
}

// testHandlerConcurrent is testConcurrent with a's completions dispatched
// by a completion handler, which the workers' posts meet at any point.
func testHandlerConcurrent(e *env) {
	const workers, rounds = 8, 100
	done := make([]chan transport.Completion, workers)
	for i := range done {
		done[i] = make(chan transport.Completion, 4) // 2 outstanding per worker: never full
	}
	r := newRecorder("a")
	ended := make(chan struct{})
	r.hook = func(cs []transport.Completion) {
		for _, c := range cs {
			done[c.ID>>32] <- c
		}
	}
	e.install(e.a, r)
	go func() {
		<-r.final
		close(ended)
	}()
	e.concurrent(workers, rounds, done, ended, func() error { return r.finalErr })
	e.a.Close()
	e.waitFinal(r)
}

// concurrent runs workers goroutines that each post, rounds times, a
// WRITE and a READ of the same span of b and check what they read back.
// done[w] gets worker w's completions; ended is closed if they stop
// coming, with endErr() saying why.
func (e *env) concurrent(workers, rounds int, done []chan transport.Completion, ended chan struct{}, endErr func() error) {
	const span = 2048
	la := e.region(e.a, 2*workers*span, rw)
	rb := e.region(e.b, workers*span, all)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := la.Bytes()[2*w*span : (2*w+1)*span]
			dst := la.Bytes()[(2*w+1)*span : (2*w+2)*span]
			for r := range rounds {
				fill(src, uint64(w*rounds+r))
				id := uint64(w)<<32 | uint64(2*r)
				wrs := []transport.WorkRequest{
					rdmaWR(id, transport.OpWrite, la, 2*w*span, span, rb, w*span),
					rdmaWR(id+1, transport.OpRead, la, (2*w+1)*span, span, rb, w*span),
				}
				for {
					err := e.a.PostSend(wrs...)
					if errors.Is(err, transport.ErrQueueFull) {
						time.Sleep(time.Millisecond)
						continue
					}
					if err != nil {
						errs <- fmt.Errorf("worker %d: post: %w", w, err)
						return
					}
					break
				}
				for k := range 2 {
					var c transport.Completion
					select {
					case c = <-done[w]:
					case <-ended:
						select {
						case c = <-done[w]:
						default:
							errs <- fmt.Errorf("worker %d: completions ended: %v", w, endErr())
							return
						}
					}
					if c.ID != id+uint64(k) || c.Status != transport.StatusSuccess {
						errs <- fmt.Errorf("worker %d round %d: completion %+v, want id %#x", w, r, c, id+uint64(k))
						return
					}
				}
				if !bytes.Equal(src, dst) {
					errs <- fmt.Errorf("worker %d round %d: read back differs from written", w, r)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		e.t.Error(err)
	}
}

func testPollContext(e *env) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := e.a.Poll(ctx, make([]transport.Completion, 4)); !errors.Is(err, context.DeadlineExceeded) {
		e.t.Errorf("poll with nothing to complete: %v, want deadline exceeded", err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	go func() {
		time.Sleep(10 * time.Millisecond)
		cancel()
	}()
	if _, err := e.a.Poll(ctx, make([]transport.Completion, 4)); !errors.Is(err, context.Canceled) {
		e.t.Errorf("poll canceled: %v, want canceled", err)
	}
}

func testCloseTwice(e *env) {
	if err := e.a.Close(); err != nil {
		e.t.Errorf("close: %v", err)
	}
	if err := e.a.Close(); err != nil {
		e.t.Errorf("second close: %v", err)
	}
	if _, err := e.a.Poll(context.Background(), make([]transport.Completion, 1)); !errors.Is(err, transport.ErrClosed) {
		e.t.Errorf("poll after close: %v, want ErrClosed", err)
	}
	if err := e.a.PostRecv(); !errors.Is(err, transport.ErrClosed) {
		e.t.Errorf("post recv after close: %v, want ErrClosed", err)
	}
	e.broken(0, 0)
}

// testCloseFlushes closes a conn with requests in flight: each completes,
// successfully or flushed, before Poll reports ErrClosed.
func testCloseFlushes(e *env) {
	const size = 64 << 10
	n := min(64, e.a.Limits().SendQueueDepth)
	la := e.region(e.a, n*size, rw)
	rb := e.region(e.b, n*size, all)
	abuf := e.region(e.a, 64, rw)
	e.postRecv(e.a, recvRR(1000, abuf, 0, 64), recvRR(1001, abuf, 0, 64))
	for i := range n {
		op := transport.OpWrite
		if i%2 == 1 {
			op = transport.OpRead
		}
		e.postSend(e.a, rdmaWR(uint64(i), op, la, i*size, size, rb, i*size))
	}
	if err := e.a.Close(); err != nil {
		e.t.Fatal(err)
	}
	// After Close returns the buffers are the caller's again.
	clear(la.Bytes())
	got := e.drain(e.a)
	seen := map[uint64]bool{}
	for _, c := range got {
		seen[c.ID] = true
		if c.Status != transport.StatusSuccess && c.Status != transport.StatusFlushed {
			e.t.Errorf("completion %+v after close, want success or flushed", c)
		}
		if c.ID >= 1000 && c.Status != transport.StatusFlushed {
			e.t.Errorf("receive %+v after close, want flushed", c)
		}
	}
	if len(got) != n+2 || len(seen) != n+2 {
		e.t.Errorf("%d completions (%d distinct) after close, want %d", len(got), len(seen), n+2)
	}
	e.broken(0, 0)
}

// testPeerClose: when one side closes, the other breaks and flushes.
func testPeerClose(e *env) {
	bbuf := e.region(e.b, 64, rw)
	e.postRecv(e.b, recvRR(1, bbuf, 0, 64), recvRR(2, bbuf, 0, 64))
	e.a.Close()
	got := e.drain(e.b)
	if len(got) != 2 {
		e.t.Fatalf("got %+v, want 2 flushed receives", got)
	}
	e.check(got[0], 1, transport.OpRecv, transport.StatusFlushed)
	e.check(got[1], 2, transport.OpRecv, transport.StatusFlushed)
	e.broken(0, 0)
}
