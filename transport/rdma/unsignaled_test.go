//go:build linux

package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// Selective signaling, completion vectors and huge pages on a device
// (Soft-RoCE in the VM), or over the fake device where there is none.

// devEnv is a connected pair with memory: la (local write) on a, rb
// (remote read and write) on b, each size bytes.
type devEnv struct {
	a, b   transport.Conn
	ca     *conn
	la, rb transport.Region
	mem    *transport.Memory
}

func newDevEnv(t testing.TB, opts Options, size int) *devEnv {
	t.Helper()
	p, ip := deviceOrFake(t, opts)
	m, err := transport.AllocMemory(2*size, false)
	if err != nil {
		t.Fatal(err)
	}
	a, b := transporttest.Connect(t, p, net.JoinHostPort(ip, "0"))
	t.Cleanup(func() {
		a.Close()
		b.Close()
		m.Free()
	})
	la, err := a.Register(m.Bytes()[:size], transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Register(m.Bytes()[size:], transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	return &devEnv{a: a, b: b, ca: a.(*conn), la: la, rb: rb, mem: m}
}

// write is an RDMA WRITE of n bytes at off of la to off of rb.
func (e *devEnv) write(id uint64, off, n int, unsignaled bool) transport.WorkRequest {
	return transport.WorkRequest{ID: id, Op: transport.OpWrite, Local: transport.SGE{Region: e.la, Offset: off, Length: n},
		RemoteAddr: e.rb.Addr() + uint64(off), RKey: e.rb.RKey(), Unsignaled: unsignaled}
}

// pollFor polls c for up to d and returns what came, and the error that
// ended it (context.DeadlineExceeded when d passed).
func pollFor(c transport.Conn, d time.Duration) ([]transport.Completion, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var got []transport.Completion
	out := make([]transport.Completion, 16)
	for {
		n, err := c.Poll(ctx, out)
		got = append(got, out[:n]...)
		if err != nil {
			return got, err
		}
	}
}

func (e *devEnv) stats() sigStats {
	e.ca.sq.mu.Lock()
	defer e.ca.sq.mu.Unlock()
	return e.ca.sigStats
}

func fillPattern(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7)
	}
}

// TestVerbsUnsignaledChain: a chain of unsignaled RDMA WRITEs ended by a
// signaled SEND yields one completion, the SEND's, and the peer finds the
// data of every WRITE when the SEND arrives.
func TestVerbsUnsignaledChain(t *testing.T) {
	const n, size = 15, 4096
	e := newDevEnv(t, Options{}, (n+1)*size)
	src := e.la.Bytes()
	for i := range n {
		fillPattern(src[i*size:(i+1)*size], byte(i+1))
	}
	if err := e.b.PostRecv(transport.RecvRequest{ID: 500, Local: transport.SGE{Region: e.rb, Offset: n * size, Length: 64}}); err != nil {
		t.Fatal(err)
	}
	wrs := make([]transport.WorkRequest, 0, n+1)
	for i := range n {
		wrs = append(wrs, e.write(uint64(i), i*size, size, true))
	}
	copy(src[n*size:], "done")
	wrs = append(wrs, transport.WorkRequest{ID: 99, Op: transport.OpSend, Local: transport.SGE{Region: e.la, Offset: n * size, Length: 4}})
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	got := pollN(t, e.a, 1)
	if got[0].ID != 99 || got[0].Op != transport.OpSend || got[0].Status != transport.StatusSuccess {
		t.Fatalf("completion %+v, want the SEND's", got[0])
	}
	recv := pollN(t, e.b, 1)
	if recv[0].ID != 500 || recv[0].Status != transport.StatusSuccess || recv[0].ByteLen != 4 {
		t.Fatalf("receive %+v", recv[0])
	}
	if !bytes.Equal(e.rb.Bytes()[:n*size], src[:n*size]) {
		t.Error("the data of the unsignaled WRITEs did not arrive before the SEND")
	}
	if more, err := pollFor(e.a, 200*time.Millisecond); len(more) > 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("more completions %+v (%v) after the SEND's", more, err)
	}
	ringEmpty(t, e.ca)
	st := e.stats()
	if st.covered != n {
		t.Errorf("stats %+v: want the %d WRITEs covered by the SEND", st, n)
	}
}

// TestVerbsUnsignaledBadRKey: an unsignaled RDMA WRITE with a bad rkey
// completes with the error; the unsignaled WRITE before it succeeded and
// completes nothing; the requests after it, signaled or not, complete
// flushed; then Poll reports ErrClosed.
func TestVerbsUnsignaledBadRKey(t *testing.T) {
	const size = 4096
	e := newDevEnv(t, Options{}, 8*size)
	dead, err := e.b.Register(e.mem.Bytes()[8*size+4*size:8*size+5*size], transport.AccessLocalWrite|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	badKey := dead.RKey()
	if err := dead.Deregister(); err != nil {
		t.Fatal(err)
	}
	fillPattern(e.la.Bytes(), 3)
	bad := e.write(1, size, size, true)
	bad.RKey = badKey
	wrs := []transport.WorkRequest{
		e.write(0, 0, size, true),
		bad,
		e.write(2, 2*size, size, true),
		e.write(3, 3*size, size, false),
		e.write(4, 4*size, size, true),
		e.write(5, 5*size, size, true),
	}
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	got, err := pollFor(e.a, 10*time.Second)
	if !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("poll ended with %v after %+v, want ErrClosed", err, got)
	}
	want := []transport.Status{transport.StatusRemoteAccessError, transport.StatusFlushed, transport.StatusFlushed, transport.StatusFlushed, transport.StatusFlushed}
	if len(got) != len(want) {
		t.Fatalf("completions %+v, want ids 1-5: %v", got, want)
	}
	for i, c := range got {
		if c.ID != uint64(i+1) || c.Status != want[i] {
			t.Errorf("completion %d: %+v, want id %d %v", i, c, i+1, want[i])
		}
	}
	if !bytes.Equal(e.rb.Bytes()[:size], e.la.Bytes()[:size]) {
		t.Error("the unsignaled WRITE before the bad one did not arrive")
	}
	st := e.stats()
	t.Logf("selective signaling stats %+v; device reports flushed unsignaled requests: %v", st, st.reported == 4)
	// The device itself reported the failed one and the three flushed
	// unsignaled ones (rxe does; a device that did not would have them
	// covered by the signaled one's flush, as flushed, on a device
	// without unsigFlushes).
	if e.ca.unsigFlushes && st.reported != 4 {
		t.Errorf("the device reported %d completions of unsignaled requests, want 4 (the failed one and 3 flushed)", st.reported)
	}
}

// TestVerbsUnsignaledDepth: unsignaled requests count in SendQueueDepth
// until a signaled one after them completes and is polled.
func TestVerbsUnsignaledDepth(t *testing.T) {
	const depth, size = 8, 512
	e := newDevEnv(t, Options{SendQueueDepth: depth}, depth*size)
	if got := e.a.Limits().SendQueueDepth; got != depth {
		t.Fatalf("SendQueueDepth %d, want %d", got, depth)
	}
	wrs := make([]transport.WorkRequest, depth)
	for i := range wrs {
		wrs[i] = e.write(uint64(i), i*size, size, i < depth-1)
	}
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // they executed, but nothing was polled
	if err := e.a.PostSend(e.write(100, 0, size, true)); !errors.Is(err, transport.ErrQueueFull) {
		t.Fatalf("post with %d unsignaled and 1 signaled request outstanding: %v, want ErrQueueFull", depth-1, err)
	}
	got := pollN(t, e.a, 1)
	if got[0].ID != depth-1 || got[0].Status != transport.StatusSuccess {
		t.Fatalf("completion %+v", got[0])
	}
	// All the room is back: a whole queue of unsignaled requests (the
	// last goes signaled, its success not returned).
	for i := range wrs {
		wrs[i].Unsignaled = true
	}
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatalf("post %d after the signaled one was polled: %v", depth, err)
	}
	if got, err := pollFor(e.a, 300*time.Millisecond); len(got) > 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("completions %+v (%v) of unsignaled requests that succeeded", got, err)
	}
	ringEmpty(t, e.ca)
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatalf("post %d more: %v", depth, err)
	}
	if st := e.stats(); st.hidden != 1 {
		t.Errorf("stats %+v: want 1 request signaled to end a run of %d", st, depth)
	}
}

// TestVerbsUnsignaledPeerClose: unsignaled WRITEs that succeeded, with
// nothing signaled after them, then the peer disconnects: Poll reports no
// completion and ErrClosed (the drain request covers them).
func TestVerbsUnsignaledPeerClose(t *testing.T) {
	const n, size = 3, 4096
	e := newDevEnv(t, Options{}, n*size)
	fillPattern(e.la.Bytes(), 9)
	for i := range n {
		if err := e.a.PostSend(e.write(uint64(i), i*size, size, true)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for !bytes.Equal(e.rb.Bytes(), e.la.Bytes()) {
		if time.Now().After(deadline) {
			t.Fatal("the WRITEs did not arrive")
		}
		time.Sleep(time.Millisecond)
	}
	e.b.Close()
	got, err := pollFor(e.a, 10*time.Second)
	if len(got) > 0 || !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("after the peer closed: completions %+v, %v; want none and ErrClosed", got, err)
	}
	st := e.stats()
	e.ca.sq.mu.Lock()
	drain := e.ca.drain
	e.ca.sq.mu.Unlock()
	t.Logf("stats %+v, drain %v", st, drain)
	if st.covered != n || drain != drainDone {
		t.Errorf("stats %+v, drain %v: want %d covered by the drain request", st, drain, n)
	}
	start := time.Now()
	e.a.Close()
	if d := time.Since(start); d > flushTimeout/2 {
		t.Errorf("Close took %v", d)
	}
}

// TestVerbsUnsignaledClose: Close with unsignaled requests outstanding
// does not wait for flushTimeout.
func TestVerbsUnsignaledClose(t *testing.T) {
	const n, size = 4, 4096
	e := newDevEnv(t, Options{}, n*size)
	for i := range n {
		if err := e.a.PostSend(e.write(uint64(i), i*size, size, true)); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	e.a.Close()
	if d := time.Since(start); d > flushTimeout/2 {
		t.Errorf("Close took %v", d)
	}
	got, err := pollFor(e.a, 5*time.Second)
	if !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("poll after close: %v", err)
	}
	// Each either succeeded (nothing) or was flushed.
	for _, c := range got {
		if c.Status != transport.StatusFlushed {
			t.Errorf("completion %+v after close", c)
		}
	}
	t.Logf("%d of %d unsignaled WRITEs reported flushed after Close; stats %+v", len(got), n, e.stats())
}

// TestVerbsUnsignaledFlushedByClose: unsignaled WRITEs held behind a SEND
// that waits for a receive the peer never posts (RNR retried forever) are
// flushed by Close, and each is reported so: by the device itself on rxe
// (which reports every flushed request, signaled or not).
func TestVerbsUnsignaledFlushedByClose(t *testing.T) {
	const n, size = 3, 4096
	e := newDevEnv(t, Options{}, (n+1)*size)
	wrs := []transport.WorkRequest{{ID: 100, Op: transport.OpSend, Local: transport.SGE{Region: e.la, Offset: n * size, Length: 16}}}
	for i := range n {
		wrs = append(wrs, e.write(uint64(i), i*size, size, true))
	}
	if err := e.a.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	if got, err := pollFor(e.a, 200*time.Millisecond); len(got) > 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("completions %+v (%v) while the SEND waits for a receive", got, err)
	}
	e.a.Close()
	got, err := pollFor(e.a, 5*time.Second)
	if !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("poll after close: %v", err)
	}
	if len(got) != n+1 {
		t.Fatalf("completions %+v, want the SEND and the %d WRITEs flushed", got, n)
	}
	for i, c := range got {
		if c.ID != wrs[i].ID || c.Status != transport.StatusFlushed {
			t.Errorf("completion %d: %+v, want id %d flushed", i, c, wrs[i].ID)
		}
	}
	st := e.stats()
	t.Logf("stats %+v: the device reported %d of the %d flushed unsignaled WRITEs itself", st, st.reported, n)
	if e.ca.unsigFlushes && st.reported != n {
		t.Errorf("the device reported %d flushed unsignaled requests, want %d", st.reported, n)
	}
}

// TestVerbsUnsignaledRefused: a request refused at post time (its local
// buffer) after unsignaled WRITEs: they succeed and complete nothing, it
// fails in its turn and breaks the connection.
func TestVerbsUnsignaledRefused(t *testing.T) {
	const size = 4096
	e := newDevEnv(t, Options{}, 2*size)
	if err := e.a.PostSend(e.write(0, 0, size, true), e.write(1, size, size, true)); err != nil {
		t.Fatal(err)
	}
	bad := e.write(2, 0, size, true)
	bad.Local.Offset = 2 * size // beyond la
	if err := e.a.PostSend(bad, e.write(3, 0, size, true)); err != nil {
		t.Fatal(err)
	}
	got, err := pollFor(e.a, 10*time.Second)
	if !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("poll ended with %v after %+v, want ErrClosed", err, got)
	}
	if len(got) != 2 || got[0].ID != 2 || got[0].Status != transport.StatusLocalProtectionError ||
		got[1].ID != 3 || got[1].Status != transport.StatusFlushed {
		t.Fatalf("completions %+v: want 2 local protection error, 3 flushed", got)
	}
	if st := e.stats(); st.covered != 2 {
		t.Errorf("stats %+v: want 2 covered (by the drain request)", st)
	}
}

// TestVerbsCompVectors: the CQs of successive connections take the
// device's completion vectors in turn.
func TestVerbsCompVectors(t *testing.T) {
	p, ip := deviceOrFake(t, Options{})
	var vecs []int
	nv := 0
	for range 3 {
		a, b := transporttest.Connect(t, p, net.JoinHostPort(ip, "0"))
		for _, c := range []transport.Conn{a, b} {
			vecs = append(vecs, c.(*conn).compVector)
			nv = c.(*conn).id.Context().NumCompVectors()
		}
	}
	t.Logf("num_comp_vectors %d; completion vectors of 6 connections: %v", nv, vecs)
	for i := 1; i < len(vecs); i++ {
		if want := (vecs[i-1] + 1) % nv; vecs[i] != want {
			t.Errorf("connection %d on vector %d, after %d: want %d", i, vecs[i], vecs[i-1], want)
		}
	}
}

// hugeTLBFree reads HugePages_Free of /proc/meminfo.
func hugeTLBFree() int {
	b, _ := os.ReadFile("/proc/meminfo")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "HugePages_Free:"); ok {
			var n int
			fmt.Sscan(v, &n)
			return n
		}
	}
	return 0
}

// anonHugeKB reads the AnonHugePages of the mapping of /proc/self/smaps
// that holds addr, or -1.
func anonHugeKB(addr uintptr) int {
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return -1
	}
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		var lo, hi uint64
		if n, _ := fmt.Sscanf(l, "%x-%x ", &lo, &hi); n == 2 && strings.Contains(l, "-") && !strings.Contains(l, ":  ") {
			in = uint64(addr) >= lo && uint64(addr) < hi
			continue
		}
		if v, ok := strings.CutPrefix(l, "AnonHugePages:"); ok && in {
			var kb int
			fmt.Sscan(v, &kb)
			return kb
		}
	}
	return -1
}

// TestVerbsHugePages registers memory of AllocMemory(hugePages) on a
// connection and moves data through it with RDMA WRITE and READ: on
// Soft-RoCE transparent huge pages (and hugetlb pages if the pool has
// some: vm.nr_hugepages).
func TestVerbsHugePages(t *testing.T) {
	p, ip := deviceOrFake(t, Options{})
	a, b := transporttest.Connect(t, p, net.JoinHostPort(ip, "0"))
	const size = 8 << 20
	m, err := transport.AllocMemory(size, true)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	buf := m.Bytes()
	addr := uintptr(unsafe.Pointer(&buf[0]))
	fillPattern(buf, 1) // fault it in, as huge pages where there are some
	t.Logf("AllocMemory(%d MiB, true): %s at %#x; AnonHugePages %d kB; HugePages_Free %d", size>>20, m.HugePages(), addr, anonHugeKB(addr), hugeTLBFree())
	if m.HugePages() == transport.HugePagesNone {
		t.Logf("no huge pages of either kind")
	}
	rb, err := b.Register(buf, transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatalf("register %s memory: %v", m.HugePages(), err)
	}
	defer rb.Deregister()
	lm, err := transport.AllocMemory(2<<20, false)
	if err != nil {
		t.Fatal(err)
	}
	defer lm.Free()
	la, err := a.Register(lm.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer la.Deregister()
	fillPattern(la.Bytes()[:1<<20], 77)
	// WRITE 1 MiB across the 2 MiB boundary at 1.5 MiB, READ it back.
	const off = 3 << 19
	if err := a.PostSend(
		transport.WorkRequest{ID: 1, Op: transport.OpWrite, Local: transport.SGE{Region: la, Length: 1 << 20}, RemoteAddr: rb.Addr() + off, RKey: rb.RKey(), Unsignaled: true},
		transport.WorkRequest{ID: 2, Op: transport.OpRead, Local: transport.SGE{Region: la, Offset: 1 << 20, Length: 1 << 20}, RemoteAddr: rb.Addr() + off, RKey: rb.RKey()},
	); err != nil {
		t.Fatal(err)
	}
	got := pollN(t, a, 1)
	if got[0].ID != 2 || got[0].Status != transport.StatusSuccess {
		t.Fatalf("completion %+v", got[0])
	}
	if !bytes.Equal(buf[off:off+1<<20], la.Bytes()[:1<<20]) {
		t.Error("the WRITE into the huge-page memory did not land")
	}
	if !bytes.Equal(la.Bytes()[1<<20:], la.Bytes()[:1<<20]) {
		t.Error("the READ from the huge-page memory returned other data")
	}
	t.Logf("after registration: AnonHugePages %d kB", anonHugeKB(addr))
}

// BenchmarkWrite4KChain16 is the throughput of chains of 16 RDMA WRITEs of
// 4 KiB, 4 chains in flight, with every WRITE signaled or only the last of
// each chain.
func BenchmarkWrite4KChain16(b *testing.B) {
	const size, chain, inFlight = 4096, 16, 4
	for _, mode := range pollModes {
		for _, sig := range []struct {
			name  string
			every int
		}{{"signal-all", 1}, {"signal-1in16", chain}} {
			b.Run(mode.name+"/"+sig.name, func(b *testing.B) {
				e := newDevEnv(b, mode.opts, size*chain*inFlight)
				ctx := context.Background()
				wrs := make([][]transport.WorkRequest, inFlight)
				for k := range wrs {
					for i := range chain {
						off := (k*chain + i) * size
						wrs[k] = append(wrs[k], e.write(uint64(k*chain+i), off, size, (i+1)%sig.every != 0))
					}
				}
				// per chain: the completions it yields
				perChain := chain / sig.every
				out := make([]transport.Completion, 64)
				b.SetBytes(size)
				b.ResetTimer()
				cs := startCosts()
				posted, done, comps := 0, 0, 0
				pending := make([]int, inFlight) // completions a chain still owes
				for k := 0; k < inFlight && posted < b.N; k++ {
					if err := e.a.PostSend(wrs[k]...); err != nil {
						b.Fatal(err)
					}
					pending[k] = perChain
					posted += chain
				}
				for done < posted {
					n, err := e.a.Poll(ctx, out)
					if err != nil {
						b.Fatal(err)
					}
					comps += n
					for _, c := range out[:n] {
						if c.Status != transport.StatusSuccess {
							b.Fatalf("completion %+v", c)
						}
						k := int(c.ID) / chain
						pending[k]--
						if pending[k] > 0 {
							continue
						}
						done += chain
						if posted < b.N {
							if err := e.a.PostSend(wrs[k]...); err != nil {
								b.Fatal(err)
							}
							pending[k] = perChain
							posted += chain
						}
					}
				}
				b.StopTimer()
				cs.report(b, posted)
				b.ReportMetric(float64(comps)/float64(posted), "completions/op")
			})
		}
	}
}
