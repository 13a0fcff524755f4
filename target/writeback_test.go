package target

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// bitmap parses a picture of up to 256 blocks, '1' dirty (or a hole),
// anything else not.
func bitmap(pic string) []uint64 {
	w := make([]uint64, 4)
	for i, c := range pic {
		if c == '1' {
			w[i/64] |= 1 << (i % 64)
		}
	}
	return w
}

func TestMergeRuns(t *testing.T) {
	for _, c := range []struct {
		name         string
		dirty, holes string
		gap          uint64
		want         []blockRun
	}{
		{name: "none", dirty: "........", gap: 1},
		{name: "one", dirty: "..1.....", gap: 1, want: []blockRun{{2, 3}}},
		{name: "touching", dirty: "..111...", gap: 1, want: []blockRun{{2, 5}}},
		{name: "first and last", dirty: "1......1", gap: 1, want: []blockRun{{0, 1}, {7, 8}}},
		{name: "all", dirty: "11111111", gap: 1, want: []blockRun{{0, 8}}},
		{name: "gap of one merged", dirty: "1.1.1...", gap: 1, want: []blockRun{{0, 5}}},
		{name: "gap of two not merged", dirty: "1..1..11", gap: 1, want: []blockRun{{0, 1}, {3, 4}, {6, 8}}},
		{name: "gap of two, gap 2", dirty: "1..1...1", gap: 2, want: []blockRun{{0, 4}, {7, 8}}},
		{name: "no merging", dirty: "1.1.11", gap: 0, want: []blockRun{{0, 1}, {2, 3}, {4, 6}}},
		{name: "hole in the gap", dirty: "1.1.1...", holes: "...1....", gap: 1, want: []blockRun{{0, 3}, {4, 5}}},
		{name: "hole elsewhere", dirty: "1.1.....", holes: ".....11.", gap: 1, want: []blockRun{{0, 3}}},
		{name: "hole in a wide gap", dirty: "1...1", holes: "..1..", gap: 3, want: []blockRun{{0, 1}, {4, 5}}},
		{name: "across words", dirty: strings.Repeat(".", 63) + "1.1" + strings.Repeat(".", 60) + "11", gap: 1,
			want: []blockRun{{63, 66}, {126, 128}}},
		{name: "word of dirty blocks", dirty: strings.Repeat("1", 64) + "." + strings.Repeat("1", 64), gap: 1,
			want: []blockRun{{0, 129}}},
		{name: "short last word", dirty: strings.Repeat(".", 70) + "1.1", gap: 1, want: []blockRun{{70, 73}}},
		{name: "gap at the end", dirty: "..1.", gap: 1, want: []blockRun{{2, 3}}},
	} {
		got := mergeRuns(nil, bitmap(c.dirty), bitmap(c.holes), uint64(len(c.dirty)), c.gap)
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: mergeRuns(%s, holes %s, gap %d) = %v, want %v", c.name, c.dirty, c.holes, c.gap, got, c.want)
		}
	}
}

func TestBitOps(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 200
	for range 2000 {
		w := make([]uint64, (n+63)/64)
		ref := make([]bool, n)
		for range 4 {
			b := uint64(rng.IntN(n))
			e := b + uint64(rng.IntN(n-int(b)+1))
			set := rng.IntN(2) == 0
			if set {
				setBits(w, b, e)
			} else {
				clearBits(w, b, e)
			}
			for i := b; i < e; i++ {
				ref[i] = set
			}
		}
		for i := range uint64(n) {
			if got := w[i/64]&(1<<(i%64)) != 0; got != ref[i] {
				t.Fatalf("bit %d = %v, want %v", i, got, ref[i])
			}
		}
		from, lim := uint64(rng.IntN(n)), uint64(rng.IntN(n+1))
		wantSet, wantClear := lim, lim
		for i := from; i < lim; i++ {
			if ref[i] && wantSet == lim {
				wantSet = i
			}
			if !ref[i] && wantClear == lim {
				wantClear = i
			}
		}
		if got := nextSet(w, from, lim); got != wantSet {
			t.Fatalf("nextSet(%d, %d) = %d, want %d", from, lim, got, wantSet)
		}
		if got := nextClear(w, from, lim); got != wantClear {
			t.Fatalf("nextClear(%d, %d) = %d, want %d", from, lim, got, wantClear)
		}
	}
}

func TestAdvance(t *testing.T) {
	a, b, c := []byte("abc"), []byte("de"), []byte("fghi")
	for _, tc := range []struct {
		n    int
		want []string
	}{{0, []string{"abc", "de", "fghi"}}, {2, []string{"c", "de", "fghi"}}, {3, []string{"de", "fghi"}}, {6, []string{"ghi"}}, {9, nil}} {
		bufs := [][]byte{a, b, c}
		var got []string
		for _, p := range advance(bufs, tc.n) {
			got = append(got, string(p))
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("advance(%d) = %q, want %q", tc.n, got, tc.want)
		}
		if string(bufs[0]) != "abc" {
			t.Errorf("advance(%d) changed the caller's buffers", tc.n)
		}
	}
}

// storeWrite is one write that reached a recStore.
type storeWrite struct {
	off, n int64
	bufs   int // 1 for WriteAt, the buffers of WriteVAt
}

// recStore records the writes of write-back; failWrites makes them fail.
type recStore struct {
	*os.File
	vectored bool // implements WriteVAt (else the target falls back to WriteAt)

	mu     sync.Mutex
	writes []storeWrite
	fail   error
	delay  time.Duration // before each write: a slow disk
}

func (r *recStore) record(w storeWrite) error {
	r.mu.Lock()
	r.writes = append(r.writes, w)
	fail, delay := r.fail, r.delay
	r.mu.Unlock()
	time.Sleep(delay)
	return fail
}

func (r *recStore) WriteAt(p []byte, off int64) (int, error) {
	if err := r.record(storeWrite{off, int64(len(p)), 1}); err != nil {
		return 0, err
	}
	return r.File.WriteAt(p, off)
}

func (r *recStore) WriteVAt(bufs [][]byte, off int64) (int, error) {
	if !r.vectored {
		panic("WriteVAt of a store without it")
	}
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	if err := r.record(storeWrite{off, int64(n), len(bufs)}); err != nil {
		return 0, err
	}
	return pwritevFile(r.File, bufs, off)
}

func (r *recStore) take() []storeWrite {
	r.mu.Lock()
	defer r.mu.Unlock()
	w := r.writes
	r.writes = nil
	return w
}

// plainStore is a Store without WriteVAt.
type plainStore struct{ *recStore }

func (plainStore) WriteVAt() {} // hides recStore's: not a VectorWriterAt

// wbEnv is a target of one export of volSize bytes in chunks of 64 KiB,
// all cached, with random content, and a model of what the file should
// hold once written back.
type wbEnv struct {
	t     testing.TB
	tg    *Target
	c     *cache
	v     *volume
	st    *recStore
	path  string
	model []byte
}

const (
	wbChunk64 = 64 << 10
	// wbVolSize: 3 chunks and a short one, whose last block is short too.
	wbVolSize = 3*wbChunk64 + 5000
)

// store: "vectored" (recStore with WriteVAt), "plain" (without: one
// WriteAt per buffer), "file" (the *os.File itself: pwritev).
func newWBEnv(t testing.TB, store string) *wbEnv {
	t.Helper()
	path := filepath.Join(t.TempDir(), "vol.img")
	model := make([]byte, wbVolSize)
	randFill(rand.New(rand.NewPCG(7, 8)), model)
	if err := os.WriteFile(path, model, 0o600); err != nil {
		t.Fatal(err)
	}
	e := &wbEnv{t: t, path: path, model: model}
	opts := Options{
		Exports:        []ExportConfig{{Name: "vol", Path: path}},
		CacheSize:      8 * wbChunk64,
		ChunkSize:      wbChunk64,
		WritebackDelay: time.Hour, // write-back only when the test asks
	}
	if store != "file" {
		opts.WrapStore = func(_ string, f *os.File) Store {
			e.st = &recStore{File: f, vectored: store == "vectored"}
			if store == "plain" {
				return plainStore{e.st}
			}
			return e.st
		}
	}
	tg, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
	})
	e.tg, e.c, e.v = tg, tg.cache, tg.vols[0]
	loadChunks(t, e.c, nil, e.v, 4)
	return e
}

func (e *wbEnv) chunk(idx uint64) *chunk {
	e.c.mu.Lock()
	defer e.c.mu.Unlock()
	return e.c.tbl.lookup(chunkKey{e.v, idx})
}

// write puts data at off of the volume in the cache, as an initiator's
// RDMA WRITE does, and marks it dirty, as its Done does.
func (e *wbEnv) write(off uint64, data []byte) {
	copy(e.model[off:], data)
	end := off + uint64(len(data))
	for idx := off / wbChunk64; idx*wbChunk64 < end; idx++ {
		ch := e.chunk(idx)
		from := max(off, ch.off) - ch.off
		to := min(end, ch.off+uint64(len(ch.buf))) - ch.off
		copy(ch.buf[from:to], data[ch.off+from-off:])
		ch.markDirty(from, to)
		e.v.markDirty(ch)
	}
}

func (e *wbEnv) zero(off, n uint64, noHole bool) {
	if err := e.c.zeroRange(e.v, off, n, noHole); err != nil {
		e.t.Fatal(err)
	}
	clear(e.model[off : off+n])
}

// check: the file holds the model, and every cached chunk what the file
// holds.
func (e *wbEnv) check(what string) {
	e.t.Helper()
	file, err := os.ReadFile(e.path)
	if err != nil {
		e.t.Fatal(err)
	}
	if !bytes.Equal(file, e.model) {
		e.t.Fatalf("%s: the file does not hold what was written: %s", what, diff(file, e.model))
	}
	for idx := range uint64(4) {
		ch := e.chunk(idx)
		if !bytes.Equal(ch.buf, file[ch.off:ch.off+uint64(len(ch.buf))]) {
			e.t.Fatalf("%s: chunk %d: the cache and the file differ: %s", what, idx, diff(ch.buf, file[ch.off:]))
		}
	}
}

func diff(got, want []byte) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			return fmt.Sprintf("first difference at %d", i)
		}
	}
	return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
}

func randFill(rng *rand.Rand, p []byte) {
	for i := range p {
		p[i] = byte(rng.Uint32())
	}
}

func fill(n int, b byte) []byte { return bytes.Repeat([]byte{b}, n) }

// TestWritebackMerges: the writes that reach the store for dirty ranges of
// chunks, and that the file then holds what was written.
func TestWritebackMerges(t *testing.T) {
	const K, C = 4096, wbChunk64
	const last = 3 * C // the short last chunk: blocks of 4096 and 904 bytes
	type op struct {
		off, n uint64
		zero   bool // trim (a hole), or with noHole write zeroes
		noHole bool
	}
	w := func(off, n uint64) op { return op{off: off, n: n} }
	for _, c := range []struct {
		name string
		ops  []op
		want []storeWrite // with WriteVAt
	}{
		{"one block", []op{w(K, K)}, []storeWrite{{K, K, 1}}},
		{"partial block", []op{w(10, 5)}, []storeWrite{{0, K, 1}}},
		{"touching", []op{w(0, K), w(K, K)}, []storeWrite{{0, 2 * K, 1}}},
		{"overlapping", []op{w(100, 5000), w(3000, 3000)}, []storeWrite{{0, 2 * K, 1}}},
		{"same range twice", []op{w(K, K), w(K, K)}, []storeWrite{{K, K, 1}}},
		{"gap of one block", []op{w(0, K), w(2*K, K)}, []storeWrite{{0, 3 * K, 1}}},
		{"gap of a partial block", []op{w(0, K+100), w(2*K+5, 10)}, []storeWrite{{0, 3 * K, 1}}},
		{"gap of two blocks", []op{w(0, K), w(3*K, K)}, []storeWrite{{0, K, 1}, {3 * K, K, 1}}},
		{"across a chunk boundary", []op{w(C-K, 2*K)}, []storeWrite{{C - K, 2 * K, 2}}},
		{"adjacent chunks in two ranges", []op{w(2*C-100, 100), w(2*C, 100)}, []storeWrite{{2*C - K, 2 * K, 2}}},
		{"three whole chunks", []op{w(0, 3*C)}, []storeWrite{{0, 3 * C, 3}}},
		{"chunks not adjacent", []op{w(0, K), w(2*C, K)}, []storeWrite{{0, K, 1}, {2 * C, K, 1}}},
		// Clean blocks are bridged within a chunk only.
		{"gap across a chunk boundary", []op{w(C-K, K), w(C+K, K)}, []storeWrite{{C - K, K, 1}, {C + K, K, 1}}},
		{"into the short last chunk", []op{w(last-K, K+5000)}, []storeWrite{{last - K, K + 5000, 2}}},
		{"the last short block", []op{w(wbVolSize-10, 10)}, []storeWrite{{last + K, 904, 1}}},
		{"the short last chunk, gap", []op{w(last, 10), w(last+K, 10)}, []storeWrite{{last, 5000, 1}}},
		{"trimmed block between", []op{w(0, K), w(2*K, K), {off: K, n: K, zero: true}}, []storeWrite{{0, K, 1}, {2 * K, K, 1}}},
		{"trimmed, then written", []op{w(0, K), w(2*K, K), {off: K, n: K, zero: true}, w(K+10, 10)}, []storeWrite{{0, 3 * K, 1}}},
		{"trimmed, a neighbour written", []op{{off: K, n: K, zero: true}, w(0, K), w(2*K, K)}, []storeWrite{{0, K, 1}, {2 * K, K, 1}}},
		{"zeroed (no hole) between", []op{w(0, K), w(2*K, K), {off: K, n: K, zero: true, noHole: true}}, []storeWrite{{0, 3 * K, 1}}},
		{"part of the gap trimmed", []op{w(0, K), w(2*K, K), {off: K + 100, n: 100, zero: true}}, []storeWrite{{0, 3 * K, 1}}},
		{"dirty block trimmed", []op{w(0, 3*K), {off: K, n: K, zero: true}}, []storeWrite{{0, K, 1}, {2 * K, K, 1}}},
		{"trim across dirty blocks", []op{w(0, 4*K), {off: 100, n: 3 * K, zero: true}}, []storeWrite{{0, K, 1}, {3 * K, K, 1}}},
		{"the last short block trimmed", []op{w(last, 5000), {off: last + K, n: 904, zero: true}}, []storeWrite{{last, K, 1}}},
	} {
		for _, store := range []string{"vectored", "plain", "file"} {
			t.Run(c.name+"/"+store, func(t *testing.T) {
				e := newWBEnv(t, store)
				rng := rand.New(rand.NewPCG(1, uint64(len(c.ops))))
				for _, o := range c.ops {
					if o.zero {
						e.zero(o.off, o.n, o.noHole)
						continue
					}
					data := make([]byte, o.n)
					randFill(rng, data)
					e.write(o.off, data)
				}
				if e.st != nil {
					e.st.take() // (zeroing may write)
				}
				if err := e.c.flush(e.v); err != nil {
					t.Fatal(err)
				}
				e.check("after flush")
				if e.st == nil {
					return
				}
				want := c.want
				if store == "plain" {
					// One WriteAt per buffer.
					want = nil
					for _, sw := range c.want {
						for off := sw.off; off < sw.off+sw.n; {
							end := min((off/C+1)*C, sw.off+sw.n)
							want = append(want, storeWrite{off, end - off, 1})
							off = end
						}
					}
				}
				if got := e.st.take(); !reflect.DeepEqual(got, want) {
					t.Fatalf("writes %v, want %v", got, want)
				}
			})
		}
	}
}

// TestWritebackMaxWrite: a vectored write stops at c.maxWrite bytes, but
// not within a chunk's run.
func TestWritebackMaxWrite(t *testing.T) {
	const C = wbChunk64
	e := newWBEnv(t, "vectored")
	e.c.maxWrite = 2 * C
	e.write(0, fill(wbVolSize, 5))
	if err := e.c.flush(e.v); err != nil {
		t.Fatal(err)
	}
	e.check("after flush")
	want := []storeWrite{{0, 2 * C, 2}, {2 * C, C + 5000, 2}}
	if got := e.st.take(); !reflect.DeepEqual(got, want) {
		t.Fatalf("writes %v, want %v", got, want)
	}
	e.c.maxWrite = C / 2
	e.write(C-10, fill(C+20, 6))
	if err := e.c.flush(e.v); err != nil {
		t.Fatal(err)
	}
	e.check("after the second flush")
	want = []storeWrite{{C - 4096, 4096, 1}, {C, C, 1}, {2 * C, 4096, 1}}
	if got := e.st.take(); !reflect.DeepEqual(got, want) {
		t.Fatalf("writes %v, want %v", got, want)
	}
}

// TestWritebackFailure: a failed write (a vectored one, over two chunks,
// and one that bridged a clean block) leaves exactly the blocks that were
// dirty dirty again, the flush reports it, and the next one writes them.
func TestWritebackFailure(t *testing.T) {
	const K, C = 4096, wbChunk64
	e := newWBEnv(t, "vectored")
	e.write(0, fill(K, 1))
	e.write(2*K, fill(K, 2))
	e.write(C-K, fill(2*K, 3))
	e.st.mu.Lock()
	e.st.fail = errors.New("disk on fire")
	e.st.mu.Unlock()
	err := e.c.flush(e.v)
	if err == nil || !strings.Contains(err.Error(), "disk on fire") {
		t.Fatalf("flush with a failing disk: %v", err)
	}
	if got := e.st.take(); !reflect.DeepEqual(got, []storeWrite{{0, 3 * K, 1}, {C - K, 2 * K, 2}}) {
		t.Fatalf("writes %v", got)
	}
	for idx, want := range map[uint64]string{0: "1.1" + strings.Repeat(".", 12) + "1", 1: "1..............."} {
		ch := e.chunk(idx)
		ch.dirtyMu.Lock()
		got := bitmap("")
		copy(got, ch.dirty)
		ch.dirtyMu.Unlock()
		if w := bitmap(want); got[0] != w[0] {
			t.Fatalf("chunk %d: dirty %b, want %b", idx, got[0], w[0])
		}
		if !ch.queued.Load() {
			t.Fatalf("chunk %d not queued for write-back again", idx)
		}
	}
	e.st.mu.Lock()
	e.st.fail = nil
	e.st.mu.Unlock()
	if err := e.c.flush(e.v); err != nil {
		t.Fatalf("flush once the disk works: %v", err)
	}
	e.check("after the second flush")
	if err := e.c.flush(e.v); err != nil {
		t.Fatalf("the error was reported twice: %v", err)
	}
}

// TestWritebackRandom: random writes, trims and write-back passes (the
// background one and FUA-like ones of some chunks); the file then holds
// what was written.
func TestWritebackRandom(t *testing.T) {
	for seed := range uint64(20) {
		e := newWBEnv(t, "vectored")
		rng := rand.New(rand.NewPCG(seed, 99))
		for range 200 {
			off := uint64(rng.IntN(wbVolSize))
			n := 1 + uint64(rng.IntN(min(3*4096, wbVolSize-int(off))))
			switch rng.IntN(10) {
			case 0:
				e.zero(off, n, rng.IntN(2) == 0)
			case 1:
				if err := e.c.writebackVolume(e.v); err != nil {
					t.Fatal(err)
				}
			case 2:
				var chunks []*chunk
				for idx := range uint64(4) {
					if rng.IntN(2) == 0 {
						chunks = append(chunks, e.chunk(idx))
					}
				}
				if err := e.c.writeChunks(e.v, chunks, nil); err != nil {
					t.Fatal(err)
				}
			default:
				data := make([]byte, n)
				randFill(rng, data)
				e.write(off, data)
			}
		}
		if err := e.c.flush(e.v); err != nil {
			t.Fatal(err)
		}
		e.check(fmt.Sprintf("seed %d", seed))
	}
}

// TestWritebackConcurrent: writers, each on blocks of its own, write and
// sometimes make their chunks durable as a Done with FUA does (and then find
// their bytes in the file), while background passes and trims (of blocks
// nobody writes) run; the file ends up holding the cache.
func TestWritebackConcurrent(t *testing.T) {
	const K, writers = 4096, 3
	e := newWBEnv(t, "vectored")
	e.st.mu.Lock()
	e.st.delay = 20 * time.Microsecond // writes that take a while, so that passes overlap
	e.st.mu.Unlock()
	nblocks := (wbVolSize + K - 1) / K
	trimmed := func(b int) bool { return b%5 == 2 }
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var errs sync.Map
	for w := range writers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			var mine []int
			for b := range nblocks {
				if !trimmed(b) && b%writers == w {
					mine = append(mine, b)
				}
			}
			for range 300 {
				b := mine[rng.IntN(len(mine))]
				blen := min(K, wbVolSize-b*K)
				at := rng.IntN(blen)
				off := uint64(b*K + at)
				data := make([]byte, 1+rng.IntN(blen-at))
				randFill(rng, data)
				ch := e.chunk(off / wbChunk64)
				from := off - ch.off
				copy(ch.buf[from:], data)
				ch.markDirty(from, from+uint64(len(data)))
				e.v.markDirty(ch)
				if rng.IntN(4) == 0 {
					if err := e.c.writeChunks(e.v, []*chunk{ch}, nil); err != nil {
						errs.Store(err, true)
						return
					}
					got := make([]byte, len(data))
					if _, err := e.v.file.ReadAt(got, int64(off)); err != nil || !bytes.Equal(got, data) {
						errs.Store(fmt.Errorf("writer %d: after write-back of its chunk the file does not hold its write at %d (%v)", w, off, err), true)
						return
					}
				}
			}
		})
	}
	var bg sync.WaitGroup
	bg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := e.c.writebackVolume(e.v); err != nil {
				errs.Store(err, true)
			}
		}
	})
	bg.Go(func() {
		rng := rand.New(rand.NewPCG(42, 1))
		for range 100 {
			b := 2 + 5*rng.IntN((nblocks-2)/5)
			n := min(uint64(K), wbVolSize-uint64(b*K))
			if err := e.c.zeroRange(e.v, uint64(b*K), n, rng.IntN(2) == 0); err != nil {
				errs.Store(err, true)
			}
		}
	})
	wg.Wait()
	close(stop)
	bg.Wait()
	errs.Range(func(k, _ any) bool { t.Error(k); return true })
	if err := e.c.flush(e.v); err != nil {
		t.Fatal(err)
	}
	file, _ := os.ReadFile(e.path)
	for idx := range uint64(4) {
		ch := e.chunk(idx)
		if !bytes.Equal(ch.buf, file[ch.off:ch.off+uint64(len(ch.buf))]) {
			t.Fatalf("chunk %d: the cache and the file differ after the flush: %s", idx, diff(file[ch.off:], ch.buf))
		}
	}
}

// TestWritebackVolumeAllocs: the background write-back (queueing a chunk,
// a pass over the volume) allocates nothing once its lists have grown, in
// race builds too (where sync.Pool drops items at random): over rdma in
// the guest a pass ran for every few writes, and TestSubmitAllocs counted
// its allocations as the IO's.
func TestWritebackVolumeAllocs(t *testing.T) {
	e := newWBEnv(t, "file")
	data := []byte("0123456789abcdef")
	off := uint64(0)
	one := func() {
		// Two chunks, two runs in the second: the pass's lists hold several.
		e.write(off, data)
		e.write(off+wbChunk64+8192, data)
		e.write(off+wbChunk64+40960, data)
		if err := e.c.writebackVolume(e.v); err != nil {
			t.Fatal(err)
		}
		off = (off + 4096) % wbChunk64
	}
	for range 10 {
		one()
	}
	if n := testing.AllocsPerRun(200, one); n != 0 {
		t.Errorf("%v allocations per write and write-back pass, want 0", n)
	}
	e.check("after the passes")
}
