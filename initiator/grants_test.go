package initiator

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/rblk/rblk/protocol"
)

const testChunk = 64 // the grant table's chunk size in these tests

// grantHarness drives a grantTable as sessions do, remembering what the
// steps returned: the references each IO holds, the grant of each fetch in
// flight, what waiters wait on, the grants revokes drain.
type grantHarness struct {
	t      grantTable
	refs   map[string][]*grant        // by IO
	fetch  map[uint64]*grant          // fetches in flight, by chunk
	waits  map[uint64]<-chan struct{} // what waiters of a chunk wait on
	drains map[uint64]*grant          // revoked grants, by chunk
}

// event changes the table and renders what it returned.
type event struct {
	name string
	do   func(h *grantHarness) string
}

func acq(io string, write bool, idxs ...uint64) event {
	return event{fmt.Sprintf("acquire %s %s %v", io, rw(write), idxs), func(h *grantHarness) string {
		var st acquireStep
		h.refs[io], st = h.t.acquire(idxs, write, h.refs[io])
		switch st.kind {
		case acquired:
			return fmt.Sprintf("acquired, holds %d", len(h.refs[io]))
		case waitFetch:
			h.waits[st.idx] = st.wait
			return fmt.Sprintf("wait %d", st.idx)
		}
		if st.grant.idx != st.idx || st.grant.fetching == nil {
			return fmt.Sprintf("bad fetch step %+v", st)
		}
		h.fetch[st.idx] = st.grant
		h.waits[st.idx] = st.grant.fetching
		if st.replaced {
			return fmt.Sprintf("fetch %d, replaced", st.idx)
		}
		return fmt.Sprintf("fetch %d", st.idx)
	}}
}

func try(io string, write bool, idxs ...uint64) event {
	return event{fmt.Sprintf("tryAcquire %s %s %v", io, rw(write), idxs), func(h *grantHarness) string {
		var ok bool
		h.refs[io], ok = h.t.tryAcquire(idxs, write, h.refs[io])
		return fmt.Sprintf("%v, holds %d", ok, len(h.refs[io]))
	}}
}

// reply is the Grant of chunk idx the target sends in these tests.
func reply(idx, gen uint64, write bool) protocol.Grant {
	gr := protocol.Grant{Offset: idx * testChunk, Addr: 0x10000 + idx*0x100, RKey: 42, Length: testChunk, Generation: gen}
	if write {
		gr.Flags = protocol.GrantWrite
	}
	return gr
}

func fetched(idx, gen uint64, write bool) event {
	return fetchedReply(idx, reply(idx, gen, write))
}

func fetchedReply(idx uint64, gr protocol.Grant) event {
	return event{fmt.Sprintf("fetched %d %+v", idx, gr), func(h *grantHarness) string {
		g := h.fetch[idx]
		delete(h.fetch, idx)
		if err := h.t.fetched(g, &gr); err != nil {
			return "error: " + err.Error()
		}
		if g.off != gr.Offset || g.addr != gr.Addr || g.rkey != gr.RKey || g.length != uint64(gr.Length) || g.gen != gr.Generation {
			return fmt.Sprintf("grant %+v does not match the reply", g)
		}
		return "ok"
	}}
}

func failed(idx uint64) event {
	return event{fmt.Sprintf("fetchFailed %d", idx), func(h *grantHarness) string {
		h.t.fetchFailed(h.fetch[idx])
		delete(h.fetch, idx)
		return ""
	}}
}

func revoke(idx, gen uint64, linkDown bool) event {
	return event{fmt.Sprintf("revoke %d gen %d (link down %v)", idx, gen, linkDown), func(h *grantHarness) string {
		st := h.t.revoke(idx*testChunk, gen, linkDown)
		switch {
		case st.wait != nil && st.drain != nil:
			return "both wait and drain"
		case st.wait != nil:
			h.waits[idx] = st.wait
			return "wait"
		case st.drain != nil:
			h.drains[idx] = st.drain
			return fmt.Sprintf("drain gen %d", st.drain.gen)
		}
		return "ack"
	}}
}

func drained(idx uint64) event {
	return event{fmt.Sprintf("drained %d", idx), func(h *grantHarness) string {
		g := h.drains[idx]
		if h.t.drained(g) {
			return "drained"
		}
		return fmt.Sprintf("%d refs", g.refs)
	}}
}

func release(io string) event {
	return event{"release " + io, func(h *grantHarness) string {
		wake := h.t.release(h.refs[io])
		delete(h.refs, io)
		if wake {
			return "wake"
		}
		return ""
	}}
}

func teardown() event {
	return event{"teardown", func(h *grantHarness) string {
		return fmt.Sprintf("held %d", h.t.teardown())
	}}
}

// woken reports whether the waiters of chunk idx were woken.
func woken(idx uint64) event {
	return event{fmt.Sprintf("woken %d", idx), func(h *grantHarness) string {
		select {
		case <-h.waits[idx]:
			return "yes"
		default:
			return "no"
		}
	}}
}

func rw(write bool) string {
	if write {
		return "write"
	}
	return "read"
}

// state renders the table: chunk:state, in chunk order.
func (h *grantHarness) state() string {
	var idxs []uint64
	for idx := range h.t.chunks {
		idxs = append(idxs, idx)
	}
	slices.Sort(idxs)
	var out []string
	for _, idx := range idxs {
		g := h.t.chunks[idx]
		var s string
		switch {
		case g.fetching != nil && !g.valid:
			s = "fetching"
		case g.fetching == nil && g.valid:
			s = fmt.Sprintf("valid gen %d", g.gen)
			if g.writable {
				s += " rw"
			} else {
				s += " ro"
			}
		default:
			s = fmt.Sprintf("bad %+v", g)
		}
		if g.idx != idx {
			s += fmt.Sprintf(" (idx %d)", g.idx)
		}
		if g.refs != 0 {
			s += fmt.Sprintf(" refs %d", g.refs)
		}
		out = append(out, fmt.Sprintf("%d:%s", idx, s))
	}
	return strings.Join(out, " ")
}

// step is an event, what it must return and the table's state after it.
type step struct {
	ev    event
	want  string
	state string
}

// TestGrantTable runs scripts of events on a table and checks what each
// returned and the table after it.
func TestGrantTable(t *testing.T) {
	for _, c := range []struct {
		name  string
		steps []step
	}{
		{"read: absent, fetching, valid, referenced, released", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{woken(0), "no", "0:fetching"},
			{fetched(0, 7, false), "ok", "0:valid gen 7 ro"},
			{woken(0), "yes", "0:valid gen 7 ro"},
			{acq("a", false, 0), "acquired, holds 1", "0:valid gen 7 ro refs 1"},
			{acq("b", false, 0), "acquired, holds 1", "0:valid gen 7 ro refs 2"},
			{release("a"), "", "0:valid gen 7 ro refs 1"},
			{release("b"), "", "0:valid gen 7 ro"},
		}},
		{"write on a writable grant", []step{
			{acq("a", true, 3), "fetch 3", "3:fetching"},
			{fetched(3, 1, true), "ok", "3:valid gen 1 rw"},
			{acq("a", true, 3), "acquired, holds 1", "3:valid gen 1 rw refs 1"},
			{acq("b", false, 3), "acquired, holds 1", "3:valid gen 1 rw refs 2"},
		}},
		{"tryAcquire: all valid or nothing, and never fetches", []step{
			{try("a", false, 0), "false, holds 0", ""},
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{try("b", false, 0), "false, holds 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{try("b", false, 0, 1), "false, holds 0", "0:valid gen 7 rw"},
			{acq("a", false, 1), "fetch 1", "0:valid gen 7 rw 1:fetching"},
			{fetched(1, 2, false), "ok", "0:valid gen 7 rw 1:valid gen 2 ro"},
			{try("b", true, 0, 1), "false, holds 0", "0:valid gen 7 rw 1:valid gen 2 ro"},
			{try("b", false, 0, 1), "true, holds 2", "0:valid gen 7 rw refs 1 1:valid gen 2 ro refs 1"},
			{try("c", true, 0), "true, holds 1", "0:valid gen 7 rw refs 2 1:valid gen 2 ro refs 1"},
		}},
		{"waiters wait for the fetch in flight", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{acq("b", true, 0), "wait 0", "0:fetching"},
			{woken(0), "no", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{woken(0), "yes", "0:valid gen 7 rw"},
			{acq("b", true, 0), "acquired, holds 1", "0:valid gen 7 rw refs 1"},
		}},
		{"several chunks: all at once, no reference while a chunk is missing", []step{
			{acq("x", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 1, true), "ok", "0:valid gen 1 rw"},
			{acq("a", false, 0, 1, 2), "fetch 1", "0:valid gen 1 rw 1:fetching"},
			{acq("b", false, 0, 1, 2), "wait 1", "0:valid gen 1 rw 1:fetching"},
			{fetched(1, 1, true), "ok", "0:valid gen 1 rw 1:valid gen 1 rw"},
			{acq("a", false, 0, 1, 2), "fetch 2", "0:valid gen 1 rw 1:valid gen 1 rw 2:fetching"},
			{fetched(2, 1, true), "ok", "0:valid gen 1 rw 1:valid gen 1 rw 2:valid gen 1 rw"},
			{acq("a", false, 0, 1, 2), "acquired, holds 3", "0:valid gen 1 rw refs 1 1:valid gen 1 rw refs 1 2:valid gen 1 rw refs 1"},
			{release("a"), "", "0:valid gen 1 rw 1:valid gen 1 rw 2:valid gen 1 rw"},
		}},
		{"a write replaces a read-only grant with a writable one", []step{
			{acq("r", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, false), "ok", "0:valid gen 7 ro"},
			{acq("r", false, 0), "acquired, holds 1", "0:valid gen 7 ro refs 1"},
			{try("w", true, 0), "false, holds 0", "0:valid gen 7 ro refs 1"},
			{acq("w", true, 0), "fetch 0, replaced", "0:fetching"},
			{acq("r2", false, 0), "wait 0", "0:fetching"},
			{fetched(0, 8, true), "ok", "0:valid gen 8 rw"},
			{acq("w", true, 0), "acquired, holds 1", "0:valid gen 8 rw refs 1"},
			// The replaced grant is out of the table, still valid for
			// the read holding it: its release wakes no one.
			{release("r"), "", "0:valid gen 8 rw refs 1"},
			{release("w"), "", "0:valid gen 8 rw"},
		}},
		{"a write given a read-only grant again asks again", []step{
			{acq("w", true, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, false), "ok", "0:valid gen 7 ro"},
			{acq("w", true, 0), "fetch 0, replaced", "0:fetching"},
		}},
		{"fetch failure: absent again, waiters woken and fetch again", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{acq("b", false, 0), "wait 0", "0:fetching"},
			{failed(0), "", ""},
			{woken(0), "yes", ""},
			{acq("b", false, 0), "fetch 0", "0:fetching"},
		}},
		{"fetch failure of a write's replacement: the read-only grant is gone", []step{
			{acq("r", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, false), "ok", "0:valid gen 7 ro"},
			{acq("w", true, 0), "fetch 0, replaced", "0:fetching"},
			{failed(0), "", ""},
			{acq("r", false, 0), "fetch 0", "0:fetching"},
		}},
		{"grant reply for another chunk", []step{
			{acq("a", false, 1), "fetch 1", "1:fetching"},
			{acq("b", false, 1), "wait 1", "1:fetching"},
			{fetchedReply(1, reply(2, 7, true)), "error: grant for 64 covers 128+64: protocol: protocol error", ""},
			{woken(1), "yes", ""},
		}},
		{"grant reply of length zero", []step{
			{acq("a", false, 1), "fetch 1", "1:fetching"},
			{fetchedReply(1, protocol.Grant{Offset: testChunk, Length: 0}), "error: grant for 64 covers 64+0: protocol: protocol error", ""},
		}},
		{"grant reply longer than a chunk", []step{
			{acq("a", false, 1), "fetch 1", "1:fetching"},
			{fetchedReply(1, protocol.Grant{Offset: testChunk, Length: testChunk + 1}), "error: grant for 64 covers 64+65: protocol: protocol error", ""},
		}},
		{"grant reply shorter than a chunk (the volume's last)", []step{
			{acq("a", false, 1), "fetch 1", "1:fetching"},
			{fetchedReply(1, protocol.Grant{Offset: testChunk, Length: 10, Generation: 3}), "ok", "1:valid gen 3 ro"},
		}},
		{"revoke of a grant without references", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{revoke(0, 7, false), "drain gen 7", ""},
			{drained(0), "drained", ""},
		}},
		{"revoke waits for the references; the last release wakes it", []step{
			{acq("a", true, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{acq("a", true, 0), "acquired, holds 1", "0:valid gen 7 rw refs 1"},
			{acq("b", false, 0), "acquired, holds 1", "0:valid gen 7 rw refs 2"},
			{revoke(0, 7, false), "drain gen 7", ""},
			{drained(0), "2 refs", ""},
			// No new references on a revoked grant: a new fetch.
			{try("c", false, 0), "false, holds 0", ""},
			{acq("c", false, 0), "fetch 0", "0:fetching"},
			{release("a"), "", "0:fetching"},
			{drained(0), "1 refs", "0:fetching"},
			{release("b"), "wake", "0:fetching"},
			{drained(0), "drained", "0:fetching"},
			{fetched(0, 8, true), "ok", "0:valid gen 8 rw"},
		}},
		{"revoke of a generation not held is acked at once", []step{
			{revoke(5, 1, false), "ack", ""},
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{acq("a", false, 0), "acquired, holds 1", "0:valid gen 7 rw refs 1"},
			{revoke(0, 6, false), "ack", "0:valid gen 7 rw refs 1"},
			{revoke(0, 8, false), "ack", "0:valid gen 7 rw refs 1"},
			{revoke(0, 7, false), "drain gen 7", ""},
			// A second Revoke of the same grant.
			{revoke(0, 7, false), "ack", ""},
		}},
		{"revoke overtaking its grant's reply waits for the fetch", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{revoke(0, 7, false), "wait", "0:fetching"},
			{woken(0), "no", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{woken(0), "yes", "0:valid gen 7 rw"},
			// The fetcher references the grant before the revoke,
			// woken, takes the mutex.
			{acq("a", false, 0), "acquired, holds 1", "0:valid gen 7 rw refs 1"},
			{revoke(0, 7, false), "drain gen 7", ""},
			{drained(0), "1 refs", ""},
			{release("a"), "wake", ""},
			{drained(0), "drained", ""},
		}},
		{"revoke of an old generation during a fetch", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{revoke(0, 6, false), "wait", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{revoke(0, 6, false), "ack", "0:valid gen 7 rw"},
		}},
		{"revoke during a fetch that fails", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{revoke(0, 7, false), "wait", "0:fetching"},
			{failed(0), "", ""},
			{woken(0), "yes", ""},
			{revoke(0, 7, false), "ack", ""},
		}},
		{"revoke during a fetch, the link down: a fetching grant is not held", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{revoke(0, 7, false), "wait", "0:fetching"},
			{revoke(0, 7, true), "ack", "0:fetching"},
			{failed(0), "", ""},
		}},
		{"revoke with the link down still drains a valid grant", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{revoke(0, 7, true), "drain gen 7", ""},
		}},
		{"revoke of a read-only grant a write replaced finds the new grant", []step{
			{acq("r", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, false), "ok", "0:valid gen 7 ro"},
			{acq("r", false, 0), "acquired, holds 1", "0:valid gen 7 ro refs 1"},
			{acq("w", true, 0), "fetch 0, replaced", "0:fetching"},
			{revoke(0, 7, false), "wait", "0:fetching"},
			{fetched(0, 8, true), "ok", "0:valid gen 8 rw"},
			{revoke(0, 7, false), "ack", "0:valid gen 8 rw"},
		}},
		{"teardown with references held and a fetch in flight", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{fetched(0, 7, true), "ok", "0:valid gen 7 rw"},
			{acq("a", false, 0), "acquired, holds 1", "0:valid gen 7 rw refs 1"},
			{acq("b", false, 1), "fetch 1", "0:valid gen 7 rw refs 1 1:fetching"},
			{fetched(1, 7, false), "ok", "0:valid gen 7 rw refs 1 1:valid gen 7 ro"},
			{acq("c", false, 2), "fetch 2", "0:valid gen 7 rw refs 1 1:valid gen 7 ro 2:fetching"},
			{acq("d", false, 2), "wait 2", "0:valid gen 7 rw refs 1 1:valid gen 7 ro 2:fetching"},
			{teardown(), "held 2", ""},
			// Waiters are left to the link's end, the fetcher reports.
			{woken(2), "no", ""},
			{release("a"), "wake", ""},
			{failed(2), "", ""},
			{woken(2), "yes", ""},
			{revoke(0, 7, false), "ack", ""},
			{teardown(), "held 0", ""},
		}},
		{"a fetch answered after teardown leaves the table empty", []step{
			{acq("a", false, 0), "fetch 0", "0:fetching"},
			{teardown(), "held 0", ""},
			{fetched(0, 7, true), "ok", ""},
			{acq("a", false, 0), "fetch 0", "0:fetching"},
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := &grantHarness{t: newGrantTable(testChunk), refs: map[string][]*grant{},
				fetch: map[uint64]*grant{}, waits: map[uint64]<-chan struct{}{}, drains: map[uint64]*grant{}}
			for i, s := range c.steps {
				got := s.ev.do(h)
				if got != s.want {
					t.Fatalf("step %d, %s: got %q, want %q", i, s.ev.name, got, s.want)
				}
				if st := h.state(); st != s.state {
					t.Fatalf("step %d, %s: table %q, want %q", i, s.ev.name, st, s.state)
				}
			}
		})
	}
}

// TestGrantTableMissingChunk: acquire names the first chunk missing, in the
// order asked, whatever the others' states.
func TestGrantTableMissingChunk(t *testing.T) {
	for _, c := range []struct {
		name  string
		setup []event
		idxs  []uint64
		write bool
		want  string
	}{
		{"first absent", nil, []uint64{4, 5}, false, "fetch 4"},
		{"fetching before absent", []event{acq("x", false, 5)}, []uint64{5, 4}, false, "wait 5"},
		{"absent before fetching", []event{acq("x", false, 5)}, []uint64{4, 5}, false, "fetch 4"},
		{"valid skipped", []event{acq("x", false, 4), fetched(4, 1, false)}, []uint64{4, 5}, false, "fetch 5"},
		{"read-only skipped for a read", []event{acq("x", false, 4), fetched(4, 1, false)}, []uint64{4}, false, "acquired, holds 1"},
		{"read-only replaced for a write", []event{acq("x", false, 4), fetched(4, 1, false)}, []uint64{4, 5}, true, "fetch 4, replaced"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := &grantHarness{t: newGrantTable(testChunk), refs: map[string][]*grant{},
				fetch: map[uint64]*grant{}, waits: map[uint64]<-chan struct{}{}, drains: map[uint64]*grant{}}
			for _, e := range c.setup {
				e.do(h)
			}
			if got := acq("a", c.write, c.idxs...).do(h); got != c.want {
				t.Fatalf("got %q, want %q", got, c.want)
			}
		})
	}
}

// TestGrantTableZero: a Revoke before the session set its table up (a
// target's mistake) finds nothing held.
func TestGrantTableZero(t *testing.T) {
	var gt grantTable
	if st := gt.revoke(0, 1, false); st.wait != nil || st.drain != nil {
		t.Fatalf("revoke on an empty table: %+v, want an ack", st)
	}
	if n := gt.teardown(); n != 0 {
		t.Fatalf("teardown of an empty table: %d held", n)
	}
}
