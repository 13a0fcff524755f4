package target

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"os"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
)

// Write-back writes the dirty blocks of chunks to their volume's store, in
// as few writes as it can:
//
//   - within a chunk, dirty runs separated by at most mergeGapBlocks clean
//     blocks are written as one, clean blocks included: the chunk's cached
//     copy holds the current bytes of every block, clean or dirty (a chunk
//     is loaded whole before it is granted, so before anything marks it
//     dirty; a dead chunk is never written; see mergeRuns for trimmed
//     blocks);
//   - runs adjacent in the file, in different chunks (and so different
//     cache slots), are written with one vectored write (pwritev), up to
//     iovMax buffers and c.maxWrite bytes;
//   - a pass sorts what it writes by file offset.

// mergeGapBlocks is the most clean blocks between two dirty runs of a
// chunk that write-back writes along with them, making one write of two.
// One block (4 KiB): the cost of a clean block written is a copy into the
// page cache and, once the kernel writes its pages back, 4 KiB more in an IO
// it would issue anyway; a write saved is a system call and, on the device,
// one IO fewer. With one block the bytes written stay below twice the dirty
// bytes whatever the pattern (the worst, every other block dirty, writes
// 2k-1 blocks for k), while random 4 KiB writes that land one block apart
// (for 64 of a chunk's 256 blocks, about a quarter of them) save a write.
const mergeGapBlocks = 1

// iovMax is the most buffers one vectored write takes (Linux's IOV_MAX,
// UIO_MAXIOV).
const iovMax = 1024

// maxWriteBytes bounds a vectored write: the chunks of a pending write stay
// locked until it is written, and past a few MiB a write saves nothing more
// (a run of one chunk longer than that is still written at once).
const maxWriteBytes = 16 << 20

// VectorWriterAt is a Store that also writes several buffers at once: a
// Store put in front of the file (Options.WrapStore) may implement it so that
// write-back batches its writes there as it does on a file. WriteVAt writes
// bufs one after the other from off, as WriteAt of their concatenation would
// (pwritev); it returns the bytes written, fewer only with an error. The
// target does not change bufs, nor keep them after it returns.
//
// A Store without it gets one WriteAt per buffer.
type VectorWriterAt interface {
	WriteVAt(bufs [][]byte, off int64) (int, error)
}

// writeV writes bufs at off to v's store: one vectored write when it can.
func (v *volume) writeV(bufs [][]byte, off int64) (int, error) {
	if len(bufs) == 1 {
		return v.f.WriteAt(bufs[0], off)
	}
	switch f := v.f.(type) {
	case VectorWriterAt:
		return f.WriteVAt(bufs, off)
	case *os.File:
		return pwritevFile(f, bufs, off)
	}
	total := 0
	for _, b := range bufs {
		n, err := v.f.WriteAt(b, off)
		total += n
		if err != nil {
			return total, err
		}
		off += int64(n)
	}
	return total, nil
}

// pwritevFile writes bufs at off of f with pwritev, as often as it takes to
// write them all.
func pwritevFile(f *os.File, bufs [][]byte, off int64) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var total int
	var werr error
	if err := rc.Control(func(fd uintptr) { total, werr = pwritevAll(int(fd), bufs, off) }); err != nil {
		return 0, err
	}
	if werr != nil {
		werr = &os.PathError{Op: "pwritev", Path: f.Name(), Err: werr}
	}
	return total, werr
}

// pwritevAll calls pwritev until bufs are written or it fails.
func pwritevAll(fd int, bufs [][]byte, off int64) (int, error) {
	total := 0
	for len(bufs) > 0 {
		n, err := unix.Pwritev(fd, bufs, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if n > 0 {
			total += n
			off += int64(n)
			bufs = advance(bufs, n)
		}
		if err != nil {
			return total, err
		}
		if n == 0 && len(bufs) > 0 {
			return total, io.ErrShortWrite
		}
	}
	return total, nil
}

// advance drops the first n bytes of bufs, into a copy if it must cut a
// buffer (bufs is the caller's).
func advance(bufs [][]byte, n int) [][]byte {
	for len(bufs) > 0 && n >= len(bufs[0]) {
		n -= len(bufs[0])
		bufs = bufs[1:]
	}
	if n > 0 {
		bufs = slices.Clone(bufs)
		bufs[0] = bufs[0][n:]
	}
	return bufs
}

// Bitmaps of blocks: bit b%64 of word b/64 is block b.

// setBits sets bits [b, e) of w.
func setBits(w []uint64, b, e uint64) {
	for b < e {
		i, lo := b/64, b%64
		hi := min(e-i*64, 64)
		w[i] |= mask(lo, hi)
		b = i*64 + hi
	}
}

// clearBits clears bits [b, e) of w.
func clearBits(w []uint64, b, e uint64) {
	for b < e {
		i, lo := b/64, b%64
		hi := min(e-i*64, 64)
		w[i] &^= mask(lo, hi)
		b = i*64 + hi
	}
}

// mask has bits [lo, hi) set, 0 <= lo < hi <= 64.
func mask(lo, hi uint64) uint64 {
	return (^uint64(0) >> (64 - (hi - lo))) << lo
}

// nextSet is the first set bit of w at or after b, or n if none before n.
func nextSet(w []uint64, b, n uint64) uint64 {
	for b < n {
		if x := w[b/64] >> (b % 64); x != 0 {
			return min(b+uint64(bits.TrailingZeros64(x)), n)
		}
		b = (b/64 + 1) * 64
	}
	return n
}

// nextClear is the first clear bit of w at or after b, or n if none before n.
func nextClear(w []uint64, b, n uint64) uint64 {
	for b < n {
		if x := ^w[b/64] >> (b % 64); x != 0 {
			return min(b+uint64(bits.TrailingZeros64(x)), n)
		}
		b = (b/64 + 1) * 64
	}
	return n
}

// blockRun is blocks [b, e) of a chunk.
type blockRun struct{ b, e uint64 }

// mergeRuns appends to runs the runs of blocks to write for the dirty blocks
// of a chunk of nblocks blocks: the runs of dirty blocks, two of them merged
// with the clean blocks between when those are at most gap and none of them
// is a hole. A hole is a block trimmed (its range of the file deallocated)
// and not written since: its cached copy is zeroes, which is what the file
// reads, so writing it would be harmless, but would allocate it again.
func mergeRuns(runs []blockRun, dirty, holes []uint64, nblocks, gap uint64) []blockRun {
	b := nextSet(dirty, 0, nblocks)
	for b < nblocks {
		e := nextClear(dirty, b, nblocks)
		for {
			next := nextSet(dirty, e, nblocks)
			if next == nblocks || next-e > gap || nextSet(holes, e, next) != next {
				runs = append(runs, blockRun{b, e})
				b = next
				break
			}
			e = nextClear(dirty, next, nblocks)
		}
	}
	return runs
}

// wbChunk is a chunk a write-back pass works on.
type wbChunk struct {
	ch     *chunk
	locked bool     // the pass took ch.wbMu (else its caller holds it)
	dirty  []uint64 // the dirty blocks the pass took off the chunk
}

// wbSeg is a range of a chunk in the pass's pending write.
type wbSeg struct {
	c        int    // index in pass.chunks
	from, to uint64 // bytes, in the chunk
}

// wbPass is one write-back of some chunks of a volume (see writeChunks).
type wbPass struct {
	c      *cache
	v      *volume
	chunks []wbChunk
	words  []uint64 // the chunks' dirty snapshots
	holes  []uint64 // scratch: the holes of the chunk at hand
	runs   []blockRun
	// The pending write: segments contiguous in the file, from off.
	segs    []wbSeg
	iov     [][]byte
	off     uint64
	end     uint64
	release int // chunks before this index are unlocked
	err     error
}

var passPool = sync.Pool{New: func() any { return new(wbPass) }}

// writebackLocked writes the dirty blocks of ch, whose wbMu the caller holds.
func (c *cache) writebackLocked(ch *chunk) error {
	return c.writeChunks(ch.key.vol, []*chunk{ch}, ch)
}

// writeChunks writes back the dirty blocks of chunks (of v, in any order,
// maybe twice; it sorts them) in file order, merged as the comment at the
// top of this file says. It takes each chunk's wbMu, in file order, but
// that of held, which the caller holds; dead chunks are skipped. A chunk
// stays locked from the moment its dirty blocks are taken until they are
// written. On failure the blocks of the failed writes are dirty again, the
// chunks back on the volume's dirty list, and the volume remembers the
// error for the next flush; writeChunks returns the first.
func (c *cache) writeChunks(v *volume, chunks []*chunk, held *chunk) error {
	p := passPool.Get().(*wbPass)
	err := c.writeChunksWith(p, v, chunks, held)
	passPool.Put(p)
	return err
}

// writeChunksWith is writeChunks with the pass buffers p, which it leaves
// reset (empty, their capacity kept). writebackVolume passes the volume's
// own (it holds passMu), so that the background write-back allocates
// nothing once they have grown, even where sync.Pool drops its items (the
// race detector drops them at random).
func (c *cache) writeChunksWith(p *wbPass, v *volume, chunks []*chunk, held *chunk) error {
	if len(chunks) > 1 {
		slices.SortFunc(chunks, func(a, b *chunk) int { return cmp.Compare(a.off, b.off) })
		chunks = slices.Compact(chunks)
	}
	p.c, p.v = c, v
	for _, ch := range chunks {
		p.add(ch, ch == held)
	}
	p.flush()
	p.unlock(len(p.chunks))
	err := p.err
	p.reset()
	return err
}

// add takes ch's dirty blocks and queues their runs.
func (p *wbPass) add(ch *chunk, held bool) {
	if !held {
		ch.wbMu.Lock()
	}
	if ch.dead {
		if !held {
			ch.wbMu.Unlock()
		}
		return
	}
	nw := len(ch.dirty)
	start := len(p.words)
	p.words = slices.Grow(p.words, nw)[:start+nw]
	dirty := p.words[start : start+nw : start+nw]
	p.holes = slices.Grow(p.holes[:0], nw)[:nw]
	ch.dirtyMu.Lock()
	copy(dirty, ch.dirty)
	clear(ch.dirty)
	copy(p.holes, ch.holes)
	ch.dirtyMu.Unlock()

	ci := len(p.chunks)
	p.chunks = append(p.chunks, wbChunk{ch: ch, locked: !held, dirty: dirty})
	n := uint64(len(ch.buf))
	nblocks := (n + dirtyBlock - 1) / dirtyBlock
	p.runs = mergeRuns(p.runs[:0], dirty, p.holes, nblocks, mergeGapBlocks)
	for _, r := range p.runs {
		from, to := r.b*dirtyBlock, min(r.e*dirtyBlock, n)
		off := ch.off + from
		if len(p.segs) > 0 && (off != p.end || len(p.iov) == iovMax || p.end-p.off+(to-from) > p.c.maxWrite) {
			p.flush()
		}
		if len(p.segs) == 0 {
			p.off = off
		}
		p.segs = append(p.segs, wbSeg{c: ci, from: from, to: to})
		p.iov = append(p.iov, ch.buf[from:to])
		p.end = off + (to - from)
	}
	// Every chunk before the first of the pending write is written.
	keep := len(p.chunks)
	if len(p.segs) > 0 {
		keep = p.segs[0].c
	}
	p.unlock(keep)
}

// flush writes the pending segments.
func (p *wbPass) flush() {
	if len(p.segs) == 0 {
		return
	}
	c, v := p.c, p.v
	size := p.end - p.off
	if _, err := v.writeV(p.iov, int64(p.off)); err != nil {
		c.m.errWriteback.Inc()
		werr := fmt.Errorf("write back %d bytes at %d of %q: %w", size, p.off, v.name, err)
		if p.err == nil {
			p.err = werr
		}
		v.setErr(werr)
		for i, sg := range p.segs {
			wc := p.chunks[sg.c]
			wc.ch.remark(wc.dirty, sg.from/dirtyBlock, (sg.to+dirtyBlock-1)/dirtyBlock)
			if i == 0 || p.segs[i-1].c != sg.c {
				v.markDirty(wc.ch)
			}
		}
	} else {
		c.progress.Add(1)
		v.m.writebackOps.Inc()
		v.m.writebackBytes.Add(float64(size))
	}
	clear(p.iov) // no reference to the cache stays in the pool
	p.segs, p.iov = p.segs[:0], p.iov[:0]
}

// unlock releases the chunks before index keep that the pass locked.
func (p *wbPass) unlock(keep int) {
	for ; p.release < keep; p.release++ {
		if wc := p.chunks[p.release]; wc.locked {
			wc.ch.wbMu.Unlock()
		}
	}
}

func (p *wbPass) reset() {
	clear(p.chunks)
	p.chunks, p.words, p.runs, p.segs, p.iov = p.chunks[:0], p.words[:0], p.runs[:0], p.segs[:0], p.iov[:0]
	p.release, p.err, p.c, p.v = 0, nil, nil, nil
}

// remark marks dirty again the blocks of [b, e) that were dirty in taken
// (a snapshot of ch.dirty).
func (ch *chunk) remark(taken []uint64, b, e uint64) {
	ch.dirtyMu.Lock()
	defer ch.dirtyMu.Unlock()
	for b < e {
		i, lo := b/64, b%64
		hi := min(e-i*64, 64)
		ch.dirty[i] |= taken[i] & mask(lo, hi)
		b = i*64 + hi
	}
}

// writebackVolume writes back every dirty chunk of v. When it returns,
// every range marked dirty before it was called is written (or its error
// recorded), including ranges an earlier pass had taken: passes are
// serialized by v.passMu.
func (c *cache) writebackVolume(v *volume) error {
	v.passMu.Lock()
	defer v.passMu.Unlock()
	taken := v.takeDirty()
	err := c.writeChunksWith(&v.pass, v, taken, nil)
	v.passDone(taken, err != nil)
	return err
}
