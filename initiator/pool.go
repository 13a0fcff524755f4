package initiator

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
)

// Size classes of the IO buffer pool: a request takes one slot of the
// smallest class that holds it (a 4 KiB read does not hold 256 KiB of
// registered memory), or as many big slots as its length needs, all at
// once (so two large requests can never each hold half of what they
// need). A class that has no free slot lends from the next larger one.
const (
	smallSlot = 4 << 10
	midSlot   = 64 << 10
	bigSlot   = 256 << 10
)

// bufPool lends memory for IO, registered on each session's connection.
//
// Every queue shares it: a queue takes and gives back its buffers of the
// two small classes through a cache of its own (allocQ, releaseQ), so that
// queues do not meet on the pool's lock for each request. A cache holds
// at most cacheLimit buffers of each class, and only while nobody waits
// for a slot: whoever is about to wait first takes every cached buffer
// back into the pool (reclaim), so that memory stashed by one queue never
// starves another.
type bufPool struct {
	mem []byte

	caches     []bufCache
	cacheLimit int          // buffers of each class one cache holds at most
	waiting    atomic.Int32 // allocs waiting for a slot: caches take nothing in

	mu      sync.Mutex
	cond    *sync.Cond
	small   []int // offsets in mem of free slots, by class
	mid     []int
	big     []int
	bigCap  int      // bytes of the big class
	freeBuf []*ioBuf // request states for reuse, so that no IO allocates
}

// ioBuf is a blockdev.Buffer with the state of one request, pooled.
type ioBuf struct {
	blockdev.Buffer
	offs   []int // offset in the pool's memory of each segment
	class  int   // slot size of the segments
	ops    []link.Op
	grants []*grant
	idxs   []uint64
	done   protocol.Done
	ranges [1]protocol.Range
	q      int // the queue it goes to (Volume.Queue), or byChunk

	// The request in flight on the run-to-completion path (see submit).
	v          *Volume
	sess       *session
	comp       blockdev.Completion
	ctx        context.Context
	off        uint64
	write, fua bool
	start      time.Time
}

// bufCache is one queue's free buffers of the small and middle classes,
// each with its slot: see bufPool.
type bufCache struct {
	mu    sync.Mutex
	small []*ioBuf
	mid   []*ioBuf
	_     [64]byte // (a cache line of its own: queues run on different cores)
}

// newBufPool carves mem into the size classes: the big class gets three
// quarters, and at least MaxRequest when mem has it; the rest goes a
// quarter to 4 KiB slots and three quarters to 64 KiB slots. It has a
// cache for each of queues queues; each may hold up to an eighth of a
// class's slots over all the caches, 64 at most.
func newBufPool(mem []byte, queues int) *bufPool {
	p := &bufPool{mem: mem}
	p.cond = sync.NewCond(&p.mu)
	total := len(mem) / bigSlot * bigSlot
	big := max(total*3/4/bigSlot*bigSlot, min(MaxRequest, total))
	rest := total - big
	small := rest / 4 / smallSlot * smallSlot
	mid := (rest - small) / midSlot * midSlot
	p.bigCap = big
	for off := big - bigSlot; off >= 0; off -= bigSlot {
		p.big = append(p.big, off)
	}
	for off := big + small - smallSlot; off >= big; off -= smallSlot {
		p.small = append(p.small, off)
	}
	for off := big + small + mid - midSlot; off >= big+small; off -= midSlot {
		p.mid = append(p.mid, off)
	}
	queues = max(queues, 1)
	p.caches = make([]bufCache, queues)
	p.cacheLimit = min(64, min(len(p.small), len(p.mid))/8/queues)
	return p
}

func (p *bufPool) capacity() int { return p.bigCap }

// take pops a slot of class size, or of a larger class when it has none.
// It reports the size of the slot it took, 0 for none. p.mu is held.
func (p *bufPool) take(size int) (int, int) {
	classes := [...]struct {
		size int
		free *[]int
	}{{smallSlot, &p.small}, {midSlot, &p.mid}, {bigSlot, &p.big}}
	for _, c := range classes {
		if c.size < size || len(*c.free) == 0 {
			continue
		}
		f := *c.free
		off := f[len(f)-1]
		*c.free = f[:len(f)-1]
		return off, c.size
	}
	return 0, 0
}

// tryTake takes the slots for n bytes into b if they are free. p.mu is held.
func (p *bufPool) tryTake(b *ioBuf, n int) bool {
	if n <= midSlot {
		off, size := p.take(n)
		if size == 0 {
			return false
		}
		b.offs = append(b.offs, off)
		b.class = size
		b.Segs = append(b.Segs, p.mem[off:off+n])
		return true
	}
	k := (n + bigSlot - 1) / bigSlot
	if len(p.big) < k {
		return false
	}
	b.class = bigSlot
	for i := range k {
		off := p.big[len(p.big)-1-i]
		l := min(bigSlot, n-i*bigSlot)
		b.offs = append(b.offs, off)
		b.Segs = append(b.Segs, p.mem[off:off+l])
	}
	p.big = p.big[:len(p.big)-k]
	return true
}

// unplugger is told before a buffer allocation waits: a plugged
// submitter (blockdev.Plugger) unplugs, since the requests whose end would
// free a buffer may be held back.
type unplugger interface{ Unplug() }

// alloc takes the slots for n bytes, waiting while the pool is short
// (after u.Unplug, if u is not nil).
func (p *bufPool) alloc(ctx context.Context, n int, u unplugger) (*ioBuf, error) {
	if n > p.capacity() {
		return nil, fmt.Errorf("buffer of %d bytes exceeds the pool of %d", n, p.capacity())
	}
	p.mu.Lock()
	var b *ioBuf
	if k := len(p.freeBuf); k > 0 {
		b = p.freeBuf[k-1]
		p.freeBuf = p.freeBuf[:k-1]
	} else {
		b = &ioBuf{}
		b.Priv = b
	}
	if !p.tryTake(b, n) {
		// Before waiting, what the queues' caches hold comes back;
		// while anyone waits they keep nothing (releaseQ).
		p.waiting.Add(1)
		defer p.waiting.Add(-1)
		p.mu.Unlock()
		if u != nil {
			u.Unplug()
		}
		p.reclaim()
		p.mu.Lock()
		stop := context.AfterFunc(ctx, func() {
			p.mu.Lock()
			p.cond.Broadcast()
			p.mu.Unlock()
		})
		defer stop()
		for !p.tryTake(b, n) {
			if err := ctx.Err(); err != nil {
				p.freeBuf = append(p.freeBuf, b)
				p.mu.Unlock()
				return nil, err
			}
			p.cond.Wait()
		}
	}
	p.mu.Unlock()
	return b, nil
}

func (p *bufPool) release(b *ioBuf) {
	p.mu.Lock()
	p.putLocked(b)
	p.cond.Broadcast()
	p.mu.Unlock()
}

// putLocked returns b's slots and b to the pool. p.mu is held.
func (p *bufPool) putLocked(b *ioBuf) {
	switch b.class {
	case smallSlot:
		p.small = append(p.small, b.offs...)
	case midSlot:
		p.mid = append(p.mid, b.offs...)
	default:
		p.big = append(p.big, b.offs...)
	}
	b.offs = b.offs[:0]
	b.reset()
	p.freeBuf = append(p.freeBuf, b)
}

// reset clears the request b carried, keeping its slots.
func (b *ioBuf) reset() {
	clear(b.Segs)
	b.Segs = b.Segs[:0]
	clear(b.grants)
	b.grants = b.grants[:0]
	b.ops = b.ops[:0]
	b.sess, b.comp, b.ctx = nil, nil, nil
}

// stack is the cache's free list for buffers of class.
func (c *bufCache) stack(class int) *[]*ioBuf {
	if class == smallSlot {
		return &c.small
	}
	return &c.mid
}

// allocQ is alloc for queue q: a request of a small class takes a buffer
// of its queue's cache when it has one, without the pool's lock.
func (p *bufPool) allocQ(ctx context.Context, q, n int, u unplugger) (*ioBuf, error) {
	if n > 0 && n <= midSlot {
		class := midSlot
		if n <= smallSlot {
			class = smallSlot
		}
		c := &p.caches[q%len(p.caches)]
		c.mu.Lock()
		st := c.stack(class)
		if k := len(*st); k > 0 {
			b := (*st)[k-1]
			(*st)[k-1] = nil
			*st = (*st)[:k-1]
			c.mu.Unlock()
			b.Segs = append(b.Segs, p.mem[b.offs[0]:b.offs[0]+n])
			return b, nil
		}
		c.mu.Unlock()
	}
	return p.alloc(ctx, n, u)
}

// releaseQ is release for queue q: a buffer of a small class goes to
// its queue's cache while it has room and nobody waits for a slot.
func (p *bufPool) releaseQ(q int, b *ioBuf) {
	if len(b.offs) == 1 && (b.class == smallSlot || b.class == midSlot) {
		c := &p.caches[q%len(p.caches)]
		c.mu.Lock()
		// (Read under c.mu: reclaim, which follows the waiter's count,
		// takes c.mu after it, and so finds b here if it went in.)
		if st := c.stack(b.class); len(*st) < p.cacheLimit && p.waiting.Load() == 0 {
			b.reset()
			*st = append(*st, b)
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
	}
	p.release(b)
}

// reclaim takes back into the pool every buffer the caches hold.
func (p *bufPool) reclaim() {
	for i := range p.caches {
		c := &p.caches[i]
		c.mu.Lock()
		if len(c.small)+len(c.mid) > 0 {
			p.mu.Lock()
			for _, st := range []*[]*ioBuf{&c.small, &c.mid} {
				for j, b := range *st {
					p.putLocked(b)
					(*st)[j] = nil
				}
				*st = (*st)[:0]
			}
			p.cond.Broadcast()
			p.mu.Unlock()
		}
		c.mu.Unlock()
	}
}
