package initiator_test

import (
	"context"
	"errors"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/transport/transporttest/faultnet"
)

// TestFastFail: with FastFailTimeout, IO waiting for a target that is
// gone fails with EIO (ErrUnavailable) once the timeout passed, and so
// does new IO, at once, while the volume goes on reconnecting; when the
// target is back, IO is served again, with the data written before. The
// volume never fails for good, and rblk_attach_fast_failing says when IO
// fails fast.
func TestFastFail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vol.img")
	r := startTargetAt(t, path, "127.0.0.1:0", 1<<20, 1<<20, 64<<10, false)
	addr := r.addr
	reg := prometheus.NewRegistry()
	v := r.openWith(initiator.Options{ReconnectTimeout: time.Minute, FastFailTimeout: 100 * time.Millisecond, Metrics: initiator.NewMetrics(reg)})
	if err := write(t, v, 0, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	r.stop()
	// A write while the target is gone waits, then fails fast.
	err := write(t, v, 4096, []byte("during"), false)
	if !errors.Is(err, initiator.ErrUnavailable) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("write while the target is gone: %v, want EIO (ErrUnavailable)", err)
	}
	if g := metric(t, reg, "rblk_attach_fast_failing"); g != 1 {
		t.Errorf("rblk_attach_fast_failing = %v while failing fast, want 1", g)
	}
	if _, err := read(t, v, 0, 6); !errors.Is(err, initiator.ErrUnavailable) {
		t.Fatalf("read while failing fast: %v, want ErrUnavailable", err)
	}
	if err := v.Flush(context.Background()); !errors.Is(err, initiator.ErrUnavailable) {
		t.Fatalf("flush while failing fast: %v, want ErrUnavailable", err)
	}
	select {
	case <-v.Done():
		t.Fatalf("the volume failed for good: %v", v.Err())
	default:
	}

	startTargetAt(t, path, addr, 1<<20, 1<<20, 64<<10, false)
	waitFor(t, "IO served again once the target is back", func() bool {
		got, err := read(t, v, 0, 6)
		return err == nil && string(got) == "before"
	})
	if err := write(t, v, 4096, []byte("after"), false); err != nil {
		t.Fatalf("write once the target is back: %v", err)
	}
	if err := v.Flush(context.Background()); err != nil {
		t.Fatalf("flush once the target is back (it stopped cleanly: nothing lost): %v", err)
	}
	if g := metric(t, reg, "rblk_attach_fast_failing"); g != 0 {
		t.Errorf("rblk_attach_fast_failing = %v once back, want 0", g)
	}
	if n := labeled(t, reg, "rblk_attach_errors_total", "op", "fast_fail"); n < 3 {
		t.Errorf("rblk_attach_errors_total{op=\"fast_fail\"} = %v, want the 3 operations failed fast at least", n)
	}
}

// TestFailOnLostWrites: with FailOnLostWrites, a volume that reconnects
// where writes acknowledged since the last flush may be lost (here an
// anonymous volume, after its connection broke) fails for good, with EIO
// (ErrLostWrites): every IO fails from then on, not only the next flush.
// Without unflushed writes it reconnects as always.
func TestFailOnLostWrites(t *testing.T) {
	for _, flushed := range []bool{true, false} {
		r := startTarget(t, 1<<20, 1<<20, 64<<10, false)
		fn := faultnet.Wrap(r.p)
		reg := prometheus.NewRegistry()
		v := r.openWith(initiator.Options{Provider: fn, ReconnectTimeout: 20 * time.Second, FailOnLostWrites: true,
			Metrics: initiator.NewMetrics(reg)})
		if err := write(t, v, 0, []byte("x"), false); err != nil {
			t.Fatal(err)
		}
		if flushed {
			if err := v.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		fn.DisconnectAll()
		err := write(t, v, 8192, []byte("after"), false)
		if flushed {
			if err != nil {
				t.Fatalf("write after the connection broke, nothing unflushed: %v", err)
			}
			if err := v.Flush(context.Background()); err != nil {
				t.Fatalf("flush after the connection broke, nothing unflushed: %v", err)
			}
			continue
		}
		if !errors.Is(err, initiator.ErrLostWrites) || !errors.Is(err, syscall.EIO) {
			t.Fatalf("write after reconnecting with unflushed writes: %v, want EIO (ErrLostWrites)", err)
		}
		select {
		case <-v.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the volume did not fail")
		}
		if _, err := read(t, v, 0, 1); !errors.Is(err, initiator.ErrLostWrites) {
			t.Fatalf("read after the volume failed: %v, want ErrLostWrites", err)
		}
		if n := labeled(t, reg, "rblk_attach_errors_total", "op", "lost_writes"); n != 1 {
			t.Errorf("rblk_attach_errors_total{op=\"lost_writes\"} = %v, want 1", n)
		}
	}
}

// TestRestartGrace: after a planned shutdown of the target (it drains the
// volume: SIGTERM of rblkd), IO waits RestartGrace for it to come back,
// not FastFailTimeout: a write issued while it is down outlives several
// failed reconnection attempts, more than the fast-fail time, and
// succeeds once the target is back.
func TestRestartGrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vol.img")
	r := startTargetAt(t, path, "127.0.0.1:0", 1<<20, 1<<20, 64<<10, false)
	addr := r.addr
	dials := &dialWatch{Provider: r.p}
	v := r.openWith(initiator.Options{Provider: dials, ReconnectTimeout: time.Minute, FastFailTimeout: 50 * time.Millisecond,
		RestartGrace: time.Minute})
	if err := write(t, v, 0, []byte("before"), false); err != nil {
		t.Fatal(err)
	}
	r.stop() // (a clean stop: the target drains the volume)
	res := make(chan error, 1)
	go func() { res <- write(t, v, 4096, []byte("during"), false) }()
	// Backing off from 50 ms, 4 more failed attempts take 750 ms at least:
	// well past the fast-fail time.
	failed := dials.failed.Load()
	waitFor(t, "4 failed reconnection attempts", func() bool { return dials.failed.Load() >= failed+4 })
	select {
	case err := <-res:
		t.Fatalf("write during a planned restart ended before the target was back: %v", err)
	default:
	}
	startTargetAt(t, path, addr, 1<<20, 1<<20, 64<<10, false)
	if err := <-res; err != nil {
		t.Fatalf("write across a planned restart: %v", err)
	}
}
