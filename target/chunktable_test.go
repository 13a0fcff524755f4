package target

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// tableHarness drives a chunkTable as the cache does, by names: sessions
// "a", "b", ... (their host given when they open a handle), volumes "v",
// "w", chunks "v0", "w3", ..., and remembers what the steps returned.
type tableHarness struct {
	tb     *testing.T
	t      *chunkTable
	clock  time.Time
	sess   map[string]*session
	vols   map[string]*volume
	keys   int
	revoke map[string][]*holder // what revoking returned, by chunk
}

const tableSlots = 4

func newTableHarness(tb *testing.T) *tableHarness {
	h := &tableHarness{tb: tb, clock: time.Unix(1000, 0), sess: map[string]*session{}, vols: map[string]*volume{},
		revoke: map[string][]*holder{}}
	h.t = newChunkTable(tableSlots, 100*time.Millisecond, func() time.Time { return h.clock })
	return h
}

func (h *tableHarness) session(name string) *session {
	if name == "-" {
		return nil
	}
	s := h.sess[name]
	if s == nil {
		s = &session{id: uint64(len(h.sess) + 1)}
		h.sess[name] = s
	}
	return s
}

func (h *tableHarness) sessName(s *session) string {
	for n, x := range h.sess {
		if x == s {
			return n
		}
	}
	return "?"
}

// key returns the chunk key of a name like "v3".
func (h *tableHarness) key(name string) chunkKey {
	var idx uint64
	fmt.Sscanf(name[1:], "%d", &idx)
	v := h.vols[name[:1]]
	if v == nil {
		v = &volume{name: name[:1]}
		h.vols[name[:1]] = v
	}
	return chunkKey{v, idx}
}

func (h *tableHarness) chunk(name string) *chunk {
	ch := h.t.lookup(h.key(name))
	if ch == nil {
		h.tb.Fatalf("no chunk %s", name)
	}
	return ch
}

func (h *tableHarness) chunkName(ch *chunk) string {
	if ch == nil {
		return "none"
	}
	return fmt.Sprintf("%s%d", ch.key.vol.name, ch.key.idx)
}

// holders renders holders as "chunk:session/handle(rw|ro)", sorted.
func (h *tableHarness) holders(hs []*holder) string {
	var out []string
	for _, x := range hs {
		rw := "ro"
		if x.writable {
			rw = "rw"
		}
		out = append(out, fmt.Sprintf("%s:%s/%d%s", h.chunkName(x.ch), h.sessName(x.s), x.handle, rw))
	}
	slices.Sort(out)
	return "[" + strings.Join(out, " ") + "]"
}

func (h *tableHarness) holderOf(chName, sess string, handle uint32) *holder {
	x := h.chunk(chName).holderOf(h.session(sess), handle)
	if x == nil {
		h.tb.Fatalf("%s holds no grant of %s under handle %d", sess, chName, handle)
	}
	return x
}

// step is one event and what it must render.
type step struct {
	do   string
	want string
}

// run applies an event, given as words: the verb, then its arguments.
func (h *tableHarness) run(ev string) string {
	w := strings.Fields(ev)
	num := func(i int) uint64 {
		var n uint64
		fmt.Sscanf(w[i], "%d", &n)
		return n
	}
	switch w[0] {
	case "open": // open SESSION HANDLE rw|ro HOST
		host := ""
		if len(w) > 4 {
			host = w[4]
		}
		s := h.session(w[1])
		h.t.openHandle(s, uint32(num(2)), w[3] == "rw", shareOf(s, host), time.Time{})
		return fmt.Sprintf("shares %d", h.t.shares)
	case "close": // close SESSION HANDLE
		return h.holders(h.t.closeHandle(h.session(w[1]), uint32(num(2))))
	case "fence":
		return h.holders(h.t.fence(h.session(w[1])))
	case "end":
		return h.holders(h.t.endSession(h.session(w[1])))
	case "acquire": // acquire CHUNK LENGTH SESSION HANDLE
		st := h.t.acquire(h.key(w[1]), num(2), h.session(w[3]), uint32(num(4)))
		switch st.kind {
		case acquireReady:
			if st.holder != nil {
				return fmt.Sprintf("ready pins %d gen %d, held", st.ch.pins, st.ch.gen)
			}
			return fmt.Sprintf("ready pins %d gen %d", st.ch.pins, st.ch.gen)
		case acquireLoad:
			return fmt.Sprintf("load slot %d", st.ch.slot)
		case acquireWaitLoad:
			return "wait load"
		case acquireWait:
			return "wait"
		case acquireRefit:
			return "refit"
		case acquireFull:
			return "full"
		}
		return "?"
	case "loaded":
		ch := h.chunk(w[1])
		h.t.loaded(ch)
		return fmt.Sprintf("gen %d", ch.gen)
	case "loadFailed":
		h.t.loadFailed(h.chunk(w[1]))
		return fmt.Sprintf("free %v", h.t.free)
	case "unpin":
		return fmt.Sprintf("wake %v", h.t.unpin(h.chunk(w[1])))
	case "grant": // grant CHUNK SESSION HANDLE rw|ro
		h.keys++
		k := &fakeKey{id: h.keys, slot: h.chunk(w[1]).slot, access: accessOf(w[4] == "rw")}
		x, added, err := h.t.grant(h.chunk(w[1]), h.session(w[2]), uint32(num(3)), k)
		switch {
		case err != nil:
			return "error: " + err.Error()
		case !added:
			return fmt.Sprintf("held key %d", x.key.(*fakeKey).id)
		}
		return fmt.Sprintf("added key %d", k.id)
	case "victim": // victim SESSION|-
		return h.chunkName(h.t.victim(h.session(w[1])))
	case "refit":
		return fmt.Sprint(h.t.refit(h.chunk(w[1])))
	case "volumeVictim":
		h.key(w[1] + "0")
		ch, busy := h.t.volumeVictim(h.vols[w[1]])
		return fmt.Sprintf("%s busy %v", h.chunkName(ch), busy)
	case "revoking":
		hs := h.t.revoking(h.chunk(w[1]))
		h.revoke[w[1]] = hs
		return h.holders(hs)
	case "drop": // drop CHUNK SESSION HANDLE: its revoke ended
		return fmt.Sprint(h.t.dropHolder(h.holderOf(w[1], w[2], uint32(num(3)))))
	case "dropRevoked": // dropRevoked CHUNK: every holder revoking returned
		var out []string
		for _, x := range h.revoke[w[1]] {
			out = append(out, fmt.Sprint(h.t.dropHolder(x)))
		}
		return strings.Join(out, " ")
	case "leak":
		h.t.leak(h.chunk(w[1]))
		return ""
	case "evicted":
		return fmt.Sprintf("freed %v", h.t.evicted(h.chunk(w[1])))
	case "evictFailed":
		h.t.evictFailed(h.chunk(w[1]))
		return ""
	case "advance":
		d, _ := time.ParseDuration(w[1])
		h.clock = h.clock.Add(d)
		return ""
	case "wait": // wait SESSION true|false
		h.t.wait(h.session(w[1]), w[2] == "true")
		return fmt.Sprintf("waiting %d", h.t.waiting)
	case "penalize": // penalize SESSION FOR
		d, _ := time.ParseDuration(w[2])
		h.t.penalize(h.session(w[1]), h.clock.Add(d))
		return ""
	case "share":
		ts := h.t.sessions[h.session(w[1])]
		if ts == nil {
			return "no session"
		}
		return fmt.Sprintf("%d held %d", h.t.share(ts.group), ts.group.held)
	case "state":
		ch := h.t.lookup(h.key(w[1]))
		if ch == nil {
			return "absent"
		}
		return fmt.Sprintf("%v pins %d holders %s", ch.state, ch.pins, h.holders(ch.holders))
	case "lru":
		var out []string
		for e := h.t.lru.Front(); e != nil; e = e.Next() {
			out = append(out, h.chunkName(e.Value.(*chunk)))
		}
		return strings.Join(out, " ")
	}
	h.tb.Fatalf("unknown event %q", ev)
	return ""
}

// ready is the events that load chunk name into the table for session s's
// handle, unpinned: acquire, loaded, unpin (each rendering ignored).
func ready(name string, s string, handle int) []step {
	return []step{{fmt.Sprintf("acquire %s 64 %s %d", name, s, handle), "*"}, {"loaded " + name, "*"}, {"unpin " + name, "*"}}
}

func steps(groups ...[]step) []step {
	var out []step
	for _, g := range groups {
		out = append(out, g...)
	}
	return out
}

func TestChunkTable(t *testing.T) {
	for _, c := range []struct {
		name  string
		steps []step
	}{
		{"load, hit, generations", []step{
			{"open a 1 rw h1", "shares 1"},
			{"acquire v0 64 a 1", "load slot 0"},
			{"acquire v0 64 a 1", "wait load"},
			{"loaded v0", "gen 1"},
			{"acquire v0 64 a 1", "ready pins 2 gen 1"},
			{"unpin v0", "wake false"},
			{"unpin v0", "wake true"},
			{"acquire v1 64 a 1", "load slot 1"},
			{"loadFailed v1", "free [3 2 1]"},
			{"state v1", "absent"},
			{"acquire v1 64 a 1", "load slot 1"},
			{"loaded v1", "gen 2"},
			{"unpin v1", "wake true"},
			{"lru", "v1 v0"},
			{"acquire v0 64 - 0", "ready pins 1 gen 1"},
			{"lru", "v0 v1"},
			{"unpin v0", "wake true"},
		}},
		{"a grant carries its handle's access; one per handle", steps(ready("v0", "a", 1), []step{
			{"open a 1 rw h1", "shares 1"},
			{"open a 2 ro h1", "shares 1"},
			{"acquire v0 64 a 2", "ready pins 1 gen 1"},
			{"grant v0 a 2 rw", "error: key access differs from its handle's"},
			{"grant v0 a 2 ro", "added key 2"},
			{"unpin v0", "wake true"},
			{"acquire v0 64 a 1", "ready pins 1 gen 1"},
			{"grant v0 a 1 ro", "error: key access differs from its handle's"},
			{"grant v0 a 1 rw", "added key 4"},
			{"grant v0 a 1 rw", "held key 4"},
			{"unpin v0", "wake true"},
			{"acquire v0 64 a 2", "ready pins 1 gen 1, held"},
			{"unpin v0", "wake true"},
			{"state v0", "ready pins 0 holders [v0:a/1rw v0:a/2ro]"},
			{"share a", "4 held 1"},
			{"grant v0 a 1 rw", "error: chunk not ready and pinned"},
			{"grant v0 a 3 ro", "error: handle closed"},
			{"grant v0 b 1 ro", "error: handle closed"},
		})},
		{"close kills exactly the handle's grants", steps(ready("v0", "a", 1), ready("v1", "a", 1), []step{
			{"open a 1 rw", "shares 1"},
			{"open a 2 ro", "shares 1"},
			{"acquire v0 64 a 1", "ready pins 1 gen 1"},
			{"grant v0 a 1 rw", "added key 1"},
			{"grant v0 a 2 ro", "added key 2"},
			{"unpin v0", "wake true"},
			{"acquire v1 64 a 1", "ready pins 1 gen 2"},
			{"grant v1 a 1 rw", "added key 3"},
			{"unpin v1", "wake true"},
			{"close a 1", "[v0:a/1rw v1:a/1rw]"},
			{"state v0", "ready pins 0 holders [v0:a/2ro]"},
			{"state v1", "ready pins 0 holders []"},
			{"close a 1", "[]"},
			{"acquire v1 64 a 1", "ready pins 1 gen 2"},
			{"grant v1 a 1 rw", "error: handle closed"},
			{"unpin v1", "wake true"},
			{"share a", "4 held 1"},
			{"close a 2", "[v0:a/2ro]"},
			{"share a", "4 held 0"},
			{"end a", "[]"},
			{"share a", "no session"},
		})},
		{"fence and end take every grant of the session", steps(ready("v0", "a", 1), []step{
			{"open a 1 rw h1", "shares 1"},
			{"open a 2 ro h1", "shares 1"},
			{"open b 1 rw h2", "shares 2"},
			{"acquire v0 64 a 1", "ready pins 1 gen 1"},
			{"grant v0 a 1 rw", "added key 1"},
			{"grant v0 a 2 ro", "added key 2"},
			{"grant v0 b 1 rw", "added key 3"},
			{"fence a", "[v0:a/1rw v0:a/2ro]"},
			{"grant v0 a 1 rw", "error: session fenced"},
			{"unpin v0", "wake true"},
			{"state v0", "ready pins 0 holders [v0:b/1rw]"},
			{"share a", "2 held 0"},
			{"end a", "[]"},
			{"share b", "4 held 1"},
			{"end b", "[v0:b/1rw]"},
			{"state v0", "ready pins 0 holders []"},
		})},
		{"a full cache evicts the least recently granted, a revoke per holder", steps(
			ready("v0", "a", 1), ready("v1", "a", 1), ready("v2", "a", 1), ready("v3", "a", 1), []step{
				{"open a 1 rw h1", "shares 1"},
				{"open a 2 ro h1", "shares 1"},
				{"acquire v0 64 a 1", "ready pins 1 gen 1"},
				{"grant v0 a 1 rw", "added key 1"},
				{"grant v0 a 2 ro", "added key 2"},
				{"unpin v0", "wake true"},
				{"acquire v4 64 a 1", "full"},
				{"victim a", "v1"},
				{"acquire v1 64 a 1", "wait"},
				{"revoking v1", "[]"},
				{"evicted v1", "freed true"},
				{"acquire v4 64 a 1", "load slot 1"},
				{"loaded v4", "gen 5"},
				{"unpin v4", "wake true"},
				{"acquire v1 64 a 1", "full"},
				{"victim a", "v2"},
				{"evictFailed v2", ""},
				{"lru", "v4 v0 v3 v2"},
				{"victim a", "v2"},
				{"revoking v2", "[]"},
				{"evicted v2", "freed true"},
				{"acquire v1 64 a 1", "load slot 2"},
				{"loaded v1", "gen 6"},
				{"unpin v1", "wake true"},
				{"victim -", "v3"},
				{"evicted v3", "freed true"},
				{"victim -", "v0"},
				{"revoking v0", "[v0:a/1rw v0:a/2ro]"},
				{"drop v0 a 2", "true"},
				{"close a 1", "[v0:a/1rw]"},
				{"dropRevoked v0", "false false"},
				{"evicted v0", "freed true"},
			})},
		{"pinned chunks are not evicted; nothing to evict", steps(
			ready("v0", "a", 1), ready("v1", "a", 1), ready("v2", "a", 1), []step{
				{"acquire v3 64 a 1", "load slot 3"},
				{"acquire v0 64 - 0", "ready pins 1 gen 1"},
				{"acquire v1 64 - 0", "ready pins 1 gen 2"},
				{"acquire v2 64 - 0", "ready pins 1 gen 3"},
				{"acquire v4 64 - 0", "full"},
				{"victim -", "none"},
				{"unpin v1", "wake true"},
				{"victim -", "v1"},
				{"acquire v1 64 - 0", "wait"},
			})},
		{"a leaked slot is never reused", steps(ready("v0", "a", 1), ready("v1", "a", 1), ready("v2", "a", 1), ready("v3", "a", 1), []step{
			{"victim -", "v0"},
			{"leak v0", ""},
			{"evicted v0", "freed false"},
			{"acquire v4 64 - 0", "full"},
			{"victim -", "v1"},
			{"evicted v1", "freed true"},
			{"acquire v4 64 - 0", "load slot 1"},
		})},
		{"a chunk whose length changed is refit", steps(ready("v0", "a", 1), []step{
			{"acquire v0 64 - 0", "ready pins 1 gen 1"},
			{"acquire v0 128 - 0", "wait"},
			{"refit v0", "false"},
			{"unpin v0", "wake true"},
			{"acquire v0 128 - 0", "refit"},
			{"state v0", "evicting pins 0 holders []"},
			{"acquire v0 128 - 0", "wait"},
			{"refit v0", "false"},
			{"evicted v0", "freed true"},
			{"acquire v0 128 - 0", "load slot 0"},
		})},
		{"volume victims", steps(ready("v0", "a", 1), ready("w0", "a", 1), []step{
			{"acquire v1 64 - 0", "load slot 2"},
			{"volumeVictim v", "v0 busy false"},
			{"volumeVictim v", "none busy true"},
			{"volumeVictim x", "none busy false"},
		})},
		{"a host's sessions are one share; anonymous ones alone", []step{
			{"open a 1 rw h1", "shares 1"},
			{"open q 1 rw h1", "shares 1"},
			{"open b 1 rw h2", "shares 2"},
			{"open c 1 rw", "shares 3"},
			{"open d 1 rw", "shares 4"},
			{"share a", "1 held 0"},
			{"close d 1", "[]"},
			{"share q", "1 held 0"},
			{"end c", "[]"},
			{"end d", "[]"},
			{"share q", "2 held 0"},
			{"end a", "[]"},
			{"share q", "2 held 0"},
			{"close q 1", "[]"},
			{"share b", "4 held 0"},
		}},
		{"a group over its share gives up its own chunk", steps(
			[]step{{"open a 1 rw h1", "shares 1"}, {"open q 1 rw h1", "shares 1"}, {"open b 1 ro h2", "shares 2"}},
			ready("v0", "b", 1), ready("v1", "a", 1), ready("v2", "q", 1), ready("v3", "b", 1), []step{
				{"acquire v1 64 a 1", "ready pins 1 gen 2"},
				{"grant v1 a 1 rw", "added key 1"},
				{"unpin v1", "wake true"},
				{"acquire v2 64 q 1", "ready pins 1 gen 3"},
				{"grant v2 q 1 rw", "added key 2"},
				{"grant v2 a 1 rw", "added key 3"},
				{"unpin v2", "wake true"},
				{"share a", "2 held 2"},
				{"victim q", "v1"},
				{"victim b", "v0"},
			})},
		{"under its share, the least recently granted goes", steps(
			[]step{{"open a 1 rw h1", "shares 1"}, {"open q 1 rw h1", "shares 1"}, {"open b 1 ro h2", "shares 2"}},
			ready("v0", "b", 1), ready("v1", "a", 1), ready("v2", "q", 1), ready("v3", "b", 1), []step{
				{"acquire v1 64 a 1", "ready pins 1 gen 2"},
				{"grant v1 a 1 rw", "added key 1"},
				{"unpin v1", "wake true"},
				{"share a", "2 held 1"},
				{"victim q", "v0"},
			})},
		{"a group at its share takes no free slot while another waits", steps(
			[]step{{"open a 1 ro h1", "shares 1"}, {"open b 1 ro h2", "shares 2"}},
			ready("v0", "a", 1), ready("v1", "a", 1), []step{
				{"acquire v0 64 a 1", "ready pins 1 gen 1"},
				{"grant v0 a 1 ro", "added key 1"},
				{"unpin v0", "wake true"},
				{"acquire v1 64 a 1", "ready pins 1 gen 2"},
				{"grant v1 a 1 ro", "added key 2"},
				{"unpin v1", "wake true"},
				{"share a", "2 held 2"},
				{"wait a true", "waiting 1"},
				{"acquire v2 64 a 1", "load slot 2"}, // only a waits
				{"loadFailed v2", "free [3 2]"},
				{"wait b true", "waiting 2"},
				{"acquire v2 64 a 1", "full"},
				{"acquire v2 64 b 1", "load slot 2"},
				{"loaded v2", "gen 3"},
				{"unpin v2", "wake true"},
				{"wait b false", "waiting 1"},
				{"acquire v3 64 a 1", "load slot 3"},
				{"loaded v3", "gen 4"},
				{"unpin v3", "wake true"},
				{"wait b true", "waiting 2"},
				{"end b", "[]"},
				{"wait a false", "waiting 0"},
			})},
		{"penalty cuts the share for a while", []step{
			{"open a 1 rw h1", "shares 1"},
			{"share a", "4 held 0"},
			{"penalize a 1s", ""},
			{"share a", "1 held 0"},
			{"advance 999ms", ""},
			{"share a", "1 held 0"},
			{"advance 1ms", ""},
			{"share a", "4 held 0"},
		}},
		{"slow holders are evicted last", steps(
			[]step{{"open a 1 ro h1", "shares 1"}, {"open b 1 ro h2", "shares 2"}},
			ready("v0", "a", 1), ready("v1", "b", 1), ready("v2", "a", 1), ready("v3", "b", 1), []step{
				{"acquire v0 64 a 1", "ready pins 1 gen 1"},
				{"grant v0 a 1 ro", "added key 1"},
				{"unpin v0", "wake true"},
				{"acquire v2 64 a 1", "ready pins 1 gen 3"},
				{"grant v2 a 1 ro", "added key 2"},
				{"unpin v2", "wake true"},
				{"lru", "v2 v0 v3 v1"},
				{"victim -", "v1"},
				{"revoking v1", "[]"},
				{"victim -", "v3"},
				{"victim -", "v0"},
				{"revoking v0", "[v0:a/1ro]"},
				{"advance 99ms", ""},
				{"acquire v0 64 - 0", "wait"},
				{"evicted v1", "freed true"},
				{"evicted v3", "freed true"},
				{"acquire v4 64 - 0", "load slot 3"},
				{"loaded v4", "gen 5"},
				{"unpin v4", "wake true"},
				{"acquire v5 64 - 0", "load slot 1"},
				{"loaded v5", "gen 6"},
				{"unpin v5", "wake true"},
				{"lru", "v5 v4 v2"},
				// a's revoke is outstanding, not yet for patience: its
				// chunk v2 is the least recently granted and goes.
				{"victim -", "v2"},
				{"evictFailed v2", ""},
				{"advance 1ms", ""},
				// Now a is slow: v4 goes before a's v2.
				{"victim -", "v4"},
				{"evictFailed v4", ""},
				{"acquire v4 64 - 0", "ready pins 1 gen 5"},
				{"unpin v4", "wake true"},
				{"lru", "v4 v5 v2"},
				{"victim -", "v5"},
				{"evictFailed v5", ""},
				{"acquire v5 64 - 0", "ready pins 1 gen 6"},
				// With every other chunk pinned, a slow holder's goes.
				{"acquire v4 64 - 0", "ready pins 1 gen 5"},
				{"victim -", "v2"},
				{"evictFailed v2", ""},
				{"unpin v4", "wake true"},
				{"unpin v5", "wake true"},
				{"lru", "v4 v5 v2"},
				// a answered: no longer slow.
				{"dropRevoked v0", "true"},
				{"victim -", "v2"},
			})},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newTableHarness(t)
			for i, st := range c.steps {
				got := h.run(st.do)
				if st.want != "*" && got != st.want {
					t.Fatalf("step %d %q: got %q, want %q", i, st.do, got, st.want)
				}
				if err := h.t.check(); err != nil {
					t.Fatalf("step %d %q: %v", i, st.do, err)
				}
			}
		})
	}
}
