package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Paths of the binaries TestMain builds (or finds in RBLK_E2E_BIN_DIR).
var (
	rblkdBin  string
	attachBin string
)

// logDir (RBLK_E2E_LOG_DIR) keeps the output of every process a test
// starts, in DIR/TEST/NAME-N.log, written as it comes: what a soak greps
// for panics and races, and what is left when the test binary dies.
var logDir string

// timeScale (RBLK_E2E_TIME_SCALE, a number >= 1, default 1) stretches the
// suite's give-up bounds, through patient: how long a test waits for a
// daemon to be ready, a metric to move, a command or fio to end, a process
// to stop, before it fails. Under emulation (the guest of
// scripts/vm-test.sh: qemu's TCG, binaries built with -race, several tests
// at once on two vCPUs) everything takes several times longer, and a bound
// sized for a real machine fails a test that is only slow. What a test
// asserts about time (a fast-fail time, a keepalive, a refusal that must
// come at once) is not scaled, and a test whose IO is only there to keep
// the data path busy may do less of it (emulated).
var timeScale = 1.0

// patient is d stretched by RBLK_E2E_TIME_SCALE: a give-up bound.
func patient(d time.Duration) time.Duration { return time.Duration(float64(d) * timeScale) }

// emulated reports whether the suite runs stretched (RBLK_E2E_TIME_SCALE > 1).
func emulated() bool { return timeScale > 1 }

func parseTimeScale() error {
	v := os.Getenv("RBLK_E2E_TIME_SCALE")
	if v == "" {
		return nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 1 || f > 100 {
		return fmt.Errorf("RBLK_E2E_TIME_SCALE=%q: want a number from 1 to 100", v)
	}
	timeScale = f
	return nil
}

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	c, err := parseCombo()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	e2e = c
	if err := parseTimeScale(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	if timeScale != 1 {
		fmt.Fprintf(os.Stderr, "e2e: give-up bounds stretched %gx (RBLK_E2E_TIME_SCALE)\n", timeScale)
	}
	if d := os.Getenv("RBLK_E2E_LOG_DIR"); d != "" {
		if err := os.MkdirAll(d, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: RBLK_E2E_LOG_DIR:", err)
			return 1
		}
		logDir = d
	}
	if d := os.Getenv("RBLK_E2E_BIN_DIR"); d != "" {
		// Binaries built elsewhere (the guest of vm/ has no time to build
		// under emulation): used as they are.
		rblkdBin, attachBin = filepath.Join(d, "rblkd"), filepath.Join(d, "rblk-attach")
		for _, b := range []string{rblkdBin, attachBin} {
			if st, err := os.Stat(b); err != nil || st.Mode()&0o111 == 0 {
				fmt.Fprintf(os.Stderr, "e2e: RBLK_E2E_BIN_DIR=%s: no executable %s (%v)\n", d, filepath.Base(b), err)
				return 1
			}
		}
	} else {
		dir, err := os.MkdirTemp("", "rblk-e2e-bin-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "e2e:", err)
			return 1
		}
		defer os.RemoveAll(dir)
		if err := buildBinaries(dir); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: build:", err)
			return 1
		}
		rblkdBin = filepath.Join(dir, "rblkd")
		attachBin = filepath.Join(dir, "rblk-attach")
	}
	fmt.Printf("e2e: %s; rblkd %s, rblk-attach %s\n", e2e, rblkdBin, attachBin)
	code := m.Run()
	fmt.Print(notApplicableSummary())
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: goroutines left behind:", err)
			code = 1
		}
	}
	return code
}

// goTool finds the go command: on PATH, else where Debian and the official
// tarball put it.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	for _, p := range []string{"/usr/local/go/bin/go", "/usr/lib/go/bin/go"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "go"
}

func buildBinaries(dir string) error {
	args := []string{"build"}
	if os.Getenv("RBLK_E2E_RACE") == "1" {
		args = append(args, "-race")
	}
	// RBLK_E2E_TAGS: build tags of the binaries; over rdma at least rdma
	// (the verbs provider).
	tags := os.Getenv("RBLK_E2E_TAGS")
	if e2e.transport == "rdma" && !slices.Contains(strings.Split(tags, ","), "rdma") {
		tags = strings.TrimPrefix(tags+",rdma", ",")
	}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	args = append(args, "-o", dir+string(filepath.Separator),
		"github.com/rblk/rblk/cmd/rblkd", "github.com/rblk/rblk/cmd/rblk-attach")
	cmd := exec.Command(goTool(), args...)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	return cmd.Run()
}

// requireEnv reports whether a missing tool or privilege must fail the test
// instead of skipping it.
func requireEnv() bool { return os.Getenv("RBLK_E2E_REQUIRE") == "1" }

// skipOrFail skips t with the reason, or fails it under RBLK_E2E_REQUIRE=1.
func skipOrFail(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if requireEnv() {
		t.Fatalf("%s (RBLK_E2E_REQUIRE=1: not skipping)", msg)
	}
	t.Skip(msg)
}

// toolPath finds a tool on PATH or in the sbin folders, which a non-login
// root shell may lack on its PATH.
func toolPath(name string) (string, bool) {
	if p, err := exec.LookPath(name); err == nil {
		return p, true
	}
	for _, d := range []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, true
		}
	}
	return "", false
}

// needTools skips (or fails) t unless every tool is installed.
func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, name := range tools {
		if _, ok := toolPath(name); !ok {
			skipOrFail(t, "%s is not installed (Debian package %s)", name, debPackage(name))
		}
	}
}

func debPackage(tool string) string {
	switch tool {
	case "qemu-io", "qemu-img":
		return "qemu-utils"
	case "nbdinfo", "nbdcopy":
		return "libnbd-bin"
	case "fusermount3":
		return "fuse3"
	case "mkfs.ext4", "e2fsck":
		return "e2fsprogs"
	case "losetup", "mount", "umount":
		return "util-linux"
	}
	return tool
}

// needRootAndFUSE skips (or fails) t unless it runs as root with /dev/fuse
// and loop devices.
func needRootAndFUSE(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		skipOrFail(t, "needs root for losetup and mount (running as uid %d)", os.Geteuid())
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		skipOrFail(t, "needs /dev/fuse for nbdfuse: %v", err)
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		skipOrFail(t, "needs loop devices (/dev/loop-control): %v", err)
	}
}

// syncBuffer collects a process's output.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// proc is a daemon started by a test: rblkd, rblk-attach or nbdfuse.
type proc struct {
	name    string
	cmd     *exec.Cmd
	out     *syncBuffer
	done    chan struct{}
	waitErr error
	checked atomic.Bool // checkOutput ran
}

// startProc starts bin with args. A cleanup kills it if the test did not
// stop it, and prints its output if the test failed.
func startProc(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	return startProcEnv(t, name, nil, bin, args...)
}

// startProcEnv is startProc with env ("KEY=VALUE") added to the test's
// environment.
func startProcEnv(t *testing.T, name string, env []string, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, out: &syncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	if env != nil {
		p.cmd.Env = append(os.Environ(), env...)
	}
	var out io.Writer = p.out
	var logFile *os.File
	if logDir != "" {
		logFile = openProcLog(t, name)
		fmt.Fprintf(logFile, "# %s %s\n", bin, strings.Join(args, " "))
		out = io.MultiWriter(p.out, logFile)
	}
	p.cmd.Stdout = out
	p.cmd.Stderr = out
	// If the test binary dies, so do its daemons.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		if logFile != nil {
			logFile.Close()
		}
		t.Fatalf("start %s: %v", name, err)
	}
	t.Logf("started %s (pid %d): %s %s", name, p.cmd.Process.Pid, filepath.Base(bin), strings.Join(args, " "))
	go func() {
		p.waitErr = p.cmd.Wait()
		if logFile != nil {
			fmt.Fprintf(logFile, "# exited: %v\n", p.waitErr)
			logFile.Close()
		}
		close(p.done)
	}()
	t.Cleanup(func() {
		if !p.exited() {
			t.Logf("cleanup: killing %s (pid %d), still running", name, p.cmd.Process.Pid)
			if t.Failed() && (name == "rblkd" || name == "rblk-attach") {
				// A hang is why many tests fail here: the Go runtime
				// prints every goroutine's stack on SIGQUIT, into
				// the output shown below.
				p.cmd.Process.Signal(syscall.SIGQUIT)
				select {
				case <-p.done:
				case <-time.After(patient(10 * time.Second)):
				}
			}
			p.cmd.Process.Kill()
			<-p.done
		}
		// A panic or a race of a daemon fails the test, however the
		// daemon ended (killed, exited by itself, or stopped).
		if name == "rblkd" || name == "rblk-attach" {
			p.checkOutput(t)
		}
		if t.Failed() {
			t.Logf("output of %s:\n%s", name, p.out.String())
		}
	})
	return p
}

var procLogSeq sync.Map // test name -> *atomic.Int64

// openProcLog creates RBLK_E2E_LOG_DIR/TEST/NAME-N.log.
func openProcLog(t *testing.T, name string) *os.File {
	t.Helper()
	dir := filepath.Join(logDir, strings.NewReplacer("/", "__", " ", "_").Replace(t.Name()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("RBLK_E2E_LOG_DIR: %v", err)
	}
	v, _ := procLogSeq.LoadOrStore(t.Name(), new(atomic.Int64))
	n := v.(*atomic.Int64).Add(1)
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("%s-%d.log", name, n)))
	if err != nil {
		t.Fatalf("RBLK_E2E_LOG_DIR: %v", err)
	}
	return f
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and requires a clean exit 0 within the timeout, with no
// panic or data race in the output.
func (p *proc) stop(t *testing.T, timeout time.Duration) {
	t.Helper()
	if p.exited() {
		t.Fatalf("%s exited before it was stopped: %v\n%s", p.name, p.waitErr, p.out.String())
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM %s: %v", p.name, err)
	}
	timeout = patient(timeout)
	select {
	case <-p.done:
	case <-time.After(timeout):
		p.cmd.Process.Kill()
		<-p.done
		t.Fatalf("%s did not exit within %v of SIGTERM\n%s", p.name, timeout, p.out.String())
	}
	if p.waitErr != nil {
		t.Fatalf("%s exited with %v after SIGTERM, want exit 0\n%s", p.name, p.waitErr, p.out.String())
	}
	p.checkOutput(t)
}

// checkOutput fails t if the process panicked or raced (once per process).
func (p *proc) checkOutput(t *testing.T) {
	t.Helper()
	if !p.checked.CompareAndSwap(false, true) {
		return
	}
	out := p.out.String()
	for _, bad := range []string{"panic:", "WARNING: DATA RACE", "fatal error:"} {
		if strings.Contains(out, bad) {
			t.Errorf("%s output has %q:\n%s", p.name, bad, out)
		}
	}
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	givenMu.Lock()
	defer givenMu.Unlock()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		// A port handed out before may be held by an rblkd of another
		// test over rdma, whose listener the TCP port table does not see:
		// each port goes to one caller only.
		if !given[port] {
			given[port] = true
			return port
		}
	}
}

// lostPortRace reports whether rblkd p, started on free ports for the
// attempt-th time, exited because one was taken meanwhile (by another
// process: over rdma, an active connection's port of the RDMA CM), and
// may be started again on others.
func lostPortRace(t *testing.T, p *proc, attempt int) bool {
	t.Helper()
	if p.exited() && strings.Contains(p.out.String(), "address already in use") && attempt < 3 {
		t.Logf("rblkd lost a port race, retrying")
		return true
	}
	return false
}

var (
	givenMu sync.Mutex
	given   = map[int]bool{} // ports freePort handed out
)

// sockDir is a short temporary folder for unix sockets (their paths are
// limited to 107 bytes).
func sockDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "rblk-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// target is a running rblkd.
type target struct {
	*proc
	addr    string // HOST:PORT initiators dial
	metrics string // HOST:PORT of /metrics
}

// startTarget starts rblkd serve on free ports with the given --export
// values and extra flags, and waits until it accepts. It listens on this
// run's transport and address (RBLK_E2E_TRANSPORT, RBLK_E2E_ADDR): rblkd
// serve --transport T --listen ADDR:PORT, with --allow-unauthenticated on a
// non-loopback address unless extra has --auth-file (the loopback address
// of the tcp run needs neither).
func startTarget(t *testing.T, exports []string, extra ...string) *target {
	t.Helper()
	for attempt := 1; ; attempt++ {
		addr := hostPort(freePort(t))
		metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		p := startProc(t, "rblkd", rblkdBin, serveArgs(addr, metrics, exports, extra)...)
		tg := &target{proc: p, addr: addr, metrics: metrics}
		err := waitUntil(p, 20*time.Second, tg.ready)
		if err == nil {
			return tg
		}
		if lostPortRace(t, p, attempt) {
			continue
		}
		t.Fatalf("rblkd not ready: %v\n%s", err, p.out.String())
	}
}

// serveArgs is the command line of rblkd serve on this run's transport.
func serveArgs(addr, metrics string, exports, extra []string) []string {
	args := []string{"serve", "--transport", e2eTransport(), "--listen", addr, "--metrics-listen", metrics}
	for _, e := range exports {
		args = append(args, "--export", e)
	}
	if !loopbackHost() && !slices.Contains(extra, "--auth-file") && !slices.Contains(extra, "--allow-unauthenticated") {
		// (the address is the guest's own, reached by nothing else)
		args = append(args, "--allow-unauthenticated")
	}
	if !slices.Contains(extra, "--admin-socket") && !slices.Contains(extra, "--config") {
		// Not the machine's /run/rblk/rblkd.sock (as root): a test that
		// wants an admin socket names its own, here or in its --config.
		args = append(args, "--admin-socket", "")
	}
	return append(args, extra...)
}

// ready says whether rblkd serves: over tcp its port accepts, over rdma
// (no TCP port to try) it logged that it listens; and /metrics answers.
func (tg *target) ready() bool {
	if e2e.transport == "tcp" {
		c, err := net.DialTimeout("tcp", tg.addr, time.Second)
		if err != nil {
			return false
		}
		c.Close()
	} else if !strings.Contains(tg.out.String(), "rblkd serving") {
		return false
	}
	return httpOK("http://" + tg.metrics + "/metrics")
}

// attacher is a running rblk-attach.
type attacher struct {
	*proc
	// sock is the path of the NBD unix socket; with RBLK_E2E_DEVICE=nbd
	// it is the block device, /dev/nbdN (dialNBD takes either).
	sock    string
	dev     string // /dev/nbdN with RBLK_E2E_DEVICE=nbd, else ""
	metrics string
}

// uri is the NBD URI of export name ("" for the default export), for
// qemu-io, qemu-img, nbdinfo, nbdfuse and fioTarget; with
// RBLK_E2E_DEVICE=nbd it is the block device (one volume, whatever name).
func (a *attacher) uri(name string) string {
	if a.dev != "" {
		return a.dev
	}
	return "nbd+unix:///" + name + "?socket=" + a.sock
}

// devRE finds the device in rblk-attach --device's "attached" log line,
// which comes once Attach returned: not in the kernel package's "nbd device
// attached" before it, after which Attach may still detach the device and
// attach it again (the kernel did not read every socket: in the guest a
// test's IO then met the device going away and its FLUSH got EIO).
var devRE = regexp.MustCompile(`\tattached\t\{"device": "(/dev/nbd[0-9]+)"`)

// startAttach attaches export of tg over this run's transport and waits
// until it serves: with --nbd-listen on a unix socket in a fresh folder
// (until its NBD server greets), or with RBLK_E2E_DEVICE=nbd as the kernel's
// device (--device auto, until it says which /dev/nbdN it attached).
func startAttach(t *testing.T, tg *target, export string, extra ...string) *attacher {
	t.Helper()
	sock := filepath.Join(sockDir(t), "nbd.sock")
	for attempt := 1; ; attempt++ {
		metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		args := []string{"attach", "--transport", e2eTransport(), "--target", tg.addr, "--export", export, "--metrics-listen", metrics}
		if e2e.device == "nbd" {
			// As many kernel sockets as queues (--queues, else one), as an
			// NBD client on the socket has: one session per queue.
			conns := "1"
			if i := slices.Index(extra, "--queues"); i >= 0 && i+1 < len(extra) {
				conns = extra[i+1]
			}
			args = append(args, "--device", "auto", "--connections", conns)
		} else {
			args = append(args, "--nbd-listen", "unix:"+sock)
		}
		if !slices.Contains(extra, "--host-id") {
			// Each attacher is a host of its own (and the machine's
			// /etc/rblk/hostid is left alone): a second attach of one
			// host and export would be refused.
			args = append(args, "--host-id", fmt.Sprintf("e2e-%s-%d", filepath.Base(sock[:len(sock)-len("/nbd.sock")]), attempt))
		}
		if !slices.Contains(extra, "--state-dir") {
			// Status files beside the socket, not in this machine's /run.
			args = append(args, "--state-dir", filepath.Join(filepath.Dir(sock), "state"))
		}
		args = append(args, extra...)
		p := startProc(t, "rblk-attach", attachBin, args...)
		a := &attacher{proc: p, sock: sock, metrics: metrics}
		var err error
		if e2e.device == "nbd" {
			err = waitUntil(p, 60*time.Second, func() bool {
				m := devRE.FindStringSubmatch(p.out.String())
				if m != nil {
					a.dev, a.sock = m[1], m[1]
				}
				return m != nil
			})
		} else {
			err = waitUntil(p, 30*time.Second, func() bool { return nbdGreets(sock) })
		}
		if err == nil {
			return a
		}
		// (a device the kernel has not quite let go of answers EBUSY)
		if p.exited() && attempt < 3 && (strings.Contains(p.out.String(), "address already in use") ||
			e2e.device == "nbd" && strings.Contains(p.out.String(), "busy")) {
			t.Logf("rblk-attach lost a port or device race, retrying")
			continue
		}
		t.Fatalf("rblk-attach not ready: %v\n%s", err, p.out.String())
	}
}

// nbdGreets reports whether an NBD server on sock sends its greeting.
func nbdGreets(sock string) bool {
	c, err := net.DialTimeout("unix", sock, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	var magic [8]byte
	if _, err := io.ReadFull(c, magic[:]); err != nil {
		return false
	}
	return string(magic[:]) == "NBDMAGIC"
}

// waitUntil polls ready until it holds, p exits, or the timeout passes.
func waitUntil(p *proc, timeout time.Duration, ready func() bool) error {
	timeout = patient(timeout)
	deadline := time.Now().Add(timeout)
	for {
		if p.exited() {
			return fmt.Errorf("%s exited: %v", p.name, p.waitErr)
		}
		if ready() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v", p.name, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func httpOK(url string) bool {
	c := http.Client{Timeout: patient(2 * time.Second)}
	resp, err := c.Get(url)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return resp.StatusCode == http.StatusOK
}

// result is the outcome of a command run to completion.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// runWithin is run, but returns nil instead of failing t on the timeout.
func runWithin(t *testing.T, timeout time.Duration, name string, args ...string) *result {
	t.Helper()
	r, ok := runCmd(t, timeout, name, args...)
	if !ok {
		return nil
	}
	return &r
}

// run runs a command to completion within timeout. Only a failure to run it
// at all (or the timeout) fails t; the exit code is the caller's to judge.
func run(t *testing.T, timeout time.Duration, name string, args ...string) result {
	t.Helper()
	r, ok := runCmd(t, timeout, name, args...)
	if !ok {
		t.Fatalf("%s %s: timed out after %v\n%s", name, strings.Join(args, " "), timeout, r)
	}
	return r
}

func runCmd(t *testing.T, timeout time.Duration, name string, args ...string) (result, bool) {
	t.Helper()
	path := name
	if !strings.Contains(name, "/") {
		if p, ok := toolPath(name); ok {
			path = p
		}
	}
	timeout = patient(timeout)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	start := time.Now()
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Logf("%s %s: timed out after %v\n%s", name, strings.Join(args, " "), timeout, r)
		return r, false
	case errors.As(err, &ee):
		r.code = ee.ExitCode()
	case err != nil:
		t.Fatalf("%s: %v", name, err)
	}
	t.Logf("ran %s %s: exit %d in %v", filepath.Base(name), strings.Join(args, " "), r.code, time.Since(start).Round(time.Millisecond))
	return r, true
}

// mustRun runs a command and fails t unless it exits 0.
func mustRun(t *testing.T, timeout time.Duration, name string, args ...string) result {
	t.Helper()
	r := run(t, timeout, name, args...)
	if r.code != 0 {
		t.Fatalf("%s %s failed: %s", name, strings.Join(args, " "), r)
	}
	return r
}

// scrape returns the text of a /metrics page.
func scrape(t *testing.T, addr string) string {
	t.Helper()
	c := http.Client{Timeout: patient(5 * time.Second)}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: status %d, %v", addr, resp.StatusCode, err)
	}
	return string(b)
}

var sampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)`)

// metricSum adds up every sample of the metric called name whose labels
// contain each of labels (as `op="write"`). found is false if there is none.
func metricSum(text, name string, labels ...string) (sum float64, found bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		m := sampleRE.FindStringSubmatch(sc.Text())
		if m == nil || m[1] != name {
			continue
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(m[2], l) {
				ok = false
			}
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			continue
		}
		sum += v
		found = true
	}
	return sum, found
}

// metric scrapes addr and returns the sum of name's samples, failing t if
// the metric is absent.
func metric(t *testing.T, addr, name string, labels ...string) float64 {
	t.Helper()
	v, ok := metricSum(scrape(t, addr), name, labels...)
	if !ok {
		t.Fatalf("metric %s%v absent from http://%s/metrics", name, labels, addr)
	}
	return v
}

// waitMetric polls the metric name at addr until ok holds of it, failing t
// after 15 seconds.
func waitMetric(t *testing.T, addr, name string, ok func(float64) bool, want string) float64 {
	t.Helper()
	deadline := time.Now().Add(patient(15 * time.Second))
	for {
		v := metric(t, addr, name)
		if ok(v) {
			return v
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %v at http://%s/metrics, want %s", name, v, addr, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func sha256File(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// firstDiff describes where got and want differ, or returns "".
func firstDiff(got, want []byte) string {
	if len(got) != len(want) {
		return fmt.Sprintf("length %d, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			j := i
			for j < len(got) && got[j] != want[j] {
				j++
			}
			n := 0
			for k := i; k < len(got); k++ {
				if got[k] != want[k] {
					n++
				}
			}
			return fmt.Sprintf("%d bytes differ; first run [%d, %d): got % x..., want % x...",
				n, i, j, got[i:min(j, i+8)], want[i:min(j, i+8)])
		}
	}
	return ""
}

// randomBytes returns size pseudo-random bytes determined by seed.
func randomBytes(seed int64, size int) []byte {
	b := make([]byte, size)
	x := uint64(seed)*0x9E3779B97F4A7C15 + 1
	for i := range b {
		// xorshift64*: deterministic, fast, good enough for test data.
		x ^= x >> 12
		x ^= x << 25
		x ^= x >> 27
		b[i] = byte((x * 0x2545F4914F6CDD1D) >> 56)
	}
	return b
}
