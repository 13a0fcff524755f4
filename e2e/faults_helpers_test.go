package e2e

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/internal/faultproxy"
)

// Helpers of the fault tests (faults_test.go): a slow backing store outside
// rblkd, restarting rblkd on the same address, a proxy between rblk-attach
// and rblkd, and a pipelined use of the raw NBD client.

// newFlags returns flags that exist only once the fixes of "Nothing lost,
// nothing hangs" are in (--host-id, --keepalive-timeout, --io-timeout).
// RBLK_E2E_WITHOUT_NEW_FLAGS=1 leaves them out, to show what a tree without
// them does under the same fault.
func newFlags(flags ...string) []string {
	if os.Getenv("RBLK_E2E_WITHOUT_NEW_FLAGS") == "1" {
		return nil
	}
	return flags
}

// faultSeed is the seed of a test's random choices: RBLK_FAULT_SEED if set,
// else the clock. It is logged so that a failure can be run again.
func faultSeed(t *testing.T) *rand.Rand {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("RBLK_FAULT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("RBLK_FAULT_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (RBLK_FAULT_SEED=%d repeats this run)", seed, seed)
	return rand.New(rand.NewPCG(seed, seed^0x5eed))
}

// pollUntil polls cond every 20 ms until it holds, failing t with what
// after timeout.
func pollUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	timeout = patient(timeout)
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// slowDisk is a file behind nbdkit's delay filter, shown as a file by
// nbdfuse: rblkd exports file, whose writes reach real after wdelay each,
// and whose fdatasync reaches nbdkit as an NBD FLUSH (fdatasync of real).
// nbdkit's log filter records every request in log.
type slowDisk struct {
	real, file, log string
	mnt             string
	nbdkit, nbdfuse *proc
}

// startSlowDisk creates real with the given content and starts nbdkit and
// nbdfuse over it. A cleanup unmounts it once the processes using the file
// were stopped (their cleanups run first: they are registered later).
func startSlowDisk(t *testing.T, content []byte, wdelay string) *slowDisk {
	t.Helper()
	needTools(t, "nbdkit", "nbdfuse", "fusermount3")
	if _, err := os.Stat("/dev/fuse"); err != nil {
		skipOrFail(t, "needs /dev/fuse for nbdfuse: %v", err)
	}
	dir := sockDir(t)
	d := &slowDisk{real: filepath.Join(dir, "real.img"), log: filepath.Join(dir, "nbdkit.log"), mnt: filepath.Join(dir, "mnt")}
	if err := os.WriteFile(d.real, content, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(d.mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "nbdkit.sock")
	nbdkit, _ := toolPath("nbdkit")
	d.nbdkit = startProc(t, "nbdkit", nbdkit, "-f", "--exit-with-parent", "-U", sock,
		"--filter=log", "--filter=delay", "file", d.real, "wdelay="+wdelay, "logfile="+d.log)
	if err := waitUntil(d.nbdkit, 20*time.Second, func() bool { return nbdGreets(sock) }); err != nil {
		t.Fatalf("nbdkit: %v\n%s", err, d.nbdkit.out.String())
	}
	pidfile := filepath.Join(dir, "nbdfuse.pid")
	d.file = filepath.Join(d.mnt, "disk")
	nbdfuse, _ := toolPath("nbdfuse")
	d.nbdfuse = startProc(t, "nbdfuse", nbdfuse, "-P", pidfile, d.file, "nbd+unix:///?socket="+sock)
	t.Cleanup(func() { d.unmount(t) })
	err := waitUntil(d.nbdfuse, 20*time.Second, func() bool {
		_, perr := os.Stat(pidfile)
		_, ferr := os.Stat(d.file)
		return perr == nil && ferr == nil
	})
	if err != nil {
		t.Fatalf("nbdfuse: %v\n%s", err, d.nbdfuse.out.String())
	}
	return d
}

// unmount unmounts nbdfuse (retrying while the file is busy) and waits for
// it to exit.
func (d *slowDisk) unmount(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(patient(20 * time.Second))
	for !d.nbdfuse.exited() {
		if r, ok := runCmd(t, cmdTimeout, "fusermount3", "-u", d.mnt); ok && r.code == 0 {
			break
		}
		if time.Now().After(deadline) {
			runCmd(t, cmdTimeout, "fusermount3", "-u", "-z", d.mnt)
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-d.nbdfuse.done:
	case <-time.After(patient(20 * time.Second)):
		t.Errorf("nbdfuse did not exit after fusermount3 -u")
	}
}

// logCounts counts nbdkit's requests of kind (Write, Flush, ...) in its
// log: started, and finished with return=0.
func (d *slowDisk) logCounts(t *testing.T, kind string) (started, ok int) {
	t.Helper()
	f, err := os.Open(d.log)
	if err != nil {
		t.Fatalf("nbdkit log: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.Contains(l, " "+kind+" id="):
			started++
		case strings.Contains(l, " ..."+kind+" id=") && strings.Contains(l, "return=0"):
			ok++
		}
	}
	return started, ok
}

// waitQuiet waits until every request nbdkit started has finished: after
// a writer of the file died, nothing more lands on real.
func (d *slowDisk) waitQuiet(t *testing.T) {
	t.Helper()
	pollUntil(t, 30*time.Second, "nbdkit finishing its requests", func() bool {
		s, ok := d.logCounts(t, "Write")
		fs, fok := d.logCounts(t, "Flush")
		return s == ok && fs == fok
	})
}

func (d *slowDisk) readReal(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(d.real)
	if err != nil {
		t.Fatalf("read the real backing file: %v", err)
	}
	return b
}

// startTargetOn starts rblkd on addr (a restart on the address initiators
// know), on this run's transport as startTarget does, and waits until its
// /metrics answers; the port may take a moment to be free.
func startTargetOn(t *testing.T, addr string, exports []string, extra ...string) *target {
	t.Helper()
	deadline := time.Now().Add(patient(20 * time.Second))
	for {
		metrics := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		p := startProc(t, "rblkd", rblkdBin, serveArgs(addr, metrics, exports, extra)...)
		tg := &target{proc: p, addr: addr, metrics: metrics}
		err := waitUntil(p, 20*time.Second, func() bool { return httpOK("http://" + metrics + "/metrics") })
		if err == nil {
			return tg
		}
		if p.exited() && strings.Contains(p.out.String(), "address already in use") && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		t.Fatalf("rblkd not ready on %s: %v\n%s", addr, err, p.out.String())
	}
}

// kill9 kills p with SIGKILL and waits for it to be gone.
func (p *proc) kill9(t *testing.T) {
	t.Helper()
	if p.exited() {
		t.Fatalf("%s exited before it was killed: %v\n%s", p.name, p.waitErr, p.out.String())
	}
	if err := p.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("SIGKILL %s: %v", p.name, err)
	}
	select {
	case <-p.done:
	case <-time.After(patient(30 * time.Second)):
		t.Fatalf("%s still running 30s after SIGKILL", p.name)
	}
}

// startProxy starts a fault proxy in front of addr, closed by a cleanup.
func startProxy(t *testing.T, addr string) *faultproxy.Proxy {
	t.Helper()
	px, err := faultproxy.New("127.0.0.1:0", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := px.Close(); err != nil {
			t.Errorf("close proxy: %v", err)
		}
	})
	return px
}

// ctxFor is a context with a timeout, cancelled by a cleanup.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patient(d))
	t.Cleanup(cancel)
	return ctx
}

// send writes one NBD request without waiting for its reply; recv reads
// the next simple reply. Together they keep a request in flight across a
// fault. recv reads the reply's header only: after a successful READ the
// caller reads the data.
func (n *nbdClient) send(typ uint16, off uint64, payload []byte) (uint64, error) {
	return n.sendLen(typ, off, uint32(len(payload)), payload)
}

// sendLen is send with the request's length given: a READ has no payload.
func (n *nbdClient) sendLen(typ uint16, off uint64, length uint32, payload []byte) (uint64, error) {
	n.handle++
	if n.dev != nil {
		n.dev.start(n.handle, typ, off, length, payload)
		return n.handle, nil
	}
	req := nbdRequest(n.handle, typ, off, length, payload)
	n.c.SetWriteDeadline(time.Now().Add(30 * time.Second))
	defer n.c.SetWriteDeadline(time.Time{})
	if _, err := n.c.Write(req); err != nil {
		return 0, fmt.Errorf("send NBD request: %w", err)
	}
	return n.handle, nil
}

func (n *nbdClient) recv(timeout time.Duration) (handle uint64, errno uint32, err error) {
	if n.dev != nil {
		return n.dev.recv(timeout)
	}
	n.c.SetReadDeadline(time.Now().Add(timeout))
	defer n.c.SetReadDeadline(time.Time{})
	var hdr [16]byte
	if _, err := io.ReadFull(n.c, hdr[:]); err != nil {
		return 0, 0, fmt.Errorf("read NBD reply: %w", err)
	}
	if m := binary.BigEndian.Uint32(hdr[0:4]); m != nbdReplyMagic {
		return 0, 0, fmt.Errorf("read NBD reply: magic %#x", m)
	}
	return binary.BigEndian.Uint64(hdr[8:16]), binary.BigEndian.Uint32(hdr[4:8]), nil
}

// mustWrite writes data at off and fails t unless the server says OK.
func (n *nbdClient) mustWrite(t *testing.T, off uint64, data []byte) {
	t.Helper()
	errno, _, err := n.do(nbdCmdWrite, off, uint32(len(data)), data)
	if err != nil || errno != 0 {
		t.Fatalf("NBD WRITE of %d bytes at %d: errno %d, %v", len(data), off, errno, err)
	}
}

// flush sends NBD_CMD_FLUSH and returns its errno.
func (n *nbdClient) flush(t *testing.T) uint32 {
	t.Helper()
	errno, _, err := n.do(nbdCmdFlush, 0, 0, nil)
	if err != nil {
		t.Fatalf("NBD FLUSH: %v", err)
	}
	return errno
}

// mustRead reads length bytes at off and fails t unless the server says OK.
func (n *nbdClient) mustRead(t *testing.T, off uint64, length int) []byte {
	t.Helper()
	errno, data, err := n.do(nbdCmdRead, off, uint32(length), nil)
	if err != nil || errno != 0 {
		t.Fatalf("NBD READ of %d bytes at %d: errno %d, %v", length, off, errno, err)
	}
	return data
}

const nbdEIO = 5

// Blocks written by the fault tests name themselves: every 16 bytes of a
// block are the magic, the block's number and the id of the write, so that
// what a block of the backing file holds says which write put it there.
const (
	blockSize  = 4096
	blockMagic = 0x726f6c6b // "rblk" backwards enough
)

func blockData(blk int, id uint32) []byte {
	b := make([]byte, blockSize)
	if id == 0 {
		return b // the initial content: zeroes
	}
	for i := 0; i < blockSize; i += 16 {
		binary.BigEndian.PutUint32(b[i:], blockMagic)
		binary.BigEndian.PutUint32(b[i+4:], uint32(blk))
		binary.BigEndian.PutUint32(b[i+8:], id)
		binary.BigEndian.PutUint32(b[i+12:], ^id)
	}
	return b
}

// blockID says which write a block holds: 0 for zeroes, -1 if it is
// neither zeroes nor one whole write of that block (torn or foreign).
func blockID(blk int, b []byte) int64 {
	id := binary.BigEndian.Uint32(b[8:])
	want := blockData(blk, id)
	if string(b) == string(want) {
		return int64(id)
	}
	return -1
}

// scrapeQuiet returns the text of a /metrics page, or "" if it cannot be
// had (the process may be gone): for sampling while something runs.
func scrapeQuiet(addr string) string {
	c := http.Client{Timeout: patient(2 * time.Second)}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return ""
	}
	return string(b)
}
