package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// drops records what a listener dropped (transport.HandshakeLimits.Dropped).
type drops struct {
	mu sync.Mutex
	by map[transport.DropReason][]string
}

func (d *drops) record(r transport.DropReason, remote string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.by == nil {
		d.by = map[transport.DropReason][]string{}
	}
	d.by[r] = append(d.by[r], remote)
}

func (d *drops) count(r transport.DropReason) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.by[r])
}

// silent is a stream that sends nothing: closed tells when the listener
// closed it.
type silent struct {
	nc     net.Conn
	dialed time.Time
	closed chan time.Time
}

// dialSilent connects from the loopback address local and says nothing.
func dialSilent(t *testing.T, addr, local string) *silent {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	start := time.Now()
	nc, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &silent{nc: nc, dialed: start, closed: make(chan time.Time, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		nc.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, err := io.Copy(io.Discard, nc)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return
		}
		s.closed <- time.Now()
	}()
	t.Cleanup(func() {
		nc.Close()
		<-done
	})
	return s
}

// closedBy fails t unless s is closed by the time by.
func (s *silent) closedBy(t *testing.T, by time.Time, what string) {
	t.Helper()
	select {
	case at := <-s.closed:
		if at.After(by) {
			t.Errorf("%s closed %v after its dial, want at most %v", what, at.Sub(s.dialed), by.Sub(s.dialed))
		}
	case <-time.After(time.Until(by) + 30*time.Second):
		t.Fatalf("%s still open %v after its dial", what, time.Since(s.dialed))
	}
}

// waitFor polls cond until it holds or 10 seconds passed.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// waiting is the number of streams l awaits a connect request of.
func waiting(l transport.Listener) int {
	ll := l.(*listener)
	ll.mu.Lock()
	defer ll.mu.Unlock()
	return len(ll.shaking)
}

// TestHandshakeLimits: the owner's limits bound the streams that send no
// connect request: beyond MaxPending a new one from the address holding
// them is closed at once; one from another address gets in, the oldest of
// the flood giving way; the rest are closed within Timeout of their
// accept; each drop is reported with its reason.
func TestHandshakeLimits(t *testing.T) {
	transporttest.CheckGoroutines(t)
	const timeout = 500 * time.Millisecond
	l := listenTCP(t, Options{})
	var d drops
	l.(transport.HandshakeLimiter).LimitHandshakes(transport.HandshakeLimits{Timeout: timeout, MaxPending: 3, Dropped: d.record})
	var held []*silent
	for range 3 {
		held = append(held, dialSilent(t, l.Addr(), "127.0.0.2"))
	}
	waitFor(t, "the listener holds three streams", func() bool { return waiting(l) == 3 })
	for i := range 2 {
		s := dialSilent(t, l.Addr(), "127.0.0.2")
		s.closedBy(t, s.dialed.Add(timeout/2), "a stream beyond the limit")
		if n := d.count(transport.DropLimit); n != i+1 {
			t.Fatalf("%d drops for the limit, want %d", n, i+1)
		}
	}
	// A host at another address gets in; the oldest waiting stream goes.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	before := time.Now()
	dialed := make(chan transport.Conn, 1)
	go func() {
		c, err := NewWithOptions("tcp", Options{LocalAddr: "127.0.0.3:0"}).Dial(ctx, l.Addr(), []byte("real"))
		if err != nil {
			t.Errorf("dial beside a full limit: %v", err)
		}
		dialed <- c
	}()
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(req.RemoteAddr(), "127.0.0.3:") {
		t.Fatalf("request from %s, want 127.0.0.3 (Options.LocalAddr)", req.RemoteAddr())
	}
	if at := req.(transport.AcceptTimer).AcceptedAt(); at.Before(before) || at.After(time.Now()) {
		t.Fatalf("AcceptedAt %v, want between the dial (%v) and now", at, before)
	}
	c, err := req.Accept(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c := <-dialed; c != nil {
		defer c.Close()
	}
	held[0].closedBy(t, time.Now().Add(timeout/2), "the oldest stream of the flood")
	if n := d.count(transport.DropEvicted); n != 1 {
		t.Fatalf("%d evictions, want 1", n)
	}
	for _, s := range held[1:] {
		s.closedBy(t, s.dialed.Add(2*timeout), "a silent stream")
	}
	waitFor(t, "two timeouts reported", func() bool { return d.count(transport.DropTimeout) == 2 })
	checkListener(t, l)
}

// TestLimitHandshakesAppliesToWaiting: limits set while streams wait
// apply to them: those beyond the bound that it would have refused (the
// newest of the address that holds the most) are closed at once, and a
// shorter timeout runs from their accept.
func TestLimitHandshakesAppliesToWaiting(t *testing.T) {
	transporttest.CheckGoroutines(t)
	l := listenTCP(t, Options{HandshakeTimeout: time.Minute})
	var ss []*silent
	for _, local := range []string{"127.0.0.1", "127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.2"} {
		ss = append(ss, dialSilent(t, l.Addr(), local))
		waitFor(t, "the listener holds the stream", func() bool { return waiting(l) == len(ss) })
	}
	var d drops
	l.(transport.HandshakeLimiter).LimitHandshakes(transport.HandshakeLimits{Timeout: 500 * time.Millisecond, MaxPending: 3, Dropped: d.record})
	if n := d.count(transport.DropLimit); n != 2 {
		t.Fatalf("%d streams dropped for the lower bound, want 2", n)
	}
	for _, s := range ss[3:] {
		s.closedBy(t, time.Now().Add(200*time.Millisecond), "a stream beyond the lowered bound")
	}
	for _, s := range ss[:3] {
		select {
		case <-s.closed:
			t.Fatal("a stream within the bound was closed at once")
		default:
		}
	}
	for _, s := range ss[:3] {
		s.closedBy(t, s.dialed.Add(time.Second), "a stream waiting when the timeout was cut")
	}
}

// TestMaxPendingHandshakesOption: without an owner's limits the option
// bounds the waiting streams.
func TestMaxPendingHandshakesOption(t *testing.T) {
	transporttest.CheckGoroutines(t)
	l := listenTCP(t, Options{MaxPendingHandshakes: 2})
	dialSilent(t, l.Addr(), "127.0.0.2")
	dialSilent(t, l.Addr(), "127.0.0.2")
	waitFor(t, "the listener holds two streams", func() bool { return waiting(l) == 2 })
	s := dialSilent(t, l.Addr(), "127.0.0.2")
	s.closedBy(t, s.dialed.Add(5*time.Second), "a third stream") // the default timeout is 10 s
	if n := waiting(l); n != 2 {
		t.Fatalf("%d streams waiting, want 2", n)
	}
}

// TestConnectRequestNotTakenInTime: a connect request that Accept does
// not take within the timeout of its stream's accept is dropped, not held
// until the listener closes.
func TestConnectRequestNotTakenInTime(t *testing.T) {
	transporttest.CheckGoroutines(t)
	var d drops
	l := listenTCP(t, Options{})
	l.(transport.HandshakeLimiter).LimitHandshakes(transport.HandshakeLimits{Timeout: 300 * time.Millisecond, Dropped: d.record})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := New("tcp").Dial(ctx, l.Addr(), nil)
	if err == nil || ctx.Err() != nil {
		t.Fatalf("dial nobody accepts: %v, want the stream closed", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the stream was closed %v after the dial, want about 300ms", took)
	}
	waitFor(t, "the timeout reported", func() bool { return d.count(transport.DropTimeout) == 1 })
	checkListener(t, l)
}

// TestLocalAddrUnix: a local address is for TCP only.
func TestLocalAddrUnix(t *testing.T) {
	_, err := NewWithOptions("unix", Options{LocalAddr: "127.0.0.1:0"}).Dial(context.Background(), "/nonexistent", nil)
	if err == nil || !strings.Contains(err.Error(), "tcp networks only") {
		t.Fatalf("unix dial with a local address: %v", err)
	}
}
