package initiator_test

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"strings"
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
			t.Errorf("write=%v: %.3f allocations per IO, want 0; where they are made:\n%s", write, n,
				allocSites(200, func() { one(write) }))
		}
	}
}

// allocSites runs f n times with every allocation sampled and returns the
// stacks that allocated during those runs, most first (the process's
// other goroutines included: the target's, the transport's).
func allocSites(n int, f func()) string {
	old := runtime.MemProfileRate
	runtime.MemProfileRate = 1
	defer func() { runtime.MemProfileRate = old }()
	snapshot := func() map[[32]uintptr]int64 {
		runtime.GC()
		runtime.GC() // (the profile reports up to the last GC's cycle)
		var recs []runtime.MemProfileRecord
		for {
			k, _ := runtime.MemProfile(nil, true)
			recs = make([]runtime.MemProfileRecord, k+50)
			if k, ok := runtime.MemProfile(recs, true); ok {
				recs = recs[:k]
				break
			}
		}
		m := make(map[[32]uintptr]int64, len(recs))
		for _, r := range recs {
			m[r.Stack0] += r.AllocObjects
		}
		return m
	}
	before := snapshot()
	for range n {
		f()
	}
	after := snapshot()
	type site struct {
		stack [32]uintptr
		per   float64
	}
	var sites []site
	for st, c := range after {
		if d := c - before[st]; d >= int64(n)/10 {
			sites = append(sites, site{st, float64(d) / float64(n)})
		}
	}
	sort.Slice(sites, func(i, j int) bool { return sites[i].per > sites[j].per })
	var b strings.Builder
	for i, s := range sites {
		if i == 8 {
			break
		}
		fmt.Fprintf(&b, "%.2f per run:\n", s.per)
		frames := runtime.CallersFrames(s.stack[:])
		for k := 0; k < 12; k++ {
			fr, more := frames.Next()
			if fr.Function == "" {
				break
			}
			fmt.Fprintf(&b, "\t%s (%s:%d)\n", fr.Function, fr.File, fr.Line)
			if !more {
				break
			}
		}
	}
	if len(sites) == 0 {
		b.WriteString("(no stack allocated in at least a tenth of the runs)\n")
	}
	return b.String()
}
