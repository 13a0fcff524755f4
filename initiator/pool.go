package initiator

import (
	"context"
	"fmt"
	"sync"
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
type bufPool struct {
	mem []byte

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

// newBufPool carves mem into the size classes: the big class gets three
// quarters, and at least MaxRequest when mem has it; the rest goes a
// quarter to 4 KiB slots and three quarters to 64 KiB slots.
func newBufPool(mem []byte) *bufPool {
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

// alloc takes the slots for n bytes, waiting while the pool is short.
func (p *bufPool) alloc(ctx context.Context, n int) (*ioBuf, error) {
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
	switch b.class {
	case smallSlot:
		p.small = append(p.small, b.offs...)
	case midSlot:
		p.mid = append(p.mid, b.offs...)
	default:
		p.big = append(p.big, b.offs...)
	}
	b.offs = b.offs[:0]
	clear(b.Segs)
	b.Segs = b.Segs[:0]
	clear(b.grants)
	b.grants = b.grants[:0]
	b.ops = b.ops[:0]
	b.sess, b.comp, b.ctx = nil, nil, nil
	p.freeBuf = append(p.freeBuf, b)
	p.cond.Broadcast()
	p.mu.Unlock()
}
