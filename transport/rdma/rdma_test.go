package rdma

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// testAddr is the IP address to listen on: RBLK_RDMA_ADDR, else the first
// IPv4 address of the first RDMA device's network interface.
func testAddr(tb testing.TB) string {
	if a := os.Getenv("RBLK_RDMA_ADDR"); a != "" {
		return a
	}
	for _, dev := range Devices() {
		addrs, err := DeviceAddrs(dev)
		if err != nil {
			tb.Logf("%v", err)
			continue
		}
		if len(addrs) > 0 {
			return addrs[0].String()
		}
	}
	tb.Skipf("no RDMA device with an IP address (devices %v); set RBLK_RDMA_ADDR", Devices())
	return ""
}

// testProvider returns the provider and the address to listen on, or skips
// the test without an RDMA device or in a build without the tag rdma.
func testProvider(tb testing.TB, opts Options) (transport.Provider, string) {
	tb.Helper()
	p, err := NewWithOptions(opts)
	if err != nil {
		if errors.Is(err, transport.ErrNoDevice) || errors.Is(err, transport.ErrUnsupported) {
			tb.Skipf("no RDMA device: %v", err)
		}
		tb.Fatal(err)
	}
	return p, testAddr(tb)
}

func TestNewWithoutDevice(t *testing.T) {
	if len(Devices()) > 0 {
		t.Skipf("devices %v exist", Devices())
	}
	_, err := New()
	if !errors.Is(err, transport.ErrNoDevice) {
		t.Fatalf("New without devices: %v, want ErrNoDevice", err)
	}
	if !Supported && !errors.Is(err, transport.ErrUnsupported) {
		t.Errorf("New in a build without rdma: %v, want ErrUnsupported too", err)
	}
	t.Log(err)
}

func TestBusyPollEnv(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want time.Duration
		bad  bool
	}{{"", 0, false}, {"0", 0, false}, {"1", DefaultBusyPoll, false}, {"20us", 20 * time.Microsecond, false}, {"soon", 0, true}, {"-1s", 0, true}} {
		got, err := busyPollFromEnv(tc.v)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("%q: %v, %v; want %v (error %v)", tc.v, got, err, tc.want, tc.bad)
		}
	}
}

func TestVendorErrString(t *testing.T) {
	if got := VendorErrString(10<<24 | 0x12); got != "remote access error (vendor_err 0x12)" {
		t.Errorf("got %q", got)
	}
	if got := VendorErrString(200 << 24); !strings.Contains(got, "200") {
		t.Errorf("got %q", got)
	}
}

// logFailpoints logs, when t ends, what the failpoints of a build with
// them injected into p (RBLK_RDMA_FAILPOINTS).
func logFailpoints(t *testing.T, p transport.Provider) {
	fc, ok := p.(interface{ FailpointCounts() map[string]uint64 })
	if !ok {
		return
	}
	t.Cleanup(func() {
		if c := fc.FailpointCounts(); c != nil {
			t.Logf("failpoints injected: %v", c)
		}
	})
}

func TestConformance(t *testing.T) {
	p, ip := testProvider(t, Options{})
	logFailpoints(t, p)
	transporttest.RunProvider(t, p, func(*testing.T) string { return net.JoinHostPort(ip, "0") })
}

func TestConformanceBusyPoll(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	p, ip := testProvider(t, Options{BusyPoll: 20 * time.Microsecond})
	logFailpoints(t, p)
	transporttest.Run(t, transporttest.PairFunc(p, func(*testing.T) string { return net.JoinHostPort(ip, "0") }))
}

type deviceInfoer interface{ DeviceInfo() string }

func TestDeviceInfo(t *testing.T) {
	p, ip := testProvider(t, Options{})
	l, err := p.Listen(context.Background(), net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	li, ok := l.(deviceInfoer)
	if !ok {
		t.Fatal("listener has no DeviceInfo")
	}
	t.Logf("listener: %s", li.DeviceInfo())
	a, b := transporttest.Connect(t, p, net.JoinHostPort(ip, "0"))
	for _, c := range []transport.Conn{a, b} {
		d, ok := c.(deviceInfoer)
		if !ok {
			t.Fatal("conn has no DeviceInfo")
		}
		info := d.DeviceInfo()
		t.Logf("conn %s -> %s: %s, limits %+v", c.LocalAddr(), c.RemoteAddr(), info, c.Limits())
		if !strings.Contains(info, " port ") || !strings.Contains(info, " gid ") || !strings.Contains(info, c.LocalAddr()) {
			t.Errorf("device info %q lacks the port, gid or address", info)
		}
		if !strings.Contains(info, Devices()[0]) && len(Devices()) == 1 {
			t.Errorf("device info %q does not name %s", info, Devices()[0])
		}
	}
}

func TestRegisterHeapRefused(t *testing.T) {
	p, ip := testProvider(t, Options{})
	a, _ := transporttest.Connect(t, p, net.JoinHostPort(ip, "0"))
	heap := make([]byte, 8192)
	if r, err := a.Register(heap, transport.AccessLocalWrite); err == nil {
		r.Deregister()
		t.Fatal("Go heap memory was registered")
	} else if !strings.Contains(err.Error(), "AllocMemory") {
		t.Errorf("error %q does not say what to use", err)
	}
	m, err := transport.AllocMemory(8192, false)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	r, err := a.Register(m.Bytes()[100:200], transport.AccessLocalWrite|transport.AccessRemoteRead)
	if err != nil {
		t.Fatalf("mmap'd memory refused: %v", err)
	}
	if err := r.Deregister(); err != nil {
		t.Fatal(err)
	}
}

// TestDialNobodyListens: a connect request to a port nobody listens on is
// refused by the peer's connection manager: not a *RejectError, and the
// error names the address.
func TestDialNobodyListens(t *testing.T) {
	p, ip := testProvider(t, Options{})
	addr := net.JoinHostPort(ip, "1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, addr, []byte("hello"))
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded")
	}
	var rej *transport.RejectError
	if errors.As(err, &rej) {
		t.Errorf("dial to nobody: %v is a RejectError", err)
	}
	if !strings.Contains(err.Error(), addr) {
		t.Errorf("error %q does not name %s", err, addr)
	}
	t.Log(err)
}

// TestDialUnreachable: an address no RDMA device can reach fails with an
// error naming it.
func TestDialUnreachable(t *testing.T) {
	p, _ := testProvider(t, Options{ResolveTimeout: 500 * time.Millisecond})
	addr := "203.0.113.7:4791"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	c, err := p.Dial(ctx, addr, nil)
	if err == nil {
		c.Close()
		t.Fatal("dial succeeded")
	}
	if !strings.Contains(err.Error(), "203.0.113.7") {
		t.Errorf("error %q does not name the address", err)
	}
	t.Logf("%v (after %v)", err, time.Since(start))
}

// TestRejectPrivateDataTooLarge: a reject carries at most
// MaxRejectPrivateData bytes.
func TestRejectPrivateDataTooLarge(t *testing.T) {
	p, ip := testProvider(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	errc := make(chan error, 1)
	go func() {
		c, err := p.Dial(ctx, l.Addr(), nil)
		if c != nil {
			c.Close()
		}
		errc <- err
	}()
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := req.Reject(make([]byte, MaxRejectPrivateData+1)); err == nil {
		t.Error("reject with too much private data succeeded")
	}
	full := bytes.Repeat([]byte{0xab}, MaxRejectPrivateData)
	if err := req.Reject(full); err != nil {
		t.Fatal(err)
	}
	var rej *transport.RejectError
	if err := <-errc; !errors.As(err, &rej) || !bytes.Equal(rej.PrivateData, full) {
		t.Fatalf("dial: %v, want a RejectError with %d bytes", err, len(full))
	}
}

// openFDs counts the open file descriptors of the process.
func openFDs(tb testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Skip(err)
	}
	return len(ents)
}

// TestNoLeaks opens and closes connections (with traffic and a broken one
// among them) and checks that no file descriptor or goroutine is left.
func TestNoLeaks(t *testing.T) {
	transporttest.CheckGoroutines(t)
	p, ip := testProvider(t, Options{})
	m, err := transport.AllocMemory(1<<20, false)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	round := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		l, err := p.Listen(ctx, net.JoinHostPort(ip, "0"))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		done := make(chan transport.Conn, 1)
		go func() {
			req, err := l.Accept(ctx)
			if err != nil {
				done <- nil
				return
			}
			c, _ := req.Accept(ctx, nil)
			done <- c
		}()
		a, err := p.Dial(ctx, l.Addr(), nil)
		if err != nil {
			t.Fatal(err)
		}
		b := <-done
		if b == nil {
			a.Close()
			t.Fatal("accept failed")
		}
		ra, err := a.Register(m.Bytes()[:4096], transport.AccessLocalWrite)
		if err != nil {
			t.Fatal(err)
		}
		rb, err := b.Register(m.Bytes()[4096:8192], transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpRead, Local: transport.SGE{Region: ra, Length: 512}, RemoteAddr: rb.Addr(), RKey: rb.RKey()}); err != nil {
			t.Fatal(err)
		}
		out := make([]transport.Completion, 4)
		if n, err := a.Poll(ctx, out); err != nil || n != 1 || out[0].Status != transport.StatusSuccess {
			t.Fatalf("poll: %d %+v %v", n, out[:n], err)
		}
		b.PostRecv(transport.RecvRequest{ID: 2, Local: transport.SGE{Region: rb, Length: 64}})
		a.Close()
		b.Close()
	}
	round() // the first round may open long-lived fds of the libraries
	before := openFDs(t)
	for range 20 {
		round()
	}
	if after := openFDs(t); after > before {
		t.Errorf("%d file descriptors open after 20 connections, %d before", after, before)
	}
}

// procIO reads the read and write syscall counts of the process.
func procIO() (r, w int64) {
	f, err := os.Open("/proc/self/io")
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), ": ")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		switch k {
		case "syscr":
			r = n
		case "syscw":
			w = n
		}
	}
	return r, w
}

func ctxSwitches() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Nvcsw + ru.Nivcsw
}

// costs reports the cgo calls, read/write syscalls and context switches
// per operation of a benchmark.
type costs struct {
	cgo, r, w, cs int64
}

func startCosts() costs {
	r, w := procIO()
	return costs{cgo: runtime.NumCgoCall(), r: r, w: w, cs: ctxSwitches()}
}

func (c costs) report(b *testing.B, ops int) {
	if ops == 0 {
		return
	}
	r, w := procIO()
	b.ReportMetric(float64(runtime.NumCgoCall()-c.cgo)/float64(ops), "cgo/op")
	b.ReportMetric(float64(r-c.r)/float64(ops), "read-sys/op")
	b.ReportMetric(float64(w-c.w)/float64(ops), "write-sys/op")
	b.ReportMetric(float64(ctxSwitches()-c.cs)/float64(ops), "ctxsw/op")
}

type benchEnv struct {
	a, b   transport.Conn
	la, rb transport.Region
}

func newBenchEnv(b *testing.B, opts Options, size int) *benchEnv {
	p, ip := testProvider(b, opts)
	m, err := transport.AllocMemory(2*size, false)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { m.Free() })
	a, c := transporttest.Connect(b, p, net.JoinHostPort(ip, "0"))
	la, err := a.Register(m.Bytes()[:size], transport.AccessLocalWrite)
	if err != nil {
		b.Fatal(err)
	}
	rb, err := c.Register(m.Bytes()[size:], transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite)
	if err != nil {
		b.Fatal(err)
	}
	return &benchEnv{a: a, b: c, la: la, rb: rb}
}

var pollModes = []struct {
	name string
	opts Options
}{
	{"event", Options{BusyPoll: -1}},
	{"busypoll", Options{BusyPoll: DefaultBusyPoll}},
}

// benchOneSided runs op of size bytes with depth requests in flight: a new
// one posted for each completion, or, with chain, depth posted in one
// PostSend once all the previous ones completed.
func benchOneSided(b *testing.B, op transport.Opcode, size, depth int, chain bool) {
	for _, mode := range pollModes {
		b.Run(mode.name, func(b *testing.B) {
			e := newBenchEnv(b, mode.opts, size*depth)
			wr := func(i int) transport.WorkRequest {
				slot := i % depth
				return transport.WorkRequest{
					ID: uint64(i), Op: op,
					Local:      transport.SGE{Region: e.la, Offset: slot * size, Length: size},
					RemoteAddr: e.rb.Addr() + uint64(slot*size), RKey: e.rb.RKey(),
				}
			}
			ctx := context.Background()
			out := make([]transport.Completion, depth)
			b.SetBytes(int64(size))
			b.ResetTimer()
			cs := startCosts()
			posted, done := 0, 0
			wrs := make([]transport.WorkRequest, 0, depth)
			if chain {
				for done < b.N {
					wrs = wrs[:0]
					for ; len(wrs) < depth && posted < b.N; posted++ {
						wrs = append(wrs, wr(posted))
					}
					if err := e.a.PostSend(wrs...); err != nil {
						b.Fatal(err)
					}
					for left := len(wrs); left > 0; {
						n, err := e.a.Poll(ctx, out)
						if err != nil {
							b.Fatal(err)
						}
						left -= n
						done += n
					}
				}
			}
			for ; posted < min(depth, b.N); posted++ {
				if err := e.a.PostSend(wr(posted)); err != nil {
					b.Fatal(err)
				}
			}
			for done < b.N {
				n, err := e.a.Poll(ctx, out)
				if err != nil {
					b.Fatal(err)
				}
				for _, c := range out[:n] {
					if c.Status != transport.StatusSuccess {
						b.Fatalf("completion %+v", c)
					}
				}
				done += n
				for ; n > 0 && posted < b.N; n-- {
					if err := e.a.PostSend(wr(posted)); err != nil {
						b.Fatal(err)
					}
					posted++
				}
			}
			b.StopTimer()
			cs.report(b, b.N)
		})
	}
}

func BenchmarkRead4K(b *testing.B)        { benchOneSided(b, transport.OpRead, 4096, 1, false) }
func BenchmarkWrite4K(b *testing.B)       { benchOneSided(b, transport.OpWrite, 4096, 1, false) }
func BenchmarkRead4KQD16(b *testing.B)    { benchOneSided(b, transport.OpRead, 4096, 16, false) }
func BenchmarkWrite4KQD16(b *testing.B)   { benchOneSided(b, transport.OpWrite, 4096, 16, false) }
func BenchmarkRead4KChain16(b *testing.B) { benchOneSided(b, transport.OpRead, 4096, 16, true) }
func BenchmarkRead1M(b *testing.B)        { benchOneSided(b, transport.OpRead, 1<<20, 8, false) }
func BenchmarkWrite1M(b *testing.B)       { benchOneSided(b, transport.OpWrite, 1<<20, 8, false) }

// BenchmarkSendRecv is a ping-pong of 64-byte SENDs: one op is a round trip.
func BenchmarkSendRecv(b *testing.B) {
	for _, mode := range pollModes {
		b.Run(mode.name, func(b *testing.B) {
			const size = 64
			e := newBenchEnv(b, mode.opts, 4096)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			// side posts a receive, SENDs, and waits for its receive (taking
			// the completions of its sends on the way).
			type side struct {
				c   transport.Conn
				r   transport.Region
				out []transport.Completion
			}
			recv := func(s *side) error {
				return s.c.PostRecv(transport.RecvRequest{ID: 1, Local: transport.SGE{Region: s.r, Offset: 2048, Length: size}})
			}
			send := func(s *side) error {
				return s.c.PostSend(transport.WorkRequest{ID: 2, Op: transport.OpSend, Local: transport.SGE{Region: s.r, Length: size}})
			}
			wait := func(s *side) error {
				for {
					n, err := s.c.Poll(ctx, s.out)
					if err != nil {
						return err
					}
					for _, comp := range s.out[:n] {
						if comp.Status != transport.StatusSuccess {
							return fmt.Errorf("completion %+v", comp)
						}
						if comp.Op == transport.OpRecv {
							return nil
						}
					}
				}
			}
			a := &side{c: e.a, r: e.la, out: make([]transport.Completion, 4)}
			echo := &side{c: e.b, r: e.rb, out: make([]transport.Completion, 4)}
			if err := recv(echo); err != nil {
				b.Fatal(err)
			}
			errc := make(chan error, 1)
			go func() {
				for i := 0; i < b.N; i++ {
					err := wait(echo)
					if err == nil {
						err = recv(echo)
					}
					if err == nil {
						err = send(echo)
					}
					if err != nil {
						errc <- fmt.Errorf("echo side, round %d: %w", i, err)
						cancel()
						return
					}
				}
				errc <- nil
			}()
			b.ResetTimer()
			cs := startCosts()
			for i := 0; i < b.N; i++ {
				err := recv(a)
				if err == nil {
					err = send(a)
				}
				if err == nil {
					err = wait(a)
				}
				if err != nil {
					cancel()
					b.Fatalf("round %d: %v (echo side: %v)", i, err, <-errc)
				}
			}
			b.StopTimer()
			if err := <-errc; err != nil {
				b.Fatal(err)
			}
			cs.report(b, b.N)
		})
	}
}

// BenchmarkGrantRegister is the cost of a grant without memory windows: an
// ibv_reg_mr and ibv_dereg_mr of 1 MiB (what the target did per chunk and
// grant).
func BenchmarkGrantRegister(b *testing.B) {
	p, ip := testProvider(b, Options{})
	a, _ := transporttest.Connect(b, p, net.JoinHostPort(ip, "0"))
	transporttest.BenchGrantRegister(b, a)
}

// BenchmarkGrantWindow is the cost of a grant with a type-2 memory window
// over memory registered once: the bind and the LOCAL_INV work requests
// and their completions, reaped by a goroutine polling the conn, woken by
// completion events or busy polling.
func BenchmarkGrantWindow(b *testing.B) {
	for _, mode := range pollModes {
		b.Run(mode.name, func(b *testing.B) {
			p, ip := testProvider(b, mode.opts)
			a, _ := transporttest.Connect(b, p, net.JoinHostPort(ip, "0"))
			transporttest.BenchGrantWindow(b, a)
		})
	}
}
