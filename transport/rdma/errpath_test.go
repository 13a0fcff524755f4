//go:build linux

package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// The error paths of dial, accept, prepare, reject, poll and close, each
// made to happen by the fake device. After each: no panic, no goroutine
// left (noLeaks), every request posted completes once (completesOnce), and
// every object of the device destroyed once (the fabric fails the test on
// a double destroy, and waitClean on a leak).

// completesOnce checks that got has each of ids exactly once, and nothing
// else.
func completesOnce(t *testing.T, got []transport.Completion, ids ...uint64) {
	t.Helper()
	seen := map[uint64]int{}
	for _, c := range got {
		seen[c.ID]++
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("request %d completed %d times in %+v", id, seen[id], got)
		}
		delete(seen, id)
	}
	for id, n := range seen {
		t.Errorf("completion of %d (%d times), which was not posted", id, n)
	}
}

// allFlushed checks that every completion of got is flushed.
func allFlushed(t *testing.T, got []transport.Completion) {
	t.Helper()
	for _, c := range got {
		if c.Status != transport.StatusFlushed {
			t.Errorf("completion %+v, want flushed", c)
		}
	}
}

// TestDisconnectedMidIO: the peer disconnects while requests are in
// flight (receives posted, SENDs waiting for the peer's receives, an
// unsignaled one among them): every one completes once, flushed, and
// Poll ends with ErrClosed saying why.
func TestDisconnectedMidIO(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	a, _ := fakePair(t, p)
	if err := a.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
		t.Fatal(err)
	}
	if err := a.PostSend(transport.WorkRequest{ID: 3, Op: transport.OpSend}, nop(4), transport.WorkRequest{ID: 5, Op: transport.OpSend, Unsignaled: true}); err != nil {
		t.Fatal(err)
	}
	f.disconnectPeer(a)
	got, err := pollAll(t, a)
	if !errors.Is(err, transport.ErrClosed) || !errors.Is(err, errPeerClose) {
		t.Errorf("poll ended with %v, want ErrClosed for the peer's disconnect", err)
	}
	completesOnce(t, got, 1, 2, 3, 4, 5)
	allFlushed(t, got)
	if err := a.PostSend(nop(6)); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("post after the disconnect: %v, want ErrClosed", err)
	}
	if d, _ := f.stops(a); d != 1 {
		t.Errorf("%d rdma_disconnect calls, want 1", d)
	}
}

// acceptOutcome is what goes wrong once the acceptor called rdma_accept.
type acceptOutcome struct {
	name    string
	setup   func(f *fakeFabric)
	removed bool // the error matches ErrDeviceRemoved
}

var acceptOutcomes = []acceptOutcome{
	{name: "rdma_accept fails", setup: func(f *fakeFabric) {
		f.failOn("accept", func(int) error { return fmt.Errorf("rdma_accept: %w", syscall.ENOMEM) })
	}},
	{name: "REJECTED", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventRejected, 28) }},
	{name: "CONNECT_ERROR", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventConnectError, -110) }},
	{name: "UNREACHABLE", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventUnreachable, -110) }},
	{name: "DISCONNECTED", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventDisconnected, 0) }},
	{name: "DEVICE_REMOVAL", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventDeviceRemoval, 0) }, removed: true},
}

func eventOf(ty verbs.EventType, status int) func() (verbs.EventType, int) {
	return func() (verbs.EventType, int) { return ty, status }
}

// TestAcceptFailures: rdma_accept fails, or the peer's confirmation does
// not come (REJECTED, CONNECT_ERROR, UNREACHABLE, DISCONNECTED,
// DEVICE_REMOVAL instead of ESTABLISHED), with a prepared conn whose
// receives are posted, or without: Accept fails saying so, the receives
// complete once, flushed, the dialer fails, everything is destroyed once,
// and the listener goes on.
func TestAcceptFailures(t *testing.T) {
	for _, oc := range acceptOutcomes {
		for _, prepared := range []bool{true, false} {
			name := oc.name + "/plain"
			if prepared {
				name = oc.name + "/prepared"
			}
			t.Run(name, func(t *testing.T) {
				noLeaks(t)
				f := newFakeFabric(t)
				p := newFakeProvider(t, f, Options{})
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				l, err := p.Listen(ctx, fakeListenAddr)
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				dialed := dialAsync(ctx, p, l.Addr(), []byte("hello"))
				req, err := l.Accept(ctx)
				if err != nil {
					t.Fatal(err)
				}
				var pc *conn
				var pd *poller
				if prepared {
					c, err := req.Prepare()
					if err != nil {
						t.Fatal(err)
					}
					pc = c.(*conn)
					if err := pc.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
						t.Fatal(err)
					}
					pd = startPoller(pc)
				}
				oc.setup(f)
				c, err := req.Accept(ctx, []byte("welcome"))
				if err == nil {
					c.Close()
					t.Fatal("accept succeeded")
				}
				t.Logf("accept: %v", err)
				if oc.removed != errors.Is(err, transport.ErrDeviceRemoved) {
					t.Errorf("accept: %v; want ErrDeviceRemoved: %v", err, oc.removed)
				}
				if derr := <-dialed; derr == nil {
					t.Error("the dialer got in")
				}
				if prepared {
					pd.wait(t)
					if !errors.Is(pd.err, transport.ErrClosed) {
						t.Errorf("poll of the prepared conn ended with %v, want ErrClosed", pd.err)
					}
					completesOnce(t, pd.comps, 1, 2)
					allFlushed(t, pd.comps)
					pc.Close()
				}
				// The listener goes on.
				f.failOn("accept", nil)
				f.acceptEvent = nil
				a, b, err := connectOnce(ctx, p, l)
				if err != nil {
					t.Fatalf("connect after the failure: %v", err)
				}
				a.Close()
				b.Close()
				l.Close()
				f.waitClean(t)
			})
		}
	}
}

// TestPrepareThenReject: a prepared conn with receives posted is
// rejected: the dialer gets the reject's private data, the receives
// complete flushed, once; and a reject after the owner closed the
// prepared conn is refused by nobody (the teardown refused the peer).
func TestPrepareThenReject(t *testing.T) {
	for _, closedFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("closed first %v", closedFirst), func(t *testing.T) {
			noLeaks(t)
			f := newFakeFabric(t)
			p := newFakeProvider(t, f, Options{})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			l, err := p.Listen(ctx, fakeListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			dialed := dialAsync(ctx, p, l.Addr(), nil)
			req, err := l.Accept(ctx)
			if err != nil {
				t.Fatal(err)
			}
			c, err := req.Prepare()
			if err != nil {
				t.Fatal(err)
			}
			pc := c.(*conn)
			if err := pc.PostRecv(transport.RecvRequest{ID: 1}); err != nil {
				t.Fatal(err)
			}
			pd := startPoller(pc)
			if closedFirst {
				pc.Close()
			}
			if err := req.Reject([]byte("go away")); err != nil {
				t.Errorf("reject: %v", err)
			}
			var rej *transport.RejectError
			derr := <-dialed
			switch {
			case !errors.As(derr, &rej):
				t.Errorf("dial: %v, want a RejectError", derr)
			case closedFirst && len(rej.PrivateData) != 0:
				t.Errorf("dial: %v with private data %q, want none (the teardown refused it)", derr, rej.PrivateData)
			case !closedFirst && string(rej.PrivateData) != "go away":
				t.Errorf("dial: private data %q, want the reject's", rej.PrivateData)
			}
			pd.wait(t)
			completesOnce(t, pd.comps, 1)
			allFlushed(t, pd.comps)
			pc.Close()
			l.Close()
			f.waitClean(t)
		})
	}
}

// TestDialFailures: each way a dial fails gives an error that says what
// happened (naming the address), leaves nothing behind, and a later dial
// works.
func TestDialFailures(t *testing.T) {
	for _, tc := range []struct {
		name   string
		addr   string // "" : the listener's
		setup  func(f *fakeFabric)
		check  func(t *testing.T, err error)
		accept func(req transport.ConnRequest) // what the listener does
	}{
		{name: "rdma_connect fails", setup: func(f *fakeFabric) {
			f.failOn("connect", func(int) error { return fmt.Errorf("rdma_connect: %w", syscall.ENOMEM) })
		}, check: wantErrno(syscall.ENOMEM)},
		{name: "rdma_resolve_addr fails", setup: func(f *fakeFabric) {
			f.failOn("resolve_addr", func(int) error { return fmt.Errorf("rdma_resolve_addr: %w", syscall.ENODEV) })
		}, check: wantErrno(syscall.ENODEV)},
		{name: "address unreachable", addr: "203.0.113.7:4791", check: wantErrno(syscall.EHOSTUNREACH)},
		{name: "rdma_resolve_route fails", setup: func(f *fakeFabric) {
			f.failOn("resolve_route", func(int) error { return fmt.Errorf("rdma_resolve_route: %w", syscall.ENETUNREACH) })
		}, check: wantErrno(syscall.ENETUNREACH)},
		{name: "nobody listens", addr: "192.0.2.1:1", check: func(t *testing.T, err error) {
			var rej *transport.RejectError
			if errors.As(err, &rej) || !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("dial: %v, want ECONNREFUSED and no RejectError", err)
			}
		}},
		{name: "rejected with private data", accept: func(req transport.ConnRequest) { req.Reject([]byte("full")) }, check: wantReject("full")},
		{name: "rejected without private data", accept: func(req transport.ConnRequest) { req.Reject(nil) }, check: wantReject("")},
		{name: "the acceptor's confirmation fails", setup: func(f *fakeFabric) { f.acceptEvent = eventOf(verbs.EventUnreachable, -110) },
			accept: func(req transport.ConnRequest) { req.Accept(context.Background(), nil) }, check: func(t *testing.T, err error) {
				if !strings.Contains(err.Error(), "RDMA_CM_EVENT_CONNECT_ERROR") {
					t.Errorf("dial: %v, want the CONNECT_ERROR", err)
				}
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			noLeaks(t)
			f := newFakeFabric(t)
			p := newFakeProvider(t, f, Options{})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			l, err := p.Listen(ctx, fakeListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			addr := tc.addr
			if addr == "" {
				addr = l.Addr()
			}
			if tc.setup != nil {
				tc.setup(f)
			}
			dialed := dialAsync(ctx, p, addr, []byte("hi"))
			var req transport.ConnRequest
			if tc.accept != nil {
				if req, err = l.Accept(ctx); err != nil {
					t.Fatal(err)
				}
				tc.accept(req)
			}
			err = <-dialed
			if err == nil {
				t.Fatal("dial succeeded")
			}
			t.Logf("dial: %v", err)
			if !strings.Contains(err.Error(), strings.Split(addr, ":")[0]) {
				t.Errorf("dial error %q does not name the address", err)
			}
			tc.check(t, err)
			l.Close()
			f.waitClean(t)
			// A dial that goes through, after.
			f.failOn("connect", nil)
			f.failOn("resolve_addr", nil)
			f.failOn("resolve_route", nil)
			f.acceptEvent = nil
			l2, err := p.Listen(ctx, fakeListenAddr)
			if err != nil {
				t.Fatal(err)
			}
			a, b, err := connectOnce(ctx, p, l2)
			if err != nil {
				t.Fatalf("connect after the failure: %v", err)
			}
			a.Close()
			b.Close()
			l2.Close()
		})
	}
}

func wantErrno(e syscall.Errno) func(t *testing.T, err error) {
	return func(t *testing.T, err error) {
		t.Helper()
		if !errors.Is(err, e) {
			t.Errorf("dial: %v, want %v", err, e)
		}
	}
}

func wantReject(pd string) func(t *testing.T, err error) {
	return func(t *testing.T, err error) {
		t.Helper()
		var rej *transport.RejectError
		if !errors.As(err, &rej) || string(rej.PrivateData) != pd {
			t.Errorf("dial: %v, want a RejectError with %q", err, pd)
		}
	}
}

// TestDialCanceled: a dial whose request nobody answers ends with its
// context, leaving nothing behind.
func TestDialCanceled(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	l, err := p.Listen(context.Background(), fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if c, err := p.Dial(ctx, l.Addr(), nil); !errors.Is(err, context.DeadlineExceeded) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("dial nobody answers: %v, want deadline exceeded", err)
	}
	l.Close()
	f.waitClean(t)
}

// TestPollCQError: ibv_poll_cq fails. Nothing may be reported while the
// QP lives (the device may still execute it): the conn closes itself,
// and once its QP is destroyed Poll returns every request, once, flushed,
// then an ErrClosed that says why; the owner's Close returns. Whether the
// CQ recovers (Close collects the flushes) or fails for good (Close gives
// up after flushTimeout).
func TestPollCQError(t *testing.T) {
	for _, forGood := range []bool{false, true} {
		t.Run(fmt.Sprintf("for good %v", forGood), func(t *testing.T) {
			noLeaks(t)
			f := newFakeFabric(t)
			p := newFakeProvider(t, f, Options{})
			p.flushTimeout = 200 * time.Millisecond
			a, _ := fakePair(t, p)
			if err := a.PostRecv(transport.RecvRequest{ID: 1}, transport.RecvRequest{ID: 2}); err != nil {
				t.Fatal(err)
			}
			// SENDs wait for receives the peer never posts.
			if err := a.PostSend(transport.WorkRequest{ID: 3, Op: transport.OpSend}, transport.WorkRequest{ID: 4, Op: transport.OpSend, Unsignaled: true}); err != nil {
				t.Fatal(err)
			}
			f.failOn("poll_cq", func(n int) error {
				if forGood || n <= 3 {
					return fmt.Errorf("ibv_poll_cq: %w", syscall.EIO)
				}
				return nil
			})
			got, err := pollAll(t, a)
			if !errors.Is(err, transport.ErrClosed) || !errors.Is(err, syscall.EIO) {
				t.Errorf("poll ended with %v, want ErrClosed saying the CQ failed", err)
			}
			completesOnce(t, got, 1, 2, 3, 4)
			allFlushed(t, got)
			a.Close()
			if st := a.state(); st != stateDestroyed {
				t.Errorf("after Close: %v", st)
			}
		})
	}
}

// TestFailedCompletion: a request fails on the device (its completion has
// an error status): it and every later request complete once (the later
// ones flushed), the conn breaks, and so does the peer's.
func TestFailedCompletion(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	a, b := fakePair(t, p)
	f.mu.Lock()
	f.execHook = func(wr verbs.WR) (uint32, bool) {
		return verbs.WCRetryExcErr, wr.ID == 1 // a's second request
	}
	f.mu.Unlock()
	if err := b.PostRecv(transport.RecvRequest{ID: 7}); err != nil {
		t.Fatal(err)
	}
	if err := a.PostSend(nop(10), nop(11), transport.WorkRequest{ID: 12, Op: transport.OpWrite, Unsignaled: true}, nop(13)); err != nil {
		t.Fatal(err)
	}
	got, err := pollAll(t, a)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll ended with %v, want ErrClosed", err)
	}
	completesOnce(t, got, 10, 11, 12, 13)
	for _, c := range got {
		want := transport.StatusFlushed
		switch c.ID {
		case 10:
			want = transport.StatusSuccess
		case 11:
			want = transport.StatusTransportError
		}
		if c.Status != want {
			t.Errorf("completion %+v, want %v", c, want)
		}
		if c.ID == 11 && c.VendorErr>>24 != verbs.WCRetryExcErr {
			t.Errorf("vendor_err %#x, want the ibv_wc_status in the top 8 bits", c.VendorErr)
		}
	}
	gotB, err := pollAll(t, b)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("the peer's poll ended with %v, want ErrClosed", err)
	}
	completesOnce(t, gotB, 7)
}

// TestPostRefusedAtIndexes: ibv_post_send and ibv_post_recv refuse the
// request at each interesting index of a call (the first, inside the
// first chain, at a chain's end, in the next chain, the last): what the
// QP took completes normally, the refused one with an error and the rest
// flushed, each once; a refusal of the whole call is ErrQueueFull and
// the conn goes on.
func TestPostRefusedAtIndexes(t *testing.T) {
	const chunk, n = 4, 10
	for _, op := range []string{"post_send", "post_recv"} {
		for _, at := range []int{0, 1, chunk - 1, chunk, chunk + 1, n - 1} {
			t.Run(fmt.Sprintf("%s/%d", op, at), func(t *testing.T) {
				noLeaks(t)
				f := newFakeFabric(t)
				p := newFakeProvider(t, f, Options{SendQueueDepth: 32, RecvQueueDepth: 32})
				p.chunk = chunk
				a, b := fakePair(t, p)
				refuseAt(f, op, at)
				ids := make([]uint64, n)
				var err error
				if op == "post_send" {
					wrs := make([]transport.WorkRequest, n)
					for i := range wrs {
						wrs[i] = nop(uint64(100 + i))
						ids[i] = wrs[i].ID
					}
					err = a.PostSend(wrs...)
				} else {
					rrs := make([]transport.RecvRequest, n)
					for i := range rrs {
						rrs[i] = transport.RecvRequest{ID: uint64(100 + i)}
						ids[i] = rrs[i].ID
					}
					err = a.PostRecv(rrs...)
				}
				if at == 0 {
					if !errors.Is(err, transport.ErrQueueFull) {
						t.Fatalf("a refusal of the whole call: %v, want ErrQueueFull", err)
					}
					// Nothing was taken; the conn goes on.
					if err := a.PostSend(nop(1)); err != nil {
						t.Fatal(err)
					}
					completesOnce(t, pollN(t, a, 1), 1)
					return
				}
				if err != nil {
					t.Fatalf("%s: %v, want the refusal reported in the completions", op, err)
				}
				got, err := pollAll(t, a)
				if !errors.Is(err, transport.ErrClosed) {
					t.Errorf("poll ended with %v, want ErrClosed", err)
				}
				completesOnce(t, got, ids...)
				for _, c := range got {
					i := int(c.ID - 100)
					want := transport.StatusFlushed
					if op == "post_send" && i < at {
						want = transport.StatusSuccess
					} else if op == "post_send" && i == at {
						want = transport.StatusTransportError
					}
					if c.Status != want {
						t.Errorf("completion %+v (index %d), want %v", c, i, want)
					}
				}
				// The peer learns of the break.
				if _, err := pollAll(t, b); !errors.Is(err, transport.ErrClosed) {
					t.Errorf("the peer's poll ended with %v, want ErrClosed", err)
				}
			})
		}
	}
}

// TestPostRefusedAfterUnsignaled: the refused request comes after
// unsignaled ones that succeed (no completion): the drain request covers
// them, so the refused one's turn comes and the conn ends, without
// Close's timeout.
func TestPostRefusedAfterUnsignaled(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	p.flushTimeout = time.Hour // a wait for it would show
	a, _ := fakePair(t, p)
	refuseAt(f, "post_send", 3)
	wrs := []transport.WorkRequest{nop(1), nop(2), nop(3), nop(4), nop(5)}
	for i := range wrs {
		wrs[i].Unsignaled = true
	}
	if err := a.PostSend(wrs...); err != nil {
		t.Fatal(err)
	}
	got, err := pollAll(t, a)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll ended with %v, want ErrClosed", err)
	}
	completesOnce(t, got, 4, 5)
	if got[0].Status != transport.StatusTransportError || got[1].Status != transport.StatusFlushed {
		t.Errorf("completions %+v: want the refused one's error, then the last flushed", got)
	}
	sends, _, _ := fakeQPOf(a).posted()
	if len(sends) != 4 || sends[3] != drainWRID {
		t.Errorf("the QP took %#x: want the 3 before the refusal and the drain request", sends)
	}
}

// TestWindowAllocAndBindFailures: ibv_alloc_mw fails (the bind fails, the
// conn goes on, the next bind works), the bind's post is refused (the
// queue is full: the memory window goes back to the pool), the bind
// fails on the device (the conn breaks), an invalidation's post is
// refused (the memory window is deallocated instead).
func TestWindowAllocAndBindFailures(t *testing.T) {
	bind := func(b *conn, r transport.Region) (transport.Window, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return b.BindWindow(ctx, r, 0, 4096, transport.AccessRemoteRead)
	}
	t.Run("alloc", func(t *testing.T) {
		noLeaks(t)
		f := newFakeFabric(t)
		_, b, r, _ := windowPair(t, f)
		f.failOn("alloc_mw", func(n int) error {
			if n == 1 {
				return fmt.Errorf("ibv_alloc_mw: %w", syscall.ENOMEM)
			}
			return nil
		})
		if _, err := bind(b, r); err == nil || errors.Is(err, transport.ErrUnsupported) {
			t.Errorf("bind with ibv_alloc_mw failing: %v, want an error other than ErrUnsupported", err)
		}
		if n := len(b.mwSem); n != 0 {
			t.Errorf("%d window slots taken after the failure", n)
		}
		w, err := bind(b, r)
		if err != nil {
			t.Fatalf("bind after: %v", err)
		}
		if err := w.Invalidate(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("post refused", func(t *testing.T) {
		noLeaks(t)
		f := newFakeFabric(t)
		_, b, r, _ := windowPair(t, f)
		f.failOn("bind_mw", func(n int) error {
			if n == 1 {
				return fmt.Errorf("ibv_post_send: %w", syscall.ENOMEM)
			}
			return nil
		})
		if _, err := bind(b, r); !errors.Is(err, transport.ErrQueueFull) {
			t.Errorf("bind refused at post: %v, want ErrQueueFull", err)
		}
		w, err := bind(b, r)
		if err != nil {
			t.Fatalf("bind after: %v", err)
		}
		if live, alloc := b.WindowStats(); live != 1 || alloc != 1 {
			t.Errorf("%d windows, %d memory windows: want the pooled one reused", live, alloc)
		}
		if err := w.Invalidate(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("bind fails on the device", func(t *testing.T) {
		noLeaks(t)
		f := newFakeFabric(t)
		a, b, r, pb := windowPair(t, f)
		f.mu.Lock()
		f.execHook = func(wr verbs.WR) (uint32, bool) { return verbs.WCMWBindErr, wr.Opcode == verbs.WRBindMW }
		f.mu.Unlock()
		if _, err := bind(b, r); err == nil || errors.Is(err, transport.ErrClosed) {
			t.Errorf("bind failing on the device: %v, want the failure", err)
		}
		pb.wait(t)
		if !errors.Is(pb.err, transport.ErrClosed) || !strings.Contains(pb.err.Error(), "memory window bind request failed") {
			t.Errorf("poll ended with %v, want the bind's failure", pb.err)
		}
		if _, err := pollAll(t, a); !errors.Is(err, transport.ErrClosed) {
			t.Errorf("the peer's poll ended with %v, want ErrClosed", err)
		}
	})
	t.Run("invalidation refused", func(t *testing.T) {
		noLeaks(t)
		f := newFakeFabric(t)
		_, b, r, _ := windowPair(t, f)
		w, err := bind(b, r)
		if err != nil {
			t.Fatal(err)
		}
		f.failOn("local_inv", func(int) error { return fmt.Errorf("ibv_post_send: %w", syscall.ENOMEM) })
		if err := w.Invalidate(context.Background()); err != nil {
			t.Errorf("invalidate refused at post: %v, want nil (the memory window deallocated instead)", err)
		}
		if live, alloc := b.WindowStats(); live != 0 || alloc != 0 {
			t.Errorf("%d windows, %d memory windows: want none", live, alloc)
		}
		if made, gone := f.counts("mw"); made != 1 || gone != 1 {
			t.Errorf("memory windows: %d allocated, %d deallocated", made, gone)
		}
	})
}

// TestClosePostSendRace: Close begins while a PostSend is inside
// ibv_post_send (the fake's post blocks until Close moved the conn to
// closed): the requests posted are flushed and returned once, not lost.
func TestClosePostSendRace(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	a, _ := fakePair(t, p)
	closed := make(chan struct{})
	f.refusePost("post_send", func(call, n int) (int, error) {
		if call == 2 {
			go func() {
				a.Close()
				close(closed)
			}()
			waitUntil(t, func() bool { return a.state() >= stateClosed })
		}
		return n, nil
	})
	if err := a.PostSend(nop(1)); err != nil {
		t.Fatal(err)
	}
	completesOnce(t, pollN(t, a, 1), 1)
	// A SEND that waits for a receive: outstanding when Close collects.
	if err := a.PostSend(transport.WorkRequest{ID: 2, Op: transport.OpSend}, nop(3)); err != nil {
		t.Fatal(err)
	}
	<-closed
	got, err := pollAll(t, a)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll ended with %v", err)
	}
	completesOnce(t, got, 2, 3)
	allFlushed(t, got)
}

// TestCloseConcurrent: Close from two goroutines while binds,
// invalidations, posts and a Poll run on the conn, many times: no panic,
// both Close return once the conn is destroyed, every request completes
// at most once (each signaled one exactly once), every object is
// destroyed once.
func TestCloseConcurrent(t *testing.T) {
	noLeaks(t)
	rounds := 30
	if testing.Short() {
		rounds = 5
	}
	for round := range rounds {
		f := newFakeFabric(t)
		p := newFakeProvider(t, f, Options{})
		a, b := fakePairNoCleanup(t, p)
		r, err := b.Register(memory(t, 1<<16), transport.AccessLocalWrite|transport.AccessBindWindow)
		if err != nil {
			t.Fatal(err)
		}
		rng := rand.New(rand.NewPCG(uint64(round), 7))
		// Close lands after the k-th operation of the workers, a
		// different point each round.
		k := int64(rng.IntN(60))
		var ops atomic.Int64
		reached := make(chan struct{})
		var once sync.Once
		step := func() {
			if ops.Add(1) >= k {
				once.Do(func() { close(reached) })
			}
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		posted := map[uint64]bool{}
		var comps []transport.Completion
		pollDone := make(chan struct{})
		go func() {
			defer close(pollDone)
			out := make([]transport.Completion, 8)
			for {
				n, err := b.Poll(context.Background(), out)
				mu.Lock()
				comps = append(comps, out[:n]...)
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
		for g := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer once.Do(func() { close(reached) })
				for i := range 20 {
					step()
					w, err := b.BindWindow(context.Background(), r, 4096*g, 4096, transport.AccessRemoteRead)
					if err != nil {
						return
					}
					step()
					w.Invalidate(context.Background())
					id := uint64(g*1000 + i)
					wr := nop(id)
					wr.Unsignaled = i%3 == 0
					step()
					if err := b.PostSend(wr); err == nil && !wr.Unsignaled {
						mu.Lock()
						posted[id] = true
						mu.Unlock()
					}
				}
			}()
		}
		<-reached
		wg.Add(2)
		for range 2 {
			go func() {
				defer wg.Done()
				b.Close()
				if st := b.state(); st != stateDestroyed {
					t.Errorf("Close returned with the conn %v", st)
				}
			}()
		}
		wg.Wait()
		<-pollDone
		seen := map[uint64]int{}
		for _, c := range comps {
			seen[c.ID]++
			if seen[c.ID] > 1 {
				t.Errorf("round %d: request %d completed twice", round, c.ID)
			}
		}
		for id := range posted {
			if seen[id] != 1 {
				t.Errorf("round %d: signaled request %d completed %d times", round, id, seen[id])
			}
		}
		a.Close()
		f.waitClean(t)
	}
}

// waitUntil polls cond until it holds, and fails t after 10 s.
func waitUntil(t testing.TB, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("the condition waited for never held")
		}
		time.Sleep(time.Millisecond)
	}
}

// fakePairNoCleanup is fakePair without the cleanup that closes the conns.
func fakePairNoCleanup(t *testing.T, p *provider) (a, b *conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ca, cb, err := connectOnce(ctx, p, l)
	if err != nil {
		t.Fatal(err)
	}
	return ca.(*conn), cb.(*conn)
}

// TestDeviceRemovalDuringClose: the device goes while Close waits for the
// flushes of requests it will never complete: Close goes on at once (not
// after flushTimeout), and everything is released.
func TestDeviceRemovalDuringClose(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	p.flushTimeout = time.Hour
	a, b := heldRecvPair(t, p)
	done := make(chan struct{})
	go func() {
		a.Close()
		close(done)
	}()
	waitUntil(t, func() bool { return a.state() >= stateClosed })
	f.removeDevice()
	closedAfterRemoval(t, f, a, b, done)
}

// heldRecvPair is a pair over p (no cleanup) whose a has receive 1 posted
// and a QP that flushes nothing.
func heldRecvPair(t *testing.T, p *provider) (a, b *conn) {
	t.Helper()
	a, b = fakePairNoCleanup(t, p)
	if err := a.PostRecv(transport.RecvRequest{ID: 1}); err != nil {
		t.Fatal(err)
	}
	fakeQPOf(a).setHold(true)
	return a, b
}

// closedAfterRemoval checks a heldRecvPair whose a's Close (closing done
// when it returns) saw the device go: Close returns at once, Poll gets the
// receive flushed once and then ErrClosed, and everything is released.
func closedAfterRemoval(t *testing.T, f *fakeFabric, a, b *conn, done <-chan struct{}) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the device was removed")
	}
	got, err := pollAll(t, a)
	if !errors.Is(err, transport.ErrClosed) {
		t.Errorf("poll: %v, want ErrClosed", err)
	}
	completesOnce(t, got, 1)
	b.Close()
	f.waitClean(t)
}

// TestDeviceRemovalAfterDrainCount: the device goes exactly after Close's
// drain counted the requests not flushed, and before it waits for them.
// The removal flushes them all and kicks the waiter; the drain must see
// that kick (not sleep until flushTimeout with nothing outstanding). CI
// saw this once as TestDeviceRemovalDuringClose hanging; the hook makes
// it happen every run.
func TestDeviceRemovalAfterDrainCount(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	p.flushTimeout = time.Hour
	p.hooks = &testHooks{}
	a, b := heldRecvPair(t, p)
	var removed atomic.Bool
	kicked := make(chan bool, 1)
	p.hooks.DrainCounted = func(c *conn) {
		if removed.Swap(true) {
			return
		}
		gen := c.cqw.gen.Load()
		f.removeDevice()
		// Wait for the removal's kick (its CM event is handled by the
		// conn's CM goroutine).
		deadline := time.Now().Add(10 * time.Second)
		for c.cqw.gen.Load() == gen && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		kicked <- c.cqw.gen.Load() != gen
	}
	done := make(chan struct{})
	go func() {
		a.Close()
		close(done)
	}()
	closedAfterRemoval(t, f, a, b, done)
	if !removed.Load() {
		t.Fatal("the hook did not run: Close found nothing to drain")
	}
	if !<-kicked {
		t.Fatal("the device removal never kicked the waiter")
	}
}

// TestRejectAfterPrepareFailure and friends: a request whose Prepare
// failed is answered (the dialer refused) and can be neither accepted nor
// rejected after.
func TestRequestAfterPrepareFailure(t *testing.T) {
	noLeaks(t)
	f := newFakeFabric(t)
	p := newFakeProvider(t, f, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dialed := dialAsync(ctx, p, l.Addr(), nil)
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	failCreate(f, "create_qp")
	if _, err := req.Prepare(); err == nil {
		t.Fatal("prepare succeeded")
	}
	if _, err := req.Prepare(); err == nil {
		t.Error("a second prepare succeeded")
	}
	if err := req.Reject(nil); err == nil {
		t.Error("reject after a failed prepare succeeded")
	}
	if derr := <-dialed; derr == nil {
		t.Error("the dialer got in")
	}
	l.Close()
	f.waitClean(t)
	if !bytes.Equal(req.PrivateData(), nil) {
		t.Errorf("private data %q", req.PrivateData())
	}
}
