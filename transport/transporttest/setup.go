package transporttest

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
)

// PairFunc returns a newPair for Run that makes its pair with Connect on a
// fresh address addr(t).
func PairFunc(p transport.Provider, addr func(t *testing.T) string) func(t *testing.T) (a, b transport.Conn) {
	return func(t *testing.T) (a, b transport.Conn) {
		t.Helper()
		return Connect(t, p, addr(t))
	}
}

// Connect listens on addr with p, dials it (a is the dialed conn, b the
// accepted one) and closes the listener. The conns are closed when tb ends.
func Connect(tb testing.TB, p transport.Provider, addr string) (a, b transport.Conn) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	l, err := p.Listen(ctx, addr)
	if err != nil {
		tb.Fatal(err)
	}
	defer l.Close()
	a, b, err = connect(ctx, p, l, []byte("dialer"), []byte("acceptor"))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		a.Close()
		b.Close()
	})
	return a, b
}

// connect dials l and accepts the request, with the private data given.
// If the dial fails before its request reaches l, the accept is given up
// (and the dial's error returned) rather than waited for until ctx ends.
func connect(ctx context.Context, p transport.Provider, l transport.Listener, dialPD, acceptPD []byte) (a, b transport.Conn, err error) {
	type result struct {
		c   transport.Conn
		err error
	}
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	dialed := make(chan result, 1)
	go func() {
		c, err := p.Dial(ctx, l.Addr(), dialPD)
		if err != nil {
			cancel()
		}
		dialed <- result{c, err}
	}()
	req, err := l.Accept(actx)
	if err == nil {
		b, err = req.Accept(actx, acceptPD)
	}
	r := <-dialed
	if r.err != nil {
		// The dial's error says what went wrong first.
		err = r.err
	} else if err == nil {
		err = r.err
	}
	if err != nil {
		if r.c != nil {
			r.c.Close()
		}
		if b != nil {
			b.Close()
		}
		return nil, nil, err
	}
	return r.c, b, nil
}

// RunProvider runs the connection setup tests of p (private data, reject,
// cancellation, listener close), then Run over conns made by PairFunc(p,
// addr). addr returns a fresh address to listen on ("127.0.0.1:0", a socket
// path).
func RunProvider(t *testing.T, p transport.Provider, addr func(t *testing.T) string) {
	listen := func(t *testing.T) transport.Listener { return listenOn(t, p, addr) }
	ctx := testContext

	t.Run("PrivateData", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		for _, sizes := range [][2]int{{0, 0}, {1, 1}, {17, 33}, {56, 196}} {
			dialPD := bytes.Repeat([]byte{'d'}, sizes[0])
			acceptPD := bytes.Repeat([]byte{'a'}, sizes[1])
			a, b, err := connect(ctx(t), p, l, dialPD, acceptPD)
			if err != nil {
				t.Fatalf("private data of %v bytes: %v", sizes, err)
			}
			if got := a.PeerPrivateData(); !bytes.Equal(got, acceptPD) {
				t.Errorf("dialer got %q, want %q", got, acceptPD)
			}
			if got := b.PeerPrivateData(); !bytes.Equal(got, dialPD) {
				t.Errorf("acceptor got %q, want %q", got, dialPD)
			}
			a.Close()
			b.Close()
		}
	})

	t.Run("PrivateDataTooLarge", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		if c, err := p.Dial(ctx(t), l.Addr(), make([]byte, 4096)); err == nil {
			c.Close()
			t.Error("dial with 4096 bytes of private data succeeded")
		}
	})

	t.Run("Reject", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		errc := make(chan error, 1)
		go func() {
			c, err := p.Dial(ctx(t), l.Addr(), []byte("let me in"))
			if c != nil {
				c.Close()
			}
			errc <- err
		}()
		req, err := l.Accept(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		if string(req.PrivateData()) != "let me in" {
			t.Errorf("request private data %q", req.PrivateData())
		}
		if err := req.Reject([]byte("go away")); err != nil {
			t.Fatal(err)
		}
		err = <-errc
		var rej *transport.RejectError
		if !errors.As(err, &rej) {
			t.Fatalf("dial rejected: %v, want a *RejectError", err)
		}
		if string(rej.PrivateData) != "go away" {
			t.Errorf("reject private data %q, want %q", rej.PrivateData, "go away")
		}
		if _, err := req.Accept(ctx(t), nil); err == nil {
			t.Error("accepting a rejected request succeeded")
		}
	})

	t.Run("DialContext", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t) // nobody accepts
		c, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		conn, err := p.Dial(c, l.Addr(), nil)
		if err == nil {
			conn.Close()
			t.Fatal("dial succeeded though nobody accepted")
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("dial: %v, want deadline exceeded", err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("dial took %v to notice its deadline", d)
		}
		c, cancel = context.WithCancel(context.Background())
		go func() {
			time.Sleep(20 * time.Millisecond)
			cancel()
		}()
		if conn, err := p.Dial(c, l.Addr(), nil); !errors.Is(err, context.Canceled) {
			if conn != nil {
				conn.Close()
			}
			t.Errorf("dial canceled: %v, want canceled", err)
		}
	})

	t.Run("AcceptContext", func(t *testing.T) {
		CheckGoroutines(t)
		l := listen(t)
		c, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		if _, err := l.Accept(c); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("accept: %v, want deadline exceeded", err)
		}
	})

	t.Run("ListenerClose", func(t *testing.T) {
		CheckGoroutines(t)
		l, err := p.Listen(context.Background(), addr(t))
		if err != nil {
			t.Fatal(err)
		}
		// A connection accepted before stays up.
		a, b, err := connect(ctx(t), p, l, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		defer b.Close()
		errc := make(chan error, 1)
		go func() {
			_, err := l.Accept(context.Background())
			errc <- err
		}()
		time.Sleep(10 * time.Millisecond)
		if err := l.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := l.Close(); err != nil {
			t.Errorf("second close: %v", err)
		}
		select {
		case err := <-errc:
			if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("blocked accept returned %v, want ErrClosed", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("blocked accept did not return after close")
		}
		if _, err := l.Accept(context.Background()); !errors.Is(err, transport.ErrClosed) {
			t.Errorf("accept after close: %v, want ErrClosed", err)
		}
		e := &env{t: t, a: a, b: b}
		t.Cleanup(func() {
			e.mu.Lock()
			defer e.mu.Unlock()
			a.Close()
			b.Close()
			for _, m := range e.mems {
				m.Free()
			}
		})
		src := e.region(a, 16, rw)
		dst := e.region(b, 16, rw)
		e.notify(src, dst, 1)
	})

	RunPrepare(t, p, addr)

	t.Run("Conn", func(t *testing.T) { Run(t, PairFunc(p, addr)) })
}

// listenOn listens with p on a fresh address of addr, closed when t ends.
func listenOn(t *testing.T, p transport.Provider, addr func(t *testing.T) string) transport.Listener {
	t.Helper()
	l, err := p.Listen(context.Background(), addr(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// testContext is a context that ends after waitTimeout, or with t.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	t.Cleanup(cancel)
	return ctx
}
