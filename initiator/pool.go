package initiator

import (
	"context"
	"fmt"
	"sync"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
)

// bufPool lends memory for IO (registered on each session's connection): fixed-size slots, of
// which a request takes as many as its length needs, all at once (so two
// large requests can never each hold half of what they need).
type bufPool struct {
	mem      []byte
	slotSize int

	mu   sync.Mutex
	cond *sync.Cond
	free []int

	bufs sync.Pool
}

// ioBuf is an blockdev.Buffer with the state of one request, pooled.
type ioBuf struct {
	blockdev.Buffer
	slots  []int
	ops    []link.Op
	grants []*grant
	idxs   []uint64
	done   protocol.Done
	ranges [1]protocol.Range
}

func newBufPool(mem []byte, slotSize int) *bufPool {
	p := &bufPool{mem: mem, slotSize: slotSize}
	p.cond = sync.NewCond(&p.mu)
	n := len(mem) / slotSize
	for i := n - 1; i >= 0; i-- {
		p.free = append(p.free, i)
	}
	p.bufs.New = func() any { b := &ioBuf{}; b.Priv = b; return b }
	return p
}

func (p *bufPool) capacity() int { return len(p.mem) / p.slotSize * p.slotSize }

// alloc takes the slots for n bytes, waiting while the pool is short.
func (p *bufPool) alloc(ctx context.Context, n int) (*ioBuf, error) {
	k := (n + p.slotSize - 1) / p.slotSize
	if n > p.capacity() {
		return nil, fmt.Errorf("buffer of %d bytes exceeds the pool of %d", n, p.capacity())
	}
	b := p.bufs.Get().(*ioBuf)
	b.slots, b.Segs = b.slots[:0], b.Segs[:0]
	p.mu.Lock()
	if len(p.free) < k {
		stop := context.AfterFunc(ctx, func() {
			p.mu.Lock()
			p.cond.Broadcast()
			p.mu.Unlock()
		})
		defer stop()
	}
	for len(p.free) < k {
		if err := ctx.Err(); err != nil {
			p.mu.Unlock()
			p.bufs.Put(b)
			return nil, err
		}
		p.cond.Wait()
	}
	b.slots = append(b.slots, p.free[len(p.free)-k:]...)
	p.free = p.free[:len(p.free)-k]
	p.mu.Unlock()
	mem := p.mem
	for i, s := range b.slots {
		l := min(p.slotSize, n-i*p.slotSize)
		b.Segs = append(b.Segs, mem[s*p.slotSize:s*p.slotSize+l])
	}
	return b, nil
}

func (p *bufPool) release(b *ioBuf) {
	p.mu.Lock()
	p.free = append(p.free, b.slots...)
	p.cond.Broadcast()
	p.mu.Unlock()
	b.slots = b.slots[:0]
	clear(b.Segs)
	b.Segs = b.Segs[:0]
	clear(b.grants)
	b.grants = b.grants[:0]
	b.ops = b.ops[:0]
	p.bufs.Put(b)
}
