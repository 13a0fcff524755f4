package e2e

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// instanceRE is an attach instance as rblk-attach shows it.
var instanceRE = regexp.MustCompile(`^[0-9a-f]{16}$`)

// attachIdentity returns the host ID and instance rblk-attach status shows
// for the attach of pid.
func attachIdentity(t *testing.T, state string, pid int) (hostID, instance string) {
	t.Helper()
	for _, e := range attachStatus(t, state) {
		if e.PID == pid {
			if !instanceRE.MatchString(e.Instance) {
				t.Fatalf("status of pid %d: instance %q, want 16 hex digits", pid, e.Instance)
			}
			return e.HostID, e.Instance
		}
	}
	t.Fatalf("status does not list pid %d", pid)
	return "", ""
}

// block is s at the start of a 4 KiB block of zeroes: a write of whole
// blocks, as the kernel's device takes them (O_DIRECT).
func block(s string) []byte {
	b := make([]byte, 4096)
	copy(b, s)
	return b
}

// waitExit waits for p to end by itself and returns its output.
func waitExit(t *testing.T, p *proc, what string) string {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(patient(60 * time.Second)):
		t.Fatalf("%s: still running", what)
	}
	return p.out.String()
}

// TestAttachInstances: two rblk-attach processes of one export with one
// host ID. The second is refused, fast and with one line that names the
// first (its instance, where from, since when) and --takeover; the first
// keeps its export and its IO goes on (before, the second silently fenced
// it). With --takeover the second fences the first, which exits saying
// who took the export over. rblk-attach status shows each attach's host ID
// and instance.
func TestAttachInstances(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	backing := filepath.Join(dir, "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=4M"})
	state := filepath.Join(sockDir(t), "state")
	a := startAttach(t, tg, "vol", "--host-id", "e2e-inst", "--state-dir", state, "--reconnect-timeout", "30s")
	host, inst := attachIdentity(t, state, a.cmd.Process.Pid)
	if host != "e2e-inst" {
		t.Fatalf("status: host ID %q", host)
	}
	if !strings.Contains(a.out.String(), inst) {
		t.Errorf("rblk-attach did not log its instance %s:\n%s", inst, a.out.String())
	}
	table := mustRun(t, 30*time.Second, attachBin, "status", "--state-dir", state).stdout
	if !strings.Contains(table, "INSTANCE") || !strings.Contains(table, inst) || !strings.Contains(table, "e2e-inst") {
		t.Errorf("status table:\n%s\nwant the host ID and instance", table)
	}
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, bytes.Repeat([]byte("A"), 4096))

	sock := "unix:" + filepath.Join(sockDir(t), "nbd.sock")
	wantCLIError(t, attachBin, []string{`held read-write by another attach of host "e2e-inst"`, "instance " + inst, "from " + net.JoinHostPort(localPeer(), ""), "since ", "--takeover"},
		"attach", "--host-id", "e2e-inst", "--transport", e2eTransport(), "--target", tg.addr, "--export", "vol", "--nbd-listen", sock, "--state-dir", state)
	// The first goes on: it writes and flushes, and it was not fenced.
	nc.mustWrite(t, 4096, bytes.Repeat([]byte("B"), 4096))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH through the first attach after the refusal: errno %d", errno)
	}
	if a.exited() {
		t.Fatalf("the first attach exited: %v\n%s", a.waitErr, a.out.String())
	}
	if v := metric(t, tg.metrics, "rblkd_sessions_fenced_total"); v != 0 {
		t.Errorf("rblkd_sessions_fenced_total = %v after a refused attach", v)
	}
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="attach_busy"`); v != 1 {
		t.Errorf(`rblkd_refused_total{reason="attach_busy"} = %v, want 1`, v)
	}

	b := startAttach(t, tg, "vol", "--host-id", "e2e-inst", "--state-dir", state, "--takeover")
	_, binst := attachIdentity(t, state, b.cmd.Process.Pid)
	if binst == inst {
		t.Fatalf("two attaches with one instance %s", inst)
	}
	out := waitExit(t, a.proc, "the attach taken over")
	if a.waitErr == nil || !strings.Contains(out, "fenced") || !strings.Contains(out, "(instance "+binst+`) took export "vol" over`) {
		t.Fatalf("the attach taken over: %v\n%s", a.waitErr, out)
	}
	nb := dialNBD(t, b.sock, "vol")
	if got := nb.mustRead(t, 0, 8192); !bytes.Equal(got, append(bytes.Repeat([]byte("A"), 4096), bytes.Repeat([]byte("B"), 4096)...)) {
		t.Fatal("the attach that took over does not read what the first wrote and flushed")
	}
	nb.close()
	b.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestAttachInstanceReinstates: the same attach coming back is
// reinstated, not refused. Its link goes silent past its keepalive
// (startFaultLink: the proxy stalls over tcp, rblkd is stopped over rdma):
// it reconnects with its instance, and rblkd, whether or not it still
// holds the old session by then, refuses nothing and checks no liveness:
// it fences the old session as the same attach's if it still holds it.
// Then rblkd is killed and started again: it reconnects again. Its
// instance stays the same, and its IO goes on. (Were the instance made per
// connection, rblkd would check the old session as another attach's and
// fence it only seconds later.) TestAttachInstanceReinstatesHalfOpen has
// the old session held for sure.
func TestAttachInstanceReinstates(t *testing.T) {
	t.Parallel()
	backing := filepath.Join(t.TempDir(), "vol.img")
	exports := []string{"vol=" + backing + ",size=4M"}
	tg := startTarget(t, exports, "--keepalive-timeout", "5m") // the old session would not end by itself
	link := startFaultLink(t, tg)
	state := filepath.Join(sockDir(t), "state")
	a := startAttach(t, link.target(), "vol", "--host-id", "e2e-inst-re", "--state-dir", state, "--reconnect-timeout", "60s", "--keepalive-timeout", "2s")
	_, inst := attachIdentity(t, state, a.cmd.Process.Pid)
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, block("before"))

	// The link goes silent until the attach declares it dead, then comes
	// back: the attach reconnects.
	link.stallAll(t)
	err := waitUntil(a.proc, 60*time.Second, func() bool {
		v, ok := metricSum(scrapeQuiet(a.metrics), "rblk_attach_target_sessions")
		return ok && v == 0
	})
	link.resumeAll(t)
	if err != nil {
		t.Fatalf("the silent link: rblk-attach did not declare it dead: %v", err)
	}
	nc.mustWrite(t, 4096, block("across a link fault"))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH after the link fault: errno %d", errno)
	}
	if v := metric(t, a.metrics, "rblk_attach_reconnects_total"); v < 1 {
		t.Errorf("rblk_attach_reconnects_total = %v after the link fault, want a reconnect", v)
	}
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="attach_busy"`); v != 0 {
		t.Errorf(`rblkd_refused_total{reason="attach_busy"} = %v`, v)
	}
	// Reinstated as the same attach: not checked as another one would be.
	if strings.Contains(tg.out.String(), "checking that this session lives") {
		t.Errorf("rblkd checked the old session's liveness: it took the reconnect for another attach:\n%s", tg.out.String())
	}
	switch v := metric(t, tg.metrics, "rblkd_sessions_fenced_total"); {
	case v == 1:
		t.Logf("rblkd still held the old session when the attach came back: fenced it")
		if want := `fenced: host \"e2e-inst-re\" opened export \"vol\" again`; !strings.Contains(tg.out.String(), want) {
			t.Errorf("rblkd fenced the old session, but not as the same attach's (%s):\n%s", want, tg.out.String())
		}
	case v == 0:
		t.Logf("rblkd had ended the old session when the attach came back")
	default:
		t.Errorf("rblkd_sessions_fenced_total = %v, want at most the attach's old session", v)
	}

	tg.kill9(t)
	tg = startTargetOn(t, tg.addr, exports)
	nc.mustWrite(t, 8192, block("across a restart"))
	if errno := nc.flush(t); errno != 0 {
		t.Logf("first FLUSH after the restart: errno %d (unflushed writes may be reported lost once)", errno)
		if errno := nc.flush(t); errno != 0 {
			t.Fatalf("FLUSH after the restart: errno %d", errno)
		}
	}
	es := attachStatus(t, state)
	if len(es) != 1 || es[0].Instance != inst || es[0].Reconnects < 2 || es[0].State != "up" {
		t.Fatalf("status after two reconnects: %+v, want instance %s up with 2 reconnects", es, inst)
	}
	if a.exited() {
		t.Fatalf("the attach exited: %v", a.waitErr)
	}
	nc.close()
	a.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	file, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if string(file[4096:4096+19]) != "across a link fault" || string(file[8192:8192+16]) != "across a restart" {
		t.Fatalf("the backing file does not hold the writes made across the faults")
	}
}

// TestAttachInstanceReinstatesHalfOpen: the link of an attach is reset on
// its side only, so that rblkd still holds the old session when the
// attach comes back: it reconnects with its instance, rblkd fences the old
// session as the same attach's (one fence), refuses nothing and checks no
// liveness, and its IO goes on.
func TestAttachInstanceReinstatesHalfOpen(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "a half-open link (the attach's side reset, rblkd's still open) is made by the TCP proxy; over rdma the RDMA CM tells rblkd of the attach's "+
		"disconnect at once, and nothing outside the processes drops it on Soft-RoCE's loopback: TestAttachInstanceReinstates has the attach's return either way")
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=4M"}, "--keepalive-timeout", "5m") // the old session would not end by itself
	px := startProxy(t, tg.addr)
	state := filepath.Join(sockDir(t), "state")
	a := startAttach(t, viaProxy(tg, px), "vol", "--host-id", "e2e-inst-half", "--state-dir", state, "--reconnect-timeout", "60s")
	_, inst := attachIdentity(t, state, a.cmd.Process.Pid)
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, block("before"))

	c, err := px.WaitConn(ctxFor(t, 10*time.Second), 0)
	if err != nil {
		t.Fatal(err)
	}
	c.ResetClientSideOnly()
	nc.mustWrite(t, 4096, block("across a half-open link"))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH after the link fault: errno %d", errno)
	}
	if v := metric(t, tg.metrics, "rblkd_sessions_fenced_total"); v != 1 {
		t.Errorf("rblkd_sessions_fenced_total = %v, want the attach's old session", v)
	}
	if want := `fenced: host \"e2e-inst-half\" opened export \"vol\" again`; !strings.Contains(tg.out.String(), want) {
		t.Errorf("rblkd did not fence the old session as the same attach's (%s):\n%s", want, tg.out.String())
	}
	if v := metric(t, tg.metrics, "rblkd_refused_total", `reason="attach_busy"`); v != 0 {
		t.Errorf(`rblkd_refused_total{reason="attach_busy"} = %v`, v)
	}
	// Reinstated as the same attach: not checked as another one would be
	// (whose check of the old session, which answers nothing here, would
	// have fenced it too, seconds later).
	if strings.Contains(tg.out.String(), "checking that this session lives") {
		t.Errorf("rblkd checked the old session's liveness: it took the reconnect for another attach:\n%s", tg.out.String())
	}
	es := attachStatus(t, state)
	if len(es) != 1 || es[0].Instance != inst || es[0].Reconnects != 1 || es[0].State != "up" {
		t.Fatalf("status after the reconnect: %+v, want instance %s up with 1 reconnect", es, inst)
	}
	nc.close()
	a.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
	file, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	if string(file[4096:4096+23]) != "across a half-open link" {
		t.Fatalf("the backing file does not hold the write made across the fault")
	}
}

// TestAttachInstanceCrash: the holder's process stops (SIGSTOP: its
// connection is up, it answers nothing). Another attach of the host gets
// the export without --takeover, after rblkd's liveness check (5 s) and
// well before rblkd's keepalive (5 min) would have dropped the holder;
// the stopped holder, continued, exits fenced. Then the new holder is
// killed (SIGKILL): the next attach of the host gets in at once.
func TestAttachInstanceCrash(t *testing.T) {
	t.Parallel()
	backing := filepath.Join(t.TempDir(), "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=4M"}, "--keepalive-timeout", "5m")
	state := filepath.Join(sockDir(t), "state")
	a := startAttach(t, tg, "vol", "--host-id", "e2e-inst-crash", "--state-dir", state, "--reconnect-timeout", "30s")
	nc := dialNBD(t, a.sock, "vol")
	nc.mustWrite(t, 0, block("first"))
	if errno := nc.flush(t); errno != 0 {
		t.Fatalf("FLUSH: errno %d", errno)
	}
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.cmd.Process.Signal(syscall.SIGCONT) })

	start := time.Now()
	b := startAttach(t, tg, "vol", "--host-id", "e2e-inst-crash", "--state-dir", state) // fails the test if refused
	t.Logf("the successor of a stopped holder attached in %v", time.Since(start).Round(time.Millisecond))
	if !strings.Contains(tg.out.String(), "did not answer a liveness check") {
		t.Errorf("rblkd's log does not say the holder did not answer:\n%s", tg.out.String())
	}
	nb := dialNBD(t, b.sock, "vol")
	nb.mustWrite(t, 4096, block("second"))
	if errno := nb.flush(t); errno != 0 {
		t.Fatalf("FLUSH through the successor: errno %d", errno)
	}
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	_, binst := attachIdentity(t, state, b.cmd.Process.Pid)
	out := waitExit(t, a.proc, "the stopped holder, continued")
	if a.waitErr == nil || !strings.Contains(out, "fenced") || !strings.Contains(out, binst) {
		t.Fatalf("the stopped holder, continued: %v, want it fenced naming instance %s\n%s", a.waitErr, binst, out)
	}

	b.kill9(t)
	c := startAttach(t, tg, "vol", "--host-id", "e2e-inst-crash", "--state-dir", state)
	ncc := dialNBD(t, c.sock, "vol")
	if got := ncc.mustRead(t, 0, 8192); !bytes.Equal(got[:4096], block("first")) || !bytes.Equal(got[4096:], block("second")) {
		t.Fatalf("the third attach reads %q, %q", got[:5], got[4096:4096+6])
	}
	ncc.close()
	c.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}
