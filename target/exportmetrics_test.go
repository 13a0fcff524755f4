package target_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/internal/metricstest"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/target/targettest"
	"github.com/rblk/rblk/transport/transporttest"
)

// series returns the value of name{export=export} in reg (a counter's,
// gauge's, or histogram's count), and whether there is such a series.
func series(t *testing.T, reg *prometheus.Registry, name, export string) (float64, bool) {
	t.Helper()
	return seriesBy(t, reg, name, "export", export)
}

// seriesBy is series of name{label=value}.
func seriesBy(t *testing.T, reg *prometheus.Registry, name, label, value string) (float64, bool) {
	t.Helper()
	v, n := metricstest.Sum(t, reg, name, label, value)
	return v, n > 0
}

// TestExportMetrics: with two exports, IO on one is counted under its
// export label only (grants, loads, bytes written, write-back, flushes,
// cache use, sessions), the idle one's series exist at 0, and a write-back
// that fails leaves a queued chunk and a write-back lag that a successful
// flush clears.
func TestExportMetrics(t *testing.T) {
	transporttest.CheckGoroutines(t)
	const chunk = 64 << 10
	dir := t.TempDir()
	pa, pb := filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img")
	for _, p := range []string{pa, pb} {
		if err := os.WriteFile(p, make([]byte, 4*chunk), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var disk *targettest.DiskStore
	reg := prometheus.NewRegistry()
	tg, err := target.New(target.Options{CacheSize: 1 << 20, ChunkSize: chunk, Registerer: reg,
		Exports: []target.ExportConfig{{Name: "a", Path: pa}, {Name: "b", Path: pb}},
		WrapStore: func(name string, f *os.File) target.Store {
			if name != "a" {
				return f
			}
			d, err := targettest.NewDiskStore(f)
			if err != nil {
				t.Fatal(err)
			}
			disk = d
			return d
		}})
	if err != nil {
		t.Fatal(err)
	}
	p, laddr := testProvider(t)
	ctx, cancel := context.WithCancel(context.Background())
	l, err := p.Listen(ctx, laddr)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(served) }()
	t.Cleanup(func() {
		cancel()
		<-served
		if err := tg.Close(); err != nil && !errors.Is(err, errDisk) {
			t.Error(err)
		}
	})

	want := func(name, export string, v float64) {
		t.Helper()
		got, ok := series(t, reg, name, export)
		if !ok || got != v {
			t.Errorf("%s{export=%q} = %v (present: %v), want %v", name, export, got, ok, v)
		}
	}
	for _, e := range []string{"a", "b"} {
		want("rblkd_grants_total", e, 0)
		want("rblkd_written_bytes_total", e, 0)
		want("rblkd_export_size_bytes", e, 4*chunk)
		want("rblkd_writeback_lag_seconds", e, 0)
	}

	lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
	defer lcancel()
	lk, err := link.Dial(lctx, p, l.Addr(), link.Options{Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Close()
	c := &client{Link: lk}
	if _, err := auth.Initiate(lctx, lk, "", nil); err != nil {
		t.Fatal(err)
	}
	if err := lk.Request(lctx, &protocol.Open{Mode: protocol.ModeReadWrite, Name: "a"}, &c.info); err != nil {
		t.Fatal(err)
	}
	var g protocol.Grant
	if err := c.Request(lctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: chunk}, &g); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{0x5a}, 8192)
	if err := c.rdma(lctx, true, g, 4096, data); err != nil {
		t.Fatal(err)
	}
	disk.FailWrites(errDisk)
	// Each write-back attempt takes 20 ms: the background write-back,
	// which retries a failed chunk every WritebackDelay, holds it off the
	// queue that long each time (see the wait below).
	disk.SetDelays(20*time.Millisecond, 0)
	done := &protocol.Done{Handle: c.info.Handle, Generation: c.info.Generation, Ranges: []protocol.Range{{Offset: chunk + 4096, Length: uint64(len(data))}}}
	if err := c.Send(lctx, 0, done); err != nil {
		t.Fatal(err)
	}
	flush := &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}
	if err := c.Request(lctx, flush, &protocol.OK{}); err == nil {
		t.Fatal("flush succeeded with a failing disk")
	}
	afterFailed := time.Now()
	want("rblkd_grants_total", "a", 1)
	want("rblkd_grants_total", "b", 0)
	want("rblkd_cache_loads_total", "a", 1)
	want("rblkd_cache_loads_total", "b", 0)
	want("rblkd_cache_load_bytes_total", "a", chunk)
	want("rblkd_written_bytes_total", "a", float64(len(data)))
	want("rblkd_written_bytes_total", "b", 0)
	want("rblkd_export_cache_bytes", "a", chunk)
	want("rblkd_export_cache_bytes", "b", 0)
	want("rblkd_export_sessions", "a", 1)
	want("rblkd_export_sessions", "b", 0)
	// The failed write-back put the chunk back on the queue. The
	// background write-back retries it meanwhile, taking it off the queue
	// for the length of each attempt (which puts it back as it fails):
	// wait until it is queued instead of sampling one moment.
	waitSeries(t, reg, "rblkd_writeback_queued_chunks", "a", 1)
	want("rblkd_writeback_bytes_total", "a", 0)
	if lag, _ := series(t, reg, "rblkd_writeback_lag_seconds", "a"); lag <= 0 {
		t.Errorf("write-back lag of a = %v after a failed write-back, want > 0", lag)
	}
	// The lag is the age of the oldest unwritten range, not of the last
	// attempt: it grows while the range stays unwritten.
	since := time.Since(afterFailed).Seconds()
	if lag, _ := series(t, reg, "rblkd_writeback_lag_seconds", "a"); lag < since {
		t.Errorf("write-back lag of a = %v, less than the %v s since the failed flush", lag, since)
	}
	want("rblkd_writeback_lag_seconds", "b", 0)

	disk.FailWrites(nil)
	// A background write-back may have failed since the failed flush: the
	// next flush reports that error (once) even though it wrote everything.
	flushes := 2.0
	if err := c.Request(lctx, flush, &protocol.OK{}); err != nil {
		flushes++
		if err := c.Request(lctx, flush, &protocol.OK{}); err != nil {
			t.Fatal(err)
		}
	}
	want("rblkd_writeback_queued_chunks", "a", 0)
	want("rblkd_writeback_lag_seconds", "a", 0)
	want("rblkd_flush_duration_seconds", "a", flushes)
	want("rblkd_flush_duration_seconds", "b", 0)
	if wb, _ := series(t, reg, "rblkd_writeback_bytes_total", "a"); wb < float64(len(data)) {
		t.Errorf("rblkd_writeback_bytes_total{export=a} = %v, want >= %d", wb, len(data))
	}
	want("rblkd_writeback_bytes_total", "b", 0)
}

// waitSeries polls name{export=export} in reg until it is v, failing t
// after 10 seconds.
func waitSeries(t *testing.T, reg *prometheus.Registry, name, export string, v float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, ok := series(t, reg, name, export)
		if ok && got == v {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s{export=%q} = %v (present: %v) for 10s, want %v", name, export, got, ok, v)
		}
		time.Sleep(time.Millisecond)
	}
}

var errDisk = errors.New("disk failure injected by the test")

// TestExportMetricsDuringAddRemove: a scrape while exports are added and
// removed reads the export list under its lock (under -race; the guest's
// e2e TestSameFileExports found Collect reading Target.vols unlocked while
// RemoveExport changed it).
func TestExportMetricsDuringAddRemove(t *testing.T) {
	dir := t.TempDir()
	pa, pb := filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img")
	for _, p := range []string{pa, pb} {
		if err := os.WriteFile(p, make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewRegistry()
	tg, err := target.New(target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10, Registerer: reg,
		Exports: []target.ExportConfig{{Name: "b", Path: pb}}})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	stop := make(chan struct{})
	scraped := make(chan int)
	go func() {
		n := 0
		defer func() { scraped <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := reg.Gather(); err != nil {
				t.Error(err)
				return
			}
			n++
		}
	}()
	ctx := context.Background()
	for range 20 {
		if err := tg.AddExport(ctx, target.ExportConfig{Name: "a", Path: pa}); err != nil {
			t.Fatal(err)
		}
		if _, n := metricstest.Sum(t, reg, "rblkd_export_size_bytes", "export", "a"); n != 1 {
			t.Fatalf("after adding export a: %d series of its size, want 1", n)
		}
		if err := tg.RemoveExport(ctx, "a"); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	if n := <-scraped; n == 0 {
		t.Fatal("no scrape ran beside the changes")
	}
}
