package faultproxy_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rblk/rblk/internal/faultproxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// peer is a plain TCP server for the proxy to forward to: it echoes what it
// reads, or only records it, and keeps its accepted connections for the
// test.
type peer struct {
	ln   net.Listener
	echo bool
	wg   sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
	got   []bytes.Buffer // what each connection read
	ended []error        // how each connection's reading ended (nil: still reading)
	ch    chan struct{}  // closed and replaced on every change
}

func newPeer(t *testing.T, echo bool) *peer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{ln: ln, echo: echo, ch: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *peer) changed() {
	close(p.ch)
	p.ch = make(chan struct{})
}

func (p *peer) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		i := len(p.conns)
		p.conns = append(p.conns, c)
		p.got = append(p.got, bytes.Buffer{})
		p.ended = append(p.ended, nil)
		p.changed()
		p.mu.Unlock()
		p.wg.Add(1)
		go p.serve(i, c)
	}
}

func (p *peer) serve(i int, c net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			p.mu.Lock()
			p.got[i].Write(buf[:n])
			p.changed()
			p.mu.Unlock()
			if p.echo {
				c.Write(buf[:n])
			}
		}
		if err != nil {
			p.mu.Lock()
			p.ended[i] = err
			p.changed()
			p.mu.Unlock()
			return
		}
	}
}

// wait waits until cond holds (called with p.mu held), for at most 10 s.
func (p *peer) wait(t *testing.T, what string, cond func() bool) {
	t.Helper()
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	for {
		p.mu.Lock()
		ok := cond()
		ch := p.ch
		p.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-ch:
		case <-timer.C:
			t.Fatalf("peer: %s: not within 10s", what)
		}
	}
}

func (p *peer) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// end is how connection i's reading ended (nil: not yet).
func (p *peer) end(i int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ended[i]
}

func (p *peer) conn(i int) net.Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conns[i]
}

func newProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	px, err := faultproxy.New("127.0.0.1:0", target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { px.Close() })
	return px
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func ctx10(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// roundTrip writes msg and reads as many bytes back within 10 s.
func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write: %v", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatalf("read echo: %v", err)
	}
	if string(got) != msg {
		t.Fatalf("echo %q, want %q", got, msg)
	}
}

// isReset reports whether err is what a reset connection gives.
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

func TestForward(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c := dial(t, px.Addr())
	roundTrip(t, c, "hello")
	big := string(bytes.Repeat([]byte("0123456789abcdef"), 1<<14)) // 256 KiB: several reads
	roundTrip(t, c, big)
	pc, err := px.WaitConn(ctx10(t), 0)
	if err != nil {
		t.Fatal(err)
	}
	want := int64(len("hello") + len(big))
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool {
		return s.Delivered[faultproxy.ClientToServer] == want && s.Delivered[faultproxy.ServerToClient] == want
	}); err != nil {
		t.Fatal(err)
	}

	// An EOF from the client reaches the server as one, and the connection
	// ends on both sides.
	c.(*net.TCPConn).CloseWrite()
	echo.wait(t, "EOF from the client", func() bool { return echo.ended[0] != nil })
	if err := echo.end(0); !errors.Is(err, io.EOF) {
		t.Errorf("server's read ended with %v, want EOF", err)
	}
	echo.conn(0).Close()
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool { return s.ClientClosed && s.ServerClosed }); err != nil {
		t.Fatal(err)
	}
	if px.Accepted() != 1 {
		t.Errorf("Accepted() = %d, want 1", px.Accepted())
	}
}

func TestReset(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c := dial(t, px.Addr())
	roundTrip(t, c, "before")
	pc, _ := px.WaitConn(ctx10(t), 0)
	pc.Reset()

	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := c.Read(make([]byte, 1))
	if !isReset(err) {
		t.Errorf("client read after Reset: %v, want ECONNRESET", err)
	}
	echo.wait(t, "server sees the reset", func() bool { return echo.ended[0] != nil })
	if err := echo.end(0); !isReset(err) {
		t.Errorf("server read after Reset: %v, want ECONNRESET", err)
	}
	if !pc.Done() {
		t.Errorf("connection not done after Reset: %+v", pc.Stats())
	}

	// A new connection is forwarded as usual.
	c2 := dial(t, px.Addr())
	roundTrip(t, c2, "after")
	if n := len(px.Conns()); n != 2 {
		t.Errorf("%d connections tracked, want 2", n)
	}
}

func TestResetPropagates(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c := dial(t, px.Addr())
	roundTrip(t, c, "x")
	// The client resets: the server must see a reset too, not an EOF.
	c.(*net.TCPConn).SetLinger(0)
	c.Close()
	echo.wait(t, "server sees the reset", func() bool { return echo.ended[0] != nil })
	if err := echo.end(0); !isReset(err) {
		t.Errorf("server read after the client's reset: %v, want ECONNRESET", err)
	}
}

func TestStallResume(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c := dial(t, px.Addr())
	roundTrip(t, c, "warm")
	pc, _ := px.WaitConn(ctx10(t), 0)
	// The echo may come back before the proxy counted the bytes out.
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool { return s.Delivered == [2]int64{4, 4} }); err != nil {
		t.Fatal(err)
	}
	before := pc.Stats()

	pc.Stall()
	if _, err := c.Write([]byte("stalled")); err != nil {
		t.Fatal(err)
	}
	// Nothing may come back while stalled; the socket stays open (a
	// timeout, not an error).
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	n, err := c.Read(make([]byte, 16))
	var ne net.Error
	if n != 0 || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read while stalled: %d bytes, %v; want a timeout", n, err)
	}
	if s := pc.Stats(); s.Delivered != before.Delivered || s.ClientClosed || s.ServerClosed {
		t.Fatalf("stats while stalled: %+v, before %+v: want nothing delivered, both open", s, before)
	}
	pc.Resume()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len("stalled"))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "stalled" {
		t.Fatalf("after Resume: %q, %v", got, err)
	}
}

func TestStallAllNewConns(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	px.StallAll()
	c := dial(t, px.Addr()) // the TCP connect succeeds
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	pc, err := px.WaitConn(ctx10(t), 0)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 4)); n != 0 || err == nil {
		t.Fatalf("read from a connection accepted while stalled: %d bytes, %v", n, err)
	}
	if s := pc.Stats(); s.Delivered[faultproxy.ClientToServer] != 0 {
		t.Fatalf("delivered %d bytes while stalled", s.Delivered[faultproxy.ClientToServer])
	}
	px.ResumeAll()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
		t.Fatalf("after ResumeAll: %q, %v", got, err)
	}
}

func TestDelay(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c := dial(t, px.Addr())
	roundTrip(t, c, "warm")
	pc, _ := px.WaitConn(ctx10(t), 0)
	const d = 150 * time.Millisecond
	pc.SetDelay(faultproxy.ClientToServer, d)
	pc.SetDelay(faultproxy.ServerToClient, d)
	start := time.Now()
	roundTrip(t, c, "slow")
	if el := time.Since(start); el < 2*d {
		t.Errorf("round trip with %v each way took %v, want at least %v", d, el, 2*d)
	}
	pc.SetDelay(faultproxy.ClientToServer, 0)
	pc.SetDelay(faultproxy.ServerToClient, 0)
	roundTrip(t, c, "fast")
}

func TestHoldBackRelease(t *testing.T) {
	sink := newPeer(t, false)
	px := newProxy(t, sink.ln.Addr().String())
	c := dial(t, px.Addr())
	if _, err := c.Write([]byte("early.")); err != nil {
		t.Fatal(err)
	}
	sink.wait(t, "early bytes", func() bool { return len(sink.got) == 1 && sink.got[0].String() == "early." })
	pc, _ := px.WaitConn(ctx10(t), 0)

	pc.HoldBack(faultproxy.ClientToServer)
	if _, err := c.Write([]byte("late frame")); err != nil {
		t.Fatal(err)
	}
	if err := pc.WaitFor(ctx10(t), faultproxy.HeldAtLeast(faultproxy.ClientToServer, len("late frame"))); err != nil {
		t.Fatal(err)
	}
	// The client's connection dies; the server's stays open and still
	// talks, into the void.
	pc.ResetClientSideOnly()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !isReset(err) {
		t.Errorf("client read after ResetClientSideOnly: %v, want ECONNRESET", err)
	}
	if _, err := sink.conn(0).Write([]byte("to nobody")); err != nil {
		t.Fatalf("server write after ResetClientSideOnly: %v", err)
	}
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool {
		return s.Dropped[faultproxy.ServerToClient] == int64(len("to nobody"))
	}); err != nil {
		t.Fatal(err)
	}
	sink.mu.Lock()
	got, ended := sink.got[0].String(), sink.ended[0]
	sink.mu.Unlock()
	if got != "early." || ended != nil {
		t.Fatalf("server got %q (read ended: %v) before Release, want %q and still open", got, ended, "early.")
	}

	n, err := pc.Release(faultproxy.ClientToServer)
	if err != nil || n != len("late frame") {
		t.Fatalf("Release: %d, %v", n, err)
	}
	sink.wait(t, "released bytes", func() bool { return sink.got[0].String() == "early.late frame" })
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool {
		return s.Held[faultproxy.ClientToServer] == 0 && s.Delivered[faultproxy.ClientToServer] == int64(len("early.late frame"))
	}); err != nil {
		t.Errorf("stats after Release: %v", err)
	}
	// The server's side stays open until someone closes it.
	pc.CloseServerSide()
	sink.wait(t, "EOF on the server side after CloseServerSide", func() bool { return sink.ended[0] != nil })
	if err := sink.end(0); !errors.Is(err, io.EOF) {
		t.Errorf("server read after CloseServerSide: %v, want EOF", err)
	}
}

func TestReleaseAfterServerClosed(t *testing.T) {
	sink := newPeer(t, false)
	px := newProxy(t, sink.ln.Addr().String())
	c := dial(t, px.Addr())
	pc, _ := px.WaitConn(ctx10(t), 0)
	sink.wait(t, "accept", func() bool { return len(sink.conns) == 1 })
	pc.HoldBack(faultproxy.ClientToServer)
	c.Write([]byte("late"))
	if err := pc.WaitFor(ctx10(t), faultproxy.HeldAtLeast(faultproxy.ClientToServer, 4)); err != nil {
		t.Fatal(err)
	}
	pc.ResetClientSideOnly()
	sink.conn(0).Close() // the server ends the connection (fencing it)
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool { return s.ServerClosed }); err != nil {
		t.Fatal(err)
	}
	// The write may be taken by the kernel before the peer's reset comes
	// back, so no error is promised; it must not hang or panic, and the
	// server must not see the bytes.
	pc.Release(faultproxy.ClientToServer)
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if s := sink.got[0].String(); s != "" {
		t.Errorf("server that closed got %q", s)
	}
}

func TestCloseTwiceAndWhileBusy(t *testing.T) {
	echo := newPeer(t, true)
	px, err := faultproxy.New("127.0.0.1:0", echo.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	// Connections in every state: forwarding, stalled, delayed, holding
	// back, half gone.
	var cs []net.Conn
	for range 5 {
		cs = append(cs, dial(t, px.Addr()))
	}
	for i := range cs {
		pc, err := px.WaitConn(ctx10(t), i)
		if err != nil {
			t.Fatal(err)
		}
		switch i {
		case 1:
			pc.Stall()
		case 2:
			pc.SetDelay(faultproxy.ClientToServer, time.Hour)
		case 3:
			pc.HoldBack(faultproxy.ClientToServer)
		case 4:
			pc.HoldBack(faultproxy.ClientToServer)
			cs[i].Write([]byte("x"))
			pc.WaitFor(ctx10(t), faultproxy.HeldAtLeast(faultproxy.ClientToServer, 1))
			pc.ResetClientSideOnly()
		}
		if i != 4 {
			cs[i].Write([]byte("data"))
		}
	}
	// The delayed chunk is waiting out its hour when Close comes.
	pc2, _ := px.WaitConn(ctx10(t), 2)
	if err := pc2.WaitFor(ctx10(t), faultproxy.ReceivedAtLeast(faultproxy.ClientToServer, 4)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- px.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10s")
	}
	if err := px.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := px.WaitConn(context.Background(), 99); !errors.Is(err, faultproxy.ErrClosed) {
		t.Errorf("WaitConn after Close: %v, want ErrClosed", err)
	}
	// Clients see their connections end.
	for i, c := range cs {
		if i == 4 {
			continue
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 16)
		for {
			_, err := c.Read(buf)
			if err != nil {
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					t.Errorf("conn %d still open after Close", i)
				}
				break
			}
		}
	}
}

func TestTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	px := newProxy(t, addr)
	// The proxy resets the client at once: the connect itself, or the
	// first read, fails.
	c, err := net.DialTimeout("tcp", px.Addr(), 5*time.Second)
	if err == nil {
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read from a proxy whose target is down: %v, want the connection closed", err)
		}
	}
	if px.Accepted() != 0 {
		t.Errorf("Accepted() = %d with the target down, want 0", px.Accepted())
	}
}

func TestResetAllAndDelayAll(t *testing.T) {
	echo := newPeer(t, true)
	px := newProxy(t, echo.ln.Addr().String())
	c1 := dial(t, px.Addr())
	c2 := dial(t, px.Addr())
	roundTrip(t, c1, "one")
	roundTrip(t, c2, "two")
	px.ResetAll()
	for i, c := range []net.Conn{c1, c2} {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Read(make([]byte, 1)); !isReset(err) {
			t.Errorf("conn %d after ResetAll: %v, want ECONNRESET", i, err)
		}
	}
	// A delay set for all applies to connections accepted later.
	const d = 100 * time.Millisecond
	px.SetDelayAll(faultproxy.ServerToClient, d)
	c3 := dial(t, px.Addr())
	start := time.Now()
	roundTrip(t, c3, "three")
	if el := time.Since(start); el < d {
		t.Errorf("round trip on a connection accepted after SetDelayAll(%v) took %v", d, el)
	}
	px.SetDelayAll(faultproxy.ServerToClient, 0)
	if n := px.Accepted(); n != 3 {
		t.Errorf("Accepted() = %d, want 3", n)
	}
}

func TestReleaseAfterClientEOF(t *testing.T) {
	sink := newPeer(t, false)
	px := newProxy(t, sink.ln.Addr().String())
	c := dial(t, px.Addr())
	pc, _ := px.WaitConn(ctx10(t), 0)
	sink.wait(t, "accept", func() bool { return len(sink.conns) == 1 })
	pc.HoldBack(faultproxy.ClientToServer)
	c.Write([]byte("last words"))
	if err := pc.WaitFor(ctx10(t), faultproxy.HeldAtLeast(faultproxy.ClientToServer, 10)); err != nil {
		t.Fatal(err)
	}
	// The client closes; its EOF waits behind the held bytes.
	c.(*net.TCPConn).CloseWrite()
	if err := pc.WaitFor(ctx10(t), func(s faultproxy.Stats) bool { return s.ClientClosed }); err != nil {
		t.Fatal(err)
	}
	if err := sink.end(0); err != nil {
		t.Fatalf("server saw the end (%v) before the held bytes", err)
	}
	if _, err := pc.Release(faultproxy.ClientToServer); err != nil {
		t.Fatal(err)
	}
	sink.wait(t, "held bytes, then EOF", func() bool { return sink.ended[0] != nil })
	sink.mu.Lock()
	got, end := sink.got[0].String(), sink.ended[0]
	sink.mu.Unlock()
	if got != "last words" || !errors.Is(end, io.EOF) {
		t.Errorf("server got %q and then %v, want %q and EOF", got, end, "last words")
	}
}
