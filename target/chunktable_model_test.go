package target

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The model test drives a chunkTable with random sequences of what the
// cache and the target do to it: sessions of several hosts (and anonymous
// ones) open and close handles of two exports (one exclusive, one shared;
// a read-write open of the exclusive one either is refused while another
// host writes it or takes it over, fencing that host's sessions, and a
// host's read-write open fences its own earlier sessions of the export, as
// Target.reinstate does), ask for grants (loading chunks, evicting when
// the cache is full), answer revokes or let them time out (which drops the
// session and penalizes its host), release keys (some fail: the slot
// leaks), grow volumes, and end. After every step it checks the table's
// own invariants (chunkTable.check) and these, against the keys it was
// given:
//
//   - every key still in the table is unreleased, and belongs to a live
//     handle (open, of a session neither fenced, dropped nor ended) with
//     that handle's access: no writable key for a read-only handle;
//   - every key the table gave up was released exactly once (a second
//     release fails the fake key);
//   - the exclusive export has at most one host with a live writable key;
//   - no slot is used after its release: a chunk in the table never sits
//     in a slot that a key of an earlier chunk (unreleased) may reach, nor
//     in a leaked slot;
//   - each chunk's pins are the ones the model holds.
//
// RBLK_MODEL_SEED=n replays one seed; the seed is printed on failure.

type modelSess struct {
	s       *session
	host    string
	handles map[uint32]modelHandle
	next    uint32
	waiting int  // its grants waiting for a slot
	fenced  bool // a later session took over: its grants are gone; it ends soon
	dropped bool // a revoke of its timed out: its link is closed; it ends soon
	ended   bool
}

type modelHandle struct {
	vol      *volume
	writable bool
}

type modelEviction struct {
	ch      *chunk
	pending []*holder
}

type tableModel struct {
	r      *rand.Rand
	t      *chunkTable
	clock  time.Time
	log    []string
	nextID uint64

	sessions []*modelSess
	bySess   map[*session]*modelSess
	vols     []*volume // vols[0] exclusive, vols[1] shared
	size     map[*volume]uint64
	chunkLen uint64

	keys       []*fakeKey              // every key made
	keyHolder  map[*fakeKey]*holder    // keys the table took
	keyChunk   map[*fakeKey]*chunk     // the chunk each key reaches
	pins       map[*chunk]int          // pins the model holds
	loading    []*chunk                // loads under way (one pin each)
	evictions  []*modelEviction        // evictions under way
	leaked     map[int]bool            // slots the table leaked
	releaseErr map[*fakeKey]bool       // keys whose release failed
	given      map[*fakeKey]*modelSess // keys handed to sessions
	seen       map[string]int          // what happened, by kind
}

const modelSlots = 6

func newTableModel(seed uint64) *tableModel {
	m := &tableModel{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), clock: time.Unix(1e6, 0),
		bySess: map[*session]*modelSess{}, size: map[*volume]uint64{}, chunkLen: 64,
		keyHolder: map[*fakeKey]*holder{}, keyChunk: map[*fakeKey]*chunk{}, pins: map[*chunk]int{},
		leaked: map[int]bool{}, releaseErr: map[*fakeKey]bool{}, given: map[*fakeKey]*modelSess{}, seen: map[string]int{}}
	m.t = newChunkTable(modelSlots, 100*time.Millisecond, func() time.Time { return m.clock })
	excl := &volume{name: "excl"}
	shared := &volume{name: "shared", cfg: ExportConfig{Shared: true}}
	m.vols = []*volume{excl, shared}
	m.size[excl] = 10*m.chunkLen + 16
	m.size[shared] = 8 * m.chunkLen
	return m
}

func (m *tableModel) logf(format string, args ...any) {
	m.log = append(m.log, fmt.Sprintf(format, args...))
}

func (m *tableModel) pick(n int) int { return m.r.IntN(n) }

// live returns the sessions not ended (fenced and dropped ones included,
// if withFenced).
func (m *tableModel) live(withFenced bool) []*modelSess {
	var out []*modelSess
	for _, ms := range m.sessions {
		if !ms.ended && (withFenced || !ms.fenced && !ms.dropped) {
			out = append(out, ms)
		}
	}
	return out
}

func (m *tableModel) newSession() {
	hosts := []string{"h1", "h2", "h3", ""}
	m.nextID++
	ms := &modelSess{s: &session{id: m.nextID}, host: hosts[m.pick(len(hosts))], handles: map[uint32]modelHandle{}}
	m.sessions = append(m.sessions, ms)
	m.bySess[ms.s] = ms
	m.logf("session %d of host %q", ms.s.id, ms.host)
}

// release releases the keys of holders the table gave up; a failed
// release leaks the chunk's slot, as the cache does.
func (m *tableModel) release(hs []*holder) error {
	// (In the order the keys were made: the table's order is a map's.)
	slices.SortFunc(hs, func(a, b *holder) int { return a.key.(*fakeKey).id - b.key.(*fakeKey).id })
	for _, h := range hs {
		k := h.key.(*fakeKey)
		if m.keyHolder[k] != h {
			return fmt.Errorf("the table gave up a holder it did not have (key %d)", k.id)
		}
		delete(m.keyHolder, k)
		k.fail = m.pick(50) == 0
		if err := k.release(); err != nil {
			if !errors.Is(err, errFakeRelease) {
				return err
			}
			m.releaseErr[k] = true
			m.seen["leak"]++
			m.t.leak(h.ch)
			m.logf("  release of key %d failed: chunk %d's slot %d leaks", k.id, h.ch.key.idx, h.ch.slot)
		}
	}
	return nil
}

// fence fences ms as Target.fence does: the table takes its grants, the
// session ends later.
func (m *tableModel) fence(ms *modelSess) error {
	ms.fenced = true
	m.seen["fence"]++
	m.logf("  fence session %d", ms.s.id)
	return m.release(m.t.fence(ms.s))
}

func (m *tableModel) open() error {
	live := m.live(false)
	if len(live) == 0 {
		return nil
	}
	ms := live[m.pick(len(live))]
	v := m.vols[m.pick(2)]
	writable := m.pick(2) == 0
	takeover := m.pick(5) == 0
	m.logf("open session %d %s writable=%v takeover=%v", ms.s.id, v.name, writable, takeover)
	if writable {
		// Exclusive export: another host's writer refuses the open or is
		// taken over.
		var others, same []*modelSess
		for _, o := range m.live(true) {
			if o == ms {
				continue
			}
			w := false
			for _, h := range o.handles {
				w = w || (h.vol == v && h.writable)
			}
			switch {
			case !w:
			case o.host != "" && o.host == ms.host:
				same = append(same, o) // reinstatement
			case !v.cfg.Shared:
				others = append(others, o)
			}
		}
		if len(others) > 0 && !takeover {
			m.seen["busy"]++
			m.logf("  refused: busy")
			return nil
		}
		if len(others) > 0 {
			m.seen["takeover"]++
		}
		for _, o := range append(others, same...) {
			if !o.fenced {
				if err := m.fence(o); err != nil {
					return err
				}
			}
		}
	}
	ms.next++
	ms.handles[ms.next] = modelHandle{v, writable}
	m.t.openHandle(ms.s, ms.next, writable, shareOf(ms.s, ms.host), time.Time{})
	m.logf("  handle %d", ms.next)
	return nil
}

func (m *tableModel) closeHandle() error {
	live := m.live(false)
	if len(live) == 0 {
		return nil
	}
	ms := live[m.pick(len(live))]
	hs := m.handlesOf(ms)
	if len(hs) == 0 {
		return nil
	}
	h := hs[m.pick(len(hs))]
	m.logf("close session %d handle %d", ms.s.id, h)
	delete(ms.handles, h)
	taken := m.t.closeHandle(ms.s, h)
	if len(taken) > 0 {
		m.seen["close with grants"]++
	}
	return m.release(taken)
}

// handlesOf returns the open handles of ms, sorted.
func (m *tableModel) handlesOf(ms *modelSess) []uint32 {
	var hs []uint32
	for h := range ms.handles {
		hs = append(hs, h)
	}
	slices.Sort(hs)
	return hs
}

func (m *tableModel) end() error {
	live := m.live(true)
	if len(live) == 0 {
		return nil
	}
	ms := live[m.pick(len(live))]
	if !ms.fenced && !ms.dropped && m.pick(3) != 0 {
		return nil // mostly fenced and dropped sessions end
	}
	m.logf("end session %d", ms.s.id)
	ms.ended = true
	ms.waiting = 0
	ms.handles = nil
	return m.release(m.t.endSession(ms.s))
}

func (m *tableModel) unpin(ch *chunk) {
	m.pins[ch]--
	if m.pins[ch] == 0 {
		delete(m.pins, ch)
	}
	m.t.unpin(ch)
}

func (m *tableModel) startEviction(ch *chunk) {
	m.evictions = append(m.evictions, &modelEviction{ch: ch, pending: m.t.revoking(ch)})
	m.logf("  evict chunk %d of %s (%d holders)", ch.key.idx, ch.key.vol.name, len(ch.holders))
}

// grant asks for a grant as session.grant does, through the cache's steps;
// mostly for live sessions, sometimes for one fenced or dropped (a request
// under way when that happened).
func (m *tableModel) grant() error {
	live := m.live(m.pick(10) == 0)
	if len(live) == 0 {
		return nil
	}
	ms := live[m.pick(len(live))]
	hs := m.handlesOf(ms)
	if len(hs) == 0 {
		return nil
	}
	handle := hs[m.pick(len(hs))]
	mh := ms.handles[handle]
	size := m.size[mh.vol]
	idx := uint64(m.pick(int((size + m.chunkLen - 1) / m.chunkLen)))
	switch m.pick(4) {
	case 0: // the last chunk, short until the volume grows
		idx = (size - 1) / m.chunkLen
	case 1, 2: // a few hot chunks: shared, hit, revoked
		idx %= 5
	}
	n := min(m.chunkLen, size-idx*m.chunkLen)
	st := m.t.acquire(chunkKey{mh.vol, idx}, n, ms.s, handle)
	m.logf("grant session %d handle %d chunk %d of %s: acquire %d", ms.s.id, handle, idx, mh.vol.name, st.kind)
	switch st.kind {
	case acquireLoad:
		if m.leaked[st.ch.slot] {
			return fmt.Errorf("chunk loads into leaked slot %d", st.ch.slot)
		}
		for k, ch := range m.keyChunk {
			if ch.slot == st.ch.slot && !k.released {
				return fmt.Errorf("chunk loads into slot %d, which key %d of an earlier chunk still reaches", st.ch.slot, k.id)
			}
		}
		if ts := m.t.sessions[ms.s]; ts != nil && m.t.waiting > ts.group.waiting && ts.group.held >= m.t.share(ts.group) {
			return fmt.Errorf("session %d at its share (%d of %d) took a free slot while another group waits", ms.s.id, ts.group.held, m.t.share(ts.group))
		}
		if m.pick(2) == 0 {
			// The load ends later (finishLoad).
			m.pins[st.ch]++
			m.loading = append(m.loading, st.ch)
			return nil
		}
		// The load ends at once: the grant goes on with the chunk.
		m.t.loaded(st.ch) // (its pin is the grant's)
		st.kind = acquireReady
	case acquireFull:
		// The grant waits for a slot (until a later step gives up).
		m.t.wait(ms.s, true)
		ms.waiting++
		m.seen["wait"]++
		if ch := m.t.victim(ms.s); ch != nil {
			m.startEviction(ch)
		}
		return nil
	case acquireRefit:
		m.seen["refit"]++
		m.startEviction(st.ch)
		return nil
	case acquireWait, acquireWaitLoad:
		return nil
	}
	ch := st.ch
	m.pins[ch]++
	if h := st.holder; h != nil {
		// The handle's grant, handed out again: it must be the handle's
		// own, with its access.
		k := h.key.(*fakeKey)
		if h.s != ms.s || h.handle != handle || h.ch != ch || k.access != accessOf(mh.writable) || k.released {
			return fmt.Errorf("session %d handle %d (writable %v) is handed key %d of session %d handle %d (access %v, released %v)",
				ms.s.id, handle, mh.writable, k.id, h.s.id, h.handle, k.access, k.released)
		}
		m.seen["grant reused"]++
	} else {
		m.nextID++
		w := mh.writable
		if m.pick(20) == 0 {
			w = !w // a bug of the caller: the table must refuse it
		}
		k := &fakeKey{id: int(m.nextID), slot: ch.slot, access: accessOf(w)}
		m.keys = append(m.keys, k)
		m.keyChunk[k] = ch
		h, added, err := m.t.grant(ch, ms.s, handle, k)
		switch {
		case ms.fenced:
			if !errors.Is(err, errSessionFenced) {
				return fmt.Errorf("grant on a fenced session: %v, %v", added, err)
			}
			k.released = true // never handed out
		case w != mh.writable:
			if !errors.Is(err, errGrantAccess) {
				return fmt.Errorf("grant with the wrong access: %v, %v", added, err)
			}
			k.released = true // never handed out
		case err != nil:
			return fmt.Errorf("grant on an open handle: %v", err)
		case !added:
			return errors.New("a grant the handle did not hold was not added")
		default:
			m.keyHolder[k] = h
			m.given[k] = ms
			m.seen[fmt.Sprintf("grant writable=%v", w)]++
			if len(ch.holders) > 1 {
				m.seen["shared chunk"]++
			}
			m.logf("  key %d", k.id)
		}
	}
	if m.pick(4) != 0 {
		m.unpin(ch) // else kept pinned for a while
	}
	return nil
}

func (m *tableModel) finishLoad() {
	if len(m.loading) == 0 {
		return
	}
	i := m.pick(len(m.loading))
	ch := m.loading[i]
	m.loading = slices.Delete(m.loading, i, i+1)
	if m.pick(10) == 0 {
		m.logf("load of chunk %d of %s fails", ch.key.idx, ch.key.vol.name)
		delete(m.pins, ch)
		m.t.loadFailed(ch)
		return
	}
	m.logf("load of chunk %d of %s ends", ch.key.idx, ch.key.vol.name)
	m.t.loaded(ch)
	m.unpin(ch)
}

// stopWaiting ends a wait for a slot (the grant got one later, or gave up).
func (m *tableModel) stopWaiting() {
	for _, ms := range m.live(true) {
		if ms.waiting > 0 {
			ms.waiting--
			m.t.wait(ms.s, false)
			return
		}
	}
}

func (m *tableModel) unpinSome() {
	var pinned []*chunk
	for ch := range m.pins {
		if ch.state != chunkLoading {
			pinned = append(pinned, ch)
		}
	}
	if len(pinned) == 0 {
		return
	}
	slices.SortFunc(pinned, func(a, b *chunk) int { return int(a.gen) - int(b.gen) })
	ch := pinned[m.pick(len(pinned))]
	m.logf("unpin chunk %d of %s", ch.key.idx, ch.key.vol.name)
	m.unpin(ch)
}

// revokeStep ends one revoke of an eviction: answered, or timed out (the
// session is dropped and its host penalized); or, once none is left, the
// eviction's write-back.
func (m *tableModel) revokeStep() error {
	if len(m.evictions) == 0 {
		return nil
	}
	i := m.pick(len(m.evictions))
	ev := m.evictions[i]
	if len(ev.pending) == 0 {
		m.evictions = slices.Delete(m.evictions, i, i+1)
		if m.pick(8) == 0 {
			m.logf("write-back of chunk %d fails", ev.ch.key.idx)
			m.t.evictFailed(ev.ch)
			return nil
		}
		if len(ev.ch.holders) != 0 {
			return fmt.Errorf("chunk %d evicted with %d holders", ev.ch.key.idx, len(ev.ch.holders))
		}
		m.seen["evicted"]++
		freed := m.t.evicted(ev.ch)
		m.logf("chunk %d of %s evicted from slot %d (freed %v)", ev.ch.key.idx, ev.ch.key.vol.name, ev.ch.slot, freed)
		if !freed {
			m.leaked[ev.ch.slot] = true
		}
		return nil
	}
	j := m.pick(len(ev.pending))
	h := ev.pending[j]
	ev.pending = slices.Delete(ev.pending, j, j+1)
	if m.pick(6) == 0 {
		m.seen["revoke timeout"]++
		m.logf("revoke of key %d times out: session %d dropped", h.key.(*fakeKey).id, h.s.id)
		ms := m.bySess[h.s]
		if !ms.ended {
			ms.dropped = true
			m.t.penalize(h.s, m.clock.Add(time.Second))
		}
	} else {
		m.seen["revoke answered"]++
		m.logf("revoke of key %d answered", h.key.(*fakeKey).id)
	}
	if m.t.dropHolder(h) {
		return m.release([]*holder{h})
	}
	return nil
}

func (m *tableModel) evict() {
	live := m.live(false)
	var s *session
	if len(live) > 0 && m.pick(2) == 0 {
		s = live[m.pick(len(live))].s
	}
	if ch := m.t.victim(s); ch != nil {
		m.logf("evict for %v", s != nil)
		m.startEviction(ch)
	}
}

func (m *tableModel) grow() {
	v := m.vols[m.pick(2)]
	if m.size[v] > 24*m.chunkLen {
		return
	}
	m.size[v] += uint64(1 + m.pick(int(2*m.chunkLen)))
	m.logf("grow %s to %d", v.name, m.size[v])
}

func (m *tableModel) step() error {
	switch x := m.pick(100); {
	case x < 6:
		if len(m.live(true)) < 8 {
			m.newSession()
		}
	case x < 14:
		return m.open()
	case x < 20:
		return m.closeHandle()
	case x < 52:
		return m.grant()
	case x < 62:
		m.finishLoad()
	case x < 65:
		m.unpinSome()
	case x < 67:
		m.stopWaiting()
	case x < 85:
		return m.revokeStep()
	case x < 89:
		m.evict()
	case x < 92:
		m.grow()
	case x < 96:
		return m.end()
	default:
		m.clock = m.clock.Add(time.Duration(m.pick(300)) * time.Millisecond)
	}
	return nil
}

// check verifies the invariants the model knows of.
func (m *tableModel) check() error {
	if err := m.t.check(); err != nil {
		return err
	}
	writers := map[string]bool{} // hosts (or anonymous sessions) with a live writable key of the exclusive export
	for k, h := range m.keyHolder {
		ms := m.bySess[h.s]
		if k.released {
			return fmt.Errorf("key %d in the table was released", k.id)
		}
		// (A dropped session's keys live until it ends: its link is
		// closed, nothing reaches them.)
		if ms.ended || ms.fenced {
			return fmt.Errorf("key %d of session %d (ended %v, fenced %v) is live", k.id, h.s.id, ms.ended, ms.fenced)
		}
		mh, open := ms.handles[h.handle]
		if !open {
			return fmt.Errorf("key %d of closed handle %d of session %d is live", k.id, h.handle, h.s.id)
		}
		if k.access != accessOf(mh.writable) {
			return fmt.Errorf("key %d of handle %d (writable %v) has access %v", k.id, h.handle, mh.writable, k.access)
		}
		if mh.vol != h.ch.key.vol {
			return fmt.Errorf("key %d of handle %d of %s reaches a chunk of %s", k.id, h.handle, mh.vol.name, h.ch.key.vol.name)
		}
		if mh.writable && h.ch.key.vol == m.vols[0] {
			id := ms.host
			if id == "" {
				id = "anon:" + strconv.FormatUint(h.s.id, 10)
			}
			writers[id] = true
		}
		if c := m.t.lookup(h.ch.key); c != h.ch {
			return fmt.Errorf("key %d reaches chunk %d, no longer in the table", k.id, h.ch.key.idx)
		}
	}
	if len(writers) > 1 {
		return fmt.Errorf("the exclusive export has writable keys of %d hosts: %v", len(writers), writers)
	}
	for k := range m.given {
		if _, live := m.keyHolder[k]; !live && !k.released {
			return fmt.Errorf("key %d left the table unreleased", k.id)
		}
	}
	for key, ch := range m.t.chunks {
		if m.leaked[ch.slot] {
			return fmt.Errorf("chunk %d of %s in leaked slot %d", key.idx, key.vol.name, ch.slot)
		}
		want := m.pins[ch]
		if ch.pins != want {
			return fmt.Errorf("chunk %d of %s: %d pins, the model holds %d", key.idx, key.vol.name, ch.pins, want)
		}
	}
	for k := range m.releaseErr {
		// A key whose release failed may still reach its slot: no
		// other chunk ever sits there.
		if c := m.slotChunk(k.slot); c != nil && c != m.keyChunk[k] {
			return fmt.Errorf("chunk %d in slot %d, which key %d (its release failed) may reach", c.key.idx, k.slot, k.id)
		}
	}
	for k, ch := range m.keyChunk {
		if k.released {
			continue
		}
		if c := m.t.lookup(ch.key); c != ch || c.slot != k.slot {
			return fmt.Errorf("unreleased key %d reaches slot %d, whose chunk is gone", k.id, k.slot)
		}
	}
	return nil
}

// slotChunk returns the chunk of the table in slot, or nil.
func (m *tableModel) slotChunk(slot int) *chunk {
	for _, ch := range m.t.chunks {
		if ch.slot == slot {
			return ch
		}
	}
	return nil
}

func TestChunkTableModel(t *testing.T) {
	var seeds []uint64
	for i := range uint64(16) {
		seeds = append(seeds, i+1)
	}
	seeds = append(seeds, uint64(time.Now().UnixNano())) // and one new each run
	steps := 5000
	if s := os.Getenv("RBLK_MODEL_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		seeds = []uint64{n}
	}
	if testing.Short() {
		steps = 1000
	}
	seen := map[string]int{}
	for _, seed := range seeds {
		m := newTableModel(seed)

		for i := range steps {
			err := m.step()
			if err == nil {
				err = m.check()
			}
			if err != nil {
				tail := m.log[max(0, len(m.log)-30):]
				t.Fatalf("seed %d (RBLK_MODEL_SEED=%d), step %d: %v\nlast events:\n%s", seed, seed, i, err, strings.Join(tail, "\n"))
			}
		}
		// Everything ends: every key is released, every slot free or leaked.
		for _, ms := range m.live(true) {
			ms.ended = true
			ms.waiting = 0
			ms.handles = nil
			if err := m.release(m.t.endSession(ms.s)); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
		}
		if len(m.keyHolder) != 0 || len(m.t.groups) != 0 || m.t.shares != 0 || m.t.waiting != 0 {
			t.Fatalf("seed %d: after every session ended: %d keys, %d groups, %d shares", seed, len(m.keyHolder), len(m.t.groups), m.t.shares)
		}
		if err := m.check(); err != nil {
			t.Fatalf("seed %d, at the end: %v", seed, err)
		}
		for k, n := range m.seen {
			seen[k] += n
		}
	}
	t.Logf("events over %d seeds of %d steps: %v", len(seeds), steps, seen)
	// The sequences reach what the invariants are about.
	for _, k := range []string{"grant writable=true", "grant writable=false", "shared chunk", "close with grants", "grant reused", "wait", "fence",
		"takeover", "busy", "revoke answered", "revoke timeout", "evicted", "refit", "leak"} {
		if seen[k] == 0 {
			t.Errorf("no %q in any sequence", k)
		}
	}
}
