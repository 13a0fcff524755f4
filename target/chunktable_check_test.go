package target

import (
	"errors"
	"fmt"

	"github.com/rblk/rblk/transport"
)

// check verifies the chunk table's invariants; the tests call it after
// every event. c.mu (if the table is a cache's) is held.
//
//   - every slot is exactly one of free, leaked, or a chunk's;
//   - a chunk is listed under its key; the LRU list holds exactly the
//     ready chunks, once each; a loading chunk is pinned; generations of
//     ready chunks are distinct and at most the table's;
//   - a holder is on a ready or evicting chunk, of a session the table
//     knows, not fenced, for a handle of it that is open, with that
//     handle's access (its key's remote write access too), at most one per
//     handle and chunk, and listed in its session's holders (and back);
//   - a group's held is the number of chunks a holder of it has, its
//     handles the open handles of its sessions, its revoking the holders
//     of it with a revoke outstanding, its waiting its sessions' grants
//     waiting for a slot (in all, the table's); shares is the number of
//     groups with an open handle.
func (t *chunkTable) check() error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	use := make([]string, t.slots)
	mark := func(slot int, what string) {
		if slot < 0 || slot >= t.slots {
			fail("%s: slot %d out of range", what, slot)
			return
		}
		if use[slot] != "" {
			fail("slot %d is both %s and %s", slot, use[slot], what)
		}
		use[slot] = what
	}
	for _, s := range t.free {
		mark(s, "free")
	}
	for _, s := range t.leaked {
		mark(s, "leaked")
	}
	inLRU := make(map[*chunk]int)
	for e := t.lru.Front(); e != nil; e = e.Next() {
		inLRU[e.Value.(*chunk)]++
	}
	gens := make(map[uint64]*chunk)
	held := make(map[*shareGroup]int)
	revoking := make(map[*shareGroup]int)
	for key, ch := range t.chunks {
		name := fmt.Sprintf("chunk %d of %p (%v)", key.idx, key.vol, ch.state)
		mark(ch.slot, name)
		if ch.key != key {
			fail("%s listed under another key", name)
		}
		if ch.pins < 0 {
			fail("%s: %d pins", name, ch.pins)
		}
		switch ch.state {
		case chunkLoading:
			if ch.pins < 1 {
				fail("%s: loading and not pinned", name)
			}
			if len(ch.holders) > 0 {
				fail("%s: loading with holders", name)
			}
		case chunkReady:
			if n := inLRU[ch]; n != 1 || ch.elem == nil || ch.elem.Value != ch {
				fail("%s: on the LRU list %d times", name, n)
			}
			if ch.gen == 0 || ch.gen > t.gen || gens[ch.gen] != nil {
				fail("%s: generation %d (table %d) not its own", name, ch.gen, t.gen)
			}
			gens[ch.gen] = ch
		case chunkEvicting:
			if ch.pins != 0 {
				fail("%s: evicting and pinned", name)
			}
		default:
			fail("%s: unknown state", name)
		}
		if ch.state != chunkReady && (inLRU[ch] != 0 || ch.elem != nil) {
			fail("%s: on the LRU list", name)
		}
		delete(inLRU, ch)
		seenHandle := make(map[holderRef]bool)
		groups := make(map[*shareGroup]bool)
		for _, h := range ch.holders {
			ref := holderRef{h.s, h.handle}
			hn := fmt.Sprintf("%s: holder of session %d handle %d", name, h.s.id, h.handle)
			if seenHandle[ref] {
				fail("%s twice", hn)
			}
			seenHandle[ref] = true
			if h.ch != ch {
				fail("%s: names another chunk", hn)
			}
			ts := t.sessions[h.s]
			if ts == nil {
				fail("%s: session unknown", hn)
				continue
			}
			if ts.fenced {
				fail("%s: session fenced", hn)
			}
			if _, ok := ts.holders[h]; !ok {
				fail("%s: not in its session's holders", hn)
			}
			w, open := ts.handles[h.handle]
			switch {
			case !open:
				fail("%s: handle closed", hn)
			case w != h.writable:
				fail("%s: writable %v, its handle %v", hn, h.writable, w)
			}
			if (h.key.Access()&transport.AccessRemoteWrite != 0) != h.writable {
				fail("%s: key access %v, writable %v", hn, h.key.Access(), h.writable)
			}
			if h.group != ts.group {
				fail("%s: in another group", hn)
			}
			groups[h.group] = true
			if !h.revoking.IsZero() {
				revoking[h.group]++
			}
		}
		for g := range groups {
			held[g]++
		}
	}
	for ch, n := range inLRU {
		fail("chunk %d on the LRU list %d times but not ready in the table", ch.key.idx, n)
	}
	for i, u := range use {
		if u == "" {
			fail("slot %d lost: neither free, leaked nor used", i)
		}
	}
	handles := make(map[*shareGroup]int)
	sessions := make(map[*shareGroup]int)
	waiting := make(map[*shareGroup]int)
	total := 0
	for s, ts := range t.sessions {
		handles[ts.group] += len(ts.handles)
		sessions[ts.group]++
		if ts.waiting < 0 {
			fail("session %d: %d grants waiting", s.id, ts.waiting)
		}
		waiting[ts.group] += ts.waiting
		total += ts.waiting
		if t.groups[ts.group.key] != ts.group {
			fail("session %d: group %v not in the table", s.id, ts.group.key)
		}
		for h := range ts.holders {
			if h.s != s || t.chunks[h.ch.key] != h.ch || !containsHolder(h.ch.holders, h) {
				fail("session %d: holder of handle %d not on its chunk", s.id, h.handle)
			}
		}
	}
	shares := 0
	for k, g := range t.groups {
		if g.key != k {
			fail("group %v listed under %v", g.key, k)
		}
		if g.held != held[g] {
			fail("group %v: held %d, its holders have %d chunks", k, g.held, held[g])
		}
		if g.handles != handles[g] {
			fail("group %v: %d handles, its sessions have %d", k, g.handles, handles[g])
		}
		if g.sessions != sessions[g] || g.sessions == 0 {
			fail("group %v: %d sessions, the table has %d", k, g.sessions, sessions[g])
		}
		if g.waiting != waiting[g] {
			fail("group %v: %d grants waiting, its sessions %d", k, g.waiting, waiting[g])
		}
		if len(g.revoking) != revoking[g] {
			fail("group %v: %d revokes outstanding, its holders %d", k, len(g.revoking), revoking[g])
		}
		for _, h := range g.revoking {
			if h.revoking.IsZero() || h.group != g || !containsHolder(h.ch.holders, h) {
				fail("group %v: a revoke outstanding of a holder not in the table", k)
			}
		}
		if g.handles > 0 {
			shares++
		}
	}
	if total != t.waiting {
		fail("%d grants waiting, the sessions have %d", t.waiting, total)
	}
	if shares != t.shares {
		fail("shares %d, groups with an open handle %d", t.shares, shares)
	}
	return errors.Join(errs...)
}

type holderRef struct {
	s      *session
	handle uint32
}

func containsHolder(hs []*holder, h *holder) bool {
	for _, x := range hs {
		if x == h {
			return true
		}
	}
	return false
}

// fakeKey is a grant key of the table's tests: nothing registered; release
// records the call, fails if told to, and fails a second call.
type fakeKey struct {
	id       int
	slot     int
	access   transport.Access
	released bool
	fail     bool
}

func (k *fakeKey) Addr() uint64             { return uint64(k.slot) << 32 }
func (k *fakeKey) RKey() uint32             { return uint32(k.id) }
func (k *fakeKey) Access() transport.Access { return k.access }

var errFakeRelease = errors.New("fake release failure")

func (k *fakeKey) release() error {
	if k.released {
		return fmt.Errorf("key %d released twice", k.id)
	}
	k.released = true
	if k.fail {
		return errFakeRelease
	}
	return nil
}

// accessOf is the access of a grant of a handle, writable or not.
func accessOf(writable bool) transport.Access {
	if writable {
		return transport.AccessRemoteRead | transport.AccessLocalWrite | transport.AccessRemoteWrite
	}
	return transport.AccessRemoteRead
}
