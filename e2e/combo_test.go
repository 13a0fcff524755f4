package e2e

import (
	"fmt"
	"net"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/internal/faultproxy"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// The combination under test: the transport between rblk-attach and rblkd
// and how rblk-attach shows the volume. One suite runs on each (see doc.go):
//
//	RBLK_E2E_TRANSPORT  tcp (default: the software provider) or rdma (the
//	                    verbs provider; the binaries and this test binary
//	                    are built with -tags rdma)
//	RBLK_E2E_ADDR       the address rblkd listens on: 127.0.0.1 by default;
//	                    over rdma the address of an RDMA device's netdev
//	                    (the guest's Soft-RoCE rxe0 has 192.0.2.1), required
//	RBLK_E2E_DEVICE     socket (default: rblk-attach --nbd-listen on a unix
//	                    socket, driven by userspace NBD clients) or nbd
//	                    (rblk-attach --device auto: the kernel's /dev/nbdN,
//	                    driven through the block device; root and the nbd
//	                    module)
//
// A test that cannot run on a combination says why in its code with
// notApplicable (or onlyTransport, needSocket): a deliberate, logged "not
// applicable", which RBLK_E2E_REQUIRE=1 allows, unlike a skip for a
// missing tool (skipOrFail). TestMain lists them at the end.
type combo struct {
	transport string // "tcp" or "rdma"
	host      string // the IP address rblkd listens on
	device    string // "socket" or "nbd"
}

// e2e is the combination of this run, set by TestMain (parseCombo).
var e2e = combo{transport: "tcp", host: "127.0.0.1", device: "socket"}

// parseCombo reads RBLK_E2E_TRANSPORT, RBLK_E2E_ADDR and RBLK_E2E_DEVICE.
func parseCombo() (combo, error) {
	c := combo{transport: "tcp", host: "127.0.0.1", device: "socket"}
	if v := os.Getenv("RBLK_E2E_TRANSPORT"); v != "" {
		c.transport = v
	}
	switch c.transport {
	case "tcp":
	case "rdma":
		if !rdmaBuilt {
			return c, fmt.Errorf("RBLK_E2E_TRANSPORT=rdma: this test binary was built without -tags rdma (go test -tags rdma ./e2e/)")
		}
		c.host = ""
	default:
		return c, fmt.Errorf("RBLK_E2E_TRANSPORT=%q: want tcp or rdma", c.transport)
	}
	if v := os.Getenv("RBLK_E2E_ADDR"); v != "" {
		if net.ParseIP(v) == nil {
			return c, fmt.Errorf("RBLK_E2E_ADDR=%q: want an IP address", v)
		}
		c.host = v
	}
	if c.host == "" {
		return c, fmt.Errorf("RBLK_E2E_TRANSPORT=rdma needs RBLK_E2E_ADDR, the IP address of an RDMA device's netdev (in the guest of vm/: 192.0.2.1)")
	}
	if v := os.Getenv("RBLK_E2E_DEVICE"); v != "" {
		c.device = v
	}
	switch c.device {
	case "socket":
	case "nbd":
		if os.Geteuid() != 0 {
			return c, fmt.Errorf("RBLK_E2E_DEVICE=nbd: needs root (running as uid %d)", os.Geteuid())
		}
		if _, err := os.Stat("/sys/module/nbd"); err != nil {
			return c, fmt.Errorf("RBLK_E2E_DEVICE=nbd: no nbd module (modprobe nbd): %v", err)
		}
	default:
		return c, fmt.Errorf("RBLK_E2E_DEVICE=%q: want socket or nbd", c.device)
	}
	return c, nil
}

func (c combo) String() string {
	return fmt.Sprintf("transport %s on %s, device %s", c.transport, c.host, c.device)
}

// e2eTransport is the --transport of every rblkd and rblk-attach the tests
// start: tests that build a command line themselves pass it too.
func e2eTransport() string { return e2e.transport }

// hostPort is HOST:PORT on the address rblkd listens on.
func hostPort(port int) string { return net.JoinHostPort(e2e.host, fmt.Sprint(port)) }

// loopbackHost says whether the address rblkd listens on is a loopback one
// (then rblkd serves without --auth-file).
func loopbackHost() bool {
	ip := net.ParseIP(e2e.host)
	return ip != nil && ip.IsLoopback()
}

// notApplicable ends t as not applicable to this combination, for the
// reason given: not a skip for something missing (that is skipOrFail), but
// a test whose subject does not exist here. It is logged, counted and
// listed by TestMain, and allowed under RBLK_E2E_REQUIRE=1.
func notApplicable(t *testing.T, format string, args ...any) {
	t.Helper()
	reason := fmt.Sprintf(format, args...)
	naMu.Lock()
	naList = append(naList, t.Name()+": "+reason)
	naMu.Unlock()
	t.Skipf("NOT APPLICABLE (%s): %s", e2e, reason)
}

var (
	naMu   sync.Mutex
	naList []string
)

// notApplicableSummary is the list of the tests that were not applicable,
// for TestMain's last lines.
func notApplicableSummary() string {
	naMu.Lock()
	defer naMu.Unlock()
	if len(naList) == 0 {
		return ""
	}
	l := slices.Clone(naList)
	sort.Strings(l)
	return fmt.Sprintf("e2e: %d tests not applicable to %s (each says why in its code):\n  %s\n",
		len(l), e2e, strings.Join(l, "\n  "))
}

// onlyTransport ends t as not applicable unless the transport is tr.
func onlyTransport(t *testing.T, tr, why string) {
	t.Helper()
	if e2e.transport != tr {
		notApplicable(t, "%s-only: %s", tr, why)
	}
}

// needSocket ends t as not applicable unless rblk-attach serves NBD on a
// socket (RBLK_E2E_DEVICE=socket): for a test of what rblk-attach's NBD
// server says to a userspace client, which the kernel's device hides.
func needSocket(t *testing.T, why string) {
	t.Helper()
	if e2e.device != "socket" {
		notApplicable(t, "needs rblk-attach's NBD socket: %s", why)
	}
}

// testProvider is the transport provider of in-process clients of rblkd
// (a hostile or greedy initiator) on this run's transport.
func testProvider(t *testing.T) transport.Provider {
	t.Helper()
	if e2e.transport == "rdma" {
		p, err := rdmaProvider()
		if err != nil {
			t.Fatalf("the verbs provider: %v", err)
		}
		return p
	}
	return tcp.New("tcp")
}

// fioTarget is the fio options that point a job at what uri names: fio's
// nbd engine on an NBD URI, or libaio with O_DIRECT on a block device
// (RBLK_E2E_DEVICE=nbd: attacher.uri is then the device).
func fioTarget(uri string) []string {
	if strings.HasPrefix(uri, "/dev/") {
		return []string{"--ioengine=libaio", "--direct=1", "--filename=" + uri}
	}
	return []string{"--ioengine=nbd", "--uri=" + uri}
}

// checkRDMAPort fails t unless the /metrics at addr show an RDMA port up
// (rblk_rdma_port_state 4, ACTIVE) whose hardware counters sent_pkts and
// rcvd_pkts moved: the verbs path really carried the IO.
func checkRDMAPort(t *testing.T, addr string) {
	t.Helper()
	text := scrape(t, addr)
	active := false
	for _, line := range strings.Split(text, "\n") {
		if m := sampleRE.FindStringSubmatch(line); m != nil && m[1] == "rblk_rdma_port_state" && m[3] == "4" {
			active = true
		}
	}
	if !active {
		t.Errorf("http://%s/metrics: no rblk_rdma_port_state of 4 (ACTIVE)", addr)
	}
	for _, c := range []string{"sent_pkts", "rcvd_pkts"} {
		if v, _ := metricSum(text, "rblk_rdma_port_hw_counters_total", `counter="`+c+`"`); v <= 0 {
			t.Errorf("http://%s/metrics: rblk_rdma_port_hw_counters_total{counter=%q} = %v, want > 0", addr, c, v)
		}
	}
}

// faultLink breaks the link between rblk-attach and rblkd from outside
// both. Over tcp it is a faultproxy between them (rblk-attach dials
// link.target()). No proxy can sit in an RDMA path: over rdma rblk-attach
// dials rblkd itself, and a stall is rblkd stopped with SIGSTOP, silent on
// every connection, as a dead path is (only its keepalive tells). The
// proxy's finer faults (resets, held-back bytes) have no rdma counterpart
// here: tests that need them are tcp-only, and the verbs provider's
// failpoints test those paths.
type faultLink struct {
	tg      *target
	px      *faultproxy.Proxy // nil over rdma
	stopped bool              // rdma: rblkd is stopped (SIGSTOP)
}

// startFaultLink puts a fault link in front of tg.
func startFaultLink(t *testing.T, tg *target) *faultLink {
	t.Helper()
	l := &faultLink{tg: tg}
	if e2e.transport == "tcp" {
		l.px = startProxy(t, tg.addr)
	}
	t.Cleanup(func() {
		if l.stopped && !l.tg.exited() {
			l.tg.cmd.Process.Signal(syscall.SIGCONT)
		}
	})
	return l
}

// target is tg as rblk-attach should dial it: through the proxy over tcp.
func (l *faultLink) target() *target {
	if l.px == nil {
		return l.tg
	}
	return viaProxy(l.tg, l.px)
}

// stallAll makes every link silent, those made later too: the proxy stops
// forwarding (tcp), or rblkd is stopped with SIGSTOP (rdma).
func (l *faultLink) stallAll(t *testing.T) {
	t.Helper()
	if l.px != nil {
		l.px.StallAll()
		return
	}
	if err := l.tg.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatalf("SIGSTOP rblkd: %v", err)
	}
	l.stopped = true
}

// resumeAll ends stallAll.
func (l *faultLink) resumeAll(t *testing.T) {
	t.Helper()
	if l.px != nil {
		l.px.ResumeAll()
		return
	}
	if err := l.tg.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatalf("SIGCONT rblkd: %v", err)
	}
	l.stopped = false
}

// delayAll delays every chunk of bytes in one direction (tcp). Over rdma
// nothing can delay the verbs path from outside: it logs that the test
// runs without the delay.
func (l *faultLink) delayAll(t *testing.T, dir faultproxy.Direction, d time.Duration) {
	t.Helper()
	if l.px != nil {
		l.px.SetDelayAll(dir, d)
		return
	}
	t.Logf("over rdma nothing outside the processes can delay the link: running without the %v delay (%v)", d, dir)
}
