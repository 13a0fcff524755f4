package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// notifySocket is a unixgram socket standing in for systemd's
// $NOTIFY_SOCKET.
type notifySocket struct {
	path string
	conn *net.UnixConn
}

func newNotifySocket(t *testing.T) *notifySocket {
	t.Helper()
	path := filepath.Join(sockDir(t), "notify.sock")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatalf("listen %s: %v", path, err)
	}
	t.Cleanup(func() { c.Close() })
	return &notifySocket{path: path, conn: c}
}

func (n *notifySocket) env() []string { return []string{"NOTIFY_SOCKET=" + n.path} }

// wait returns the next datagram that p sends, failing t if p exits first
// or none comes within the timeout.
func (n *notifySocket) wait(t *testing.T, p *proc, timeout time.Duration) string {
	t.Helper()
	msg, err := n.next(p, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

// next is wait's work: the datagram, or why none came.
func (n *notifySocket) next(p *proc, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 4096)
	for {
		// Short reads, so that p's exit is noticed.
		n.conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		k, err := n.conn.Read(buf)
		if err == nil {
			return string(buf[:k]), nil
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			return "", fmt.Errorf("read %s: %w", n.path, err)
		}
		if p.exited() {
			return "", fmt.Errorf("%s exited before it notified: %v\n%s", p.name, p.waitErr, p.out.String())
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no notification from %s within %v\n%s", p.name, timeout, p.out.String())
		}
	}
}

// notifyLines splits a notification into its KEY=VALUE lines.
func notifyLines(msg string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(msg, "\n") {
		k, v, _ := strings.Cut(l, "=")
		m[k] = v
	}
	return m
}

// TestSystemdNotify runs rblkd and rblk-attach as systemd's Type=notify
// would: READY=1 must come only once they serve (an initiator's first
// connection gets in, over tcp the port accepts; /metrics answers; the NBD
// socket greets), STOPPING=1 on SIGTERM. On the run's transport: rblkd's
// listener is the transport's own.
func TestSystemdNotify(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ns := newNotifySocket(t)
	addr := hostPort(freePort(t))
	metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := filepath.Join(dir, "rblkd.yaml")
	writeConfig := func(exports ...string) {
		t.Helper()
		y := "exports:\n"
		for _, e := range exports {
			y += fmt.Sprintf("  - name: %s\n    path: %s\n    size: 4M\n", e, filepath.Join(dir, e+".img"))
		}
		if err := os.WriteFile(cfg, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeConfig("vol0")
	p := startProcEnv(t, "rblkd", ns.env(), rblkdBin, serveArgs(addr, metrics, nil, []string{"--config", cfg, "--admin-socket", ""})...)
	msg := notifyLines(ns.wait(t, p, 30*time.Second))
	if msg["READY"] != "1" {
		t.Fatalf("rblkd's first notification %v, want READY=1", msg)
	}
	// Ready means ready: no polling from here on.
	if e2e.transport == "tcp" {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatalf("rblkd sent READY=1, but %s does not accept: %v", addr, err)
		}
		c.Close()
	}
	if r := run(t, 30*time.Second, attachBin, "list", "--host-id", "e2e-notify", "--transport", e2eTransport(), "--target", addr); r.code != 0 || !strings.Contains(r.stdout, "vol0") {
		t.Fatalf("rblkd sent READY=1, but its first list does not get in: %s", r)
	}
	if !httpOK("http://" + metrics + "/metrics") {
		t.Fatalf("rblkd sent READY=1, but http://%s/metrics does not answer", metrics)
	}
	if !strings.Contains(msg["STATUS"], "serving 1 exports on "+addr) {
		t.Errorf("rblkd's STATUS=%q, want it to say what it serves", msg["STATUS"])
	}
	tg := &target{proc: p, addr: addr, metrics: metrics}

	// A reload (systemd's ExecReload sends SIGHUP): RELOADING=1, then
	// READY=1 once it is done, with a STATUS= that says what it did.
	writeConfig("vol0", "vol1")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if got := notifyLines(ns.wait(t, p, 30*time.Second)); got["RELOADING"] != "1" || got["MONOTONIC_USEC"] == "" {
		t.Fatalf("rblkd's notification after SIGHUP %v, want RELOADING=1 with MONOTONIC_USEC", got)
	}
	if got := notifyLines(ns.wait(t, p, 30*time.Second)); got["READY"] != "1" || !strings.Contains(got["STATUS"], "reloaded") ||
		!strings.Contains(got["STATUS"], "vol1") {
		t.Fatalf("rblkd's notification after the reload %v, want READY=1 and a STATUS= naming the added vol1", got)
	}

	// rblk-attach: READY=1 once its NBD socket serves.
	ans := newNotifySocket(t)
	sock := filepath.Join(sockDir(t), "nbd.sock")
	a := startProcEnv(t, "rblk-attach", ans.env(), attachBin, "attach", "--transport", e2eTransport(), "--target", addr,
		"--export", "vol0", "--nbd-listen", "unix:"+sock, "--host-id", "e2e-notify", "--state-dir", "")
	amsg := notifyLines(ans.wait(t, a, 30*time.Second))
	if amsg["READY"] != "1" {
		t.Fatalf("rblk-attach's first notification %v, want READY=1", amsg)
	}
	if !nbdGreets(sock) {
		t.Fatalf("rblk-attach sent READY=1, but its NBD socket %s does not greet", sock)
	}
	a.stop(t, stopTimeout)
	if got := notifyLines(ans.wait(t, a, time.Second)); got["STOPPING"] != "1" {
		t.Errorf("rblk-attach's notification after SIGTERM %v, want STOPPING=1", got)
	}

	tg.stop(t, stopTimeout)
	if got := notifyLines(ns.wait(t, p, time.Second)); got["STOPPING"] != "1" {
		t.Errorf("rblkd's notification after SIGTERM %v, want STOPPING=1", got)
	}
}

// statusEntry is an element of rblk-attach status --json.
type statusEntry struct {
	PID        int       `json:"pid"`
	Device     string    `json:"device"`
	Socket     string    `json:"socket"`
	Export     string    `json:"export"`
	Target     string    `json:"target"`
	Transport  string    `json:"transport"`
	State      string    `json:"state"`
	Reconnects int       `json:"reconnects"`
	Since      time.Time `json:"since"`
	Queues     int       `json:"queues"`
	Size       uint64    `json:"size"`
	HostID     string    `json:"host_id"`
	Instance   string    `json:"instance"`
}

func attachStatus(t *testing.T, dir string) []statusEntry {
	t.Helper()
	r := mustRun(t, 30*time.Second, attachBin, "status", "--json", "--state-dir", dir)
	var es []statusEntry
	if err := json.Unmarshal([]byte(r.stdout), &es); err != nil {
		t.Fatalf("rblk-attach status --json: %v\n%s", err, r.stdout)
	}
	return es
}

// TestStatus follows an attach through rblk-attach status: up with its
// export, target and socket; reconnects counted across a restart of
// rblkd; gone once it exits. And list --json.
func TestStatus(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	state := filepath.Join(dir, "attach")
	if err := os.WriteFile(filepath.Join(dir, "ro1.img"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	exports := []string{"vol0=" + filepath.Join(dir, "vol0.img") + ",size=4M", "ro1=" + filepath.Join(dir, "ro1.img") + ",ro"}
	tg := startTarget(t, exports)

	if es := attachStatus(t, state); len(es) != 0 {
		t.Fatalf("status with no attach: %+v, want []", es)
	}
	a := startAttach(t, tg, "vol0", "--state-dir", state, "--queues", "2")
	es := attachStatus(t, state)
	if len(es) != 1 {
		t.Fatalf("status: %d attaches, want 1: %+v", len(es), es)
	}
	e := es[0]
	// (with RBLK_E2E_DEVICE=nbd: a device, no socket)
	wantSock, wantDev := "unix:"+a.sock, ""
	if a.dev != "" {
		wantSock, wantDev = "", a.dev
	}
	if e.PID != a.cmd.Process.Pid || e.State != "up" || e.Export != "vol0" || e.Target != tg.addr || e.Socket != wantSock || e.Device != wantDev ||
		e.Transport != e2eTransport() || e.Queues != 2 || e.Size != 4<<20 || e.Reconnects != 0 || e.Since.IsZero() {
		t.Errorf("status: %+v; want pid %d, up, vol0 of %s on %q%q over %s, 2 queues, 4 MiB, no reconnects", e, a.cmd.Process.Pid, tg.addr, wantSock, wantDev, e2eTransport())
	}
	table := mustRun(t, 30*time.Second, attachBin, "status", "--state-dir", state).stdout
	if !strings.Contains(table, "RECONNECTS") || !strings.Contains(table, "vol0") || !strings.Contains(table, " up ") {
		t.Errorf("status printed:\n%s\nwant a table with vol0, up", table)
	}

	// rblkd dies and comes back: the attach reconnects, and says so.
	tg.kill9(t)
	tg = startTargetOn(t, tg.addr, exports)
	pollUntil(t, 30*time.Second, "status shows the reconnect", func() bool {
		es := attachStatus(t, state)
		return len(es) == 1 && es[0].State == "up" && es[0].Reconnects >= 1
	})

	r := mustRun(t, 30*time.Second, attachBin, "list", "--json", "--host-id", "e2e-status", "--transport", e2eTransport(), "--target", tg.addr)
	var list []struct {
		Name     string `json:"name"`
		Size     uint64 `json:"size"`
		ReadOnly bool   `json:"read_only"`
		CanTrim  bool   `json:"can_trim"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &list); err != nil {
		t.Fatalf("rblk-attach list --json: %v\n%s", err, r.stdout)
	}
	if got := fmt.Sprintf("%+v", list); got != "[{Name:ro1 Size:1048576 ReadOnly:true CanTrim:false} {Name:vol0 Size:4194304 ReadOnly:false CanTrim:true}]" &&
		got != "[{Name:vol0 Size:4194304 ReadOnly:false CanTrim:true} {Name:ro1 Size:1048576 ReadOnly:true CanTrim:false}]" {
		t.Errorf("list --json: %s", got)
	}

	// A second attach, killed: its file stays until status finds it stale.
	a2 := startAttach(t, tg, "ro1", "--state-dir", state)
	if es := attachStatus(t, state); len(es) != 2 {
		t.Fatalf("status with two attaches: %+v", es)
	}
	a2.kill9(t)
	if _, err := os.Stat(filepath.Join(state, fmt.Sprintf("%d.json", a2.cmd.Process.Pid))); err != nil {
		t.Fatalf("the killed attach's status file: %v, want it left behind", err)
	}
	a.stop(t, stopTimeout)
	if es := attachStatus(t, state); len(es) != 0 {
		t.Errorf("status after the attaches exited (one killed): %+v, want []", es)
	}
	if des, _ := os.ReadDir(state); len(des) != 0 {
		t.Errorf("%s holds %d files after the attach exited, want none", state, len(des))
	}
	tg.stop(t, stopTimeout)
}

// TestGenDocs generates the man pages and completions make install
// installs, from the real binaries: a page per command, one that man (or
// groff) renders, and a bash completion that registers itself.
func TestGenDocs(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	pages := map[string][]string{
		rblkdBin:  {"rblkd.1", "rblkd-serve.1", "rblkd-completion.1"},
		attachBin: {"rblk-attach.1", "rblk-attach-attach.1", "rblk-attach-detach.1", "rblk-attach-list.1", "rblk-attach-status.1"},
	}
	for bin, want := range pages {
		name := filepath.Base(bin)
		mustRun(t, time.Minute, bin, "gen-docs", dir)
		for _, p := range want {
			b, err := os.ReadFile(filepath.Join(dir, "man1", p))
			if err != nil {
				t.Errorf("%s gen-docs: %v", name, err)
				continue
			}
			if !strings.HasPrefix(string(b), ".nh\n.TH") && !strings.Contains(string(b), ".TH \"") {
				t.Errorf("%s is not a man page:\n%.200s", p, b)
			}
		}
		// Hidden commands get no page.
		for _, hidden := range []string{"gen-docs", "udev-id"} {
			if _, err := os.Stat(filepath.Join(dir, "man1", name+"-"+hidden+".1")); err == nil {
				t.Errorf("a man page for the hidden command %s %s", name, hidden)
			}
		}
		for _, f := range []string{"bash-completion/" + name, "zsh/_" + name, "fish/" + name + ".fish"} {
			b, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil || !strings.Contains(string(b), name) {
				t.Errorf("completion %s: %v; want a script for %s", f, err, name)
			}
		}
		// Sourced in bash, the completion registers itself.
		if bash, ok := toolPath("bash"); ok {
			r := mustRun(t, time.Minute, bash, "-c", "source "+filepath.Join(dir, "bash-completion", name)+" && complete -p "+name)
			if !strings.Contains(r.stdout, name) {
				t.Errorf("bash completion of %s registers nothing: %s", name, r)
			}
		}
	}
	// The page of status documents --json, and renders.
	page := filepath.Join(dir, "man1", "rblk-attach-status.1")
	var text string
	switch {
	case hasTool("man"):
		r := mustRun(t, time.Minute, "man", "-l", "-P", "cat", page)
		text = r.stdout
		if strings.Contains(r.stderr, "warning") {
			t.Errorf("man -l %s warns:\n%s", page, r.stderr)
		}
	case hasTool("groff"):
		text = mustRun(t, time.Minute, "groff", "-man", "-Tutf8", page).stdout
	default:
		t.Logf("neither man nor groff is installed: the page is not rendered")
		return
	}
	if !strings.Contains(text, "--json") || !strings.Contains(text, "rblk-attach") {
		t.Errorf("the rendered page of rblk-attach status lacks --json:\n%s", text)
	}
}

func hasTool(name string) bool {
	_, ok := toolPath(name)
	return ok
}
