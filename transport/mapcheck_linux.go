//go:build linux

package transport

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"unsafe"
)

// mapsReads counts the checks that read /proc/self/maps (for tests).
var mapsReads atomic.Int64

// CheckNotFileMapping reports, from /proc/self/maps, whether buf lies in
// memory that may be registered for RDMA: it returns an error matching
// ErrFileMapping if any byte of buf is in a mapping of a file.
//
// Pinning file pages for a device to write into behind the page cache's
// back is what RDMA registration does: kernels from 6.5 on refuse
// long-term pins of writable file-backed shared mappings, and older ones
// accept them and may lose or corrupt the data (the file system writes the
// page back and may reclaim or move it while the device still writes into
// the pinned copy). Providers call it in Register, whatever their kind, so
// that the software provider refuses what the hardware one would.
//
// The rule, per mapping of /proc/self/maps that overlaps buf:
//   - no path, or a pseudo name in brackets ([heap], [stack], [anon:...]):
//     anonymous memory, accepted;
//   - a path starting with "/" is a file, refused, except the names the
//     kernel gives to shmem and hugetlb memory that no file system writes
//     back: "/memfd:" (memfd_create), "/dev/zero" (a shared mapping of it),
//     "/anon_hugepage" (MAP_ANONYMOUS|MAP_HUGETLB, as AllocMemory maps huge
//     pages) and "/SYSV" (System V shared memory);
//   - anything else is accepted.
//
// Parts of buf that no mapping covers are not reported here: registering
// them fails in the provider itself.
//
// A buf that lies within one Memory not yet freed (AllocMemory's anonymous
// mapping) is accepted without reading /proc/self/maps.
func CheckNotFileMapping(buf []byte) error {
	if len(buf) == 0 {
		return nil
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
	if liveMem.contains(p, p+uintptr(len(buf))) {
		return nil
	}
	mapsReads.Add(1)
	lo := uint64(p)
	hi := lo + uint64(len(buf))
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return nil // no procfs: nothing to check against
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		start, end, path, ok := parseMapsLine(sc.Bytes())
		if !ok {
			continue
		}
		if start >= hi {
			break // the lines are sorted by address
		}
		if end <= lo {
			continue
		}
		if isFilePath(path) {
			return fmt.Errorf("register: the buffer is a mapping of file %q; RDMA must not pin file pages: %w", path, ErrFileMapping)
		}
	}
	return nil
}

// parseMapsLine splits "start-end perms offset dev inode   path".
func parseMapsLine(line []byte) (start, end uint64, path string, ok bool) {
	dash := bytes.IndexByte(line, '-')
	sp := bytes.IndexByte(line, ' ')
	if dash <= 0 || sp <= dash {
		return 0, 0, "", false
	}
	var err error
	if start, err = strconv.ParseUint(string(line[:dash]), 16, 64); err != nil {
		return 0, 0, "", false
	}
	if end, err = strconv.ParseUint(string(line[dash+1:sp]), 16, 64); err != nil {
		return 0, 0, "", false
	}
	// Skip perms, offset, dev and inode; the rest is the path.
	rest := line[sp:]
	for range 4 {
		rest = bytes.TrimLeft(rest, " ")
		i := bytes.IndexByte(rest, ' ')
		if i < 0 {
			return start, end, "", true
		}
		rest = rest[i:]
	}
	return start, end, string(bytes.TrimLeft(rest, " ")), true
}

// isFilePath applies the rule of CheckNotFileMapping to a mapping's path.
func isFilePath(path string) bool {
	if len(path) == 0 || path[0] != '/' {
		return false
	}
	for _, p := range []string{"/memfd:", "/dev/zero", "/anon_hugepage", "/SYSV"} {
		if len(path) >= len(p) && path[:len(p)] == p {
			return false
		}
	}
	return true
}
