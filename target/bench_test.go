package target

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
)

// countStore is a Store that counts the writes (syscalls) that reach the
// file: WriteAt is one pwrite, WriteVAt one pwritev.
type countStore struct {
	*os.File
	writes atomic.Int64
}

func (s *countStore) WriteAt(p []byte, off int64) (int, error) {
	s.writes.Add(1)
	return s.File.WriteAt(p, off)
}

func (s *countStore) WriteVAt(bufs [][]byte, off int64) (int, error) {
	s.writes.Add(1)
	return pwritevFile(s.File, bufs, off)
}

// benchTarget is a target of one export of size bytes on a counting store,
// whose background write-back never runs during a benchmark.
func benchTarget(b testing.TB, size int64, chunkSize int) (*Target, *volume, *countStore) {
	b.Helper()
	var cs *countStore
	tg, err := New(Options{
		Exports:        []ExportConfig{{Name: "vol", Path: filepath.Join(b.TempDir(), "vol.img"), Size: size}},
		CacheSize:      max(size, 4*int64(chunkSize)),
		ChunkSize:      chunkSize,
		WritebackDelay: time.Hour,
		WrapStore: func(_ string, f *os.File) Store {
			cs = &countStore{File: f}
			return cs
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := tg.Close(); err != nil {
			b.Error(err)
		}
	})
	return tg, tg.vols[0], cs
}

// loadChunks loads chunks [0, n) of v.
func loadChunks(b testing.TB, c *cache, s *session, v *volume, n int) []*chunk {
	b.Helper()
	var out []*chunk
	for i := range n {
		ch, _, err := c.get(context.Background(), s, 0, v, uint64(i))
		if err != nil {
			b.Fatal(err)
		}
		c.unpin(ch)
		out = append(out, ch)
	}
	return out
}

// BenchmarkWriteback writes back dirty ranges of a volume: N random 4 KiB
// blocks of one 1 MiB chunk, and runs of whole chunks adjacent in the file.
// writes/op counts the writes that reach the store.
func BenchmarkWriteback(b *testing.B) {
	for _, n := range []int{16, 64, 128, 256} {
		b.Run(fmt.Sprintf("random4k/blocks=%d", n), func(b *testing.B) {
			const cs = 1 << 20
			tg, v, st := benchTarget(b, cs, cs)
			ch := loadChunks(b, tg.cache, nil, v, 1)[0]
			blocks := rand.New(rand.NewPCG(1, 2)).Perm(cs / dirtyBlock)[:n]
			st.writes.Store(0)
			b.SetBytes(int64(n) * dirtyBlock)
			b.ResetTimer()
			for range b.N {
				for _, blk := range blocks {
					ch.markDirty(uint64(blk)*dirtyBlock, uint64(blk+1)*dirtyBlock)
				}
				v.markDirty(ch)
				if err := tg.cache.writebackVolume(v); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(st.writes.Load())/float64(b.N), "writes/op")
		})
	}
	for _, c := range []struct{ chunks, size int }{{16, 64 << 10}, {4, 1 << 20}} {
		b.Run(fmt.Sprintf("sequential/chunks=%dx%dK", c.chunks, c.size>>10), func(b *testing.B) {
			tg, v, st := benchTarget(b, int64(c.chunks*c.size), c.size)
			chunks := loadChunks(b, tg.cache, nil, v, c.chunks)
			st.writes.Store(0)
			b.SetBytes(int64(c.chunks * c.size))
			b.ResetTimer()
			for range b.N {
				for _, ch := range chunks {
					// Sequential 4 KiB writes, reported one by one.
					for off := uint64(0); off < uint64(c.size); off += dirtyBlock {
						ch.markDirty(off, off+dirtyBlock)
					}
					v.markDirty(ch)
				}
				if err := tg.cache.writebackVolume(v); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(st.writes.Load())/float64(b.N), "writes/op")
		})
	}
}

// nopKey is a grant key of a benchmark: nothing registered.
type nopKey struct{}

func (nopKey) Addr() uint64 { return 0 }
func (nopKey) RKey() uint32 { return 0 }
func (nopKey) Access() transport.Access {
	return transport.AccessRemoteRead | transport.AccessRemoteWrite
}
func (nopKey) release() error { return nil }

// BenchmarkDone handles Done messages on a session that holds writable
// grants of 64 chunks: one 4 KiB range per message, at random in those
// chunks, and 8 ranges per message.
func BenchmarkDone(b *testing.B) {
	for _, nranges := range []int{1, 8} {
		b.Run(fmt.Sprintf("ranges=%d", nranges), func(b *testing.B) {
			const cs, nchunks = 64 << 10, 64
			tg, v, _ := benchTarget(b, cs*nchunks, cs)
			s := benchSession(tg)
			const handle = 1
			ov := &openVol{v: v, writable: true, gen: 7}
			benchOpen(s, handle, ov)
			for _, ch := range loadChunks(b, tg.cache, s, v, nchunks) {
				benchGrant(b, s, ch, handle)
			}
			rng := rand.New(rand.NewPCG(3, 4))
			msgs := make([][]byte, 256)
			for i := range msgs {
				d := &protocol.Done{Handle: handle, Generation: ov.gen}
				for range nranges {
					off := uint64(rng.IntN(cs*nchunks/dirtyBlock)) * dirtyBlock
					d.Ranges = append(d.Ranges, protocol.Range{Offset: off, Length: dirtyBlock})
				}
				msgs[i] = make([]byte, d.Size())
				d.MarshalTo(msgs[i])
			}
			h := protocol.Header{Type: protocol.TypeDone}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				s.handleDone(h, msgs[i%len(msgs)])
			}
		})
	}
	// Sessions on their own goroutines, each with grants of its own 16
	// chunks of the same volume: what they share is the cache and the
	// volume.
	b.Run("ranges=1/parallel", func(b *testing.B) {
		const cs, nchunks, per = 64 << 10, 256, 16
		tg, v, _ := benchTarget(b, cs*nchunks, cs)
		chunks := loadChunks(b, tg.cache, nil, v, nchunks)
		var next atomic.Int64
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			k := int(next.Add(1)-1) % (nchunks / per)
			s := benchSession(tg)
			const handle = 1
			ov := &openVol{v: v, writable: true, gen: 7}
			benchOpen(s, handle, ov)
			for _, ch := range chunks[k*per : (k+1)*per] {
				benchGrant(b, s, ch, handle)
			}
			rng := rand.New(rand.NewPCG(uint64(k), 4))
			msgs := make([][]byte, 64)
			for i := range msgs {
				off := uint64(k*per*cs) + uint64(rng.IntN(per*cs/dirtyBlock))*dirtyBlock
				d := &protocol.Done{Handle: handle, Generation: ov.gen, Ranges: []protocol.Range{{Offset: off, Length: dirtyBlock}}}
				msgs[i] = make([]byte, d.Size())
				d.MarshalTo(msgs[i])
			}
			h := protocol.Header{Type: protocol.TypeDone}
			for i := 0; pb.Next(); i++ {
				s.handleDone(h, msgs[i%len(msgs)])
			}
		})
	})
}

// benchSession is a session without a connection, for benchmarks that
// call its handlers directly (and send nothing).
func benchSession(tg *Target) *session {
	s := &session{t: tg, id: 1, log: zap.NewNop(), noisy: zap.NewNop(), ready: make(chan struct{}), ended: make(chan struct{}),
		handles: make(map[uint32]*openVol)}
	close(s.ready)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s
}

// benchOpen gives s handle of ov, as addHandle does.
func benchOpen(s *session, handle uint32, ov *openVol) {
	s.mu.Lock()
	s.handles[handle] = ov
	s.mu.Unlock()
	s.t.cache.openHandle(s, handle, ov.writable, "")
}

// benchGrant gives handle of s a writable grant of ch, as grant does.
func benchGrant(b testing.TB, s *session, ch *chunk, handle uint32) {
	c := s.t.cache
	c.mu.Lock()
	ch.pins++ // (grant holds the pin of get)
	_, _, err := c.tbl.grant(ch, s, handle, nopKey{})
	ch.pins--
	c.mu.Unlock()
	if err != nil {
		b.Fatal(err)
	}
	s.mu.Lock()
	ov := s.handles[handle]
	if ov.grants == nil {
		ov.grants = make(map[uint64]*chunk)
	}
	ov.grants[ch.key.idx] = ch
	s.mu.Unlock()
}

// BenchmarkRequestMetrics is the metrics work of one served request (serve):
// the children looked up by label values on every request, as before, and
// resolved once, as now.
func BenchmarkRequestMetrics(b *testing.B) {
	m := NewMetrics(nil)
	b.Run("labels", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				m.requestSeconds.WithLabelValues("grant").Observe(1e-5)
				m.requests.WithLabelValues("grant", "ok").Inc()
			}
		})
	})
	b.Run("resolved", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				m.opGrant.seconds.Observe(1e-5)
				m.opGrant.ok.Inc()
			}
		})
	})
}

// BenchmarkGrantReuse is the cache's part of a grant the handle holds
// already (the common GrantRequest once the cache is warm): the chunk
// looked up, pinned, the handle's grant found, unpinned. The reply is the
// same either way and is left out.
func BenchmarkGrantReuse(b *testing.B) {
	const cs, nchunks = 64 << 10, 64
	tg, v, _ := benchTarget(b, cs*nchunks, cs)
	s := benchSession(tg)
	const handle = 1
	ov := &openVol{v: v, writable: true, gen: 7}
	benchOpen(s, handle, ov)
	for _, ch := range loadChunks(b, tg.cache, s, v, nchunks) {
		benchGrant(b, s, ch, handle)
	}
	c := tg.cache
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		ch, hd, err := c.get(ctx, s, handle, v, uint64(i%nchunks))
		if err != nil || hd == nil {
			b.Fatal(err, hd)
		}
		c.unpin(ch)
	}
}
