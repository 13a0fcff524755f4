package tcp_test

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

func tcpAddr(*testing.T) string { return "127.0.0.1:0" }

// unixAddr is a socket path in a fresh directory, short enough for
// sun_path (108 bytes) even under long test names.
func unixAddr(t *testing.T) string {
	path := filepath.Join(t.TempDir(), "s")
	if len(path) < 100 {
		return path
	}
	dir, err := os.MkdirTemp("", "rblk")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s")
}

func TestConformanceTCP(t *testing.T) {
	transporttest.RunProvider(t, tcp.New("tcp"), tcpAddr)
}

func TestConformanceUnix(t *testing.T) {
	transporttest.RunProvider(t, tcp.New("unix"), unixAddr)
}

// TestConformanceSmallQueues runs the data path with tiny queues and READ
// depths, where holding back and queue-full paths are taken all the time.
func TestConformanceSmallQueues(t *testing.T) {
	p := tcp.NewWithOptions("tcp", tcp.Options{SendQueueDepth: 8, RecvQueueDepth: 4, MaxReadsInFlight: 2})
	transporttest.Run(t, transporttest.PairFunc(p, tcpAddr))
}

func TestName(t *testing.T) {
	for _, n := range []string{"tcp", "unix"} {
		if got := tcp.New(n).Name(); got != n {
			t.Errorf("Name() = %q, want %q", got, n)
		}
	}
	if _, err := tcp.New("udp").Listen(context.Background(), "127.0.0.1:0"); err == nil {
		t.Error("listening on udp succeeded")
	}
}

func TestLimits(t *testing.T) {
	a, b := transporttest.Connect(t, tcp.New("tcp"), "127.0.0.1:0")
	want := transport.Limits{SendQueueDepth: 1024, RecvQueueDepth: 1024, MaxReadsInFlight: 128, MaxPrivateData: 56}
	for _, c := range []transport.Conn{a, b} {
		if got := c.Limits(); got != want {
			t.Errorf("limits %+v, want %+v", got, want)
		}
	}
	// The READ depth is the smaller of both sides'.
	small := tcp.NewWithOptions("tcp", tcp.Options{MaxReadsInFlight: 3})
	l, err := small.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		req, err := l.Accept(context.Background())
		if err == nil {
			c, err := req.Accept(context.Background(), nil)
			if err == nil {
				t.Cleanup(func() { c.Close() })
			}
		}
	}()
	c, err := tcp.New("tcp").Dial(context.Background(), l.Addr(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got := c.Limits().MaxReadsInFlight; got != 3 {
		t.Errorf("negotiated READ depth %d, want 3", got)
	}
}

// TestRNRTimeout: a SEND that meets no RECV for RNRTimeout fails with
// StatusRNRRetryExceeded and breaks the connection.
func TestRNRTimeout(t *testing.T) {
	transporttest.CheckGoroutines(t)
	p := tcp.NewWithOptions("tcp", tcp.Options{RNRTimeout: 100 * time.Millisecond})
	a, b := transporttest.Connect(t, p, "127.0.0.1:0")
	r, err := a.Register(make([]byte, 64), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := a.PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: r, Length: 8}},
		transport.WorkRequest{ID: 2, Op: transport.OpSend, Local: transport.SGE{Region: r, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	got := pollAll(t, a)
	if len(got) != 2 || got[0].Status != transport.StatusRNRRetryExceeded || got[1].Status != transport.StatusFlushed {
		t.Fatalf("completions %+v, want RNR retry exceeded then flushed", got)
	}
	if d := time.Since(start); d < 90*time.Millisecond {
		t.Errorf("RNR failure after %v, before the timeout", d)
	}
	pollAll(t, b)
}

// pollAll polls c until ErrClosed.
func pollAll(t *testing.T, c transport.Conn) []transport.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []transport.Completion
	out := make([]transport.Completion, 8)
	for {
		n, err := c.Poll(ctx, out)
		got = append(got, out[:n]...)
		if errors.Is(err, transport.ErrClosed) {
			return got
		}
		if err != nil {
			t.Fatalf("poll: %v after %+v", err, got)
		}
	}
}

// TestBidirectionalBulk: both sides READ and WRITE megabytes from each
// other at once, the pattern that deadlocks a reader that writes.
func TestBidirectionalBulk(t *testing.T) {
	transporttest.CheckGoroutines(t)
	p := tcp.NewWithOptions("tcp", tcp.Options{MaxReadsInFlight: 16})
	a, b := transporttest.Connect(t, p, "127.0.0.1:0")
	const n, size = 64, 1 << 20
	type side struct {
		c      transport.Conn
		local  transport.Region
		remote transport.Region
	}
	reg := func(c transport.Conn) transport.Region {
		r, err := c.Register(make([]byte, n*size), transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	sa, sb := side{c: a, local: reg(a)}, side{c: b, local: reg(b)}
	sa.remote, sb.remote = sb.local, sa.local
	errc := make(chan error, 2)
	for _, s := range []side{sa, sb} {
		go func() {
			wrs := make([]transport.WorkRequest, n)
			for i := range wrs {
				op := transport.OpRead
				if i%4 == 3 {
					op = transport.OpWrite
				}
				// Each side reads from the first half of the peer's region
				// into the second half of its own, and writes the other way.
				wrs[i] = transport.WorkRequest{
					ID: uint64(i), Op: op,
					Local:      transport.SGE{Region: s.local, Offset: (i%(n/2) + n/2) * size, Length: size},
					RemoteAddr: s.remote.Addr() + uint64(i%(n/2))*size, RKey: s.remote.RKey(),
				}
				if op == transport.OpWrite {
					wrs[i].Local.Offset, wrs[i].RemoteAddr = (i%(n/2))*size, s.remote.Addr()+uint64(i%(n/2)+n/2)*size
				}
			}
			if err := s.c.PostSend(wrs...); err != nil {
				errc <- err
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			out := make([]transport.Completion, 16)
			for got := 0; got < n; {
				k, err := s.c.Poll(ctx, out)
				if err != nil {
					errc <- err
					return
				}
				for _, c := range out[:k] {
					if c.Status != transport.StatusSuccess {
						errc <- c.Err()
						return
					}
				}
				got += k
			}
			errc <- nil
		}()
	}
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
}

// TestUnixStaleSocket: a socket file nothing listens on is replaced; one
// with a listener is not.
func TestUnixStaleSocket(t *testing.T) {
	path := unixAddr(t)
	nl, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	nl.(*net.UnixListener).SetUnlinkOnClose(false)
	nl.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("stale socket file: %v", err)
	}
	p := tcp.New("unix")
	l, err := p.Listen(context.Background(), path)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	defer l.Close()
	if l.Addr() != path {
		t.Errorf("Addr() = %q, want %q", l.Addr(), path)
	}
	if l2, err := p.Listen(context.Background(), path); err == nil {
		l2.Close()
		t.Fatal("second listener on a live socket succeeded")
	}
	// The live listener still works.
	transporttest.CheckGoroutines(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() {
		if req, err := l.Accept(ctx); err == nil {
			req.Reject(nil)
		}
	}()
	var rej *transport.RejectError
	if _, err := p.Dial(ctx, path, nil); !errors.As(err, &rej) {
		t.Errorf("dial: %v, want rejected", err)
	}
}

func TestDialErrors(t *testing.T) {
	p := tcp.New("tcp")
	// Nothing listens there (a port just released).
	nl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := nl.Addr().String()
	nl.Close()
	_, err = p.Dial(context.Background(), addr, nil)
	if err == nil {
		t.Fatal("dial to a closed port succeeded")
	}
	if want := "dial " + addr + ": "; len(err.Error()) < len(want) || err.Error()[:len(want)] != want {
		t.Errorf("error %q does not start with %q", err, want)
	}
	if _, err := p.Dial(context.Background(), addr, make([]byte, tcp.MaxConnectPrivateData+1)); err == nil {
		t.Error("dial with too much private data succeeded")
	}
}

// TestDialSilentPeer: Dial to a stream peer that never answers ends with
// the context.
func TestDialSilentPeer(t *testing.T) {
	nl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	go func() {
		c, err := nl.Accept()
		if err == nil {
			defer c.Close()
			buf := make([]byte, 1024)
			for {
				if _, err := c.Read(buf); err != nil {
					return
				}
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := tcp.New("tcp").Dial(ctx, nl.Addr().String(), []byte("hi")); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("dial: %v, want deadline exceeded", err)
	}
}

// TestListenerCloseDropsUnanswered: a request Accept returned and nobody
// answered is dropped when the listener closes; its Dial fails.
func TestListenerCloseDropsUnanswered(t *testing.T) {
	transporttest.CheckGoroutines(t)
	p := tcp.New("tcp")
	l, err := p.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
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
	l.Close()
	if err := <-errc; err == nil || ctx.Err() != nil {
		t.Errorf("dial: %v, want a failure before the context's end", err)
	}
	if _, err := req.Accept(ctx, nil); err == nil {
		t.Error("accepting a dropped request succeeded")
	}
}

// TestPrepareStrict runs the Prepare tests where a SEND that finds no
// receive posted fails at once (as verbs with RNR retry 0 would): receives
// posted on a prepared conn must be there before the peer's first SENDs.
func TestPrepareStrict(t *testing.T) {
	p := tcp.NewWithOptions("tcp", tcp.Options{RNRTimeout: time.Nanosecond})
	transporttest.RunPrepare(t, p, tcpAddr)
}
