package target

import (
	"container/list"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/rblk/rblk/transport"
)

// chunkTable is the cache's table of chunks and grants: what the cache
// decides, without the IO. It has no lock, starts no goroutine, sends no
// message and touches no memory or file: each method takes an event (a
// grant needs a chunk, a load ended, a revoke was answered, a handle was
// closed, a session was fenced or ended) and returns what the caller must
// do; the cache (cache.go) holds its mutex across each call and does the
// loads, registrations, revokes, write-backs and releases of keys outside
// it. Time comes from now, so that tests drive patience and penalties.
//
// A chunk is in one of these states:
//
//   - absent: not in the table.
//   - loading: it has a slot and is pinned by the grant that loads it;
//     others wait for chunk.loaded.
//   - ready: it may be granted; it is on the LRU list.
//   - evicting: its holders are being revoked and its dirty blocks written
//     back; it takes no pins and no holders, and others wait.
//
// The transitions (event: what the caller is told):
//
//	absent    acquire, a slot free      -> loading   acquireLoad (pinned)
//	absent    acquire, no slot free     -> absent    acquireFull: victim, or wait
//	absent    acquire, at its share     -> absent    acquireFull, while another group waits
//	loading   acquire                   -> loading   acquireWaitLoad
//	loading   loaded                    -> ready     (new generation, LRU front)
//	loading   loadFailed                -> absent    (slot free again)
//	ready     acquire, same length      -> ready     acquireReady (pinned, LRU front)
//	ready     acquire, length changed   -> evicting  acquireRefit, if unpinned: evict it
//	ready     acquire, length changed   -> ready     acquireWait, while pinned
//	ready     victim, refit,            -> evicting  (unpinned only)
//	          volumeVictim
//	evicting  acquire                   -> evicting  acquireWait
//	evicting  revoking                  -> evicting  (the holders to revoke, their clocks started)
//	evicting  evicted                   -> absent    (slot free, unless leaked)
//	evicting  evictFailed               -> ready     (LRU back)
//
// A grant (a holder) belongs to one handle of one session, and carries that
// handle's access: a read-only handle never holds a writable key, whatever
// else its session holds, and two handles of one session asking for one
// chunk get two grants. grant adds one to a pinned ready chunk, for an open
// handle of a session that is not fenced. A holder leaves the table exactly
// once, by whichever comes first: dropHolder (its revoke was answered or
// timed out, or the grant never left), closeHandle (its handle), fence
// and endSession (its session); the caller then releases its key, and
// calls leak if that failed: the chunk's slot is then never reused.
//
// Fair share: the sessions of one host ID (a session's queues among them;
// an anonymous session alone) are one share group. The cache's slots are
// shared equally by the groups with an open handle; a group's share is a
// quarter of that while it is penalized (one of its sessions did not answer
// a revoke in time). A group at or over its share gives up one of its own
// chunks when it needs another (and takes no free slot while another group
// waits for one: the slots others' evictions free are theirs); otherwise
// the least recently granted unpinned chunk goes, preferring one whose
// holders' groups have no revoke outstanding for longer than patience (slow
// holders). Neither shortens the time a holder has to answer a revoke: that
// is the cache's revoke timeout, the same for every holder.
//
// The waits of the cache are counted here too (wait): from a grant's first
// acquireFull until it returns.
type chunkTable struct {
	slots    int
	patience time.Duration
	now      func() time.Time

	free   []int // free slots, the next one last
	leaked []int // slots taken out of use: a key over them may still reach them
	chunks map[chunkKey]*chunk
	lru    list.List // ready chunks, most recently granted first
	gen    uint64

	sessions map[*session]*tableSession
	groups   map[shareKey]*shareGroup
	shares   int // groups with an open handle
	waiting  int // grants waiting for a slot (see wait)
}

// shareKey names a share group: a host ID, or an anonymous session.
type shareKey struct {
	host string
	anon uint64 // the session's id when host is ""
}

// shareGroup is one share of the cache.
type shareGroup struct {
	key      shareKey
	sessions int       // its sessions in the table
	handles  int       // their open handles
	held     int       // chunks a handle of the group holds a grant of
	revoking []*holder // its holders with a revoke outstanding
	penalty  time.Time // until when its share is cut
	waiting  int       // its grants waiting for a slot
}

// tableSession is a session as the table knows it: from its first handle
// to its end.
type tableSession struct {
	group   *shareGroup
	handles map[uint32]bool      // open handles: writable
	holders map[*holder]struct{} // its grants
	fenced  bool
	waiting int // its grants waiting for a slot
}

// holder is a grant: a key to a chunk's memory that works only through
// one session's connection, made for one handle of it, with that handle's
// access. Its fields do not change once it is in the table, but revoking
// (guarded by cache.mu).
type holder struct {
	ch       *chunk
	s        *session
	handle   uint32
	key      grantKey
	writable bool
	group    *shareGroup
	revoking time.Time // when its revoke was sent (zero: none outstanding)
}

type chunkState uint8

const (
	chunkLoading chunkState = iota
	chunkReady
	chunkEvicting
)

func (st chunkState) String() string {
	switch st {
	case chunkLoading:
		return "loading"
	case chunkReady:
		return "ready"
	case chunkEvicting:
		return "evicting"
	}
	return fmt.Sprintf("chunkState(%d)", uint8(st))
}

// Errors of chunkTable.grant.
var (
	// errHandleClosed: the handle a grant was made for is closed (or its
	// session ended).
	errHandleClosed = errors.New("handle closed")
	// errSessionFenced: the session of the handle was fenced.
	errSessionFenced = errors.New("session fenced")
	// errGrantAccess: a key's access is not its handle's (a bug of the
	// caller: the key is refused).
	errGrantAccess = errors.New("key access differs from its handle's")
	// errNotGrantable: the chunk is not ready and pinned (a bug of the
	// caller).
	errNotGrantable = errors.New("chunk not ready and pinned")
)

func newChunkTable(slots int, patience time.Duration, now func() time.Time) *chunkTable {
	t := &chunkTable{slots: slots, patience: patience, now: now, chunks: make(map[chunkKey]*chunk),
		sessions: make(map[*session]*tableSession), groups: make(map[shareKey]*shareGroup)}
	for i := slots - 1; i >= 0; i-- {
		t.free = append(t.free, i)
	}
	return t
}

// openHandle records handle of s, writable or not, and s's share group (the
// first handle of s places it; penalty: until when its host is penalized,
// from earlier sessions).
func (t *chunkTable) openHandle(s *session, handle uint32, writable bool, group shareKey, penalty time.Time) {
	ts := t.sessions[s]
	if ts == nil {
		g := t.groups[group]
		if g == nil {
			g = &shareGroup{key: group}
			t.groups[group] = g
		}
		g.sessions++
		ts = &tableSession{group: g, handles: make(map[uint32]bool), holders: make(map[*holder]struct{})}
		t.sessions[s] = ts
	}
	if _, ok := ts.handles[handle]; ok {
		return
	}
	if penalty.After(ts.group.penalty) {
		ts.group.penalty = penalty
	}
	ts.handles[handle] = writable
	if ts.group.handles++; ts.group.handles == 1 {
		t.shares++
	}
}

// closeHandle forgets handle of s and returns its grants, out of the
// table: the caller releases their keys (writable ones as lost: the
// chunk is written back whole).
func (t *chunkTable) closeHandle(s *session, handle uint32) []*holder {
	ts := t.sessions[s]
	if ts == nil {
		return nil
	}
	if _, ok := ts.handles[handle]; !ok {
		return nil
	}
	delete(ts.handles, handle)
	if ts.group.handles--; ts.group.handles == 0 {
		t.shares--
	}
	return t.takeHolders(ts, func(h *holder) bool { return h.handle == handle })
}

// fence marks s fenced (no new grant) and returns all its grants, out of
// the table.
func (t *chunkTable) fence(s *session) []*holder {
	ts := t.sessions[s]
	if ts == nil {
		return nil
	}
	ts.fenced = true
	return t.takeHolders(ts, nil)
}

// endSession forgets s, its handles closed, and returns the grants it
// still held, out of the table.
func (t *chunkTable) endSession(s *session) []*holder {
	ts := t.sessions[s]
	if ts == nil {
		return nil
	}
	out := t.takeHolders(ts, nil)
	g := ts.group
	if n := len(ts.handles); n > 0 {
		if g.handles -= n; g.handles == 0 {
			t.shares--
		}
	}
	g.waiting -= ts.waiting
	t.waiting -= ts.waiting
	delete(t.sessions, s)
	if g.sessions--; g.sessions == 0 {
		delete(t.groups, g.key)
	}
	return out
}

// wait records that a grant of s starts (waiting) or stops waiting for a
// slot: from its first acquireFull until it returns, whichever way.
func (t *chunkTable) wait(s *session, waiting bool) {
	ts := t.sessions[s]
	if ts == nil {
		return
	}
	d := 1
	if !waiting {
		d = -1
	}
	ts.waiting += d
	ts.group.waiting += d
	t.waiting += d
}

// penalize cuts the share of s's group until until.
func (t *chunkTable) penalize(s *session, until time.Time) {
	if ts := t.sessions[s]; ts != nil && until.After(ts.group.penalty) {
		ts.group.penalty = until
	}
}

// takeHolders takes the holders of ts that match (nil: all) out of the
// table and returns them.
func (t *chunkTable) takeHolders(ts *tableSession, match func(*holder) bool) []*holder {
	var out []*holder
	for h := range ts.holders {
		if match == nil || match(h) {
			out = append(out, h)
		}
	}
	for _, h := range out {
		t.removeHolder(h.ch, slices.Index(h.ch.holders, h))
	}
	return out
}

// removeHolder removes holder i of ch and keeps the accounting.
func (t *chunkTable) removeHolder(ch *chunk, i int) {
	h := ch.holders[i]
	ch.holders = slices.Delete(ch.holders, i, i+1)
	if ts := t.sessions[h.s]; ts != nil {
		delete(ts.holders, h)
	}
	if !h.revoking.IsZero() {
		if j := slices.Index(h.group.revoking, h); j >= 0 {
			h.group.revoking = slices.Delete(h.group.revoking, j, j+1)
		}
	}
	if !ch.heldBy(h.group) {
		h.group.held--
	}
}

// heldBy reports whether a handle of g holds a grant of ch.
func (ch *chunk) heldBy(g *shareGroup) bool {
	for _, h := range ch.holders {
		if h.group == g {
			return true
		}
	}
	return false
}

// holderOf returns the grant of ch that handle of s holds, or nil.
func (ch *chunk) holderOf(s *session, handle uint32) *holder {
	for _, h := range ch.holders {
		if h.s == s && h.handle == handle {
			return h
		}
	}
	return nil
}

// acquireKind is what acquire asks of its caller.
type acquireKind uint8

const (
	// acquireReady: the chunk is ready and pinned; holder is the
	// handle's grant of it if it holds one.
	acquireReady acquireKind = iota
	// acquireLoad: the chunk is new, loading, in a slot and pinned: load
	// it, then report loaded or loadFailed.
	acquireLoad
	// acquireWaitLoad: the chunk is loading: wait for chunk.loaded.
	acquireWaitLoad
	// acquireWait: the chunk is being evicted, or pinned with a length
	// that changed: wait for the cache to change.
	acquireWait
	// acquireRefit: the chunk's length changed (its volume grew): it is
	// now evicting; evict it, then wait.
	acquireRefit
	// acquireFull: no slot is free: evict one (victim), or wait for an
	// eviction.
	acquireFull
)

// acquireStep is acquire's answer.
type acquireStep struct {
	kind   acquireKind
	ch     *chunk
	holder *holder
}

// acquire asks for chunk key, of length n at its volume's current size,
// for handle of s (s may be nil: no grant is looked up). A free slot does
// not go to a group at or over its share while another group's grant waits
// for one (see wait): that group gives up a chunk of its own instead.
func (t *chunkTable) acquire(key chunkKey, n uint64, s *session, handle uint32) acquireStep {
	ch := t.chunks[key]
	if ch == nil {
		if len(t.free) == 0 {
			return acquireStep{kind: acquireFull}
		}
		if ts := t.sessions[s]; s != nil && ts != nil && t.waiting > ts.group.waiting && ts.group.held >= t.share(ts.group) {
			return acquireStep{kind: acquireFull}
		}
		slot := t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
		ch = &chunk{key: key, slot: slot, length: n, state: chunkLoading, pins: 1}
		t.chunks[key] = ch
		return acquireStep{kind: acquireLoad, ch: ch}
	}
	switch ch.state {
	case chunkLoading:
		return acquireStep{kind: acquireWaitLoad, ch: ch}
	case chunkEvicting:
		return acquireStep{kind: acquireWait, ch: ch}
	}
	if ch.length != n {
		if t.refit(ch) {
			return acquireStep{kind: acquireRefit, ch: ch}
		}
		return acquireStep{kind: acquireWait, ch: ch}
	}
	ch.pins++
	t.lru.MoveToFront(ch.elem)
	var h *holder
	if s != nil {
		h = ch.holderOf(s, handle)
	}
	return acquireStep{kind: acquireReady, ch: ch, holder: h}
}

// loaded reports that ch (loading) loaded: it is ready, with a new
// generation, still pinned.
func (t *chunkTable) loaded(ch *chunk) {
	t.gen++
	ch.gen = t.gen
	ch.state = chunkReady
	ch.elem = t.lru.PushFront(ch)
}

// loadFailed reports that the load of ch failed: it leaves the table and
// its slot is free again.
func (t *chunkTable) loadFailed(ch *chunk) {
	delete(t.chunks, ch.key)
	ch.pins = 0
	t.free = append(t.free, ch.slot)
}

// unpin gives back a pin acquire took, and reports whether it was the
// last: waiters must be woken.
func (t *chunkTable) unpin(ch *chunk) (wake bool) {
	ch.pins--
	return ch.pins == 0
}

// lookup returns chunk key, in whatever state, or nil.
func (t *chunkTable) lookup(key chunkKey) *chunk { return t.chunks[key] }

// grant adds the grant of ch (ready, pinned by the caller) that key gives
// handle of s, and returns it. If the handle holds one already, that one is
// returned and added is false: the caller releases key, which never left.
// The handle must be open, its session not fenced, and key's access that
// of the handle; otherwise the caller releases key too.
func (t *chunkTable) grant(ch *chunk, s *session, handle uint32, key grantKey) (h *holder, added bool, err error) {
	ts := t.sessions[s]
	if ts == nil {
		return nil, false, errHandleClosed
	}
	writable, open := ts.handles[handle]
	switch {
	case !open:
		return nil, false, errHandleClosed
	case ts.fenced:
		return nil, false, errSessionFenced
	case (key.Access()&transport.AccessRemoteWrite != 0) != writable:
		return nil, false, errGrantAccess
	case ch.state != chunkReady || ch.pins == 0 || t.chunks[ch.key] != ch:
		return nil, false, errNotGrantable
	}
	if old := ch.holderOf(s, handle); old != nil {
		return old, false, nil
	}
	h = &holder{ch: ch, s: s, handle: handle, key: key, writable: writable, group: ts.group}
	if !ch.heldBy(ts.group) {
		ts.group.held++
	}
	ch.holders = append(ch.holders, h)
	ts.holders[h] = struct{}{}
	return h, true, nil
}

// dropHolder takes h out of the table, if it is still there (its revoke
// ended, or it never left its grant), and reports whether it did: then the
// caller releases its key.
func (t *chunkTable) dropHolder(h *holder) bool {
	i := slices.Index(h.ch.holders, h)
	if i < 0 {
		return false
	}
	t.removeHolder(h.ch, i)
	return true
}

// holds reports whether h is still in the table.
func (t *chunkTable) holds(h *holder) bool { return slices.Contains(h.ch.holders, h) }

// leak takes ch's slot out of use for good: a key over it could not be
// released, and may still reach it.
func (t *chunkTable) leak(ch *chunk) { ch.leaked = true }

// share is how many chunks group g may hold while others need the cache.
func (t *chunkTable) share(g *shareGroup) int {
	sh := max(t.slots/max(t.shares, 1), 1)
	if t.now().Before(g.penalty) {
		sh = max(sh/4, 1)
	}
	return sh
}

// slow reports whether a holder of ch has had a revoke outstanding for
// longer than patience, or belongs to a group that has.
func (t *chunkTable) slow(ch *chunk, now time.Time) bool {
	for _, h := range ch.holders {
		for _, r := range h.group.revoking {
			if now.Sub(r.revoking) >= t.patience {
				return true
			}
		}
	}
	return false
}

// victim picks a ready, unpinned chunk to evict so that s (nil: anyone)
// gets a slot, marks it evicting and returns it; nil if there is none. A
// group at or over its share gives up the least recently granted of its
// own chunks; otherwise the least recently granted chunk goes, one without
// slow holders first.
func (t *chunkTable) victim(s *session) *chunk {
	if ts := t.sessions[s]; s != nil && ts != nil && ts.group.held >= t.share(ts.group) {
		for e := t.lru.Back(); e != nil; e = e.Prev() {
			ch := e.Value.(*chunk)
			if ch.pins == 0 && ch.heldBy(ts.group) {
				t.startEvict(ch)
				return ch
			}
		}
	}
	now := t.now()
	var slow *chunk
	for e := t.lru.Back(); e != nil; e = e.Prev() {
		ch := e.Value.(*chunk)
		if ch.pins != 0 {
			continue
		}
		if t.slow(ch, now) {
			if slow == nil {
				slow = ch
			}
			continue
		}
		t.startEvict(ch)
		return ch
	}
	if slow != nil {
		t.startEvict(slow)
	}
	return slow
}

// refit starts the eviction of ch, ready, if nothing pins it, and reports
// whether it did.
func (t *chunkTable) refit(ch *chunk) bool {
	if ch.state != chunkReady || ch.pins != 0 {
		return false
	}
	t.startEvict(ch)
	return true
}

// volumeVictim picks a chunk of v to evict (the volume is being removed)
// and marks it evicting; busy reports chunks of v that cannot be evicted
// now (loading, pinned or being evicted).
func (t *chunkTable) volumeVictim(v *volume) (victim *chunk, busy bool) {
	for key, ch := range t.chunks {
		if key.vol != v {
			continue
		}
		if ch.state == chunkReady && ch.pins == 0 {
			t.startEvict(ch)
			return ch, false
		}
		busy = true
	}
	return nil, busy
}

func (t *chunkTable) startEvict(ch *chunk) {
	ch.state = chunkEvicting
	t.lru.Remove(ch.elem)
	ch.elem = nil
}

// revoking returns the holders of ch (evicting) to revoke, and starts
// their clocks: a holder that has not answered after patience is slow.
// Each leaves the table with dropHolder once its revoke ended, unless
// something else took it out first.
func (t *chunkTable) revoking(ch *chunk) []*holder {
	now := t.now()
	out := slices.Clone(ch.holders)
	for _, h := range out {
		if h.revoking.IsZero() {
			h.revoking = now
			h.group.revoking = append(h.group.revoking, h)
		}
	}
	return out
}

// evicted reports that ch (evicting, without holders) is written back: it
// leaves the table, and its slot is free again unless leaked (freed
// false). (A holder left over would be a bug of the caller: its key may
// reach the slot, which is then leaked too.)
func (t *chunkTable) evicted(ch *chunk) (freed bool) {
	delete(t.chunks, ch.key)
	if ch.leaked || len(ch.holders) > 0 {
		ch.leaked = true
		t.leaked = append(t.leaked, ch.slot)
		return false
	}
	t.free = append(t.free, ch.slot)
	return true
}

// evictFailed reports that the write-back of ch (evicting) failed: it
// stays cached, ready, least recently granted.
func (t *chunkTable) evictFailed(ch *chunk) {
	ch.state = chunkReady
	ch.elem = t.lru.PushBack(ch)
}

// dropAll takes every holder out of the table (the cache closes).
func (t *chunkTable) dropAll() []*holder {
	var out []*holder
	for _, ts := range t.sessions {
		out = append(out, t.takeHolders(ts, nil)...)
	}
	return out
}
