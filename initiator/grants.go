package initiator

import (
	"context"
	"fmt"
	"time"

	"github.com/rblk/rblk/protocol"
)

// grant is a chunk of the target's memory this initiator may use.
type grant struct {
	off      uint64
	addr     uint64
	rkey     uint32
	length   uint64
	gen      uint64
	writable bool
	valid    bool          // usable: new IO may take references
	refs     int           // IO in flight on it
	fetching chan struct{} // non-nil while the GrantRequest is in flight
}

// tryAcquire takes a reference on the grant of every chunk of idxs if all
// of them are held and usable, and reports whether it did.
func (s *session) tryAcquire(b *ioBuf, idxs []uint64, write bool) bool {
	v := s.v
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, idx := range idxs {
		if g := s.grants[idx]; g == nil || !g.valid || (write && !g.writable) {
			return false
		}
	}
	for _, idx := range idxs {
		g := s.grants[idx]
		g.refs++
		b.grants = append(b.grants, g)
	}
	return true
}

// acquire makes sure the chunks idxs are granted, then takes a reference on
// each, all at once: no reference is held while waiting for a grant, so a
// revoke never waits on an IO that waits on another grant. With a single
// chunk it always makes progress: a grant just fetched is referenced before
// a revoke of it can take effect.
func (s *session) acquire(ctx context.Context, b *ioBuf, idxs []uint64, write bool) error {
	v := s.v
	v.mu.Lock()
	for {
		missing := -1
		for i, idx := range idxs {
			if g := s.grants[idx]; g == nil || !g.valid || (write && !g.writable) {
				missing = i
				break
			}
		}
		if missing < 0 {
			for _, idx := range idxs {
				g := s.grants[idx]
				g.refs++
				b.grants = append(b.grants, g)
			}
			v.mu.Unlock()
			return nil
		}
		idx := idxs[missing]
		if g := s.grants[idx]; g != nil && g.fetching != nil {
			ch := g.fetching
			v.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return ctx.Err()
			case <-s.link.Done():
				return s.link.Err()
			}
			v.mu.Lock()
			continue
		}
		g := &grant{fetching: make(chan struct{})}
		old := s.grants[idx]
		s.grants[idx] = g
		v.mu.Unlock()
		if old != nil && old.valid {
			v.m.grantsHeld.Dec() // replaced by a writable one
		}
		err := s.fetch(ctx, idx, g)
		v.mu.Lock()
		close(g.fetching)
		g.fetching = nil
		if err != nil {
			if s.grants[idx] == g {
				delete(s.grants, idx)
			}
			v.mu.Unlock()
			return err
		}
	}
}

// fetch asks the target for a grant of chunk idx and fills g.
func (s *session) fetch(ctx context.Context, idx uint64, g *grant) error {
	v := s.v
	start := time.Now()
	req := protocol.GrantRequest{Handle: s.info.Handle, Offset: idx * uint64(s.info.ChunkSize)}
	if !v.ReadOnly() {
		req.Flags = protocol.GrantWrite
	}
	var gr protocol.Grant
	v.m.grantRequests.Inc()
	if err := s.link.Request(ctx, &req, &gr); err != nil {
		v.m.errors.WithLabelValues("grant").Inc()
		return fmt.Errorf("grant of chunk at %d: %w", req.Offset, err)
	}
	v.m.grantSeconds.Observe(time.Since(start).Seconds())
	if gr.Offset != req.Offset || gr.Length == 0 || gr.Length > s.info.ChunkSize {
		s.protocolError(fmt.Errorf("grant for %d covers %d+%d: %w", req.Offset, gr.Offset, gr.Length, protocol.ErrProtocol))
		return protocol.ErrProtocol
	}
	v.mu.Lock()
	g.off, g.addr, g.rkey, g.length, g.gen = gr.Offset, gr.Addr, gr.RKey, uint64(gr.Length), gr.Generation
	g.writable = gr.Flags&protocol.GrantWrite != 0
	g.valid = true
	v.mu.Unlock()
	v.m.grantsHeld.Inc()
	return nil
}

func (v *Volume) releaseGrants(b *ioBuf) {
	v.mu.Lock()
	for _, g := range b.grants {
		g.refs--
		if g.refs == 0 && !g.valid {
			v.cond.Broadcast()
		}
	}
	v.mu.Unlock()
	clear(b.grants)
	b.grants = b.grants[:0]
}
