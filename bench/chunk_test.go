package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

// BenchmarkChunkSize measures 4 KiB random reads and writes (32 in flight)
// and 1 MiB sequential reads and writes (8 in flight) over a volume four
// times the target's cache, so that much of the IO meets a chunk that is not
// granted or not cached: the cost of grants, loads, revokes and write-back
// by chunk size. The README's default comes from it.
func BenchmarkChunkSize(b *testing.B) {
	for _, cs := range []int{64 << 10, 256 << 10, 1 << 20, 4 << 20} {
		for _, write := range []bool{false, true} {
			op := "randread"
			if write {
				op = "randwrite"
			}
			b.Run(fmt.Sprintf("chunk=%dK/%s-4k", cs>>10, op), func(b *testing.B) { benchChunk(b, cs, write, 4096, true) })
		}
		b.Run(fmt.Sprintf("chunk=%dK/seqread-1M", cs>>10), func(b *testing.B) { benchChunk(b, cs, false, 1<<20, false) })
		b.Run(fmt.Sprintf("chunk=%dK/seqwrite-1M", cs>>10), func(b *testing.B) { benchChunk(b, cs, true, 1<<20, false) })
	}
}

func benchChunk(b *testing.B, chunkSize int, write bool, bs uint64, random bool) {
	const volSize, cacheSize = 256 << 20, 64 << 20
	depth := 32
	if !random {
		depth = 8
	}
	v := serve(b, chunkSize, volSize, cacheSize)
	ctx := context.Background()
	b.SetBytes(int64(bs))
	b.ResetTimer()
	var wg sync.WaitGroup
	for w := range depth {
		n := b.N / depth
		if w == 0 {
			n += b.N % depth
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			buf, err := v.Alloc(ctx, int(bs))
			if err != nil {
				b.Error(err)
				return
			}
			defer v.Free(buf)
			seq := uint64(w) * bs
			for range n {
				off := seq % volSize
				seq += uint64(depth) * bs
				if random {
					off = rng.Uint64N(volSize/bs) * bs
				}
				if write {
					err = v.WriteAt(ctx, buf, off, false)
				} else {
					err = v.ReadAt(ctx, buf, off)
				}
				if err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
