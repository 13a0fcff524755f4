//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

// The two panics of issue 16, reproduced exactly: a hook runs Close at
// the one point of the window code where it made two owners close one
// channel, and a device fails QP creation under newConn.

// poller polls c in the background until it ends, as a session's
// completion loop does, so that window requests complete.
type poller struct {
	done  chan struct{}
	comps []transport.Completion
	err   error
}

func startPoller(c transport.Conn) *poller {
	p := &poller{done: make(chan struct{})}
	go func() {
		defer close(p.done)
		out := make([]transport.Completion, 16)
		for {
			n, err := c.Poll(context.Background(), out)
			p.comps = append(p.comps, out[:n]...)
			if err != nil {
				p.err = err
				return
			}
		}
	}()
	return p
}

// wait waits for the poller to end (its conn broke or closed).
func (p *poller) wait(t testing.TB) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the poller did not end")
	}
}

// windowPair is a connected pair over f whose b has a region for windows,
// polled in the background.
func windowPair(t *testing.T, f *fakeFabric) (a, b *conn, r transport.Region, pb *poller) {
	t.Helper()
	p := newFakeProvider(t, f, Options{})
	p.hooks = &testHooks{}
	a, b = fakePair(t, p)
	r, err := b.Register(memory(t, 1<<16), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		t.Fatal(err)
	}
	pb = startPoller(b)
	t.Cleanup(func() {
		b.Close()
		pb.wait(t)
	})
	return a, b, r, pb
}

// TestInvalidateRacesClose: the panic "close of closed channel" in
// postMW from window.Invalidate. Close runs after Invalidate started its
// request and before it is posted; Close's teardown ends the request (and
// the memory window), then the post finds the conn closed. Invalidate
// must return nil (the window died with the conn), nothing panics, and
// every object is destroyed once.
func TestInvalidateRacesClose(t *testing.T) {
	transporttest.CheckGoroutines(t)
	f := newFakeFabric(t)
	a, b, r, pb := windowPair(t, f)
	w, err := b.BindWindow(context.Background(), r, 0, 4096, transport.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	b.hooks.AfterStartOp = func(c *conn, op *mwOp) {
		if op.kind == opInv && !closed {
			closed = true
			c.Close()
		}
	}
	if err := w.Invalidate(context.Background()); err != nil {
		t.Errorf("invalidate with the conn closed under it: %v, want nil", err)
	}
	if !closed {
		t.Fatal("the hook did not run")
	}
	if err := w.Invalidate(context.Background()); err != nil {
		t.Errorf("second invalidate: %v", err)
	}
	pb.wait(t)
	if !errors.Is(pb.err, transport.ErrClosed) {
		t.Errorf("poll ended with %v, want ErrClosed", pb.err)
	}
	a.Close()
	f.waitClean(t)
	if made, gone := f.counts("mw"); made != 1 || gone != 1 {
		t.Errorf("memory windows: %d allocated, %d deallocated; want 1, 1", made, gone)
	}
}

// TestBindWindowRacesClose is TestInvalidateRacesClose for BindWindow
// (newWindow then postMW): it must fail with ErrClosed.
func TestBindWindowRacesClose(t *testing.T) {
	transporttest.CheckGoroutines(t)
	f := newFakeFabric(t)
	a, b, r, pb := windowPair(t, f)
	b.hooks.AfterStartOp = func(c *conn, op *mwOp) {
		if op.kind == opBind {
			c.Close()
		}
	}
	if w, err := b.BindWindow(context.Background(), r, 0, 4096, transport.AccessRemoteRead); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("bind with the conn closed under it: %v, %v; want ErrClosed", w, err)
	}
	pb.wait(t)
	a.Close()
	f.waitClean(t)
	if made, gone := f.counts("mw"); made != gone {
		t.Errorf("memory windows: %d allocated, %d deallocated", made, gone)
	}
}

// failCreate makes op fail with ENOMEM, every time.
func failCreate(f *fakeFabric, op string) {
	f.failOn(op, func(int) error { return fmt.Errorf("%s: %w", op, syscall.ENOMEM) })
}

// dialAsync dials addr through p in the background.
func dialAsync(ctx context.Context, p *provider, addr string, pd []byte) chan error {
	ch := make(chan error, 1)
	go func() {
		c, err := p.Dial(ctx, addr, pd)
		if c != nil {
			c.Close()
		}
		ch <- err
	}()
	return ch
}

// TestNewConnFailsOnAccept: the nil pointer in destroyWindows from
// newConn's cleanup, when the QP cannot be made (connReq.Prepare during an
// initiator's reconnect), and the same for each resource newConn makes, in
// each of Prepare, Accept and Dial: an error that says what failed, no
// panic, the dialer refused, everything made destroyed once, the listener
// still accepting.
func TestNewConnFailsOnAccept(t *testing.T) {
	for _, op := range []string{"create_qp", "create_cq", "alloc_pd", "create_comp_channel", "query_device"} {
		for _, how := range []string{"prepare", "accept", "dial"} {
			t.Run(op+"/"+how, func(t *testing.T) {
				transporttest.CheckGoroutines(t)
				f := newFakeFabric(t)
				p := newFakeProvider(t, f, Options{})
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				l, err := p.Listen(ctx, fakeListenAddr)
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				if how == "dial" {
					// Only the dialer's fails: the listener made nothing yet.
					failCreate(f, op)
					err := <-dialAsync(ctx, p, l.Addr(), nil)
					if err == nil {
						t.Fatal("dial succeeded")
					}
					t.Logf("dial: %v", err)
				} else {
					dialed := dialAsync(ctx, p, l.Addr(), nil)
					req, err := l.Accept(ctx)
					if err != nil {
						t.Fatal(err)
					}
					failCreate(f, op)
					var c transport.Conn
					if how == "prepare" {
						c, err = req.Prepare()
					} else {
						c, err = req.Accept(ctx, nil)
					}
					if err == nil {
						c.Close()
						t.Fatalf("%s succeeded", how)
					}
					t.Logf("%s: %v", how, err)
					if derr := <-dialed; derr == nil {
						t.Error("the dialer got in")
					}
					if _, err := req.Accept(ctx, nil); err == nil {
						t.Error("accept after the failure succeeded")
					}
				}
				// The listener goes on.
				f.failOn(op, nil)
				a, b, err := connectOnce(ctx, p, l)
				if err != nil {
					t.Fatalf("connect after the failure: %v", err)
				}
				a.Close()
				b.Close()
			})
		}
	}
}

// connectOnce dials l through p and accepts; if the dial fails the
// accept is given up.
func connectOnce(ctx context.Context, p *provider, l transport.Listener) (a, b transport.Conn, err error) {
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	type res struct {
		c   transport.Conn
		err error
	}
	accepted := make(chan res, 1)
	go func() {
		req, err := l.Accept(actx)
		if err != nil {
			accepted <- res{nil, err}
			return
		}
		c, err := req.Accept(actx, nil)
		accepted <- res{c, err}
	}()
	a, err = p.Dial(ctx, l.Addr(), nil)
	if err != nil {
		cancel()
		if r := <-accepted; r.c != nil {
			r.c.Close()
		}
		return nil, nil, err
	}
	r := <-accepted
	if r.err != nil {
		a.Close()
		return nil, nil, r.err
	}
	return a, r.c, nil
}
