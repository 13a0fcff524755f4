package target

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// TestBuckets drives the token buckets with a clock of their own.
func TestBuckets(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	type step struct {
		op   string // take, allowed, wait
		key  string
		at   time.Duration
		want any // bool for take and allowed, time.Duration for wait
	}
	for _, c := range []struct {
		name  string
		limit RateLimit
		steps []step
	}{
		{"burst then refused", RateLimit{Burst: 2, Every: time.Second}, []step{
			{"allowed", "a", 0, true}, {"take", "a", 0, true}, {"take", "a", 0, true},
			{"allowed", "a", 0, false}, {"take", "a", 0, false}, {"wait", "a", 0, time.Second},
			{"allowed", "b", 0, true}, // another key is another bucket
		}},
		{"refill one per interval", RateLimit{Burst: 2, Every: time.Second}, []step{
			{"take", "a", 0, true}, {"take", "a", 0, true}, {"wait", "a", 400 * time.Millisecond, 600 * time.Millisecond},
			{"take", "a", 999 * time.Millisecond, false}, {"take", "a", time.Second, true}, {"take", "a", time.Second, false},
			{"wait", "a", time.Hour, time.Duration(0)}, {"take", "a", time.Hour, true}, {"take", "a", time.Hour, true},
			{"take", "a", time.Hour, false}, // refilled to the burst, not beyond
		}},
		{"a clock going back changes nothing", RateLimit{Burst: 1, Every: time.Second}, []step{
			{"take", "a", 5 * time.Second, true}, {"take", "a", 0, false}, {"take", "a", 6 * time.Second, true},
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := newBuckets(c.limit, 100)
			for i, s := range c.steps {
				var got any
				switch s.op {
				case "take":
					got = b.take(s.key, at(s.at))
				case "allowed":
					got = b.allowed(s.key, at(s.at))
				case "wait":
					got = b.wait(s.key, at(s.at))
				}
				if got != s.want {
					t.Fatalf("step %d: %s(%q) at %v = %v, want %v", i, s.op, s.key, s.at, got, s.want)
				}
			}
		})
	}
}

// TestBucketsBounded: a flood of keys (random host IDs, addresses) keeps
// at most the bound; the keys that count most (emptiest) stay.
func TestBucketsBounded(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBuckets(RateLimit{Burst: 3, Every: time.Minute}, 50)
	for range 3 {
		b.take("attacker", t0) // empty
	}
	for i := range 10000 {
		b.take(string(rune('a'+i%26))+strings.Repeat("x", i%7)+string(rune(i)), t0)
		if b.len() > 50 {
			t.Fatalf("%d keys after %d, want at most 50", b.len(), i+1)
		}
	}
	if b.allowed("attacker", t0) {
		t.Fatal("the emptiest key was dropped for keys that count less")
	}
	// Refilled buckets are dropped first.
	b.take("new", t0.Add(time.Hour))
	if b.len() > 2 {
		t.Fatalf("%d keys after every bucket refilled, want the new one (and at most one more)", b.len())
	}
}

// TestLogLimiter: a burst of a kind of line goes through, then nothing
// until a token is back; the next line says how many were left out; other
// kinds and other addresses have their own.
func TestLogLimiter(t *testing.T) {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	ll := newLogLimiter(RateLimit{Burst: 2, Every: time.Second}, c)
	t0 := time.Unix(1000, 0)
	for i, s := range []struct {
		key    string
		at     time.Duration
		ok     bool
		before uint64
	}{
		{"p1\x00open", 0, true, 0}, {"p1\x00open", 0, true, 0}, {"p1\x00open", 0, false, 0}, {"p1\x00open", 0, false, 0},
		{"p2\x00open", 0, true, 0}, {"p1\x00auth", 0, true, 0},
		{"p1\x00open", 500 * time.Millisecond, false, 0}, {"p1\x00open", time.Second, true, 3}, {"p1\x00open", time.Second, false, 0},
		{"p1\x00open", 10 * time.Second, true, 1}, {"p1\x00open", 10 * time.Second, true, 0},
	} {
		ok, before := ll.allow(s.key, t0.Add(s.at))
		if ok != s.ok || before != s.before {
			t.Fatalf("step %d: allow(%q) at %v = %v, %d; want %v, %d", i, s.key, s.at, ok, before, s.ok, s.before)
		}
	}
	var m dto.Metric
	c.Write(&m)
	if m.GetCounter().GetValue() != 4 {
		t.Fatalf("suppressed counted %v, want 4", m.GetCounter().GetValue())
	}
}

// serveInternal serves a shared 256 KiB export "vol" with opts over the
// software transport on loopback.
func serveInternal(t *testing.T, opts Options) (*Target, string) {
	t.Helper()
	transporttest.CheckGoroutines(t)
	path := filepath.Join(t.TempDir(), "vol.img")
	if err := os.WriteFile(path, make([]byte, 256<<10), 0o600); err != nil {
		t.Fatal(err)
	}
	opts.Exports = []ExportConfig{{Name: "vol", Path: path, Shared: true}}
	opts.CacheSize, opts.ChunkSize = 1<<20, 64<<10
	tg, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l, err := tcp.New("tcp").Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(done) }()
	t.Cleanup(func() {
		cancel()
		<-done
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
	})
	return tg, l.Addr()
}

// onlySession returns the target's one session.
func onlySession(t *testing.T, tg *Target) *session {
	t.Helper()
	tg.mu.Lock()
	defer tg.mu.Unlock()
	if len(tg.sessions) != 1 {
		t.Fatalf("%d sessions, want 1", len(tg.sessions))
	}
	for s := range tg.sessions {
		return s
	}
	return nil
}

// TestHandleLimit: a session has at most MaxHandlesPerSession handles,
// however many Opens it sends at once; more are refused, busy, saying so
// and counted; closing handles frees what they held (their identities
// too), so that open/close pairs leave nothing behind.
func TestHandleLimit(t *testing.T) {
	reg := prometheus.NewRegistry()
	tg, addr := serveInternal(t, Options{MaxHandlesPerSession: 4, Registerer: reg})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	l, err := link.Dial(ctx, tcp.New("tcp"), addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := auth.Initiate(ctx, l, "host-a", nil); err != nil {
		t.Fatal(err)
	}
	open := func() (uint32, error) {
		var info protocol.VolumeInfo
		err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "vol", HostID: "host-a"}, &info)
		return info.Handle, err
	}
	closeH := func(h uint32) {
		t.Helper()
		if err := l.Request(ctx, &protocol.Close{Handle: h}, &protocol.OK{}); err != nil {
			t.Fatalf("close %d: %v", h, err)
		}
	}
	var handles []uint32
	for range 4 {
		h, err := open()
		if err != nil {
			t.Fatal(err)
		}
		handles = append(handles, h)
	}
	_, err = open()
	if !errors.Is(err, protocol.ErrBusy) || !strings.Contains(err.Error(), "the session has 4 handles open, the most one session may have") {
		t.Fatalf("fifth open: %v, want busy", err)
	}
	closeH(handles[1])
	if handles[1], err = open(); err != nil {
		t.Fatalf("open after a close: %v", err)
	}
	// 2,000 Opens at once (64 in flight): none gets past the limit.
	for _, h := range handles {
		closeH(h)
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	var mu sync.Mutex
	var got []uint32
	refused := 0
	for range 2000 {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			h, err := open()
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				got = append(got, h)
			case errors.Is(err, protocol.ErrBusy):
				refused++
			default:
				t.Errorf("open: %v", err)
			}
		}()
	}
	wg.Wait()
	s := onlySession(t, tg)
	s.mu.Lock()
	n, opening := len(s.handles), s.opening
	s.mu.Unlock()
	if len(got) != 4 || n != 4 || opening != 0 || refused != 1996 {
		t.Fatalf("2000 Opens at once: %d handles given, %d open, %d being opened, %d refused; want 4, 4, 0, 1996", len(got), n, opening, refused)
	}
	if v := testutilCounter(t, reg, "rblkd_refused_total", "handle_limit"); v != 1997 {
		t.Fatalf("rblkd_refused_total{reason=\"handle_limit\"} = %v, want 1997", v)
	}
	for _, h := range got {
		closeH(h)
	}
	// Open/close pairs leave nothing behind: no handle, no identity.
	for range 1000 {
		h, err := open()
		if err != nil {
			t.Fatal(err)
		}
		closeH(h)
	}
	s.mu.Lock()
	n = len(s.handles)
	s.mu.Unlock()
	tg.mu.Lock()
	idents := len(tg.idents)
	tg.mu.Unlock()
	if n != 0 || idents != 0 {
		t.Fatalf("after open/close pairs: %d handles, %d identities; want none", n, idents)
	}
}

// testutilCounter is the counter name{reason=reason}.
func testutilCounter(t *testing.T, reg *prometheus.Registry, name, reason string) float64 {
	t.Helper()
	v, _ := metricstest.Sum(t, reg, name, "reason", reason)
	return v
}

// TestHandleNumbersWrap: after 2^32 handles a session's numbers wrap
// around the ones still open instead of reusing them.
func TestHandleNumbersWrap(t *testing.T) {
	tg, addr := serveInternal(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	l, err := link.Dial(ctx, tcp.New("tcp"), addr, link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := auth.Initiate(ctx, l, "", nil); err != nil {
		t.Fatal(err)
	}
	open := func() uint32 {
		t.Helper()
		var info protocol.VolumeInfo
		if err := l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadOnly, Name: "vol"}, &info); err != nil {
			t.Fatal(err)
		}
		return info.Handle
	}
	first := open() // 1
	s := onlySession(t, tg)
	s.mu.Lock()
	s.next = ^uint32(0) - 1
	s.mu.Unlock()
	if h := open(); h != ^uint32(0) {
		t.Fatalf("handle %d, want %d", h, ^uint32(0))
	}
	if h := open(); h == 0 || h == first {
		t.Fatalf("after the wrap: handle %d (the first open is %d)", h, first)
	}
}
