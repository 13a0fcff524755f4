package initiator_test

import (
	"context"
	"testing"
)

// chanCompletion hands a request's result to a channel.
type chanCompletion chan error

func (c chanCompletion) Complete(err error) { c <- err }

// TestSubmitAllocs: a 4 KiB read or write through SubmitRead and
// SubmitWrite, on chunks already granted, allocates nothing on the heap, in
// the initiator nor in the target and transport of this process. It runs
// under the race detector too (no sync.Pool on the path, whose items the
// detector drops at random).
func TestSubmitAllocs(t *testing.T) {
	const size = 4 << 20
	r := startTarget(t, size, 8<<20, 1<<20, false)
	v := r.open(false)
	ctx := context.Background()
	buf, err := v.Alloc(ctx, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer v.Free(buf)
	done := make(chanCompletion, 1)
	off := uint64(0)
	one := func(write bool) {
		off = (off + 12345*4096) % size
		if write {
			v.SubmitWrite(ctx, buf, off, false, done)
		} else {
			v.SubmitRead(ctx, buf, off, done)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	for range 500 { // every chunk granted, the free lists warm
		one(true)
		one(false)
	}
	for _, write := range []bool{false, true} {
		// A keepalive or a credit message now and then may allocate;
		// an allocation per IO is 1.
		if n := testing.AllocsPerRun(2000, func() { one(write) }); n > 0.05 {
			t.Errorf("write=%v: %.3f allocations per IO, want 0", write, n)
		}
	}
}
