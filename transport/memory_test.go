package transport

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// anonHugeKB reads the AnonHugePages (kB) of the mapping of /proc/self/smaps
// that contains addr.
func anonHugeKB(t *testing.T, addr uintptr) int {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skip(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	in := false
	for sc.Scan() {
		line := sc.Text()
		if lo, hi, ok := strings.Cut(strings.Fields(line)[0], "-"); ok && !strings.HasSuffix(line, ":") && !strings.Contains(line, " kB") {
			l, err1 := strconv.ParseUint(lo, 16, 64)
			h, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uint64(addr) >= l && uint64(addr) < h
			continue
		}
		if v, ok := strings.CutPrefix(line, "AnonHugePages:"); ok && in {
			kb, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			return kb
		}
	}
	return -1
}

func TestAllocMemory(t *testing.T) {
	for _, tc := range []struct {
		size int
		huge bool
	}{{4096, false}, {5000, false}, {3 << 20, false}, {4096, true}, {3<<20 + 123, true}, {8 << 20, true}} {
		m, err := AllocMemory(tc.size, tc.huge)
		if err != nil {
			t.Fatalf("AllocMemory(%d, %v): %v", tc.size, tc.huge, err)
		}
		b := m.Bytes()
		if len(b) != tc.size || cap(b) != tc.size {
			t.Errorf("AllocMemory(%d, %v): len %d cap %d", tc.size, tc.huge, len(b), cap(b))
		}
		if !bytes.Equal(b, make([]byte, tc.size)) {
			t.Errorf("AllocMemory(%d, %v): not zeroed", tc.size, tc.huge)
		}
		for i := range b {
			b[i] = byte(i)
		}
		hp := m.HugePages()
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		switch {
		case !tc.huge && hp != HugePagesNone:
			t.Errorf("AllocMemory(%d, false): %s", tc.size, hp)
		case hp == HugePagesTHP:
			if addr%thpSize != 0 {
				t.Errorf("AllocMemory(%d, true): transparent huge pages at %#x, not aligned to 2 MiB", tc.size, addr)
			}
			if err := CheckNotFileMapping(b); err != nil {
				t.Error(err)
			}
			t.Logf("AllocMemory(%d, true): %s at %#x, AnonHugePages %d kB (THP %q)", tc.size, hp, addr, anonHugeKB(t, addr), thpMode())
		case hp == HugePagesTLB:
			if err := CheckNotFileMapping(b); err != nil {
				t.Error(err)
			}
			t.Logf("AllocMemory(%d, true): %s at %#x", tc.size, hp, addr)
		case tc.huge && tc.size >= thpSize && thpMode() != "never" && thpMode() != "":
			t.Errorf("AllocMemory(%d, true): %s, want huge pages of some kind (THP %q)", tc.size, hp, thpMode())
		}
		if err := m.Free(); err != nil {
			t.Errorf("free %d bytes (%s): %v", tc.size, hp, err)
		}
		if err := m.Free(); err != nil || m.Bytes() != nil {
			t.Errorf("second free: %v, bytes %v", err, m.Bytes() != nil)
		}
	}
}
