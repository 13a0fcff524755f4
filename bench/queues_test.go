package bench

import (
	"context"
	"fmt"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/target"
)

// BenchmarkQueues measures how the data path scales with the volume's
// queues: 4k random IO, 8 requests in flight per queue, each queue driven
// by one goroutine through its own blockdev backend (Volume.Queue) on the
// run-to-completion path, as the NBD server drives the kernel's sockets,
// a buffer taken and given back per request. Besides IOPS it reports the
// time goroutines spent blocked on a mutex per IO (runtime/metrics
// /sync/mutex/wait/total:seconds, the whole process: initiator and target),
// the figure that shows a lock shared by the queues on a machine with too
// few cores for the IOPS to show it. Run with -mutexprofile to see whose
// lock it is.
func BenchmarkQueues(b *testing.B) {
	for _, write := range []bool{false, true} {
		for _, queues := range []int{1, 2, 4, 8, 16} {
			op := "randread"
			if write {
				op = "randwrite"
			}
			b.Run(fmt.Sprintf("%s/queues=%d", op, queues), func(b *testing.B) { benchQueues(b, write, queues, 8) })
		}
	}
}

// mutexWait reads the process's cumulative time blocked on mutexes.
func mutexWait() time.Duration {
	s := []metrics.Sample{{Name: "/sync/mutex/wait/total:seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 {
		return 0
	}
	return time.Duration(s[0].Value.Float64() * float64(time.Second))
}

func benchQueues(b *testing.B, write bool, queues, depth int) {
	const (
		bs      = 4096
		volSize = 64 << 20
	)
	chunk := target.DefaultChunkSize
	v := serveQueues(b, chunk, volSize, volSize+4*int64(chunk), queues)
	ctx := context.Background()
	// Every chunk granted (writable, for writes) on every queue before the
	// timer starts: the figures are of the steady data path.
	for q := range queues {
		be := v.Queue(q)
		buf, err := be.Alloc(ctx, bs)
		if err != nil {
			b.Fatal(err)
		}
		for off := uint64(0); off < volSize; off += uint64(chunk) {
			if write {
				err = be.WriteAt(ctx, buf, off, false)
			} else {
				err = be.ReadAt(ctx, buf, off)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		be.Free(buf)
	}
	b.SetBytes(bs)
	b.ReportAllocs()
	wait0 := mutexWait()
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	per := b.N / queues
	for q := range queues {
		n := per
		if q == 0 {
			n += b.N % queues
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := driveQueue(ctx, v.Queue(q), uint64(q), n, depth, write); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	waited := mutexWait() - wait0
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "iops")
	b.ReportMetric(float64(waited.Nanoseconds())/float64(b.N), "mutex-ns/op")
}

// request is one of a queue's requests in flight.
type request struct {
	buf  *blockdev.Buffer
	err  error
	done chan *request
}

func (r *request) Complete(err error) {
	r.err = err
	r.done <- r
}

// driveQueue keeps depth requests in flight on one queue from a single
// goroutine, as the NBD server's reader does for its connection: a
// completion frees its buffer, then the next request takes one and goes;
// n requests in all, 4k at random offsets of the 64 MiB volume.
func driveQueue(ctx context.Context, be blockdev.Backend, seed uint64, n, depth int, write bool) error {
	const bs, volSize = 4096, 64 << 20
	sub := be.(blockdev.Submitter)
	done := make(chan *request, depth)
	x := seed*0x9e3779b97f4a7c15 + 1
	submit := func(r *request) error {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		off := x % (volSize / bs) * bs
		var err error
		if r.buf, err = be.Alloc(ctx, bs); err != nil {
			return err
		}
		if write {
			sub.SubmitWrite(ctx, r.buf, off, false, r)
		} else {
			sub.SubmitRead(ctx, r.buf, off, r)
		}
		return nil
	}
	inflight := 0
	for range min(depth, n) {
		if err := submit(&request{done: done}); err != nil {
			return err
		}
		inflight++
	}
	var first error
	for sent := inflight; inflight > 0; {
		r := <-done
		inflight--
		be.Free(r.buf)
		if r.err != nil && first == nil {
			first = r.err
		}
		if sent < n && first == nil {
			if err := submit(r); err != nil {
				return err
			}
			sent++
			inflight++
		}
	}
	return first
}
