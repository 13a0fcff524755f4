package target

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
)

// gateKey is a grant key whose release waits until releaseWorkers releases
// are in progress at once (or a deadline passes, and it fails).
type gateKey struct {
	g *releaseGate
}

type releaseGate struct {
	mu       sync.Mutex
	inFlight int
	most     int
	open     chan struct{} // closed once releaseWorkers were in flight together
	released atomic.Int64
}

func (k gateKey) Addr() uint64             { return 0 }
func (k gateKey) RKey() uint32             { return 0 }
func (k gateKey) Access() transport.Access { return transport.AccessRemoteRead }

func (k gateKey) release() error {
	g := k.g
	g.mu.Lock()
	g.inFlight++
	g.most = max(g.most, g.inFlight)
	if g.inFlight == releaseWorkers {
		select {
		case <-g.open:
		default:
			close(g.open)
		}
	}
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		g.inFlight--
		g.mu.Unlock()
	}()
	select {
	case <-g.open:
		g.released.Add(1)
		return nil
	case <-time.After(2 * time.Second):
		return errors.New("released alone: no other release in flight with it")
	}
}

// TestReleaseAllConcurrently: the grants a Close or a fence gives up are
// released up to releaseWorkers at once (each a work request waited for,
// on RDMA), never more, and releaseAll returns once every one is.
func TestReleaseAllConcurrently(t *testing.T) {
	tg, _, _ := benchTarget(t, 4<<20, 1<<20)
	c := tg.cache
	g := &releaseGate{open: make(chan struct{})}
	var hs []*holder
	for range 3 * releaseWorkers {
		hs = append(hs, &holder{ch: &chunk{}, s: &session{}, key: gateKey{g}})
	}
	c.releaseAll(hs, true)
	if n := g.released.Load(); n != int64(len(hs)) {
		t.Fatalf("%d of %d grants released (the others were released alone, one at a time)", n, len(hs))
	}
	if g.most != releaseWorkers {
		t.Fatalf("up to %d releases at once, want %d", g.most, releaseWorkers)
	}
}
