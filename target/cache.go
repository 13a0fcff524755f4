package target

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
)

// dirtyBlock is the granularity of dirty tracking: a write marks the
// dirtyBlock-sized blocks it touches, and write-back writes whole blocks from
// the cached copy (which holds the whole chunk, so this is always correct),
// a few clean ones too when that saves a write (see writeback.go).
const dirtyBlock = 4096

type chunkKey struct {
	vol *volume
	idx uint64
}

// chunk is one cached, registered chunk of a volume.
type chunk struct {
	// The table's part (chunktable.go), guarded by cache.mu and changed
	// only by the chunkTable.
	key     chunkKey
	off     uint64 // start in the volume (set with buf)
	slot    int
	length  uint64 // the chunk's length when it was loaded
	gen     uint64
	state   chunkState
	pins    int           // grants being set up; a pinned chunk is not evicted
	leaked  bool          // a grant's key could not be released: the slot is never reused
	elem    *list.Element // place in the LRU list while ready
	holders []*holder     // its grants

	buf    []byte        // the slot's memory, the chunk's length
	loaded chan struct{} // closed when loading ends

	wbMu    sync.Mutex // serializes write-back, zeroing and the end of eviction
	dead    bool       // evicted: the slot may hold another chunk (guarded by wbMu)
	dirtyMu sync.Mutex
	dirty   []uint64 // bitmap of dirty blocks
	// holes is the bitmap of blocks trimmed and not written since (their
	// range of the file may be deallocated): write-back does not write
	// them to merge the dirty runs around them (see mergeRuns).
	holes []uint64
	// queued: on its volume's dirty list (see volume.markDirty).
	queued atomic.Bool
}

// markDirty marks the blocks of [from, to) (offsets within the chunk).
func (ch *chunk) markDirty(from, to uint64) {
	b, e := from/dirtyBlock, (to+dirtyBlock-1)/dirtyBlock
	ch.dirtyMu.Lock()
	setBits(ch.dirty, b, e)
	clearBits(ch.holes, b, e)
	ch.dirtyMu.Unlock()
}

// zeroed clears the dirty blocks wholly inside [from, to), which were just
// zeroed in the cache and are being zeroed in the file, and records them as
// holes if the file's range may be deallocated. The last block of a chunk
// whose length is not a multiple of dirtyBlock is wholly inside when to is
// the chunk's end.
func (ch *chunk) zeroed(from, to uint64, hole bool) {
	b, e := (from+dirtyBlock-1)/dirtyBlock, to/dirtyBlock
	if to == uint64(len(ch.buf)) {
		e = (to + dirtyBlock - 1) / dirtyBlock
	}
	if b >= e {
		return
	}
	ch.dirtyMu.Lock()
	clearBits(ch.dirty, b, e)
	if hole {
		setBits(ch.holes, b, e)
	}
	ch.dirtyMu.Unlock()
}

// cache is the target's bounded cache of registered chunks, shared by all
// volumes. Memory is one mapping of slots*chunkSize bytes. Its decisions
// (which chunk is where, who holds grants of it, what to evict) are the
// chunkTable's; the cache holds mu across each call to it and does the IO
// outside: loads, registrations, revokes, write-back, release of keys.
type cache struct {
	chunkSize int
	slots     int
	mem       *transport.Memory
	log       *zap.Logger
	m         *Metrics
	// revokeTTL is how long every holder has to answer a revoke before its
	// session is closed: the same for all, whatever share they hold.
	revokeTTL time.Duration
	// patience is how long a grant waiting for a free slot waits on one
	// eviction before it starts another, and how long a holder may take
	// to answer a revoke before evictions look elsewhere first (slow
	// holders): a holder slow to answer does not stall the others.
	patience time.Duration
	progress *atomic.Uint64 // the target's drain progress: bumped per write-back
	maxWrite uint64         // the most bytes of a vectored write-back (maxWriteBytes)

	ctx    context.Context // the evictions' lifetime: ends when the target closes
	cancel context.CancelFunc
	wg     sync.WaitGroup // evictions

	mu   sync.Mutex
	cond *sync.Cond
	tbl  *chunkTable
}

// eviction is the outcome of one eviction, guarded by cache.mu.
type eviction struct {
	finished bool
	err      error
}

func newCache(size int64, chunkSize int, log *zap.Logger, m *Metrics, revokeTTL time.Duration, progress *atomic.Uint64) (*cache, error) {
	slots := int(size / int64(chunkSize))
	if slots < 4 {
		return nil, fmt.Errorf("cache of %d bytes holds %d chunks of %d bytes: need at least 4", size, slots, chunkSize)
	}
	mem, err := transport.AllocMemory(slots*chunkSize, true) // huge pages where there are
	if err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	c := &cache{chunkSize: chunkSize, slots: slots, progress: progress, maxWrite: maxWriteBytes, mem: mem, log: log, m: m, revokeTTL: revokeTTL,
		patience: min(revokeTTL/20, 250*time.Millisecond)}
	c.tbl = newChunkTable(slots, c.patience, time.Now)
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.cond = sync.NewCond(&c.mu)
	m.cacheBudget.Set(float64(slots * chunkSize))
	return c, nil
}

func (c *cache) slotBytes(slot int) []byte {
	return c.mem.Bytes()[slot*c.chunkSize : (slot+1)*c.chunkSize]
}

// wait waits on c.cond, waking up when ctx ends or, if d > 0, after d.
// c.mu is held.
func (c *cache) wait(ctx context.Context, d time.Duration) error {
	wake := func() {
		c.mu.Lock()
		c.cond.Broadcast()
		c.mu.Unlock()
	}
	stop := context.AfterFunc(ctx, wake)
	if d > 0 {
		t := time.AfterFunc(d, wake)
		defer t.Stop()
	}
	c.cond.Wait()
	stop()
	return ctx.Err()
}

// shareOf is the share group of a session whose host is host: the host's
// sessions (its queues among them) share one; an anonymous session has its
// own.
func shareOf(s *session, host string) shareKey {
	if host == "" {
		return shareKey{anon: s.id}
	}
	return shareKey{host: host}
}

// openHandle tells the table that s opened handle (see chunkTable.openHandle).
func (c *cache) openHandle(s *session, handle uint32, writable bool, host string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tbl.openHandle(s, handle, writable, shareOf(s, host), time.Unix(0, s.penaltyEnd.Load()))
}

// penalize cuts the share of s's group until until (see chunkTable.share).
func (c *cache) penalize(s *session, until time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.tbl.penalize(s, until)
}

// get returns chunk idx of v, loaded and pinned, for handle of session s
// (s may be nil), and the handle's grant of it if it holds one. The caller
// unpins it. When the cache is full it evicts the chunk the table picks
// (chunkTable.victim); if that eviction has not freed a slot after
// c.patience it starts another, so a holder slow to answer does not stall
// the rest.
func (c *cache) get(ctx context.Context, s *session, handle uint32, v *volume, idx uint64) (*chunk, *holder, error) {
	// The common case, a cached chunk, without the slow path's defers.
	c.mu.Lock()
	st := c.tbl.acquire(chunkKey{v, idx}, c.chunkLen(v, idx), s, handle)
	if st.kind == acquireReady {
		c.mu.Unlock()
		return st.ch, st.holder, nil
	}
	defer c.mu.Unlock()
	return c.getSlow(ctx, s, handle, v, idx, st)
}

// getSlow is get once the chunk was not ready: st is the table's first
// answer. c.mu is held.
func (c *cache) getSlow(ctx context.Context, s *session, handle uint32, v *volume, idx uint64, st acquireStep) (*chunk, *holder, error) {
	key := chunkKey{v, idx}
	var ev *eviction // the eviction this call started last
	var started time.Time
	waiting := false // counted in the table's waiting grants
	defer func() {
		if waiting {
			c.tbl.wait(s, false)
		}
	}()
	for first := true; ; first = false {
		if !first {
			// (Not before the first step: an acquireLoad the caller got
			// must be loaded here, whatever ctx says. Returning then left
			// the chunk loading with no loader, and every later grant of
			// it waited forever.)
			if err := ctx.Err(); err != nil {
				return nil, nil, err
			}
			st = c.tbl.acquire(key, c.chunkLen(v, idx), s, handle)
		}
		switch st.kind {
		case acquireReady:
			return st.ch, st.holder, nil
		case acquireWaitLoad:
			c.waitLoaded(ctx, st.ch)
			continue
		case acquireRefit:
			// The volume grew past this short last chunk: it goes, and is
			// loaded again with its new length.
			c.startEvict(st.ch, "evicting a chunk the volume grew past failed")
			fallthrough
		case acquireWait:
			if err := c.wait(ctx, 0); err != nil {
				return nil, nil, err
			}
			continue
		case acquireFull:
			if err := ctx.Err(); err != nil {
				return nil, nil, err // no eviction for a grant nobody waits for
			}
			if !waiting && s != nil {
				waiting = true
				c.tbl.wait(s, true)
			}
			if ev != nil && ev.finished && ev.err != nil {
				return nil, nil, ev.err
			}
			if ev == nil || ev.finished || time.Since(started) >= c.patience {
				if victim := c.tbl.victim(s); victim != nil {
					ev, started = &eviction{}, time.Now()
					c.wg.Add(1)
					go func(ev *eviction) {
						defer c.wg.Done()
						err := c.evict(victim)
						c.mu.Lock()
						ev.finished, ev.err = true, err
						c.cond.Broadcast()
						c.mu.Unlock()
					}(ev)
				}
			}
			if err := c.wait(ctx, c.patience); err != nil {
				return nil, nil, err
			}
			continue
		}
		// acquireLoad: a new chunk in a free slot, pinned, which only this
		// call may load: it does, even for a context that ended (the
		// chunk is cached for the next grant, or its slot freed again).
		ch := st.ch
		n := ch.length
		words := (c.chunkSize/dirtyBlock + 63) / 64
		// A window over the slot may reach all of it (see grantkey.go):
		// the tail past a short last chunk must not hold another
		// chunk's data.
		clear(c.slotBytes(ch.slot)[n:])
		ch.off, ch.buf = idx*uint64(c.chunkSize), c.slotBytes(ch.slot)[:n]
		ch.loaded = make(chan struct{})
		ch.dirty, ch.holes = make([]uint64, words), make([]uint64, words)
		c.mu.Unlock()
		err := c.load(v, ch)
		c.mu.Lock()
		close(ch.loaded)
		if err != nil {
			c.tbl.loadFailed(ch)
			c.cond.Broadcast()
			return nil, nil, err
		}
		c.tbl.loaded(ch)
		c.m.cacheUsed.Add(float64(c.chunkSize))
		v.cached.Add(1)
		if c.chunkLen(v, idx) != n {
			// The volume grew while it loaded: loaded again (above).
			c.tbl.unpin(ch)
			c.cond.Broadcast()
			continue
		}
		return ch, nil, nil
	}
}

// startEvict evicts ch, which the table marked evicting, on a goroutine of
// its own, logging a failure with what. c.mu is held.
func (c *cache) startEvict(ch *chunk, what string) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		if err := c.evict(ch); err != nil {
			c.log.Warn(what, zap.String("export", ch.key.vol.name), zap.Uint64("offset", ch.off), zap.Error(err))
		}
	}()
}

func (c *cache) load(v *volume, ch *chunk) error {
	start := time.Now()
	v.ioMu.RLock()
	defer v.ioMu.RUnlock()
	if _, err := v.f.ReadAt(ch.buf, int64(ch.off)); err != nil {
		c.m.errLoad.Inc()
		return fmt.Errorf("load chunk at %d of %q: %w", ch.off, v.name, err)
	}
	v.m.loads.Inc()
	v.m.loadBytes.Add(float64(len(ch.buf)))
	v.m.loadSeconds.Observe(time.Since(start).Seconds())
	return nil
}

func (c *cache) unpin(ch *chunk) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.tbl.unpin(ch) {
		c.cond.Broadcast()
	}
}

// evict takes ch (marked evicting) out of the cache: every holder is asked
// to give its grant back, and its key released once it answered (or did
// not in time), dirty blocks are written back, then the slot is freed. If
// write-back fails the chunk stays cached (ready, without grants) and the
// error is returned. It runs in the cache's own context, not that of the
// session whose grant needed the slot: that session may go away without
// harm to the holders. Every holder gets the whole revoke timeout.
func (c *cache) evict(ch *chunk) error {
	c.mu.Lock()
	holders := c.tbl.revoking(ch)
	c.mu.Unlock()

	var wg sync.WaitGroup
	for _, h := range holders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.mu.Lock()
			live := c.tbl.holds(h)
			c.mu.Unlock()
			if live { // (else its handle closed, or its session ended, meanwhile)
				h.s.revoke(c.ctx, h, c.revokeTTL)
			}
		}()
	}
	wg.Wait()

	ch.wbMu.Lock()
	err := c.writebackLocked(ch)
	if err == nil {
		ch.dead = true
	}
	ch.wbMu.Unlock()

	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		c.tbl.evictFailed(ch)
		c.cond.Broadcast()
		return err
	}
	if c.tbl.evicted(ch) {
		c.m.cacheUsed.Sub(float64(c.chunkSize))
		ch.key.vol.cached.Add(-1)
	}
	ch.key.vol.m.evictions.Inc()
	c.cond.Broadcast()
	return nil
}

// dropHolder takes h out of the table, if it is still there, and releases
// its key (see release).
func (c *cache) dropHolder(h *holder, lost bool) {
	c.mu.Lock()
	ok := c.tbl.dropHolder(h)
	c.mu.Unlock()
	if ok {
		c.release(h, lost)
	}
}

// release releases the key of h, which the table gave up. With lost (h's
// handle or session went away without telling what it wrote: its
// connection was lost, it was fenced, it closed the handle, or it did not
// answer a revoke) a writable grant's chunk counts as dirty whole, since the
// cache holds whatever its RDMA WRITEs placed and their Done may be lost
// with the connection, although the initiator acknowledged those writes.
// Writing back blocks nobody changed is harmless: the cache holds what the
// file holds. If the release fails the initiator may still reach the
// memory: the chunk's slot is then never reused (leaked), and the error is
// logged and counted.
func (c *cache) release(h *holder, lost bool) {
	ch := h.ch
	if lost && h.writable {
		ch.markDirty(0, uint64(len(ch.buf)))
		ch.key.vol.markDirty(ch)
	}
	c.releaseKey(ch, h.s, h.key, "deregister a chunk's grant failed: its cache slot is taken out of use")
}

// releaseKey releases key, a grant of ch on s's connection; if that fails
// the slot of ch is leaked and what is logged.
func (c *cache) releaseKey(ch *chunk, s *session, key grantKey, what string) {
	if err := key.release(); err != nil {
		c.m.errDeregister.Inc()
		c.log.Error(what, zap.Uint64("session", s.id), zap.Uint64("offset", ch.off), zap.Error(err))
		c.mu.Lock()
		c.tbl.leak(ch)
		c.mu.Unlock()
	}
}

// releaseWorkers bounds how many grants one releaseAll releases at once.
// Invalidating a memory window is a work request on its session's send
// queue, waited for until it completes, and the rdma provider keeps room
// for 8 of them per connection: one at a time, a session's thousand grants
// (a Close, a fence) cost a thousand round trips through the completion
// path (2 s for 904 on Soft-RoCE in an emulated guest, 0.8 s 8 at a time;
// several times that on a busy one).
const releaseWorkers = 8

// releaseAll releases the grants the table gave up, lost as release says,
// up to releaseWorkers at once, and returns when all are released.
func (c *cache) releaseAll(hs []*holder, lost bool) {
	if len(hs) <= 1 {
		for _, h := range hs {
			c.release(h, lost)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(releaseWorkers, len(hs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(hs) {
					return
				}
				c.release(hs[i], lost)
			}
		}()
	}
	wg.Wait()
}

// flush makes every range marked dirty before the call durable: the chunks
// still on the dirty list and those a background pass took and is writing
// (writebackVolume waits for that pass), then fdatasync.
func (c *cache) flush(v *volume) error {
	v.flushMu.Lock()
	defer v.flushMu.Unlock()
	start := time.Now()
	c.writebackVolume(v)
	if err := v.f.Sync(); err != nil {
		v.setErr(fmt.Errorf("fdatasync %q: %w", v.name, err))
	}
	v.m.flushSeconds.Observe(time.Since(start).Seconds())
	return v.takeErr()
}

// writebackLoop writes back dirty chunks of v shortly after they are
// reported, coalescing what arrives meanwhile, until ctx ends.
func (c *cache) writebackLoop(ctx context.Context, v *volume) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.wbTimer.C:
		}
		if err := c.writebackVolume(v); err != nil {
			c.log.Warn("write-back failed; the next flush reports it", zap.String("export", v.name), zap.Error(err))
		}
	}
}

// zeroRange zeroes [off, off+n) of v in every cached chunk and in the file.
func (c *cache) zeroRange(v *volume, off, n uint64, noHole bool) error {
	v.ioMu.Lock() // no chunk of v loads meanwhile
	defer v.ioMu.Unlock()
	cs := uint64(c.chunkSize)
	for idx := off / cs; idx*cs < off+n; idx++ {
		c.mu.Lock()
		ch := c.tbl.lookup(chunkKey{v, idx})
		c.mu.Unlock()
		if ch == nil {
			continue
		}
		ch.wbMu.Lock()
		// A short last chunk the volume grew past (being refit) may end
		// before the range: only the file has what lies beyond it.
		if from, to := max(off, ch.off)-ch.off, min(off+n, ch.off+uint64(len(ch.buf)))-ch.off; !ch.dead && from < to {
			clear(ch.buf[from:to])
			ch.zeroed(from, to, !noHole)
		}
		ch.wbMu.Unlock()
	}
	if err := v.zeroFile(off, n, noHole); err != nil {
		return fmt.Errorf("zero %d bytes at %d of %q: %w", n, off, v.name, err)
	}
	return nil
}

// close writes everything back and frees the memory. No session may be left.
func (c *cache) close(vols []*volume) error {
	c.cancel()
	c.wg.Wait()
	var errs []error
	for _, v := range vols {
		if err := c.flush(v); err != nil {
			errs = append(errs, err)
		}
	}
	c.mu.Lock()
	left := c.tbl.dropAll()
	c.mu.Unlock()
	for _, h := range left {
		h.key.release() // (the memory is freed next)
	}
	if err := c.mem.Free(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// waitLoaded waits, with c.mu released, until ch has loaded or ctx ends;
// the caller looks at ch again (and at ctx) with c.mu held.
func (c *cache) waitLoaded(ctx context.Context, ch *chunk) {
	loaded := ch.loaded
	c.mu.Unlock()
	select {
	case <-loaded:
	case <-ctx.Done():
	}
	c.mu.Lock()
}
