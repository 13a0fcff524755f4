//go:build linux

package transport

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestCheckNotFileMappingLiveMemory: a buffer inside a live Memory is
// accepted without reading /proc/self/maps; one that is not, or reaches
// past the Memory, is checked from the map.
func TestCheckNotFileMappingLiveMemory(t *testing.T) {
	m, err := AllocMemory(2<<12, false)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	b := m.Bytes()
	for _, tc := range []struct {
		name     string
		buf      []byte
		wantRead bool
	}{
		{"the whole memory", b, false},
		{"a page inside it", b[4096:8192], false},
		{"one byte at its end", b[len(b)-1:], false},
		{"the Go heap", make([]byte, 4096), true},
		// Reaches one page past the mapping; the check reads no byte of it.
		{"past its end", unsafe.Slice(&b[4096], 8192), true},
	} {
		before := mapsReads.Load()
		if err := CheckNotFileMapping(tc.buf); err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if read := mapsReads.Load() != before; read != tc.wantRead {
			t.Errorf("%s: read /proc/self/maps %v, want %v", tc.name, read, tc.wantRead)
		}
	}
}

// TestCheckNotFileMappingAfterFree: once a Memory is freed, a file mapped
// at its address is refused, as any other file mapping.
func TestCheckNotFileMappingAfterFree(t *testing.T) {
	const size = 4 << 12
	m, err := AllocMemory(size, false)
	if err != nil {
		t.Fatal(err)
	}
	base := unsafe.Pointer(unsafe.SliceData(m.Bytes()))
	if err := m.Free(); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "file"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	p, err := unix.MmapPtr(int(f.Fd()), 0, base, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED_NOREPLACE)
	if err != nil {
		t.Skipf("map the file at the freed memory's address %p: %v", base, err)
	}
	defer unix.MunmapPtr(p, size)
	if p != base {
		t.Skipf("the file was mapped at %p, not at the freed memory's %p", p, base)
	}
	if err := CheckNotFileMapping(unsafe.Slice((*byte)(p), size)); !errors.Is(err, ErrFileMapping) {
		t.Fatalf("a file mapped where a freed Memory was: %v, want ErrFileMapping", err)
	}
}

// BenchmarkCheckNotFileMapping: the check of one page, inside a live
// Memory (no read of /proc/self/maps) and in the Go heap (a read).
func BenchmarkCheckNotFileMapping(b *testing.B) {
	m, err := AllocMemory(1<<20, false)
	if err != nil {
		b.Fatal(err)
	}
	defer m.Free()
	for _, bc := range []struct {
		name string
		buf  []byte
	}{{"memory", m.Bytes()[4096:8192]}, {"heap", make([]byte, 4096)}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if err := CheckNotFileMapping(bc.buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
