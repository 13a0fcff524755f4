//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// The failpoints (inject.go) over the fake device: each fires where it
// says, as the device would fail, the provider survives it (no panic, no
// leak, every request completed once), and it is logged and counted.

func TestParseFailpoints(t *testing.T) {
	for _, tc := range []struct {
		spec string
		ok   bool
	}{
		{"", true},
		{"seed=7", true},
		{"qp_create=1/50", true},
		{" post_send=1/2000 , cq_error=0/1 ,seed=3", true},
		{"disconnect_midio=1/5000#3", true},
		{"accept=1/1", true},
		{"nope=1/2", false},
		{"qp_create", false},
		{"qp_create=1", false},
		{"qp_create=2/1", false},
		{"qp_create=1/0", false},
		{"qp_create=a/b", false},
		{"qp_create=1/2#0", false},
		{"qp_create=1/2#x", false},
		{"seed=x", false},
	} {
		fp, err := parseFailpoints(tc.spec, zap.NewNop())
		if (err == nil) != tc.ok {
			t.Errorf("%q: %v, want ok %v", tc.spec, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), FailpointsEnv) {
			t.Errorf("%q: error %q does not name %s", tc.spec, err, FailpointsEnv)
		}
		_ = fp
	}
	fp, err := parseFailpoints("seed=7,post_send=1/2000#3,cq_error=1/5", zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if fp.seed != 7 || fp.rules[fpPostSend] != (fpRule{1, 2000, 3}) || fp.rules[fpCQError] != (fpRule{1, 5, 0}) || fp.rules[fpQPCreate].n != 0 {
		t.Errorf("parsed %+v, seed %d", fp.rules, fp.seed)
	}
}

// TestFailpointRates: N/M fires about N in M, the limit holds, and a seed
// gives the same sequence.
func TestFailpointRates(t *testing.T) {
	const tries = 20000
	run := func(spec string) (fired int, seq []bool) {
		fp, err := parseFailpoints(spec, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		for range tries {
			hit := fp.fire(fpPostSend)
			if hit {
				fired++
			}
			seq = append(seq, hit)
		}
		if got := fp.counts()["post_send"]; got != uint64(fired) {
			t.Errorf("%s: counted %d, fired %d", spec, got, fired)
		}
		return fired, seq
	}
	n, seq1 := run("seed=1,post_send=1/10")
	if n < tries/10*8/10 || n > tries/10*12/10 {
		t.Errorf("1/10 fired %d times in %d", n, tries)
	}
	_, seq2 := run("seed=1,post_send=1/10")
	for i := range seq1 {
		if seq1[i] != seq2[i] {
			t.Fatalf("the same seed gave another sequence at %d", i)
		}
	}
	if n, _ := run("seed=1,post_send=1/2#5"); n != 5 {
		t.Errorf("#5 fired %d times", n)
	}
	if n, _ := run("seed=1,post_send=0/2"); n != 0 {
		t.Errorf("0/2 fired %d times", n)
	}
}

// failpointProvider is a provider over f with the failpoints of spec,
// logging to an observer.
func failpointProvider(t *testing.T, f *fakeFabric, spec string) (*provider, *failpoints, *observer.ObservedLogs) {
	t.Helper()
	core, logs := observer.New(zapcore.WarnLevel)
	log := zap.New(core)
	fp, err := parseFailpoints(spec, log)
	if err != nil {
		t.Fatal(err)
	}
	o, err := Options{Logger: log}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	p, err := newProviderOn(fp.wrap(f), []string{fakeDevName}, o)
	if err != nil {
		t.Fatal(err)
	}
	p.fp = fp
	return p, fp, logs
}

// injectedLogs counts the warnings of injections of name.
func injectedLogs(logs *observer.ObservedLogs, name string) int {
	n := 0
	for _, e := range logs.FilterMessage("rdma failpoint: injecting a fault").All() {
		if e.ContextMap()["failpoint"] == name {
			n++
		}
	}
	return n
}

// TestFailpointEach makes each failpoint fire once (N/M = 1/1, #1) in the
// situation it is for, and checks what the provider makes of it.
func TestFailpointEach(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, p *provider, f *fakeFabric)
		// times is how often it fires (1 but for qp_create: newConn
		// tries again without inline data).
		times uint64
	}{
		{"qp_create", dialFailsOnce, 2},
		{"cq_create", dialFailsOnce, 1},
		{"connect", dialFailsOnce, 1},
		{"accept", func(t *testing.T, p *provider, f *fakeFabric) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			l, err := p.Listen(ctx, fakeListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			dialed := dialAsync(ctx, p, l.Addr(), nil)
			req, err := l.Accept(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if c, err := req.Accept(ctx, nil); !errors.Is(err, syscall.ENOMEM) {
				if c != nil {
					c.Close()
				}
				t.Errorf("accept with rdma_accept failing: %v, want ENOMEM", err)
			}
			var rej *transport.RejectError
			if err := <-dialed; !errors.As(err, &rej) {
				t.Errorf("dial: %v, want refused", err)
			}
			a, b, err := connectOnce(ctx, p, l)
			if err != nil {
				t.Fatal(err)
			}
			a.Close()
			b.Close()
		}, 1},
		{"mw_alloc", func(t *testing.T, p *provider, f *fakeFabric) {
			_, b := fakePair(t, p)
			bindTwice(t, b, func(err error) bool {
				return errors.Is(err, syscall.ENOMEM) && !errors.Is(err, transport.ErrUnsupported)
			})
		}, 1},
		{"mw_bind", func(t *testing.T, p *provider, f *fakeFabric) {
			_, b := fakePair(t, p)
			bindTwice(t, b, func(err error) bool { return errors.Is(err, transport.ErrQueueFull) })
		}, 1},
		{"post_send", func(t *testing.T, p *provider, f *fakeFabric) {
			a, _ := fakePair(t, p)
			wrs := make([]transport.WorkRequest, 10)
			ids := make([]uint64, 10)
			for i := range wrs {
				wrs[i], ids[i] = nop(uint64(i+1)), uint64(i+1)
			}
			if err := a.PostSend(wrs...); err != nil && !errors.Is(err, transport.ErrQueueFull) {
				t.Fatalf("post send: %v", err)
			} else if err != nil {
				return // nothing taken: refused as a full queue
			}
			got, err := pollAll(t, a)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("poll: %v", err)
			}
			completesOnce(t, got, ids...)
		}, 1},
		{"post_recv", func(t *testing.T, p *provider, f *fakeFabric) {
			a, _ := fakePair(t, p)
			rrs := make([]transport.RecvRequest, 10)
			ids := make([]uint64, 10)
			for i := range rrs {
				rrs[i], ids[i] = transport.RecvRequest{ID: uint64(i + 1)}, uint64(i+1)
			}
			if err := a.PostRecv(rrs...); err != nil && !errors.Is(err, transport.ErrQueueFull) {
				t.Fatalf("post recv: %v", err)
			} else if err != nil {
				return
			}
			got, err := pollAll(t, a)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("poll: %v", err)
			}
			completesOnce(t, got, ids...)
			allFlushed(t, got)
		}, 1},
		{"cq_error", func(t *testing.T, p *provider, f *fakeFabric) {
			a, b := fakePair(t, p)
			if err := b.PostRecv(transport.RecvRequest{ID: 100}); err != nil {
				t.Fatal(err)
			}
			if err := a.PostSend(nop(1), nop(2), transport.WorkRequest{ID: 3, Op: transport.OpSend}); err != nil {
				t.Fatal(err)
			}
			got, err := pollAll(t, a)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("poll: %v", err)
			}
			completesOnce(t, got, 1, 2, 3)
			if got[0].Status != transport.StatusTransportError || got[0].VendorErr>>24 != verbs.WCRetryExcErr {
				t.Errorf("first completion %+v, want the injected RETRY_EXC_ERR", got[0])
			}
			allFlushed(t, got[1:])
			// The receive the SEND reached stays a success: it arrived.
			gotB, err := pollAll(t, b)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("the peer's poll: %v", err)
			}
			completesOnce(t, gotB, 100)
		}, 1},
		{"reject_midio", func(t *testing.T, p *provider, f *fakeFabric) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			l, err := p.Listen(ctx, fakeListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			type res struct {
				c   transport.Conn
				err error
			}
			dialed := make(chan res, 1)
			go func() {
				c, err := p.Dial(ctx, l.Addr(), nil)
				dialed <- res{c, err}
			}()
			req, err := l.Accept(ctx)
			if err != nil {
				t.Fatal(err)
			}
			pc, err := req.Prepare()
			if err != nil {
				t.Fatal(err)
			}
			if err := pc.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
				t.Fatal(err)
			}
			pd := startPoller(pc)
			if _, err := req.Accept(ctx, nil); err == nil || !strings.Contains(err.Error(), "RDMA_CM_EVENT_REJECTED") {
				t.Errorf("accept: %v, want REJECTED", err)
			}
			pd.wait(t)
			completesOnce(t, pd.comps, 1, 2)
			allFlushed(t, pd.comps)
			pc.Close()
			// The dialer got in, then sees its connection end.
			r := <-dialed
			if r.err != nil {
				t.Fatalf("dial: %v", r.err)
			}
			defer r.c.Close()
			if _, err := pollAll(t, r.c); !errors.Is(err, transport.ErrClosed) {
				t.Errorf("the dialer's poll: %v, want ErrClosed", err)
			}
		}, 1},
		{"disconnect_midio", func(t *testing.T, p *provider, f *fakeFabric) {
			a, b := fakePair(t, p)
			if err := b.PostRecv(transport.RecvRequest{ID: 100}); err != nil {
				t.Fatal(err)
			}
			if err := a.PostRecv(transport.RecvRequest{ID: 50}); err != nil {
				t.Fatal(err)
			}
			if err := a.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend}, transport.WorkRequest{ID: 2, Op: transport.OpSend}); err != nil {
				t.Fatal(err)
			}
			got, err := pollAll(t, a)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("poll: %v, want ErrClosed", err)
			}
			completesOnce(t, got, 1, 2, 50)
			gotB, err := pollAll(t, b)
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("the peer's poll: %v", err)
			}
			completesOnce(t, gotB, 100)
		}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			f := newFakeFabric(t)
			times := max(tc.times, 1)
			p, fp, logs := failpointProvider(t, f, fmt.Sprintf("seed=1,%s=1/1#%d", tc.name, times))
			tc.run(t, p, f)
			if n := fp.counts()[tc.name]; n != times {
				t.Errorf("%s fired %d times, want %d (counts %v)", tc.name, n, times, fp.counts())
			}
			if n := injectedLogs(logs, tc.name); n != int(times) {
				t.Errorf("%d warnings of %s injections, want %d", n, tc.name, times)
			}
			if c := p.FailpointCounts(); c[tc.name] != times {
				t.Errorf("FailpointCounts %v", c)
			}
		})
	}
}

// dialFailsOnce: the first connection fails (its dial with the injected
// ENOMEM), the second works.
func dialFailsOnce(t *testing.T, p *provider, f *fakeFabric) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := p.Dial(ctx, l.Addr(), nil)
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded")
	}
	if !errors.Is(err, syscall.ENOMEM) || !strings.Contains(err.Error(), FailpointsEnv) {
		t.Errorf("dial: %v, want the injected ENOMEM", err)
	}
	a, b, err := connectOnce(ctx, p, l)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	b.Close()
}

// bindTwice: the first bind fails as want says, the second works.
func bindTwice(t *testing.T, b *conn, want func(error) bool) {
	t.Helper()
	r, err := b.Register(memory(t, 1<<16), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		t.Fatal(err)
	}
	pb := startPoller(b)
	defer func() {
		b.Close()
		pb.wait(t)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.BindWindow(ctx, r, 0, 4096, transport.AccessRemoteRead); !want(err) {
		t.Errorf("bind with the failpoint: %v", err)
	}
	w, err := b.BindWindow(ctx, r, 0, 4096, transport.AccessRemoteRead)
	if err != nil {
		t.Fatalf("bind after: %v", err)
	}
	if err := w.Invalidate(ctx); err != nil {
		t.Error(err)
	}
}

// TestFailpointSoak: connections with traffic (SENDs, WRITEs, READs,
// windows) under every failpoint at once, round after round: whatever
// fails, nothing panics, every signaled request completes once, each
// conn ends, data read back is what was written when both succeeded, and
// the device ends clean.
func TestFailpointSoak(t *testing.T) {
	noLeaks(t)
	rounds := 400
	if testing.Short() {
		rounds = 50
	}
	f := newFakeFabric(t)
	spec := "seed=11,qp_create=1/20,cq_create=1/20,mw_alloc=1/10,mw_bind=1/10,post_send=1/40,post_recv=1/40," +
		"cq_error=1/60,connect=1/20,accept=1/20,reject_midio=1/10,disconnect_midio=1/80"
	p, fp, _ := failpointProvider(t, f, spec)
	mem := memory(t, 1<<20)
	for round := range rounds {
		soakRound(t, p, mem, uint64(round))
	}
	f.waitClean(t)
	t.Logf("injected: %v; device objects: %v", fp.counts(), f.leaks())
	for _, name := range []string{"post_send", "cq_error", "disconnect_midio", "reject_midio"} {
		if fp.counts()[name] == 0 {
			t.Errorf("%s never fired in %d rounds", name, rounds)
		}
	}
}

func soakRound(t *testing.T, p *provider, mem []byte, seed uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ca, cb, err := connectOnce(ctx, p, l)
	if err != nil {
		return // a failpoint refused the connection
	}
	a, b := ca.(*conn), cb.(*conn)
	defer a.Close()
	defer b.Close()
	rng := rand.New(rand.NewPCG(seed, 1))
	const span = 4096
	la, err := a.Register(mem[:64*span], transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Register(mem[64*span:128*span], transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite|transport.AccessBindWindow)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	signaled := map[uint64]bool{}
	seen := map[uint64]int{}
	var wg sync.WaitGroup
	poll := func(c *conn) {
		defer wg.Done()
		out := make([]transport.Completion, 16)
		for {
			n, err := c.Poll(ctx, out)
			mu.Lock()
			for _, comp := range out[:n] {
				seen[comp.ID]++
			}
			mu.Unlock()
			if err != nil {
				if !errors.Is(err, transport.ErrClosed) {
					t.Errorf("poll ended with %v, want ErrClosed", err)
				}
				return
			}
		}
	}
	wg.Add(2)
	go poll(a)
	go poll(b)
	// b's windows, bound and invalidated while a works.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 10 {
			w, err := b.BindWindow(ctx, rb, (i%8)*span, span, transport.AccessRemoteRead)
			if err != nil {
				continue
			}
			w.Invalidate(ctx)
		}
	}()
	id := uint64(1 << 32)
	for i := range 40 {
		id++
		var err error
		var wr transport.WorkRequest
		switch rng.IntN(4) {
		case 0:
			if err = b.PostRecv(transport.RecvRequest{ID: id, Local: transport.SGE{Region: rb, Offset: 60 * span, Length: 64}}); err == nil {
				mu.Lock()
				signaled[id] = true
				mu.Unlock()
			}
			continue
		case 1:
			wr = transport.WorkRequest{ID: id, Op: transport.OpWrite, Local: transport.SGE{Region: la, Offset: (i % 32) * span, Length: span},
				RemoteAddr: rb.Addr() + uint64(i%32)*span, RKey: rb.RKey(), Unsignaled: rng.IntN(3) == 0}
		case 2:
			wr = transport.WorkRequest{ID: id, Op: transport.OpRead, Local: transport.SGE{Region: la, Offset: (32 + i%32) * span, Length: span},
				RemoteAddr: rb.Addr() + uint64(i%32)*span, RKey: rb.RKey()}
		default:
			wr = transport.WorkRequest{ID: id, Op: transport.OpSend, Local: transport.SGE{Region: la, Length: 16}}
		}
		err = a.PostSend(wr)
		if err == nil && !wr.Unsignaled {
			mu.Lock()
			signaled[id] = true
			mu.Unlock()
		}
		if err != nil && !errors.Is(err, transport.ErrClosed) && !errors.Is(err, transport.ErrQueueFull) {
			t.Errorf("post: %v", err)
		}
	}
	// Close both while things may still be in flight: everything ends.
	a.Close()
	b.Close()
	wg.Wait()
	for id := range signaled {
		if seen[id] != 1 {
			t.Errorf("round %d: request %#x completed %d times", seed, id, seen[id])
		}
	}
	for id, n := range seen {
		if n > 1 {
			t.Errorf("round %d: request %#x completed %d times", seed, id, n)
		}
	}
}

// TestWithFailpointsEnv: FailpointsEnv turns the failpoints on in a build
// with them, and is refused when malformed; in a build without, it is
// ignored, with a warning.
func TestWithFailpointsEnv(t *testing.T) {
	f := newFakeFabric(t)
	core, logs := observer.New(zapcore.WarnLevel)
	t.Setenv(FailpointsEnv, "seed=1,connect=1/1")
	stack, fp, err := withFailpoints(f, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	if FailpointsBuilt {
		if fp == nil || stack == verbs.Stack(f) {
			t.Error("the failpoints of the environment are not on")
		}
		t.Setenv(FailpointsEnv, "connect=2/1")
		if _, _, err := withFailpoints(f, zap.New(core)); err == nil {
			t.Error("a malformed spec was accepted")
		}
		return
	}
	if fp != nil || stack != verbs.Stack(f) {
		t.Error("a build without failpoints injects")
	}
	if logs.FilterMessageSnippet("no failpoints").Len() != 1 {
		t.Errorf("no warning that %s is ignored: %v", FailpointsEnv, logs.All())
	}
}
