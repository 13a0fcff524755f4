package e2e

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// refuseWithin bounds each command that must be refused at once: an open
// that blocks (a FIFO waiting for a writer) shows as a timeout.
const refuseWithin = 20 * time.Second

// startNotifyTarget starts rblkd serve on the run's transport and
// address (serveArgs) with args, as systemd's Type=notify would (with
// $NOTIFY_SOCKET), and waits for its READY=1.
func startNotifyTarget(t *testing.T, args ...string) (*target, *notifySocket) {
	t.Helper()
	ns := newNotifySocket(t)
	for attempt := 1; ; attempt++ {
		addr := hostPort(freePort(t))
		metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		p := startProcEnv(t, "rblkd", ns.env(), rblkdBin, serveArgs(addr, metrics, nil, args)...)
		raw, err := ns.next(p, 30*time.Second)
		if err != nil {
			if lostPortRace(t, p, attempt) {
				continue
			}
			t.Fatal(err)
		}
		if msg := notifyLines(raw); msg["READY"] != "1" {
			t.Fatalf("rblkd's first notification %v, want READY=1\n%s", msg, p.out.String())
		}
		return &target{proc: p, addr: addr, metrics: metrics}, ns
	}
}

// hupStatus sends SIGHUP and returns the STATUS= that comes with the
// READY=1 after the RELOADING=1.
func (tg *target) hupStatus(t *testing.T, ns *notifySocket) string {
	t.Helper()
	if err := tg.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if got := notifyLines(ns.wait(t, tg.proc, 30*time.Second)); got["RELOADING"] != "1" {
		t.Fatalf("notification after SIGHUP %v, want RELOADING=1", got)
	}
	got := notifyLines(ns.wait(t, tg.proc, 30*time.Second))
	if got["READY"] != "1" {
		t.Fatalf("notification after the reload %v, want READY=1", got)
	}
	return got["STATUS"]
}

// refusedServeArgs is the command line of an rblkd serve that must be
// refused before it serves: on the run's transport and address (port 0),
// with no admin socket unless extra names one (serveArgs).
func refusedServeArgs(exports []string, extra ...string) []string {
	return serveArgs(hostPort(0), "127.0.0.1:0", exports, extra)
}

// mkfifo makes a FIFO (mode 0600) in dir.
func mkfifo(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReloadHalfWritten: while fio writes and verifies export a and
// qemu-io uses export b, SIGHUP reloads a file that is half-written
// (empty; cut before exports:; cut just after it; cut in an export; cut in
// a's path) or has b's path mistyped. Each reload is refused: every export
// stays with its session, the attaches never fail nor reconnect, fio's
// verification passes, and the log, systemd's STATUS= and
// rblkd_config_reloads_total{result="error"} say why. A good file then
// reloads.
func TestReloadHalfWritten(t *testing.T) {
	t.Parallel()
	needTools(t, "fio", "qemu-io")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "rblkd.sock")
	settings := "cache_size: 16M\nchunk_size: 256K\ndrain_timeout: 5s\nadmin_socket: " + sock + "\n"
	a, b := [3]string{"a", filepath.Join(dir, "a.img"), "32M"}, [3]string{"b", filepath.Join(dir, "b.img"), "8M"}
	writeConfig(t, cfg, settings, a, b)
	good, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	tg, ns := startNotifyTarget(t, "--config", cfg)
	atA := startAttach(t, tg, "a")
	atB := startAttach(t, tg, "b")
	// fio keeps a's data path busy through the reloads: under emulation
	// one pass outlasts them.
	loops := 4
	if emulated() {
		loops = 1
	}
	fio := startFio(t, append(append([]string{"--name=half-written"}, fioTarget(atA.uri("a"))...), "--rw=randwrite", "--bs=4k",
		"--iodepth=8", "--size=24M", fmt.Sprintf("--loops=%d", loops), "--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--exitall_on_error=1", "--verify_state_save=0")...)
	waitMetric(t, atA.metrics, "rblk_attach_rdma_ops_total", func(v float64) bool { return v >= 200 }, ">= 200")

	g := string(good)
	cutKey := strings.Index(g, "    path: "+b[1]) + len("    pa")
	cutPath := strings.Index(g, a[1]) + len(a[1]) - 4
	for i, c := range []struct {
		name, content, why string
	}{
		{"empty", "", cfg + ": empty file"},
		{"cut before exports:", g[:strings.Index(g, "exports:")], cfg + " configures no exports: refusing to remove every export (is the file half-written?)"},
		{"cut after exports:", g[:strings.Index(g, "exports:")+len("exports:\n")], cfg + " configures no exports"},
		{"cut in an export's key", g[:cutKey], cfg + ":11: YAML: could not find expected ':'"},
		{"cut in a's path", g[:cutPath] + "\n", cfg + ":7: export \"a\": path " + a[1][:len(a[1])-4] + " does not exist: a reload does not create a new file for an export it serves"},
		{"b's path mistyped", strings.Replace(g, b[1], b[1]+"x", 1), cfg + ":10: export \"b\": path " + b[1] + "x does not exist"},
	} {
		if err := os.WriteFile(cfg, []byte(c.content), 0o644); err != nil {
			t.Fatal(err)
		}
		status := tg.hupStatus(t, ns)
		if !strings.HasPrefix(status, "reload refused, nothing changed: ") || !strings.Contains(status, c.why) {
			t.Errorf("%s: STATUS=%q, want it refused saying %q", c.name, status, c.why)
		}
		waitLabeled(t, tg.metrics, "rblkd_config_reloads_total", `result="error"`, float64(i+1))
		if v, _ := metricSum(scrape(t, tg.metrics), "rblkd_config_reloads_total", `result="ok"`); v != 0 {
			t.Errorf("%s: rblkd_config_reloads_total{result=\"ok\"} = %v", c.name, v)
		}
		if n := strings.Count(tg.out.String(), "reload refused: nothing changed, the running exports stay"); n != i+1 {
			t.Errorf("%s: %d refusals in rblkd's log, want %d", c.name, n, i+1)
		}
		ex := adminExports(t, sock)
		if len(ex) != 2 || ex["a"] == nil || ex["b"] == nil || ex["a"]["sessions"].(float64) != 1 || ex["b"]["sessions"].(float64) != 1 ||
			ex["a"]["path"] != a[1] || ex["b"]["path"] != b[1] {
			t.Fatalf("%s: exports after the refused reload: %v, want a and b as they were, one session each", c.name, ex)
		}
		qemuIO(t, atB.uri("b"), []qop{{kind: 'w', off: i << 16, n: 65536, pattern: byte(0x10 + i)}, {kind: 'r', off: i << 16, n: 65536, pattern: byte(0x10 + i)}})
	}
	if strings.Contains(tg.out.String(), "export removed") {
		t.Error("a refused reload removed an export")
	}
	if fio.exited() {
		t.Log("note: fio ended before the last refused reload")
	}
	// The file written in full: the reload applies.
	c := [3]string{"c", filepath.Join(dir, "c.img"), "4M"}
	writeConfig(t, cfg, settings, a, b, c)
	if status := tg.hupStatus(t, ns); status != "reloaded: added c" {
		t.Errorf("STATUS=%q after a good reload, want \"reloaded: added c\"", status)
	}
	res := fio.wait(t)
	if j := res.Jobs[0]; j.Write.IOBytes != int64(loops)*24<<20 || j.Read.IOBytes < int64(loops)*24<<20 {
		t.Errorf("fio wrote %d and verified %d bytes, want %d both", j.Write.IOBytes, j.Read.IOBytes, int64(loops)*24<<20)
	}
	var reads []qop
	for i := range 6 {
		reads = append(reads, qop{kind: 'r', off: i << 16, n: 65536, pattern: byte(0x10 + i)})
	}
	qemuIO(t, atB.uri("b"), reads)
	for _, at := range []*attacher{atA, atB} {
		if v := metric(t, at.metrics, "rblk_attach_reconnects_total"); v != 0 {
			t.Errorf("%s reconnected %v times across the refused reloads, want 0", at.uri(""), v)
		}
	}
	atA.stop(t, stopTimeout)
	atB.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestFIFOExport: an export of a FIFO is refused at once, naming the path
// and what it is: at start (--export p=FIFO,ro and read-write) and by
// rblkd export add (--read-only and read-write); the admin calls after it
// work, and SIGTERM ends rblkd cleanly.
func TestFIFOExport(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fifo := mkfifo(t, dir, "fifo")
	want := fifo + " is a FIFO: want a regular file or a block device"
	for _, opt := range []string{",ro", ""} {
		r := runWithin(t, refuseWithin, rblkdBin, refusedServeArgs([]string{"p=" + fifo + opt})...)
		switch {
		case r == nil:
			t.Errorf("rblkd serve --export p=FIFO%s: still running after %v (blocked in open?)", opt, refuseWithin)
		case r.code == 0 || !strings.Contains(r.stderr, `export "p": `+want):
			t.Errorf("rblkd serve --export p=FIFO%s: %s\nwant a failure saying %q", opt, r, want)
		}
	}

	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "rblkd.sock")
	writeConfig(t, cfg, "admin_socket: "+sock+"\n", [3]string{"k", filepath.Join(dir, "k.img"), "4M"})
	tg := startTarget(t, nil, "--config", cfg)
	for _, ro := range []string{"--read-only", "--shared"} {
		r := runWithin(t, refuseWithin, rblkdBin, "export", "add", "f", fifo, ro, "--socket", sock)
		switch {
		case r == nil:
			t.Errorf("rblkd export add f FIFO %s: no answer in %v", ro, refuseWithin)
		case r.code == 0 || !strings.Contains(r.stderr, `add export: export "f": `+want):
			t.Errorf("rblkd export add f FIFO %s: %s\nwant a failure saying %q", ro, r, want)
		}
	}
	if r := runWithin(t, refuseWithin, rblkdBin, "export", "add", "g", filepath.Join(dir, "g.img"), "--size", "1M", "--socket", sock); r == nil || r.code != 0 {
		t.Errorf("rblkd export add after the FIFO's refusal: %v", r)
	}
	if ex := adminExports(t, sock); len(ex) != 2 || ex["k"] == nil || ex["g"] == nil {
		t.Errorf("exports: %v, want k and g", ex)
	}
	tg.stop(t, stopTimeout)
}

// TestAdminNeverHoldsShutdown: while rblkd export remove drains a session
// whose initiator is stopped (SIGSTOP; --drain-timeout 5m), an export add
// of a FIFO is refused at once and export list answers; then SIGTERM ends
// rblkd within a minute (not after the drain's 5 minutes), with exit 0,
// and the data written to both exports is in their backing files. rblkd
// started again, the other export's attach comes back and detaches
// cleanly.
func TestAdminNeverHoldsShutdown(t *testing.T) {
	t.Parallel()
	needTools(t, "qemu-io")
	dir := t.TempDir()
	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "rblkd.sock")
	k, r := [3]string{"k", filepath.Join(dir, "k.img"), "8M"}, [3]string{"r", filepath.Join(dir, "r.img"), "8M"}
	writeConfig(t, cfg, "drain_timeout: 5m\ndrain_limit: 10m\nadmin_socket: "+sock+"\n", k, r)
	tg := startTarget(t, nil, "--config", cfg)
	atK := startAttach(t, tg, "k")
	atR := startAttach(t, tg, "r")
	qemuIO(t, atR.uri("r"), []qop{{kind: 'w', off: 0, n: 65536, pattern: 0x72}})
	if err := atR.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { atR.cmd.Process.Signal(syscall.SIGCONT) })
	remove := startProc(t, "rblkd export remove", rblkdBin, "export", "remove", "r", "--socket", sock)
	if err := waitUntil(tg.proc, 30*time.Second, func() bool { return strings.Contains(tg.out.String(), "draining this session") }); err != nil {
		t.Fatalf("the removal's drain did not start: %v\n%s", err, tg.out.String())
	}
	fifo := mkfifo(t, dir, "fifo")
	res := runWithin(t, refuseWithin, rblkdBin, "export", "add", "f", fifo, "--read-only", "--socket", sock)
	switch {
	case res == nil:
		t.Errorf("rblkd export add of a FIFO during a drain: no answer in %v", refuseWithin)
	case res.code == 0 || !strings.Contains(res.stderr, fifo+" is a FIFO"):
		t.Errorf("rblkd export add of a FIFO during a drain: %s", res)
	}
	if ex := adminExports(t, sock); ex["k"] == nil {
		t.Errorf("export list during the drain: %v", ex)
	}
	// Written to k, not flushed, while the removal drains.
	qemuIO(t, atK.uri("k"), []qop{{kind: 'w', off: 1 << 20, n: 65536, pattern: 0x6b}})
	start := time.Now()
	tg.stop(t, time.Minute)
	t.Logf("rblkd stopped %v after SIGTERM", time.Since(start).Round(time.Millisecond))
	select {
	case <-remove.done:
	case <-time.After(patient(30 * time.Second)):
		t.Error("rblkd export remove still waits after rblkd stopped")
	}
	for _, c := range []struct {
		path    string
		off     int
		pattern byte
	}{{k[1], 1 << 20, 0x6b}, {r[1], 0, 0x72}} {
		b, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if want := bytes.Repeat([]byte{c.pattern}, 65536); !bytes.Equal(b[c.off:c.off+65536], want) {
			t.Errorf("%s after the shutdown: %s", c.path, firstDiff(b[c.off:c.off+65536], want))
		}
	}
	// The attach of k lost rblkd and waits for it (its detach flushes the
	// volume with --device): rblkd back on its address, it reconnects and
	// then detaches cleanly.
	tg = startTargetOn(t, tg.addr, nil, "--config", cfg)
	waitMetric(t, atK.metrics, "rblk_attach_reconnects_total", func(v float64) bool { return v >= 1 }, "a reconnect to rblkd started again")
	atK.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)
}

// TestFIFOFiles: an auth file, a configuration file, a secret file or a
// host ID file that is a FIFO is refused at once, naming the path and what
// it is (read as before, each would block for ever waiting for a writer).
func TestFIFOFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	fifo := mkfifo(t, dir, "fifo")
	img := filepath.Join(dir, "v.img")
	nbd := "unix:" + filepath.Join(sockDir(t), "nbd.sock")
	is := fifo + " is a FIFO: want a regular file"
	for _, c := range []struct {
		name string
		bin  string
		args []string
		want string
	}{
		{"auth file", rblkdBin, refusedServeArgs([]string{"v=" + img + ",size=1M"}, "--auth-file", fifo), "--auth-file: auth file: " + is},
		{"configuration file", rblkdBin, refusedServeArgs(nil, "--admin-socket", "", "--config", fifo), "--config: read config: " + is},
		{"doctor's configuration file", rblkdBin, []string{"doctor", "--transport", e2eTransport(), "--config", fifo}, "--config: read config: " + is},
		{"secret file", attachBin, []string{"attach", "--transport", e2eTransport(), "--target", hostPort(1), "--export", "v", "--host-id", "h",
			"--nbd-listen", nbd, "--state-dir", filepath.Join(dir, "state"), "--secret-file", fifo}, "--secret-file: secret file: " + is},
		{"host ID file", attachBin, []string{"attach", "--transport", e2eTransport(), "--target", hostPort(1), "--export", "v",
			"--nbd-listen", nbd, "--state-dir", filepath.Join(dir, "state"), "--host-id-file", fifo}, "host ID file: " + is},
	} {
		r := runWithin(t, refuseWithin, c.bin, c.args...)
		switch {
		case r == nil:
			t.Errorf("%s that is a FIFO: still running after %v (blocked in open?)", c.name, refuseWithin)
		case r.code == 0 || !strings.Contains(r.stderr, c.want):
			t.Errorf("%s that is a FIFO: %s\nwant a failure saying %q", c.name, r, c.want)
		}
	}
}

// TestSameFileExports: one file is one export. A second export of a file
// under a second name (hard link), a symbolic link, a "d/../" path or a
// folder reached through a symbolic link is
// refused naming the first: at start, by rblkd export add and by a reload
// (which then changes nothing). A reload that moves the file from export a
// to export b (a rename) removes a, then adds b.
func TestSameFileExports(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := filepath.Join(dir, "a.img")
	if err := os.WriteFile(img, bytes.Repeat([]byte{0xa5}, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	hard := filepath.Join(dir, "hard.img")
	if err := os.Link(img, hard); err != nil {
		t.Fatal(err)
	}
	sym := filepath.Join(dir, "sym.img")
	if err := os.Symlink(img, sym); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	dirLink := filepath.Join(dir, "dirlink")
	if err := os.Symlink(dir, dirLink); err != nil {
		t.Fatal(err)
	}
	names := []struct{ how, path string }{{"hard link", hard}, {"symbolic link", sym}, {"d/../", dir + "/d/../a.img"},
		{"linked folder", filepath.Join(dirLink, "a.img")}}
	same := func(p string) string { return p + ` is the same file as export "a" (` + img + `)` }
	for _, n := range names {
		r := runWithin(t, refuseWithin, rblkdBin, refusedServeArgs([]string{"a=" + img, "b=" + n.path})...)
		switch {
		case r == nil:
			t.Errorf("rblkd serve with a second export by a %s: it served both", n.how)
		case r.code == 0 || !strings.Contains(r.stderr, `export "b": `+same(n.path)):
			t.Errorf("rblkd serve with a second export by a %s: %s\nwant a failure saying %q", n.how, r, same(n.path))
		}
	}

	cfg := filepath.Join(dir, "rblkd.yaml")
	sock := filepath.Join(sockDir(t), "rblkd.sock")
	settings := "admin_socket: " + sock + "\n"
	writeConfig(t, cfg, settings, [3]string{"a", img, "4M"})
	tg := startTarget(t, nil, "--config", cfg)
	for _, n := range names {
		r := run(t, cmdTimeout, rblkdBin, "export", "add", "b", n.path, "--read-only", "--socket", sock)
		abs, _ := filepath.Abs(n.path) // (rblkd export add sends the path cleaned: d/../ is gone)
		if r.code == 0 || !strings.Contains(r.stderr, `add export "b": `+same(abs)) {
			t.Errorf("rblkd export add of a second export by a %s: %s\nwant a failure saying %q", n.how, r, same(abs))
		}
	}
	for i, n := range names {
		writeConfig(t, cfg, settings, [3]string{"a", img, "4M"}, [3]string{"b", n.path, "4M"})
		tg.hup(t, "error", float64(i+1))
		if want := strings.ReplaceAll(`export "b": `+same(n.path), `"`, `\"`); !strings.Contains(tg.out.String(), want) {
			t.Errorf("reload with a second export by a %s: rblkd's log lacks %q", n.how, want)
		}
		if ex := adminExports(t, sock); len(ex) != 1 || ex["a"] == nil {
			t.Errorf("exports after the refused reload: %v, want a alone", ex)
		}
	}
	// A rename in one reload: the file moves from a to b.
	writeConfig(t, cfg, settings, [3]string{"b", sym, "4M"})
	tg.hup(t, "ok", 1)
	if !strings.Contains(tg.out.String(), `"changes": "removed a, added b"`) {
		t.Errorf("rblkd's log lacks the rename's changes:\n%s", tg.out.String())
	}
	if ex := adminExports(t, sock); len(ex) != 1 || ex["b"] == nil || ex["b"]["path"] != sym {
		t.Errorf("exports after the rename: %v, want b at %s", ex, sym)
	}
	tg.stop(t, stopTimeout)
}
