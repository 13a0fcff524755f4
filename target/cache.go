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

type chunkState uint8

const (
	chunkLoading chunkState = iota
	chunkReady
	chunkEvicting
)

type chunkKey struct {
	vol *volume
	idx uint64
}

// holder is one session's grant of a chunk: a key to the chunk's memory
// that works only through that session's connection.
type holder struct {
	handle uint32
	key    grantKey
}

// chunk is one cached, registered chunk of a volume.
type chunk struct {
	key    chunkKey
	off    uint64 // start in the volume
	slot   int
	buf    []byte // the slot's memory, the chunk's length
	gen    uint64
	state  chunkState
	loaded chan struct{} // closed when loading ends
	pins   int           // grants being set up; a pinned chunk is not evicted
	leaked bool          // a grant's deregistration failed: the slot is never reused
	elem   *list.Element // place in the LRU list while ready

	holders map[*session]holder // guarded by cache.mu

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
// volumes. Memory is one mapping of slots*chunkSize bytes.
type cache struct {
	chunkSize int
	slots     int
	mem       *transport.Memory
	log       *zap.Logger
	m         *Metrics
	revokeTTL time.Duration
	// patience is how long a grant waiting for a free slot waits on one
	// eviction before it starts another: a holder slow to answer a revoke
	// does not stall the others.
	patience time.Duration
	// sessions counts the sessions that hold grants or may ask for them,
	// for the fair share.
	sessions atomic.Int64
	progress *atomic.Uint64 // the target's drain progress: bumped per write-back
	maxWrite uint64         // the most bytes of a vectored write-back (maxWriteBytes)

	ctx    context.Context // the evictions' lifetime: ends when the target closes
	cancel context.CancelFunc
	wg     sync.WaitGroup // evictions

	mu     sync.Mutex
	cond   *sync.Cond
	free   []int
	chunks map[chunkKey]*chunk
	lru    list.List // ready chunks, most recently granted first
	gen    uint64
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
		patience: min(revokeTTL/20, 250*time.Millisecond), chunks: make(map[chunkKey]*chunk)}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.cond = sync.NewCond(&c.mu)
	for i := slots - 1; i >= 0; i-- {
		c.free = append(c.free, i)
	}
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

// get returns chunk idx of v, loaded and pinned, for session s (which may
// be nil), and s's grant of it if it holds one. The caller unpins it. When
// the cache is full it evicts: a chunk of s's own if s holds more than its
// fair share, else the least recently granted chunk, preferring chunks
// whose holders answer revokes; if that eviction has not freed a slot after
// c.patience it starts another, so a holder slow to answer does not stall
// the rest.
func (c *cache) get(ctx context.Context, s *session, v *volume, idx uint64) (*chunk, holder, bool, error) {
	key := chunkKey{v, idx}
	c.mu.Lock()
	defer c.mu.Unlock()
	var ev *eviction // the eviction this call started last
	var started time.Time
	for {
		if err := ctx.Err(); err != nil {
			return nil, holder{}, false, err
		}
		if ch := c.chunks[key]; ch != nil {
			switch ch.state {
			case chunkReady:
				if c.stale(ch) {
					// The volume grew past this short last chunk: it
					// goes, and is loaded again with its new length.
					c.refitStale(ch)
					if err := c.wait(ctx, 0); err != nil {
						return nil, holder{}, false, err
					}
					continue
				}
				ch.pins++
				c.lru.MoveToFront(ch.elem)
				hd, held := ch.holders[s]
				return ch, hd, held, nil
			case chunkLoading:
				c.waitLoaded(ctx, ch)
			case chunkEvicting:
				if err := c.wait(ctx, 0); err != nil {
					return nil, holder{}, false, err
				}
			}
			continue
		}
		if len(c.free) == 0 {
			if ev != nil && ev.finished && ev.err != nil {
				return nil, holder{}, false, ev.err
			}
			if ev == nil || ev.finished || time.Since(started) >= c.patience {
				if victim := c.victim(s); victim != nil {
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
				return nil, holder{}, false, err
			}
			continue
		}
		slot := c.free[len(c.free)-1]
		c.free = c.free[:len(c.free)-1]
		n := c.chunkLen(v, idx)
		words := (c.chunkSize/dirtyBlock + 63) / 64
		// A window over the slot may reach all of it (see grantkey.go):
		// the tail past a short last chunk must not hold another
		// chunk's data.
		clear(c.slotBytes(slot)[n:])
		ch := &chunk{key: key, off: idx * uint64(c.chunkSize), slot: slot, buf: c.slotBytes(slot)[:n],
			state: chunkLoading, loaded: make(chan struct{}), pins: 1, holders: make(map[*session]holder),
			dirty: make([]uint64, words), holes: make([]uint64, words)}
		c.chunks[key] = ch
		c.mu.Unlock()
		err := c.load(v, ch)
		c.mu.Lock()
		close(ch.loaded)
		if err != nil {
			delete(c.chunks, key)
			c.free = append(c.free, slot)
			c.cond.Broadcast()
			return nil, holder{}, false, err
		}
		c.gen++
		ch.gen = c.gen
		ch.state = chunkReady
		ch.elem = c.lru.PushFront(ch)
		c.m.cacheUsed.Add(float64(c.chunkSize))
		v.cached.Add(1)
		if c.stale(ch) {
			// The volume grew while it loaded: loaded again (above).
			ch.pins--
			c.cond.Broadcast()
			continue
		}
		return ch, holder{}, false, nil
	}
}

// share is how many chunks one session may hold while others wait for the
// cache: an equal part of it, a quarter of that while the session's host
// is penalized for not answering revokes.
func (c *cache) share(s *session) int {
	n := max(c.sessions.Load(), 1)
	sh := max(c.slots/int(n), 1)
	if s.penalized() {
		sh = max(sh/4, 1)
	}
	return sh
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

// victim picks a chunk to evict for s (nil: any) and marks it evicting,
// or returns nil if every chunk is loading, pinned or being evicted. c.mu
// is held. A session over its fair share gives up one of its own chunks;
// otherwise the least recently granted chunk goes, preferring one whose
// holders have no revoke outstanding for longer than c.patience.
func (c *cache) victim(s *session) *chunk {
	take := func(ch *chunk) *chunk {
		ch.state = chunkEvicting
		c.lru.Remove(ch.elem)
		ch.elem = nil
		return ch
	}
	if s != nil && int(s.held.Load()) >= c.share(s) {
		for e := c.lru.Back(); e != nil; e = e.Prev() {
			ch := e.Value.(*chunk)
			if _, mine := ch.holders[s]; mine && ch.pins == 0 {
				return take(ch)
			}
		}
	}
	var slow *chunk
	for e := c.lru.Back(); e != nil; e = e.Prev() {
		ch := e.Value.(*chunk)
		if ch.pins != 0 {
			continue
		}
		if c.slowHolders(ch) {
			if slow == nil {
				slow = ch
			}
			continue
		}
		return take(ch)
	}
	if slow != nil {
		return take(slow)
	}
	return nil
}

// slowHolders reports whether a holder of ch is slow to answer a revoke.
// c.mu is held.
func (c *cache) slowHolders(ch *chunk) bool {
	for s := range ch.holders {
		if s.slowRevokes.Load() > 0 {
			return true
		}
	}
	return false
}

func (c *cache) unpin(ch *chunk) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch.pins--
	if ch.pins == 0 {
		c.cond.Broadcast()
	}
}

// evict takes ch (marked evicting) out of the cache: every holder is asked
// to give its grant back and its registration is removed, dirty blocks are
// written back, then the slot is freed. If write-back fails the chunk stays
// cached (ready, without grants) and the error is returned. It runs in the
// cache's own context, not that of the session whose grant needed the
// slot: that session may go away without harm to the holders.
func (c *cache) evict(ch *chunk) error {
	c.mu.Lock()
	type hs struct {
		s *session
		h holder
	}
	var list []hs
	for s, h := range ch.holders {
		list = append(list, hs{s, h})
	}
	c.mu.Unlock()

	var wg sync.WaitGroup
	for _, x := range list {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ttl := c.revokeTTL
			c.mu.Lock()
			if int(x.s.held.Load()) > c.share(x.s) {
				// A session holding more than its share, and so
				// keeping others waiting, gets less time.
				ttl = max(c.revokeTTL/10, c.patience)
			}
			c.mu.Unlock()
			x.s.revoke(c.ctx, ch, x.h, ttl, c.patience)
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
		ch.state = chunkReady
		ch.elem = c.lru.PushBack(ch)
		c.cond.Broadcast()
		return err
	}
	delete(c.chunks, ch.key)
	if !ch.leaked {
		c.free = append(c.free, ch.slot)
		c.m.cacheUsed.Sub(float64(c.chunkSize))
		ch.key.vol.cached.Add(-1)
	}
	ch.key.vol.m.evictions.Inc()
	c.cond.Broadcast()
	return nil
}

// dropHolder forgets s's grant of ch (after a revoke or when s ends) and
// deregisters its region. If deregistration fails the initiator may still
// reach the memory: the chunk's slot is then never reused (leaked), and the
// error is logged and counted.
func (c *cache) dropHolder(ch *chunk, s *session) {
	c.mu.Lock()
	h, ok := ch.holders[s]
	delete(ch.holders, s)
	c.mu.Unlock()
	if !ok {
		return
	}
	s.held.Add(-1)
	if err := h.key.release(); err != nil {
		c.m.errDeregister.Inc()
		c.log.Error("deregister a chunk's grant failed: its cache slot is taken out of use",
			zap.Uint64("session", s.id), zap.Uint64("offset", ch.off), zap.Error(err))
		c.mu.Lock()
		ch.leaked = true
		c.mu.Unlock()
	}
}

// dropHolderLost drops s's grant of ch when s went away without telling
// what it wrote (its connection was lost, it was fenced, or it did not
// answer a revoke): if the grant was writable, every block of the chunk
// counts as dirty, since the cache holds whatever its RDMA WRITEs placed and
// their Done may be lost with the connection, although the initiator
// acknowledged those writes. Writing back blocks nobody changed is harmless:
// the cache holds what the file holds.
func (c *cache) dropHolderLost(ch *chunk, s *session) {
	c.mu.Lock()
	h, ok := ch.holders[s]
	c.mu.Unlock()
	if ok && h.key.Access()&transport.AccessRemoteWrite != 0 {
		ch.markDirty(0, uint64(len(ch.buf)))
		ch.key.vol.markDirty(ch)
	}
	c.dropHolder(ch, s)
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
func (c *cache) writebackLoop(ctx context.Context, v *volume, delay time.Duration) {
	t := time.NewTimer(delay)
	t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.wbSignal:
		}
		t.Reset(delay)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
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
		ch := c.chunks[chunkKey{v, idx}]
		c.mu.Unlock()
		if ch == nil {
			continue
		}
		ch.wbMu.Lock()
		if !ch.dead {
			from := max(off, ch.off) - ch.off
			to := min(off+n, ch.off+uint64(len(ch.buf))) - ch.off
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
	for _, ch := range c.chunks {
		for s, h := range ch.holders {
			h.key.release()
			delete(ch.holders, s)
		}
	}
	c.mu.Unlock()
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
