package initiator_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

type rig struct {
	t    *testing.T
	tgt  *target.Target
	reg  *prometheus.Registry
	addr string
	p    transport.Provider
	path string
	stop func()
}

// startTarget serves one export of size bytes at path on a loopback port
// (or on RBLK_RDMA_ADDR over rdma: testProvider).
func startTarget(t *testing.T, size int64, cache int64, chunk int, ro bool, mods ...func(*target.Options)) *rig {
	t.Helper()
	return startTargetAt(t, filepath.Join(t.TempDir(), "vol.img"), "127.0.0.1:0", size, cache, chunk, ro, mods...)
}

// startTargetAt starts a target with the tests' provider (testProvider) on
// addr, where "127.0.0.1:0" stands for a free port of that provider's
// address; mods change its options before it starts.
func startTargetAt(t *testing.T, path, addr string, size int64, cache int64, chunk int, ro bool, mods ...func(*target.Options)) *rig {
	t.Helper()
	p, free := testProvider(t)
	if addr == "127.0.0.1:0" {
		addr = free
	}
	return startTargetOn(t, p, path, addr, size, cache, chunk, ro, mods...)
}

// startTargetOn starts a target listening with p.
func startTargetOn(t *testing.T, p transport.Provider, path, addr string, size int64, cache int64, chunk int, ro bool, mods ...func(*target.Options)) *rig {
	t.Helper()
	if ro {
		if err := os.WriteFile(path, bytes.Repeat([]byte{0x42}, int(size)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewRegistry()
	opts := target.Options{Exports: []target.ExportConfig{{Name: "vol", Path: path, Size: size, ReadOnly: ro}},
		CacheSize: cache, ChunkSize: chunk, Registerer: reg, RevokeTimeout: 5 * time.Second}
	for _, mod := range mods {
		mod(&opts)
	}
	tg, err := target.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	l, err := p.Listen(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- tg.Serve(ctx, l) }()
	r := &rig{t: t, tgt: tg, reg: reg, addr: l.Addr(), p: p, path: path}
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("serve: %v", err)
			}
			if err := tg.Close(); err != nil {
				t.Errorf("target close: %v", err)
			}
		})
	}
	t.Cleanup(r.stop)
	return r
}

// dialWatch is a provider that counts the dials that failed: the volume's
// attempts to reconnect while the target is down.
type dialWatch struct {
	transport.Provider
	failed atomic.Int64
}

func (d *dialWatch) Dial(ctx context.Context, addr string, privateData []byte) (transport.Conn, error) {
	c, err := d.Provider.Dial(ctx, addr, privateData)
	if err != nil {
		d.failed.Add(1)
	}
	return c, err
}

// waitFor polls cond for up to 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func (r *rig) open(ro bool) *initiator.Volume {
	return r.openWith(initiator.Options{ReadOnly: ro})
}

func (r *rig) openWith(o initiator.Options) *initiator.Volume {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if o.Provider == nil {
		o.Provider = r.p
	}
	if o.Queues == 0 {
		o.Queues = testQueues
	}
	o.Target, o.Export = r.addr, "vol"
	v, err := initiator.Open(ctx, o)
	if err != nil {
		r.t.Fatal(err)
	}
	r.t.Cleanup(func() { v.Close(context.Background()) })
	return v
}

func write(t *testing.T, v blockdev.Backend, off uint64, data []byte, fua bool) error {
	t.Helper()
	ctx := context.Background()
	b, err := v.Alloc(ctx, len(data))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Free(b)
	p := data
	for _, s := range b.Segs {
		p = p[copy(s, p):]
	}
	return v.WriteAt(ctx, b, off, fua)
}

func read(t *testing.T, v *initiator.Volume, off uint64, n int) ([]byte, error) {
	t.Helper()
	ctx := context.Background()
	b, err := v.Alloc(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Free(b)
	if err := v.ReadAt(ctx, b, off); err != nil {
		return nil, err
	}
	out := make([]byte, 0, n)
	for _, s := range b.Segs {
		out = append(out, s...)
	}
	return out, nil
}

// testQueues is the queues of the volumes the tests open (unless a test
// chooses): RBLK_TEST_QUEUES, default 1. The test command runs the
// package's tests again with several.
var testQueues = 1

func TestMain(m *testing.M) {
	if q := os.Getenv("RBLK_TEST_QUEUES"); q != "" {
		n, err := strconv.Atoi(q)
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "RBLK_TEST_QUEUES=%q: want a number of queues\n", q)
			os.Exit(2)
		}
		testQueues = n
	}
	goleak.VerifyTestMain(m)
}

// TestRandomIOAgainstModel runs concurrent random reads, writes, trims and
// write-zeroes over a volume four times the cache, checks every read
// against a model, then checks the backing file after a flush and after the
// target closed.
func TestRandomIOAgainstModel(t *testing.T) {
	const size, chunk = 4 << 20, 64 << 10
	r := startTarget(t, size, 1<<20, chunk, false) // cache: 16 chunks, volume: 64
	v := r.open(false)
	model := make([]byte, size)
	// Each worker owns a stripe of the volume, so IO never overlaps.
	const workers = 8
	stripe := uint64(size / workers)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			// The data from a stream cipher, a block at a time: filled a
			// byte at a time, built with -race, it was nearly half the
			// test's time.
			fill := rand.NewChaCha8([32]byte{byte(w), 7})
			base := uint64(w) * stripe
			for i := 0; i < 300; i++ {
				off := base + rng.Uint64N(stripe-1)
				n := 1 + rng.Uint64N(min(stripe-(off-base), 3*chunk))
				switch k := rng.IntN(10); {
				case k < 4:
					data := make([]byte, n)
					fill.Read(data)
					if err := write(t, v, off, data, k == 0); err != nil {
						errs <- fmt.Errorf("write %d+%d: %w", off, n, err)
						return
					}
					copy(model[off:], data)
				case k < 8:
					got, err := read(t, v, off, int(n))
					if err != nil {
						errs <- fmt.Errorf("read %d+%d: %w", off, n, err)
						return
					}
					if !bytes.Equal(got, model[off:off+n]) {
						errs <- fmt.Errorf("read %d+%d: data differs from what was written", off, n)
						return
					}
				case k == 8:
					if err := v.Trim(context.Background(), off, n, false); err != nil {
						errs <- fmt.Errorf("trim: %w", err)
						return
					}
					clear(model[off : off+n])
				default:
					if err := v.WriteZeroes(context.Background(), off, n, rng.IntN(2) == 0, false); err != nil {
						errs <- fmt.Errorf("zero: %w", err)
						return
					}
					clear(model[off : off+n])
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatalf("flush: %v", err)
	}
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, model) {
		t.Fatalf("after flush the backing file differs from what was written")
	}
	if ev := metric(t, r.reg, "rblkd_cache_evictions_total"); ev == 0 {
		t.Errorf("no evictions with a volume 4x the cache")
	}
	v.Close(context.Background())
	r.stop()
}

// metric sums the samples of the counter or gauge called name.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	return metricstest.Value(t, reg, name)
}

// TestWritesSurviveTargetClose: unflushed writes are written back when the
// target stops cleanly.
func TestWritesSurviveTargetClose(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	v := r.open(false)
	data := bytes.Repeat([]byte("rblk"), 5000)
	if err := write(t, v, 12345, data, false); err != nil {
		t.Fatal(err)
	}
	v.Close(context.Background())
	r.stop()
	file, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file[12345:12345+len(data)], data) {
		t.Fatal("write lost after clean target stop")
	}
}

func TestReadOnlyRefusesWrites(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, true)
	// Asked without ReadOnly, the open falls back to read-only.
	if v := r.open(false); !v.ReadOnly() {
		t.Fatal("volume of a read-only export is not read-only")
	}
	v := r.open(true)
	if err := write(t, v, 0, []byte("x"), false); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("write on ro volume: %v, want EPERM", err)
	}
	got, err := read(t, v, 100, 1000)
	if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0x42}, 1000)) {
		t.Fatalf("read of ro volume: %v", err)
	}
}

func TestOutOfRange(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	v := r.open(false)
	if _, err := read(t, v, 1<<20-10, 20); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past the end: %v, want EINVAL", err)
	}
	// The session still works.
	if err := write(t, v, 0, []byte("ok"), true); err != nil {
		t.Fatal(err)
	}
}

// TestTargetGoneFailsIO: without reconnection, IO after the target went
// away fails, and does not hang.
func TestTargetGoneFailsIO(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	v := r.openWith(initiator.Options{ReconnectTimeout: -1})
	if err := write(t, v, 0, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	r.stop()
	select {
	case <-v.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("volume did not notice the target going away")
	}
	if _, err := read(t, v, 0, 10); err == nil {
		t.Fatal("read after the target stopped succeeded")
	}
	if err := v.Flush(context.Background()); err == nil {
		t.Fatal("flush after the target stopped succeeded")
	}
}

// TestTargetRestart: IO waits while the target restarts and goes on after;
// the data written before a clean stop is there; a flush after the restart
// reports that unflushed writes may have been lost, once; flushed writes
// cause no such report.
func TestTargetRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vol.img")
	r := startTargetAt(t, path, "127.0.0.1:0", 1<<20, 1<<20, 64<<10, false)
	addr := r.addr
	dials := &dialWatch{Provider: r.p}
	v := r.openWith(initiator.Options{Provider: dials, ReconnectTimeout: 20 * time.Second})

	// 1. Flushed writes, clean restart: no error anywhere.
	if err := write(t, v, 0, []byte("flushed"), false); err != nil {
		t.Fatal(err)
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.stop()
	r = startTargetAt(t, path, addr, 1<<20, 1<<20, 64<<10, false)
	got, err := read(t, v, 0, 7)
	if err != nil || string(got) != "flushed" {
		t.Fatalf("read after restart: %q, %v", got, err)
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatalf("flush after a restart with nothing unflushed: %v", err)
	}

	// 2. Unflushed writes, clean restart while IO is waiting: the target
	// drains the initiator (IO finishes, flush) before it stops, so
	// nothing is lost and nothing is reported.
	if err := write(t, v, 4096, []byte("unflushed"), false); err != nil {
		t.Fatal(err)
	}
	r.stop()
	res := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		close(started)
		res <- write(t, v, 70000, []byte("during"), false)
	}()
	// The write waits while the volume tries to reconnect: it is still
	// waiting after the volume failed to reach the target three more
	// times (backing off, 150ms at least).
	<-started
	failed := dials.failed.Load()
	waitFor(t, "3 failed reconnection attempts", func() bool { return dials.failed.Load() >= failed+3 })
	select {
	case err := <-res:
		t.Fatalf("write finished while the target was down: %v", err)
	default:
	}
	startTargetAt(t, path, addr, 1<<20, 1<<20, 64<<10, false)
	if err := <-res; err != nil {
		t.Fatalf("write across the restart: %v", err)
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatalf("flush after a clean restart: %v", err)
	}
	for _, c := range []struct {
		off  uint64
		want string
	}{{0, "flushed"}, {4096, "unflushed"}, {70000, "during"}} {
		got, err := read(t, v, c.off, len(c.want))
		if err != nil || string(got) != c.want {
			t.Fatalf("read at %d: %q, %v; want %q", c.off, got, err, c.want)
		}
	}
}

// TestConnectionLostReportsLostWrites: when the connection breaks without
// the target's drain (a pulled cable, a crash), writes acknowledged since the
// last flush may be gone with the target's memory: the next flush says so,
// once, and IO goes on over a new connection.
func TestConnectionLostReportsLostWrites(t *testing.T) {
	r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
	fn := faultnet.Wrap(r.p)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	v, err := initiator.Open(ctx, initiator.Options{Provider: fn, Target: r.addr, Export: "vol", ReconnectTimeout: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close(context.Background())
	if err := write(t, v, 0, []byte("x"), false); err != nil {
		t.Fatal(err)
	}
	fn.DisconnectAll()
	if err := write(t, v, 8192, []byte("after"), false); err != nil {
		t.Fatalf("write after the connection broke: %v", err)
	}
	if err := v.Flush(ctx); !errors.Is(err, initiator.ErrLostWrites) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("flush after a lost connection with unflushed writes: %v, want EIO (lost writes)", err)
	}
	if err := v.Flush(ctx); err != nil {
		t.Fatalf("second flush: %v", err)
	}
	got, err := read(t, v, 8192, 5)
	if err != nil || string(got) != "after" {
		t.Fatalf("read: %q, %v", got, err)
	}
}

// TestRequestsLargerThanCache: requests that span more chunks than the
// target's cache holds, several at once, finish and are right.
func TestRequestsLargerThanCache(t *testing.T) {
	const chunk = 64 << 10
	r := startTarget(t, 4<<20, 4*chunk, chunk, false) // a cache of 4 chunks
	v := r.open(false)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := uint64(w)<<20 + 1000
			data := bytes.Repeat([]byte{byte(w + 1)}, 7*chunk+123) // 9 chunks
			if err := write(t, v, off, data, w == 0); err != nil {
				t.Errorf("write %d: %v", w, err)
				return
			}
			got, err := read(t, v, off, len(data))
			if err != nil || !bytes.Equal(got, data) {
				t.Errorf("read %d: %v (equal %v)", w, err, bytes.Equal(got, data))
			}
		}()
	}
	wg.Wait()
}
