package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestList checks that rblk-attach list prints every export with its size
// and mode.
func TestList(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	beta := filepath.Join(dir, "beta.img")
	if err := os.WriteFile(beta, randomBytes(4, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	tg := startTarget(t, []string{"alpha=" + filepath.Join(dir, "alpha.img") + ",size=3M", "beta=" + beta + ",ro"})
	r := mustRun(t, 30*time.Second, attachBin, "list", "--host-id", "e2e-cli", "--transport", e2eTransport(), "--target", tg.addr)
	rows := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 {
			rows[f[0]] = f
		}
	}
	want := map[string][]string{
		"NAME":  {"NAME", "SIZE", "BYTES", "MODE"},
		"alpha": {"alpha", "3.0MiB", "3145728", "rw"},
		"beta":  {"beta", "1.0MiB", "1048576", "ro"},
	}
	if fmt.Sprint(rows) != fmt.Sprint(want) {
		t.Errorf("rblk-attach list printed:\n%s\nwant rows %v", r.stdout, want)
	}
	// size= created the missing file, sparse, of that size.
	if st, err := os.Stat(filepath.Join(dir, "alpha.img")); err != nil || st.Size() != 3<<20 {
		t.Errorf("alpha.img: %v, %v; want a 3 MiB file", st, err)
	}
	tg.stop(t, stopTimeout)
}

// logLine matches the lines of rblk's console logger, which may come before
// the error line.
var logLine = regexp.MustCompile(`^\d{4}-\d\d-\d\dT\S+\t(DEBUG|INFO|WARN)\t`)

// wantCLIError runs a command that must fail at once: exit non-zero,
// nothing on stdout, and one error line on stderr (beside log lines) that
// starts with the program's name and contains each of wants.
func wantCLIError(t *testing.T, bin string, wants []string, args ...string) {
	t.Helper()
	r := run(t, 30*time.Second, bin, args...)
	prog := filepath.Base(bin)
	if r.code == 0 {
		t.Fatalf("%s %s succeeded, want a failure: %s", prog, strings.Join(args, " "), r)
	}
	if strings.TrimSpace(r.stdout) != "" {
		t.Errorf("%s %s printed on stdout: %q", prog, strings.Join(args, " "), r.stdout)
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(r.stderr, "\n"), "\n") {
		if !logLine.MatchString(l) {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 {
		t.Fatalf("%s %s: want one error line on stderr, got %d: %s", prog, strings.Join(args, " "), len(lines), r)
	}
	line := lines[0]
	if !strings.HasPrefix(line, prog+": ") {
		t.Errorf("error line %q does not start with %q", line, prog+": ")
	}
	for _, w := range wants {
		if !strings.Contains(strings.ToLower(line), strings.ToLower(w)) {
			t.Errorf("%s %s: error line %q does not mention %q", prog, strings.Join(args, " "), line, w)
		}
	}
	if strings.Contains(r.stderr, "panic") || strings.Contains(r.stderr, "Usage:") {
		t.Errorf("stderr has a panic or a usage dump: %s", r.stderr)
	}
}

// cliCase is a command line that must fail with an error line containing
// wants.
type cliCase struct {
	name  string
	bin   string
	args  []string
	wants []string
}

// TestCLIErrors checks that mistakes and unusable environments end the
// tools at once with one line naming the cause.
func TestCLIErrors(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "command lines and the software transport's errors (connection refused, a TCP port in use), and --transport rdma on a machine without a device; the verbs provider's dial and listen errors are its own tests' (transport/rdma)")
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.img")
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyAddr := busy.Addr().String()
	tg := startTarget(t, []string{"vol=" + img})
	sock := filepath.Join(sockDir(t), "nbd.sock")
	free := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	attach := func(extra ...string) []string {
		return append([]string{"attach", "--host-id", "e2e-cli", "--transport", "tcp", "--target", tg.addr, "--export", "vol",
			"--nbd-listen", "unix:" + sock}, extra...)
	}
	serve := func(extra ...string) []string {
		return append([]string{"serve", "--transport", "tcp", "--listen", free, "--export", "vol=" + img}, extra...)
	}

	cases := []cliCase{
		{"rblkd bad flag", rblkdBin, serve("--bogus"), []string{"unknown flag: --bogus"}},
		{"rblkd unknown command", rblkdBin, []string{"frobnicate"}, []string{"unknown command", "frobnicate"}},
		{"rblkd no export", rblkdBin, []string{"serve", "--transport", "tcp", "--listen", free}, []string{"--export"}},
		{"rblkd malformed export", rblkdBin, []string{"serve", "--transport", "tcp", "--export", "novalue"}, []string{"NAME=PATH"}},
		{"rblkd bad export option", rblkdBin, serve("--export", "w="+img+",rw,fast"), []string{"fast"}},
		{"rblkd bad size", rblkdBin, serve("--cache-size", "lots"), []string{"--cache-size", "lots"}},
		{"rblkd bad chunk size", rblkdBin, serve("--chunk-size", "3K"), []string{"chunk size"}},
		{"rblkd cache below 4 chunks", rblkdBin, serve("--cache-size", "2M", "--chunk-size", "1M"), []string{"cache"}},
		{"rblkd bad transport", rblkdBin, []string{"serve", "--transport", "pigeon", "--export", "vol=" + img}, []string{"--transport", "pigeon"}},
		{"rblkd bad log format", rblkdBin, serve("--log-format", "xml"), []string{"log-format"}},
		{"rblkd missing export file", rblkdBin, []string{"serve", "--transport", "tcp", "--listen", free, "--export", "m=" + missing},
			[]string{missing, "no such file"}},
		{"rblkd listen port in use", rblkdBin, []string{"serve", "--transport", "tcp", "--listen", busyAddr, "--export", "vol=" + img},
			[]string{"--listen", busyAddr, "address already in use"}},
		{"rblkd metrics port in use", rblkdBin, serve("--metrics-listen", busyAddr), []string{"--metrics-listen", "address already in use"}},
		{"rblkd pprof without metrics", rblkdBin, serve("--debug-pprof"), []string{"--debug-pprof needs --metrics-listen"}},
		{"rblk-attach bad flag", attachBin, attach("--bogus"), []string{"unknown flag: --bogus"}},
		{"rblk-attach unknown command", attachBin, []string{"detonate"}, []string{"unknown command", "detonate"}},
		{"rblk-attach no target", attachBin, []string{"attach", "--host-id", "e2e-cli", "--export", "vol", "--nbd-listen", "unix:" + sock}, []string{"--target"}},
		{"rblk-attach no export", attachBin, []string{"attach", "--host-id", "e2e-cli", "--target", tg.addr, "--nbd-listen", "unix:" + sock}, []string{"--export"}},
		{"rblk-attach no nbd-listen", attachBin, []string{"attach", "--host-id", "e2e-cli", "--target", tg.addr, "--export", "vol"}, []string{"--nbd-listen"}},
		{"rblk-attach bad nbd-listen", attachBin, []string{"attach", "--host-id", "e2e-cli", "--transport", "tcp", "--target", tg.addr, "--export", "vol", "--nbd-listen", "/tmp/x.sock"},
			[]string{"unix:PATH"}},
		{"rblk-attach nbd port in use", attachBin, []string{"attach", "--host-id", "e2e-cli", "--transport", "tcp", "--target", tg.addr, "--export", "vol", "--nbd-listen", "tcp:" + busyAddr},
			[]string{"--nbd-listen", "address already in use"}},
		{"rblk-attach metrics port in use", attachBin, attach("--metrics-listen", busyAddr), []string{"--metrics-listen", "address already in use"}},
		{"rblk-attach pprof without metrics", attachBin, attach("--debug-pprof"), []string{"--debug-pprof needs --metrics-listen"}},
		{"rblk-attach no such export", attachBin, []string{"attach", "--host-id", "e2e-cli", "--transport", "tcp", "--target", tg.addr, "--export", "nope", "--nbd-listen", "unix:" + sock},
			[]string{`"nope"`}},
		{"rblk-attach target down", attachBin, []string{"attach", "--host-id", "e2e-cli", "--transport", "tcp", "--target", free, "--export", "vol", "--nbd-listen", "unix:" + sock},
			[]string{free, "connection refused"}},
		{"rblk-attach list target down", attachBin, []string{"list", "--host-id", "e2e-cli", "--transport", "tcp", "--target", free}, []string{"connection refused"}},
		{"rblk-attach list no target", attachBin, []string{"list"}, []string{"--target"}},
	}
	// --transport rdma on a host without RDMA devices.
	if ents, _ := os.ReadDir("/sys/class/infiniband"); len(ents) == 0 {
		noDev := []string{"--transport rdma", "no RDMA device"}
		cases = append(cases,
			cliCase{"rblkd rdma without device", rblkdBin, []string{"serve", "--transport", "rdma", "--listen", free, "--export", "vol=" + img}, noDev},
			cliCase{"rblk-attach rdma without device", attachBin, []string{"attach", "--host-id", "e2e-cli", "--transport", "rdma", "--target", tg.addr, "--export", "vol", "--nbd-listen", "unix:" + sock}, noDev},
			cliCase{"rblk-attach list rdma without device", attachBin, []string{"list", "--host-id", "e2e-cli", "--transport", "rdma", "--target", tg.addr}, noDev},
		)
	} else {
		t.Logf("this host has RDMA devices (%d in /sys/class/infiniband): not checking --transport rdma without one", len(ents))
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { wantCLIError(t, c.bin, c.wants, c.args...) })
	}
	// None of the failed attempts disturbed the running target, and none
	// created the missing file.
	if _, err := os.Stat(missing); err == nil {
		t.Errorf("%s was created by a failed rblkd", missing)
	}
	waitMetric(t, tg.metrics, "rblkd_sessions", func(v float64) bool { return v == 0 }, "0 after the failed attaches")
	tg.stop(t, stopTimeout)
}
