package target

import (
	"errors"
	"testing"

	"github.com/rblk/rblk/protocol"
)

// TestDoneAfterDroppedRevoke: a Done that arrives for a grant whose revoke
// just timed out, on the session being closed for it, is dropped, not a
// protocol error; the same Done on a session in good standing, for a chunk
// its handle holds no grant of, is one. And a Done is accepted only for the
// handle's own grants: another writable handle of the session holding the
// chunk does not cover it.
func TestDoneAfterDroppedRevoke(t *testing.T) {
	const cs = 64 << 10
	tg, v, _ := benchTarget(t, 4*cs, cs)
	s := benchSession(tg)
	ov := &openVol{v: v, writable: true, gen: 7}
	other := &openVol{v: v, writable: true, gen: 7}
	benchOpen(s, 1, ov)
	benchOpen(s, 2, other)
	chunks := loadChunks(t, tg.cache, s, v, 2)
	benchGrant(t, s, chunks[0], 1)
	benchGrant(t, s, chunks[1], 2)
	done := func(off uint64) error {
		d := &protocol.Done{Handle: 1, Generation: 7, Ranges: []protocol.Range{{Offset: off, Length: 4096}}}
		s.mu.Lock()
		defer s.mu.Unlock()
		_, _, err := s.doneLocked(d, false)
		return err
	}
	if err := done(0); err != nil {
		t.Fatalf("Done within the handle's grant: %v", err)
	}
	if err := done(cs); !errors.Is(err, protocol.ErrStale) {
		t.Fatalf("Done within another handle's grant: %v, want ErrStale (a protocol error)", err)
	}
	// The revoke of chunk 0 times out: the session is dropped and the
	// grant forgotten (session.revoke).
	s.mu.Lock()
	s.dropped = true
	s.mu.Unlock()
	s.forgetGrant(1, chunks[0])
	if err := done(0); !errors.Is(err, errFencedDone) {
		t.Fatalf("Done of a grant whose revoke timed out, on the session being dropped: %v, want it dropped quietly", err)
	}
}
