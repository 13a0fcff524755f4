package target_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/target/targettest"
)

// TestRandomWritesDurable: random small writes (some across a chunk
// boundary, into the short last chunk), trims between them, Dones with and
// without FUA, with the background write-back merging and batching: a Done
// with FUA finds its bytes on the disk model's stable storage when it is
// answered, and after a Flush the disk holds exactly what was written.
// (Trims reach the file by fallocate on its descriptor, which the disk
// model does not see: its stable storage is checked outside them.)
func TestRandomWritesDurable(t *testing.T) {
	const chunk, size = 64 << 10, 4*(64<<10) + 5000
	rng := rand.New(rand.NewPCG(11, 12))
	model := make([]byte, size)
	for i := range model {
		model[i] = byte(rng.Uint32())
	}
	var disk *targettest.DiskStore
	e, _ := startWith(t, model, target.Options{CacheSize: 1 << 20, ChunkSize: chunk,
		WrapStore: func(_ string, f *os.File) target.Store {
			d, err := targettest.NewDiskStore(f)
			if err != nil {
				t.Fatal(err)
			}
			disk = d
			return d
		}}, target.ExportConfig{})
	model = bytes.Clone(model)
	trimmed := make([]bool, size) // since written
	c, err := e.dial(protocol.ModeReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	grants := map[uint64]protocol.Grant{}
	for off := uint64(0); off < size; off += chunk {
		var g protocol.Grant
		if err := c.Request(ctx, &protocol.GrantRequest{Handle: c.info.Handle, Flags: protocol.GrantWrite, Offset: off}, &g); err != nil {
			t.Fatal(err)
		}
		grants[off] = g
	}
	writes := 0
	for i := range 300 {
		off := uint64(rng.IntN(size))
		if rng.IntN(2) == 0 {
			off &^= 4095
		}
		n := 1 + uint64(rng.IntN(min(8192, size-int(off))))
		if rng.IntN(12) == 0 {
			if err := c.Request(ctx, &protocol.Trim{Handle: c.info.Handle, Offset: off, Length: n}, &protocol.OK{}); err != nil {
				t.Fatal(err)
			}
			clear(model[off : off+n])
			for j := off; j < off+n; j++ {
				trimmed[j] = true
			}
			continue
		}
		data := make([]byte, n)
		for j := range data {
			data[j] = byte(rng.Uint32())
		}
		copy(model[off:], data)
		clear(trimmed[off : off+n])
		for p := off; p < off+n; {
			g := grants[p/chunk*chunk]
			end := min(off+n, g.Offset+uint64(g.Length))
			if err := c.rdma(ctx, true, g, p-g.Offset, data[p-off:end-off]); err != nil {
				t.Fatal(err)
			}
			p = end
		}
		writes++
		done := &protocol.Done{Handle: c.info.Handle, Generation: c.info.Generation, Ranges: []protocol.Range{{Offset: off, Length: n}}}
		if i%10 != 0 {
			if err := c.Send(ctx, 0, done); err != nil {
				t.Fatal(err)
			}
			continue
		}
		done.Flags = protocol.DoneFUA
		if err := c.Request(ctx, done, &protocol.OK{}); err != nil {
			t.Fatal(err)
		}
		if got := disk.Durable(int64(off), int64(n)); !bytes.Equal(got, data) {
			t.Fatalf("write %d of %d bytes at %d with FUA answered, but the disk's stable storage does not hold it", i, n, off)
		}
	}
	if err := c.Request(ctx, &protocol.Flush{Handle: c.info.Handle, Generation: c.info.Generation}, &protocol.OK{}); err != nil {
		t.Fatal(err)
	}
	if file, _ := os.ReadFile(e.path); !bytes.Equal(file, model) {
		t.Fatalf("after Flush the file does not hold what was written: %s", firstDiffAt(file, model))
	}
	got := disk.Durable(0, size)
	for j := range got {
		if trimmed[j] {
			got[j] = 0
		}
	}
	if !bytes.Equal(got, model) {
		t.Fatalf("after Flush the disk's stable storage does not hold what was written: %s", firstDiffAt(got, model))
	}
	w, s := disk.Counts()
	t.Logf("%d writes reported in %d Dones reached the disk in %d writes, %d syncs", writes, writes, w, s)
}

func firstDiffAt(got, want []byte) string {
	for i := range min(len(got), len(want)) {
		if got[i] != want[i] {
			j := i
			for j < len(got) && got[j] != want[j] {
				j++
			}
			return fmt.Sprintf("bytes [%d, %d) differ (%#x, want %#x)", i, j, got[i], want[i])
		}
	}
	return fmt.Sprintf("%d bytes, want %d", len(got), len(want))
}
