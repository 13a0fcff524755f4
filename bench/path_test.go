package bench

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/tcp"
)

// serve starts a target with a sparse volume of volSize bytes over the
// software provider on loopback, and opens the volume with one queue; both
// are closed when the benchmark ends.
func serve(b *testing.B, chunkSize int, volSize, cacheSize int64) *initiator.Volume {
	return serveQueues(b, chunkSize, volSize, cacheSize, 1)
}

// serveQueues is serve with the volume opened with queues queues (as a
// host, which more than one queue needs).
func serveQueues(b *testing.B, chunkSize int, volSize, cacheSize int64, queues int) *initiator.Volume {
	b.Helper()
	path := filepath.Join(b.TempDir(), "vol.img")
	tg, err := target.New(target.Options{Exports: []target.ExportConfig{{Name: "vol", Path: path, Size: volSize}},
		CacheSize: cacheSize, ChunkSize: chunkSize})
	if err != nil {
		b.Fatal(err)
	}
	p := tcp.New("tcp")
	ctx, cancel := context.WithCancel(context.Background())
	l, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { tg.Serve(ctx, l); close(done) }()
	opts := initiator.Options{Provider: p, Target: l.Addr(), Export: "vol"}
	if queues > 1 {
		opts.HostID, opts.Queues = "bench", queues
	}
	v, err := initiator.Open(ctx, opts)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		v.Close(context.Background())
		cancel()
		<-done
		tg.Close()
	})
	return v
}

// setup serves a volume that fits the cache, and takes a grant of every
// chunk before the timer starts, so the figures are of the steady data path.
func setup(b *testing.B, chunkSize int, volSize int64) *initiator.Volume {
	b.Helper()
	v := serve(b, chunkSize, volSize, volSize+4*int64(chunkSize))
	ctx := context.Background()
	buf, _ := v.Alloc(ctx, 4096)
	for off := uint64(0); off < uint64(volSize); off += uint64(chunkSize) {
		if err := v.ReadAt(ctx, buf, off); err != nil {
			b.Fatal(err)
		}
	}
	v.Free(buf)
	return v
}

// benchIO runs depth goroutines of bs-byte IO each, with ReadAt and
// WriteAt, or with submit through the run-to-completion path
// (blockdev.Submitter) as the NBD server drives it.
func benchIO(b *testing.B, write bool, bs int, depth int, submit bool) {
	const volSize = 64 << 20
	v := setup(b, target.DefaultChunkSize, volSize)
	ctx := context.Background()
	b.SetBytes(int64(bs))
	b.ReportAllocs()
	b.ResetTimer()
	var wg sync.WaitGroup
	per := b.N / depth
	for w := range depth {
		n := per
		if w == 0 {
			n += b.N % depth
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf, err := v.Alloc(ctx, bs)
			if err != nil {
				b.Error(err)
				return
			}
			defer v.Free(buf)
			done := make(chanCompletion, 1)
			off := uint64(w*bs) % volSize
			for range n {
				switch {
				case submit && write:
					v.SubmitWrite(ctx, buf, off, false, done)
					err = <-done
				case submit:
					v.SubmitRead(ctx, buf, off, done)
					err = <-done
				case write:
					err = v.WriteAt(ctx, buf, off, false)
				default:
					err = v.ReadAt(ctx, buf, off)
				}
				if err != nil {
					b.Error(err)
					return
				}
				off = (off + uint64(depth*bs) + 12345*4096) % (volSize - uint64(bs))
				off &^= 4095
			}
		}()
	}
	wg.Wait()
}

// BenchmarkPath measures the initiator's Volume against a target over the
// software RDMA provider on TCP loopback: RDMA READ (read), RDMA WRITE plus
// Done (write), by block size and number of requests in flight.
func BenchmarkPath(b *testing.B) {
	for _, write := range []bool{false, true} {
		for _, c := range []struct{ bs, depth int }{{4096, 1}, {4096, 32}, {1 << 20, 8}} {
			op := "read"
			if write {
				op = "write"
			}
			b.Run(fmt.Sprintf("%s/bs=%d/qd=%d", op, c.bs, c.depth), func(b *testing.B) { benchIO(b, write, c.bs, c.depth, false) })
		}
	}
}

// chanCompletion hands a request's result to a channel.
type chanCompletion chan error

func (c chanCompletion) Complete(err error) { c <- err }

// BenchmarkSubmit is BenchmarkPath through SubmitRead and SubmitWrite.
func BenchmarkSubmit(b *testing.B) {
	for _, write := range []bool{false, true} {
		for _, c := range []struct{ bs, depth int }{{4096, 1}, {4096, 32}, {1 << 20, 8}} {
			op := "read"
			if write {
				op = "write"
			}
			b.Run(fmt.Sprintf("%s/bs=%d/qd=%d", op, c.bs, c.depth), func(b *testing.B) { benchIO(b, write, c.bs, c.depth, true) })
		}
	}
}
