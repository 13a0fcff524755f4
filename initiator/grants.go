package initiator

import (
	"fmt"

	"github.com/rblk/rblk/protocol"
)

// grant is a chunk of the target's memory this initiator may use: an entry
// of a grantTable.
type grant struct {
	idx      uint64 // the chunk
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

// grantTable is the grant table of one session: for each chunk of the
// volume, the grant the initiator holds of it, if any. It is the protocol
// logic of grants without the IO: no locking, no goroutines, no messages,
// no metrics. Each method takes an event (IO needs chunks, a fetch ended, a
// Revoke came, IO released its references, the session ended) and returns
// what the caller must do; the session (acquire, revoke, teardown) does the
// requests, the waiting and the accounting.
//
// A chunk is in one of these states:
//
//   - absent: no grant. IO that needs the chunk starts a fetch.
//   - fetching: a GrantRequest is in flight (grant.fetching is open). IO
//     that needs the chunk, and a Revoke of it, wait for the fetch to end.
//   - valid: IO may take references (a write only on a writable grant).
//   - revoked: the grant left the table; no new references. The Revoke's
//     ack waits until the references held drain to zero.
//
// The transitions (event: what the caller is told):
//
//	absent    acquire                        -> fetching  startFetch
//	valid     acquire for a write, read-only -> fetching  startFetch, replaced
//	fetching  acquire                        -> fetching  waitFetch
//	fetching  fetched                        -> valid     (waiters woken)
//	fetching  fetchFailed, fetched bad reply -> absent    (waiters woken)
//	fetching  revoke                         -> fetching  wait (it may have overtaken the reply)
//	fetching  revoke, link down              -> fetching  ack
//	valid     revoke of its generation       -> revoked   drain, then ack
//	valid     revoke of another generation   -> valid     ack
//	absent    revoke                         -> absent    ack
//	revoked   release of the last reference  -> (gone)    wake: the drain is over
//	any       teardown                       -> absent    (valid ones counted)
//
// The fetch's channel is the only one: waiters need something to select on
// with their context and the link.
//
// A read-only grant replaced by a writable one leaves the table but stays
// usable by the IO that holds references on it; it is no longer counted as
// held, and a Revoke of its generation finds the new grant instead.
//
// The caller's duties:
//
//   - Hold the session's mutex (s.mu) across each call and while it reads a
//     grant's state (valid, refs, fetching). The chunk's address fields
//     (off, addr, rkey, length) of a grant IO references do not change, so
//     IO reads them without the mutex.
//   - After acquire returns startFetch, do the GrantRequest without the
//     mutex, then report it with exactly one of fetched and fetchFailed.
//     Until then the chunk stays fetching and whoever needs it waits.
//   - After acquire returns waitFetch, release the mutex, wait for the
//     channel (or give up: the context ended, the link went down), retake
//     the mutex and call acquire again. No reference is held meanwhile.
//   - Give back every reference taken (tryAcquire, acquire) with release,
//     once the IO's Done messages are sent, and wake the revokes waiting
//     (broadcast) when release says so.
//   - On a Revoke, call revoke; with a wait channel, wait for it without the
//     mutex and call revoke again (with linkDown once the link is down);
//     with a grant to drain, wait until drained; then send the RevokeAck.
//   - Keep the grants_held gauge: one more on fetched, one fewer on a
//     startFetch step that replaced a grant and on a revoke that returned a
//     grant to drain, the count teardown returns fewer at the end.
type grantTable struct {
	chunkSize uint64
	chunks    map[uint64]*grant
}

func newGrantTable(chunkSize uint32) grantTable {
	return grantTable{chunkSize: uint64(chunkSize), chunks: make(map[uint64]*grant)}
}

// acquireKind is what acquire asks of its caller.
type acquireKind int

const (
	// acquired: a reference is taken on the grant of every chunk.
	acquired acquireKind = iota
	// waitFetch: a chunk is being fetched; wait for the channel to close,
	// then acquire again.
	waitFetch
	// startFetch: fetch the chunk, report it with fetched or fetchFailed,
	// then acquire again.
	startFetch
)

// acquireStep is acquire's answer.
type acquireStep struct {
	kind     acquireKind
	idx      uint64          // waitFetch, startFetch: the chunk
	wait     <-chan struct{} // waitFetch: closed when the fetch ends
	grant    *grant          // startFetch: the grant being fetched
	replaced bool            // startFetch: a valid read-only grant left the table
}

// usable reports whether IO may take a reference on the grant of chunk idx.
func (t *grantTable) usable(idx uint64, write bool) bool {
	g := t.chunks[idx]
	return g != nil && g.valid && (!write || g.writable)
}

// ref takes a reference on the grant of every chunk of idxs, appended to
// refs.
func (t *grantTable) ref(idxs []uint64, refs []*grant) []*grant {
	for _, idx := range idxs {
		g := t.chunks[idx]
		g.refs++
		refs = append(refs, g)
	}
	return refs
}

// tryAcquire takes a reference on the grant of every chunk of idxs, appended
// to refs, if all of them are valid (and writable, for a write), and reports
// whether it did. It changes nothing otherwise.
func (t *grantTable) tryAcquire(idxs []uint64, write bool, refs []*grant) ([]*grant, bool) {
	for _, idx := range idxs {
		if !t.usable(idx, write) {
			return refs, false
		}
	}
	return t.ref(idxs, refs), true
}

// acquire takes a reference on the grant of every chunk of idxs, all at
// once, appended to refs; or, if one is missing (the first in idxs that is
// absent, fetching, or read-only for a write), takes none and says what to
// do about that chunk: wait for its fetch in flight, or fetch it. A
// read-only grant that a write needs is replaced by the fetch.
func (t *grantTable) acquire(idxs []uint64, write bool, refs []*grant) ([]*grant, acquireStep) {
	for _, idx := range idxs {
		if t.usable(idx, write) {
			continue
		}
		old := t.chunks[idx]
		if old != nil && old.fetching != nil {
			return refs, acquireStep{kind: waitFetch, idx: idx, wait: old.fetching}
		}
		g := &grant{idx: idx, fetching: make(chan struct{})}
		t.chunks[idx] = g
		return refs, acquireStep{kind: startFetch, idx: idx, grant: g, replaced: old != nil && old.valid}
	}
	return t.ref(idxs, refs), acquireStep{kind: acquired}
}

// fetched reports the Grant reply to the fetch of g: the grant becomes
// valid, and those waiting for the fetch are woken. A reply that does not
// cover g's chunk (another offset, an empty or oversized length) is a
// protocol error, returned: the fetch failed, as with fetchFailed.
func (t *grantTable) fetched(g *grant, gr *protocol.Grant) error {
	if off := g.idx * t.chunkSize; gr.Offset != off || gr.Length == 0 || uint64(gr.Length) > t.chunkSize {
		t.fetchFailed(g)
		return fmt.Errorf("grant for %d covers %d+%d: %w", off, gr.Offset, gr.Length, protocol.ErrProtocol)
	}
	g.off, g.addr, g.rkey, g.length, g.gen = gr.Offset, gr.Addr, gr.RKey, uint64(gr.Length), gr.Generation
	g.writable = gr.Flags&protocol.GrantWrite != 0
	g.valid = true
	close(g.fetching)
	g.fetching = nil
	return nil
}

// fetchFailed reports that the fetch of g failed: the chunk is absent again
// (unless teardown cleared it meanwhile), and those waiting are woken.
func (t *grantTable) fetchFailed(g *grant) {
	close(g.fetching)
	g.fetching = nil
	if t.chunks[g.idx] == g {
		delete(t.chunks, g.idx)
	}
}

// revokeStep is revoke's answer; with neither field set, the caller acks
// at once.
type revokeStep struct {
	// wait: the chunk's grant is being fetched, and the Revoke may have
	// overtaken the reply. Nothing changed: wait for the channel to close,
	// then call revoke again.
	wait <-chan struct{}
	// drain: the grant revoked (it left the table and takes no new
	// references). Ack once drained(drain).
	drain *grant
}

// revoke handles the target's Revoke of the grant of the chunk at off under
// generation gen. With linkDown (the session's link is down: a fetch in
// flight will not be answered) it decides at once: a grant still being
// fetched is not held. A Revoke of a generation not held (an older one, a
// grant already revoked, a chunk absent) is acked at once.
func (t *grantTable) revoke(off, gen uint64, linkDown bool) revokeStep {
	if t.chunkSize == 0 {
		return revokeStep{} // the table is not set up yet: nothing is held
	}
	idx := off / t.chunkSize
	g := t.chunks[idx]
	if g == nil {
		return revokeStep{}
	}
	if g.fetching != nil && !linkDown {
		return revokeStep{wait: g.fetching}
	}
	if !g.valid || g.gen != gen {
		return revokeStep{}
	}
	g.valid = false
	delete(t.chunks, idx)
	return revokeStep{drain: g}
}

// drained reports whether no IO holds a reference on g any more.
func (t *grantTable) drained(g *grant) bool { return g.refs == 0 }

// release gives back the references refs holds, and reports whether a
// revoked grant lost its last one: the revokes waiting must be woken.
func (t *grantTable) release(refs []*grant) (wake bool) {
	for _, g := range refs {
		g.refs--
		if g.refs == 0 && !g.valid {
			wake = true
		}
	}
	return wake
}

// teardown empties the table when the session ends: no grant is usable any
// more, references held are left to be released, fetches in flight to be
// reported. It returns how many valid grants it dropped.
func (t *grantTable) teardown() (held int) {
	for idx, g := range t.chunks {
		if g.valid {
			held++
		}
		g.valid = false
		delete(t.chunks, idx)
	}
	return held
}
