package transport

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// What backs a Memory (Memory.HugePages).
const (
	// HugePagesTLB: huge pages of the hugetlb pool (MAP_HUGETLB), which
	// must have been reserved (vm.nr_hugepages).
	HugePagesTLB = "hugetlb"
	// HugePagesTHP: normal pages that the kernel backs with transparent
	// huge pages where it can (madvise MADV_HUGEPAGE over a mapping
	// aligned to 2 MiB).
	HugePagesTHP = "thp"
	// HugePagesNone: normal pages.
	HugePagesNone = "none"
)

// thpSize is the size of a transparent huge page (a PMD on x86-64 and
// arm64 with 4 KiB pages): mappings smaller than it get none.
const thpSize = 2 << 20

// Memory is a buffer allocated outside the Go heap with mmap, so that its
// address is stable and may be handed to hardware. Register spans of it with
// Conn.Register.
type Memory struct {
	mu     sync.Mutex
	buf    []byte         // what Bytes returns
	base   unsafe.Pointer // the mapping Free unmaps
	mapLen uintptr
	huge   string
}

// AllocMemory maps size bytes of anonymous, zeroed memory.
//
// If hugePages is true it asks for huge pages: from the hugetlb pool first
// (MAP_HUGETLB, the mapping rounded up to the default huge page size),
// else, for a size of at least 2 MiB, normal pages aligned to 2 MiB and
// advised to be transparent huge pages (MADV_HUGEPAGE: the kernel backs
// them with huge pages when it has them). HugePages says which it got, for
// logs. Fewer, larger pages mean fewer entries in a device's translation
// tables and fewer TLB misses over large RDMA regions.
func AllocMemory(size int, hugePages bool) (*Memory, error) {
	if size <= 0 {
		return nil, fmt.Errorf("alloc memory: invalid size %d", size)
	}
	if hugePages {
		n := roundUp(size, hugeTLBSize())
		if p, err := mmap(n, unix.MAP_HUGETLB); err == nil {
			return newMemory(p, n, size, HugePagesTLB), nil
		}
		if size >= thpSize {
			if m, err := allocTHP(size); err == nil {
				return m, nil
			}
		}
	}
	p, err := mmap(size, 0)
	if err != nil {
		return nil, fmt.Errorf("alloc memory: mmap %d bytes: %w", size, err)
	}
	return newMemory(p, size, size, HugePagesNone), nil
}

func mmap(n, flags int) (unsafe.Pointer, error) {
	return unix.MmapPtr(-1, 0, nil, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|flags)
}

func newMemory(p unsafe.Pointer, mapLen, size int, huge string) *Memory {
	m := &Memory{buf: unsafe.Slice((*byte)(p), size), base: p, mapLen: uintptr(mapLen), huge: huge}
	liveMem.add(uintptr(p), uintptr(mapLen))
	return m
}

// liveMem holds the spans of the Memory not yet freed: anonymous mappings
// this process made (AllocMemory), which no file backs for as long as they
// live. CheckNotFileMapping accepts a buffer inside one of them without
// reading /proc/self/maps: a registration of cache memory (one per chunk
// on a device without memory windows, one per cache slot on one whose
// windows reach their whole region) then costs no read and parse of the
// whole map (26 µs in a small process on this project's machines; more
// with more mappings). Free takes the span out before it unmaps it, so
// whatever is mapped there later is checked from /proc/self/maps again.
var liveMem memSpans

type memSpans struct {
	mu sync.RWMutex
	// One per live Memory, in no order: the target's cache, each link's
	// message buffers, the initiator's pool. A scan of them, even with a
	// link per session of a busy target, costs far less than the map.
	spans []memSpan
}

type memSpan struct{ lo, hi uintptr }

func (l *memSpans) add(base, n uintptr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.spans = append(l.spans, memSpan{base, base + n})
}

func (l *memSpans) remove(base uintptr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, s := range l.spans {
		if s.lo == base {
			last := len(l.spans) - 1
			l.spans[i] = l.spans[last]
			l.spans = l.spans[:last]
			return
		}
	}
}

// contains reports whether [lo, hi) lies within one live Memory.
func (l *memSpans) contains(lo, hi uintptr) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	for _, s := range l.spans {
		if lo >= s.lo && hi <= s.hi {
			return true
		}
	}
	return false
}

// allocTHP maps size bytes (rounded up to thpSize) at an address aligned
// to thpSize, so that every 2 MiB of it may be a huge page, and advises
// transparent huge pages for it. It fails when the kernel refuses the
// advice (no THP support); with THP disabled ("never") the memory is
// reported as HugePagesNone.
func allocTHP(size int) (*Memory, error) {
	n := roundUp(size, thpSize)
	raw, err := mmap(n+thpSize, 0)
	if err != nil {
		return nil, err
	}
	skip := roundUp(int(uintptr(raw)), thpSize) - int(uintptr(raw))
	p := unsafe.Add(raw, skip)
	// Unmap the unaligned head and the tail.
	if skip > 0 {
		unix.MunmapPtr(raw, uintptr(skip))
	}
	if tail := thpSize - skip; tail > 0 {
		unix.MunmapPtr(unsafe.Add(p, n), uintptr(tail))
	}
	if err := unix.Madvise(unsafe.Slice((*byte)(p), n), unix.MADV_HUGEPAGE); err != nil {
		unix.MunmapPtr(p, uintptr(n))
		return nil, err
	}
	huge := HugePagesTHP
	if thpMode() == "never" {
		huge = HugePagesNone
	}
	return newMemory(p, n, size, huge), nil
}

func roundUp(n, to int) int { return (n + to - 1) / to * to }

var hugeTLBSizeOnce = sync.OnceValue(func() int {
	// The default huge page size, which MAP_HUGETLB maps and munmap
	// must be given a multiple of.
	if f, err := os.Open("/proc/meminfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if v, ok := bytes.CutPrefix(sc.Bytes(), []byte("Hugepagesize:")); ok {
				v = bytes.TrimSpace(bytes.TrimSuffix(bytes.TrimSpace(v), []byte("kB")))
				if kb, err := strconv.Atoi(string(v)); err == nil && kb > 0 {
					return kb << 10
				}
			}
		}
	}
	return thpSize
})

// hugeTLBSize is the default huge page size of the hugetlb pool.
func hugeTLBSize() int { return hugeTLBSizeOnce() }

// thpMode is the system's transparent huge page setting: "always",
// "madvise", "never", or "" if it cannot be read.
func thpMode() string {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	if err != nil {
		return ""
	}
	if i := bytes.IndexByte(b, '['); i >= 0 {
		if j := bytes.IndexByte(b[i:], ']'); j > 0 {
			return string(b[i+1 : i+j])
		}
	}
	return ""
}

// HugePages says what backs the memory: HugePagesTLB, HugePagesTHP or
// HugePagesNone (with hugePages false, always the last).
func (m *Memory) HugePages() string { return m.huge }

// Bytes is the memory, the size bytes asked for. It is nil after Free.
func (m *Memory) Bytes() []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.buf
}

// Free unmaps the memory. Every region registered over it must have been
// deregistered first. Safe to call twice.
func (m *Memory) Free() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.buf == nil {
		return nil
	}
	// Out of the known spans before the unmap: once unmapped, the
	// address range may be mapped again, to a file.
	liveMem.remove(uintptr(m.base))
	err := unix.MunmapPtr(m.base, m.mapLen)
	m.buf, m.base = nil, nil
	if err != nil {
		return fmt.Errorf("free memory: %w", err)
	}
	return nil
}
