//go:build linux

package rdma

import (
	"errors"
	"testing"

	"github.com/rblk/rblk/transport"
)

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

// TestDisconnectedMidIO: the peer disconnects while requests are in
// flight (receives posted, SENDs waiting for the peer's receives): every
// one completes once, flushed, and Poll ends with ErrClosed saying why.
func TestDisconnectedMidIO(t *testing.T) {
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
	for _, c := range got {
		if c.Status != transport.StatusFlushed {
			t.Errorf("completion %+v, want flushed", c)
		}
	}
}
