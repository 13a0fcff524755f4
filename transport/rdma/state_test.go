//go:build linux

package rdma

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// noLeaks fails t if goroutines started during it are left when it ends
// (after its other cleanups: call it first).
func noLeaks(t *testing.T) {
	opt := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, opt) })
}

// TestTransitionTable: the moves of the conn's state machine, all of
// them: forward only, and only along the documented edges.
func TestTransitionTable(t *testing.T) {
	const (
		C = stateConnecting
		E = stateEstablished
		F = stateFailing
		D = stateDraining
		X = stateClosed
		Z = stateDestroyed
	)
	allowed := map[[2]connState]bool{
		{C, E}: true, {C, D}: true, {C, X}: true,
		{E, F}: true, {E, D}: true, {E, X}: true,
		{F, D}: true, {F, X}: true,
		{D, X}: true,
		{X, Z}: true,
	}
	for from := C; from <= Z; from++ {
		for to := C; to <= Z; to++ {
			if got, want := transitionAllowed(from, to), allowed[[2]connState{from, to}]; got != want {
				t.Errorf("%v → %v allowed %v, want %v", from, to, got, want)
			}
		}
	}
	if s := connState(9).String(); s != "connState(9)" {
		t.Errorf("String of an unknown state: %q", s)
	}
}

// TestTransitionStopsQPOnce drives conns along each path to closed and
// counts what was done to their QP: stopped exactly once, with
// rdma_disconnect if the conn was established, else by a move to the
// error state; the first cause is the one kept; the moves that are not
// allowed change nothing.
func TestTransitionStopsQPOnce(t *testing.T) {
	causeA, causeB := errors.New("first"), errors.New("second")
	for _, tc := range []struct {
		name        string
		established bool
		path        []connState
		disconnects int
		toErrors    int
	}{
		{"prepared closed", false, []connState{stateClosed}, 0, 1},
		{"prepared broken then closed", false, []connState{stateDraining, stateClosed}, 0, 1},
		{"established closed", true, []connState{stateClosed}, 1, 0},
		{"established broken then closed", true, []connState{stateDraining, stateClosed}, 1, 0},
		{"established failing, broken, closed", true, []connState{stateFailing, stateDraining, stateClosed}, 1, 0},
		{"established failing then closed", true, []connState{stateFailing, stateClosed}, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeFabric(t)
			p := newFakeProvider(t, f, Options{})
			var c *conn
			if tc.established {
				c, _ = fakePair(t, p)
			} else {
				c = preparedConn(t, p)
			}
			for i, to := range tc.path {
				cause := causeB
				if i == 0 {
					cause = causeA
				}
				if from, ok := c.transition(to, cause); !ok {
					t.Fatalf("%v → %v refused", from, to)
				}
				// The same move again, and one backwards, change nothing.
				if _, ok := c.transition(to, causeB); ok {
					t.Errorf("%v → %v allowed twice", to, to)
				}
				if _, ok := c.transition(stateEstablished, nil); ok {
					t.Errorf("%v → established allowed", to)
				}
			}
			if d, e := f.stops(c); d != tc.disconnects || e != tc.toErrors {
				t.Errorf("%d rdma_disconnect and %d moves to the error state, want %d and %d", d, e, tc.disconnects, tc.toErrors)
			}
			if err := c.closedErr(); !errors.Is(err, causeA) || errors.Is(err, causeB) {
				t.Errorf("the conn's end %v, want the first cause", err)
			}
			// The one that moved it to closed (here the test) finishes the
			// close.
			c.finishClose()
			if st := c.state(); st != stateDestroyed {
				t.Errorf("after the close: %v", st)
			}
			c.Close() // returns at once
		})
	}
}

// preparedConn is a conn of ConnRequest.Prepare over p (a dialer waits
// for it in the background; both are cleaned up when t ends).
func preparedConn(t *testing.T, p *provider) *conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	l, err := p.Listen(ctx, fakeListenAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	dialed := dialAsync(ctx, p, l.Addr(), nil)
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c, err := req.Prepare()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		req.Reject(nil)
		c.Close()
		<-dialed
	})
	return c.(*conn)
}
