package e2e

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFastFail: rblk-attach --fast-fail-timeout fails IO with EIO once
// its target (killed with SIGKILL) has been gone that long, while it goes
// on reconnecting; the target started again, IO is served again, on the
// same attach, with what was flushed before.
func TestFastFail(t *testing.T) {
	t.Parallel()
	backing := filepath.Join(t.TempDir(), "vol.img")
	exports := []string{"vol=" + backing + ",size=4M"}
	tg := startTarget(t, exports)
	a := startAttach(t, tg, "vol", "--host-id", "e2e-fastfail", "--reconnect-timeout", "2m", "--fast-fail-timeout", "1s")
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, block("before"))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH: errno %d", errno)
	}

	tg.kill9(t)
	errno, _, err := nc.do(nbdCmdWrite, 4096, 4096, block("while gone"))
	if err != nil || errno != 5 {
		t.Fatalf("NBD WRITE while the target is gone: errno %d, %v; want EIO (5) after --fast-fail-timeout", errno, err)
	}
	if v := metric(t, a.metrics, "rblk_attach_fast_failing"); v != 1 {
		t.Errorf("rblk_attach_fast_failing = %v while failing fast, want 1", v)
	}
	if v := metric(t, a.metrics, "rblk_attach_errors_total", `op="fast_fail"`); v < 1 {
		t.Errorf(`rblk_attach_errors_total{op="fast_fail"} = %v, want the failed write`, v)
	}

	tg = startTargetOn(t, tg.addr, exports)
	if err := waitUntil(a.proc, 60*time.Second, func() bool {
		v, ok := metricSum(scrapeQuiet(a.metrics), "rblk_attach_fast_failing")
		return ok && v == 0
	}); err != nil {
		t.Fatalf("rblk-attach did not reconnect to the restarted target: %v", err)
	}
	if got := nc.mustRead(t, 0, 4096); string(got[:6]) != "before" {
		t.Fatalf("read after the target came back: %q", got[:6])
	}
	nc.mustWrite(t, 4096, block("after"))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH after the target came back (nothing was unflushed): errno %d", errno)
	}
	if a.exited() {
		t.Fatalf("rblk-attach exited: %v", a.waitErr)
	}
	nc.close()
	a.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestFailOnLostWrites: rblk-attach --fail-on-lost-writes whose target is
// killed (SIGKILL) with writes it acknowledged and nobody flushed, and
// started again, fails when it reconnects: IO fails, and it exits saying
// writes may have been lost, so that a mirror above takes the member out
// instead of letting it rejoin as if whole.
func TestFailOnLostWrites(t *testing.T) {
	t.Parallel()
	backing := filepath.Join(t.TempDir(), "vol.img")
	exports := []string{"vol=" + backing + ",size=4M"}
	tg := startTarget(t, exports)
	a := startAttach(t, tg, "vol", "--host-id", "e2e-lostwrites", "--reconnect-timeout", "2m", "--fail-on-lost-writes")
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, block("unflushed"))

	tg.kill9(t)
	tg = startTargetOn(t, tg.addr, exports)
	out := waitExit(t, a.proc, "rblk-attach after losing writes")
	if a.waitErr == nil || !strings.Contains(out, "may have been lost") {
		t.Fatalf("rblk-attach after its target restarted with unflushed writes: %v, want it to fail saying writes may have been lost\n%s", a.waitErr, out)
	}
	if errno, _, err := nc.do(nbdCmdRead, 0, 4096, nil); err == nil && errno == 0 {
		t.Fatal("a read after the member failed succeeded")
	}
	nc.close()
	tg.stop(t, stopTimeout)
}
