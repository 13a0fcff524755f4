package target

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// TestHandlesRandom drives a real Target over the software transport with
// raw protocol clients, at random: hosts (and anonymous initiators) connect,
// open two exports (one exclusive, one shared) read-only or read-write on
// one session, several handles each, take the exclusive one over, ask for
// grants of a small cache (so that chunks are revoked, some by clients slow
// to answer, one that never answers and is dropped), close handles,
// disconnect, try writes through the keys of closed handles and of
// read-only grants, and the exports grow. The logic of handles, identity
// and the exclusive writer is the Target's own (reinstate, fence, forget).
// After every step it checks, under the cache's lock:
//
//   - the chunk table's invariants (chunkTable.check);
//   - every grant in the table belongs to a handle its session has open,
//     with that handle's access, of the chunk's volume, on a session that
//     is neither fenced nor ending;
//   - the exclusive export has writable grants of one host at most;
//
// and, through the clients, that every write through the key of a closed
// handle or a read-only grant fails with a remote access error. The seed
// is printed on failure (RBLK_HANDLES_SEED replays one).
func TestHandlesRandom(t *testing.T) {
	base := uint64(time.Now().UnixNano())
	runs := 6
	if s := os.Getenv("RBLK_HANDLES_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		base, runs = n, 1
	}
	steps := 500
	if testing.Short() {
		steps = 150
	}
	// The events every run must show, over its seeds.
	kinds := []string{"grant rw", "grant ro", "close", "takeover", "busy", "dead key write refused", "revoked", "revoke timeout", "grow"}
	seen := map[string]int{}
	missing := func() bool {
		for _, k := range kinds {
			if seen[k] == 0 {
				return true
			}
		}
		return false
	}
	// More seeds, up to four times as many, while an event has not come:
	// some (a silent client's revoke timing out) are rare enough that six
	// seeds miss them now and then (the guest's soak, under a CPU hog).
	maxRuns := runs
	if runs > 1 {
		maxRuns = 4 * runs
	}
	var ran uint64
	for seed := base; seed < base+uint64(runs) || seed < base+uint64(maxRuns) && missing() && !t.Failed(); seed++ {
		ran++
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			h := newHandlesHarness(t, seed)
			for i := range steps {
				err := h.step()
				if err == nil {
					err = h.check()
				}
				if err != nil {
					tail := h.log[max(0, len(h.log)-30):]
					t.Fatalf("seed %d (RBLK_HANDLES_SEED=%d), step %d: %v\nlast events:\n%s", seed, seed, i, err, strings.Join(tail, "\n"))
				}
			}
			h.seen["revoke timeout"] = int(testutil.ToFloat64(h.tg.m.revokeTimeouts))
			for k, n := range h.seen {
				seen[k] += n
			}
		})
	}
	t.Logf("seeds %d..%d: %v", base, base+ran-1, seen)
	if runs > 1 && !t.Failed() {
		for _, k := range kinds {
			if seen[k] == 0 {
				t.Errorf("seeds %d..%d: no %q", base, base+ran-1, k)
			}
		}
	}
}

const hmChunk = 64 << 10

type hmHandle struct {
	info     protocol.VolumeInfo
	export   string
	writable bool
	closed   bool
}

type hmGrant struct {
	g        protocol.Grant
	handle   *hmHandle
	writable bool
}

type hmClient struct {
	l       *link.Link
	host    string
	handles []*hmHandle
	grants  []hmGrant
	silent  bool // never answers a revoke
}

type handlesHarness struct {
	t    *testing.T
	r    *rand.Rand
	tg   *Target
	p    transport.Provider
	addr string
	log  []string
	seen map[string]int

	mu      sync.Mutex // revoked, from the clients' handlers
	revoked int

	clients []*hmClient
}

func newHandlesHarness(t *testing.T, seed uint64) *handlesHarness {
	transporttest.CheckGoroutines(t)
	dir := t.TempDir()
	var exports []ExportConfig
	for _, e := range []struct {
		name   string
		shared bool
	}{{"excl", false}, {"shared", true}} {
		exports = append(exports, ExportConfig{Name: e.name, Path: filepath.Join(dir, e.name), Size: 10*hmChunk + 4096, Shared: e.shared})
	}
	tg, err := New(Options{Exports: exports, CacheSize: 6 * hmChunk, ChunkSize: hmChunk, RevokeTimeout: 400 * time.Millisecond,
		DrainTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	p := tcp.New("tcp")
	ctx, cancel := context.WithCancel(context.Background())
	l, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(done) }()
	h := &handlesHarness{t: t, r: rand.New(rand.NewPCG(seed, seed+1)), tg: tg, p: p, addr: l.Addr(), seen: map[string]int{}}
	t.Cleanup(func() {
		for _, c := range h.clients {
			c.l.Close()
		}
		cancel()
		<-done
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
	})
	return h
}

func (h *handlesHarness) logf(format string, args ...any) {
	h.log = append(h.log, fmt.Sprintf(format, args...))
}

func (h *handlesHarness) pick(n int) int { return h.r.IntN(n) }

func (h *handlesHarness) connect() error {
	hosts := []string{"h1", "h2", "h3", ""}
	host := hosts[h.pick(len(hosts))]
	c := &hmClient{host: host, silent: h.pick(6) == 0}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ready := make(chan struct{})
	l, err := link.Dial(ctx, h.p, h.addr, link.Options{Handler: func(hd protocol.Header, p []byte) {
		<-ready
		var rv protocol.Revoke
		if hd.Type != protocol.TypeRevoke || rv.Unmarshal(p) != nil || c.silent {
			return
		}
		h.mu.Lock()
		h.revoked++
		h.mu.Unlock()
		go c.l.Send(context.Background(), hd.Tag, &protocol.RevokeAck{Handle: rv.Handle, Offset: rv.Offset, Generation: rv.Generation})
	}})
	if err != nil {
		return err
	}
	c.l = l
	close(ready)
	if _, err := auth.Initiate(ctx, l, host, nil); err != nil {
		return err
	}
	h.clients = append(h.clients, c)
	h.logf("connect as %q (silent %v)", host, c.silent)
	return nil
}

// live returns the clients whose link is up.
func (h *handlesHarness) live() []*hmClient {
	var out []*hmClient
	for _, c := range h.clients {
		if c.l.Err() == nil {
			out = append(out, c)
		}
	}
	return out
}

func (h *handlesHarness) client() *hmClient {
	live := h.live()
	if len(live) == 0 {
		return nil
	}
	return live[h.pick(len(live))]
}

func (c *hmClient) openHandles() []*hmHandle {
	var out []*hmHandle
	for _, hd := range c.handles {
		if !hd.closed {
			out = append(out, hd)
		}
	}
	return out
}

// request does a request of c and sorts its error: nil, a refusal the
// protocol allows (returned as what), or a failure.
func (h *handlesHarness) request(c *hmClient, m, reply protocol.Message) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := c.l.Request(ctx, m, reply)
	var re *protocol.RemoteError
	switch {
	case err == nil:
		return "", nil
	case errors.As(err, &re):
		return re.Error(), nil
	case c.l.Err() != nil:
		return "link down", nil // fenced, dropped, or broken by a refused write
	}
	return "", fmt.Errorf("%v: %w", m.Type(), err)
}

func (h *handlesHarness) open() error {
	c := h.client()
	if c == nil {
		return nil
	}
	export := []string{"excl", "excl", "shared"}[h.pick(3)]
	mode := protocol.ModeReadOnly
	if h.pick(3) != 0 {
		mode = protocol.ModeReadWrite
	}
	var flags uint8
	if mode == protocol.ModeReadWrite && h.pick(3) == 0 {
		flags = protocol.OpenTakeover
	}
	before := testutil.ToFloat64(h.tg.m.takeovers)
	var info protocol.VolumeInfo
	refused, err := h.request(c, &protocol.Open{Mode: mode, Name: export, HostID: c.host, Flags: flags}, &info)
	h.logf("open %q %v %v takeover=%v: %q", c.host, export, mode, flags != 0, refused)
	if err != nil || refused != "" {
		if strings.Contains(refused, "held read-write") {
			h.seen["busy"]++
		}
		return err
	}
	if testutil.ToFloat64(h.tg.m.takeovers) > before {
		h.seen["takeover"]++
	}
	c.handles = append(c.handles, &hmHandle{info: info, export: export, writable: mode == protocol.ModeReadWrite})
	return nil
}

func (h *handlesHarness) grant() error {
	c := h.client()
	if c == nil {
		return nil
	}
	hs := c.openHandles()
	if len(hs) == 0 {
		return nil
	}
	hd := hs[h.pick(len(hs))]
	off := uint64(h.pick(int(hd.info.VolumeSize)))
	req := &protocol.GrantRequest{Handle: hd.info.Handle, Offset: off}
	if hd.writable && h.pick(2) == 0 {
		req.Flags = protocol.GrantWrite
	}
	var g protocol.Grant
	refused, err := h.request(c, req, &g)
	h.logf("grant %q handle %d at %d: %q", c.host, hd.info.Handle, off, refused)
	if err != nil || refused != "" {
		return err
	}
	w := g.Flags&protocol.GrantWrite != 0
	if w != hd.writable {
		return fmt.Errorf("handle %d (writable %v) got a grant with GrantWrite %v", hd.info.Handle, hd.writable, w)
	}
	h.seen[map[bool]string{true: "grant rw", false: "grant ro"}[w]]++
	c.grants = append(c.grants, hmGrant{g: g, handle: hd, writable: w})
	return nil
}

func (h *handlesHarness) closeHandle() error {
	c := h.client()
	if c == nil {
		return nil
	}
	hs := c.openHandles()
	if len(hs) == 0 {
		return nil
	}
	hd := hs[h.pick(len(hs))]
	refused, err := h.request(c, &protocol.Close{Handle: hd.info.Handle}, &protocol.OK{})
	h.logf("close %q handle %d: %q", c.host, hd.info.Handle, refused)
	if err != nil || refused != "" {
		return err
	}
	hd.closed = true
	h.seen["close"]++
	return nil
}

// deadWrite writes through the key of a closed handle, or of a read-only
// grant: it must fail with a remote access error (which breaks that
// client's connection).
func (h *handlesHarness) deadWrite() error {
	c := h.client()
	if c == nil {
		return nil
	}
	var dead []hmGrant
	for _, g := range c.grants {
		if g.handle.closed || !g.writable {
			dead = append(dead, g)
		}
	}
	if len(dead) == 0 {
		return nil
	}
	g := dead[h.pick(len(dead))]
	mem, err := transport.AllocMemory(4096, false)
	if err != nil {
		return err
	}
	defer mem.Free()
	local, err := c.l.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		return nil // the link went down meanwhile
	}
	defer local.Deregister()
	copy(local.Bytes(), "DEAD KEY")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = c.l.RDMA(ctx, link.Op{Write: true, Local: transport.SGE{Region: local, Length: 8}, Addr: g.g.Addr, RKey: g.g.RKey})
	h.logf("write %q through handle %d's key (closed %v, writable %v): %v", c.host, g.handle.info.Handle, g.handle.closed, g.writable, err)
	switch {
	case transporttest.Refused(err):
		h.seen["dead key write refused"]++
	case err == nil:
		return fmt.Errorf("an RDMA WRITE through the key of handle %d (closed %v, writable grant %v) landed", g.handle.info.Handle, g.handle.closed, g.writable)
	}
	c.l.Close()
	return nil
}

func (h *handlesHarness) disconnect() {
	if c := h.client(); c != nil {
		h.logf("disconnect %q", c.host)
		c.l.Close()
	}
}

func (h *handlesHarness) grow() error {
	name := []string{"excl", "shared"}[h.pick(2)]
	h.tg.volMu.RLock()
	v := h.tg.volumes[name]
	h.tg.volMu.RUnlock()
	size := v.size.Load()
	if size > 20*hmChunk {
		return nil
	}
	size += uint64(1+h.pick(8)) * 4096
	h.logf("grow %s to %d", name, size)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.tg.Grow(ctx, name, int64(size)); err != nil {
		return fmt.Errorf("grow: %w", err)
	}
	h.seen["grow"]++
	return nil
}

func (h *handlesHarness) step() error {
	switch x := h.pick(100); {
	case x < 8:
		if len(h.live()) < 6 {
			return h.connect()
		}
	case x < 25:
		return h.open()
	case x < 70:
		return h.grant()
	case x < 80:
		return h.closeHandle()
	case x < 85:
		return h.deadWrite()
	case x < 90:
		h.disconnect()
	case x < 92:
		return h.grow()
	}
	return nil
}

// check verifies the invariants under the cache's lock, with the sessions
// as they are.
func (h *handlesHarness) check() error {
	h.mu.Lock()
	if h.revoked > 0 {
		h.seen["revoked"] = h.revoked
	}
	h.mu.Unlock()
	tg := h.tg
	tg.mu.Lock()
	sessions := make([]*session, 0, len(tg.sessions))
	for s := range tg.sessions {
		sessions = append(sessions, s)
	}
	tg.mu.Unlock()
	// The handles of each session, as its own map has them (s.mu), then
	// the table (c.mu): s.mu is taken before c.mu, as the target does.
	type hs struct {
		handles map[uint32]*openVol
		fenced  bool
		ending  bool
		host    string
	}
	state := map[*session]hs{}
	for _, s := range sessions {
		s.mu.Lock()
		state[s] = hs{handles: maps.Clone(s.handles), fenced: s.fenced, ending: s.ctx.Err() != nil || s.link.Err() != nil, host: s.host}
		s.mu.Unlock()
	}
	c := tg.cache
	c.mu.Lock()
	defer c.mu.Unlock()
	// Sessions that changed meanwhile (a step's effects still landing:
	// an eviction, a session ending) are skipped.
	for _, s := range sessions {
		s.mu.Lock()
		st := state[s]
		changed := len(s.handles) != len(st.handles) || s.fenced != st.fenced
		s.mu.Unlock()
		if changed {
			delete(state, s)
		}
	}
	if err := c.tbl.check(); err != nil {
		return err
	}
	writers := map[string]bool{}
	for _, ch := range c.tbl.chunks {
		for _, x := range ch.holders {
			st, ok := state[x.s]
			if !ok || st.ending {
				continue // ended or ending: its link is down
			}
			if st.fenced {
				return fmt.Errorf("session %d is fenced and holds a grant of chunk %d of %s", x.s.id, ch.key.idx, ch.key.vol.name)
			}
			ov := st.handles[x.handle]
			if ov == nil {
				return fmt.Errorf("session %d holds a grant of chunk %d of %s for handle %d, which it does not have open", x.s.id, ch.key.idx, ch.key.vol.name, x.handle)
			}
			if ov.writable != x.writable || (x.key.Access()&transport.AccessRemoteWrite != 0) != ov.writable {
				return fmt.Errorf("session %d handle %d (writable %v) holds a key with access %v", x.s.id, x.handle, ov.writable, x.key.Access())
			}
			if ov.v != ch.key.vol {
				return fmt.Errorf("session %d handle %d of %s holds a grant of %s", x.s.id, x.handle, ov.v.name, ch.key.vol.name)
			}
			if x.writable && !ch.key.vol.cfg.Shared {
				id := st.host
				if id == "" {
					id = fmt.Sprintf("anonymous session %d", x.s.id)
				}
				writers[id] = true
			}
		}
	}
	if len(writers) > 1 {
		ids := make([]string, 0, len(writers))
		for id := range writers {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		return fmt.Errorf("the exclusive export has writable grants of %v", ids)
	}
	return nil
}
