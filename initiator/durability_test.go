package initiator_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/target/targettest"
)

// slowDisk starts a target whose export sits on a slow disk with a volatile
// write cache, and returns the disk.
func slowDisk(t *testing.T, size, cache int64, chunk int, write, sync time.Duration) (*rig, *targettest.DiskStore) {
	t.Helper()
	var disk *targettest.DiskStore
	r := startTarget(t, size, cache, chunk, false, func(o *target.Options) {
		o.WrapStore = func(_ string, f *os.File) target.Store {
			d, err := targettest.NewDiskStore(f)
			if err != nil {
				t.Fatal(err)
			}
			d.SetDelays(write, sync)
			disk = d
			return d
		}
	})
	return r, disk
}

// TestFlushIsDurable: a FLUSH that returned OK leaves every write
// acknowledged before it on stable storage, whatever the background
// write-back is doing (on main before the fix, a FLUSH issued while the
// write-back loop was writing chunks it had taken returned at once, and
// most of the data was only in the disk's volatile cache).
func TestFlushIsDurable(t *testing.T) {
	const size = 16 << 20
	r, disk := slowDisk(t, size, 32<<20, 1<<20, 20*time.Millisecond, time.Millisecond)
	v := r.open(false)
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 3 {
		off := uint64(rng.IntN(size/2)) &^ 4095
		data := make([]byte, 8<<20)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		for p := 0; p < len(data); p += 256 << 10 {
			if err := write(t, v, off+uint64(p), data[p:p+256<<10], false); err != nil {
				t.Fatal(err)
			}
		}
		if err := v.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := disk.Durable(int64(off), int64(len(data))); !bytes.Equal(got, data) {
			t.Fatalf("round %d: FLUSH returned OK but the disk holds %s", round, firstDiff(got, data))
		}
	}
}

// TestFUAIsDurable: a write with FUA is durable when it returns.
func TestFUAIsDurable(t *testing.T) {
	r, disk := slowDisk(t, 4<<20, 8<<20, 64<<10, 5*time.Millisecond, time.Millisecond)
	v := r.open(false)
	for i := range 20 {
		data := bytes.Repeat([]byte{byte(i + 1)}, 100<<10)
		off := uint64(i*37) << 10
		if err := write(t, v, off, data, true); err != nil {
			t.Fatal(err)
		}
		if got := disk.Durable(int64(off), int64(len(data))); !bytes.Equal(got, data) {
			t.Fatalf("write %d with FUA returned but the disk holds %s", i, firstDiff(got, data))
		}
	}
}

// firstDiff describes where got first differs from want.
func firstDiff(got, want []byte) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			n := 0
			for j := i; j < min(len(got), len(want)); j++ {
				if got[j] != want[j] {
					n++
				}
			}
			return fmt.Sprintf("%d of %d bytes that differ, the first at %d (%#x, want %#x)", n, len(want), i, got[i], want[i])
		}
	}
	if len(got) != len(want) {
		return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
	}
	return "the same bytes"
}
