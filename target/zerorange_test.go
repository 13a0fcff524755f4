package target

import (
	"bytes"
	"testing"
)

// TestZeroRangePastShortChunk: between a Grow making the new size the
// volume's and the refit of its short last chunk, a trim beyond that
// chunk's old end finds it cached, shorter than the range: the file is
// zeroed and the cached chunk left alone (it is refit next). Before, the
// slice of the chunk's buffer ran past its end: a panic.
func TestZeroRangePastShortChunk(t *testing.T) {
	const cs = 64 << 10
	tg, v, _ := benchTarget(t, cs+36<<10, cs) // chunk 1 is 36 KiB
	chunks := loadChunks(t, tg.cache, nil, v, 2)
	if len(chunks[1].buf) != 36<<10 {
		t.Fatalf("chunk 1 has %d bytes", len(chunks[1].buf))
	}
	// Grow's first half: the file extended, the new size in effect.
	if err := v.extend(2 * cs); err != nil {
		t.Fatal(err)
	}
	if _, err := v.file.WriteAt(bytes.Repeat([]byte{7}, 4096), cs+46<<10); err != nil {
		t.Fatal(err)
	}
	v.size.Store(2 * cs)
	if err := tg.cache.zeroRange(v, cs+46<<10, 4096, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := v.file.ReadAt(got, cs+46<<10); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, make([]byte, 4096)) {
		t.Fatal("the range past the short chunk was not zeroed in the file")
	}
}
