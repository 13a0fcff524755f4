package ublk

import (
	"context"
	"errors"
	"fmt"
	"go.uber.org/zap"
	"syscall"
	"testing"

	"github.com/rblk/rblk/initiator/blockdev"
)

func TestResultOf(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int32
	}{
		{nil, 4096},
		{fmt.Errorf("write: %w", syscall.ENOSPC), -int32(syscall.ENOSPC)},
		{syscall.EPERM, -int32(syscall.EPERM)},
		{errors.New("target gone"), -int32(syscall.EIO)},
		{context.Canceled, -int32(syscall.EIO)},
	} {
		if got := resultOf(tc.err, 4096); got != tc.want {
			t.Errorf("resultOf(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

// segBackend lends buffers of segs segments, and none while empty.
type segBackend struct {
	blockdev.Backend
	segs   int
	empty  bool
	ctxErr bool // Alloc was called with a context that had ended
	freed  int
}

func (b *segBackend) Alloc(ctx context.Context, n int) (*blockdev.Buffer, error) {
	if ctx.Err() != nil {
		b.ctxErr = true
	}
	if b.empty {
		return nil, ctx.Err()
	}
	buf := &blockdev.Buffer{}
	for i := range b.segs {
		l := n / b.segs
		if i == b.segs-1 {
			l = n - l*(b.segs-1)
		}
		buf.Segs = append(buf.Segs, make([]byte, l))
	}
	return buf, nil
}

func (b *segBackend) Free(*blockdev.Buffer) { b.freed++ }

func TestTryAlloc(t *testing.T) {
	be := &segBackend{segs: 1}
	q := newQueue(&Device{opts: Options{Backend: be, Depth: 4}, log: nopLogger()}, 0)
	b, ok := q.tryAlloc(8192)
	if !ok || len(b.Segs) != 1 || len(b.Segs[0]) != 8192 {
		t.Fatalf("one segment: %v, %v", b, ok)
	}
	if !be.ctxErr {
		t.Fatal("tryAlloc passed a live context: the queue could wait on the pool")
	}
	be.segs = 2
	if _, ok := q.tryAlloc(8192); ok || be.freed != 1 {
		t.Fatalf("a buffer of two segments taken (ok %v), or not given back (freed %d)", ok, be.freed)
	}
	be.empty = true
	if _, ok := q.tryAlloc(8192); ok {
		t.Fatal("an empty pool lent a buffer")
	}
}

// The backend's completions reach the queue's list, newest first, and
// carry the result the kernel gets.
func TestCompletePosts(t *testing.T) {
	q := newQueue(&Device{opts: Options{Backend: &segBackend{segs: 1}, Depth: 3}, log: nopLogger()}, 0)
	q.awake.Store(true) // (no eventfd here: the loop is not asleep)
	q.tags[0].n, q.tags[1].n = 4096, 512
	q.tags[0].Complete(nil)
	q.tags[1].Complete(fmt.Errorf("x: %w", syscall.EROFS))
	var got []*tag
	for t := q.list.Swap(nil); t != nil; t = t.next {
		got = append(got, t)
	}
	if len(got) != 2 || got[0] != &q.tags[1] || got[1] != &q.tags[0] {
		t.Fatalf("list %v", got)
	}
	if q.tags[0].res != 4096 || q.tags[1].res != -int32(syscall.EROFS) || q.tags[0].state != tagCommit {
		t.Fatalf("results %d %d", q.tags[0].res, q.tags[1].res)
	}
	if q.wakePending.Load() {
		t.Fatal("woke a queue that was awake")
	}
}

func nopLogger() *zap.Logger { return zap.NewNop() }
