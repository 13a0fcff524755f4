package target

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/safeopen"
)

// ExportConfig describes one exported volume.
type ExportConfig struct {
	// Name is what initiators open it by.
	Name string
	// Path is a regular file or a block device.
	Path string
	// ReadOnly exports refuse writes, trims and write-zeroes, and their
	// chunks are registered without remote write access.
	ReadOnly bool
	// Size, if not zero, creates Path as a sparse file of that size when it
	// does not exist. An existing file keeps its size.
	Size int64
	// Allow, if not empty, lists the host IDs that may list and open the
	// export; other hosts are refused.
	Allow []string
	// Private exports admit the hosts in Allow only: with Allow empty, no
	// host (a pool's volume before it is published to a host). Without
	// it an empty Allow admits every host.
	Private bool
	// Shared lets several hosts open the export read-write at once (for
	// cluster file systems). Without it a read-write export has one writer
	// at a time (see Open's takeover); read-only opens are always shared.
	Shared bool
}

// allows reports whether host may open e.
func (e *ExportConfig) allows(host string) bool {
	if len(e.Allow) == 0 {
		return !e.Private
	}
	for _, h := range e.Allow {
		if h == host {
			return true
		}
	}
	return false
}

// ParseExport parses NAME=PATH[,ro][,size=BYTES], the form of rblkd's --export flag.
func ParseExport(s string) (ExportConfig, error) {
	name, rest, ok := strings.Cut(s, "=")
	if !ok || name == "" || rest == "" {
		return ExportConfig{}, fmt.Errorf("export %q: want NAME=PATH[,ro][,size=BYTES][,shared][,allow=ID1:ID2]", s)
	}
	if len(name) > 255 || strings.ContainsAny(name, "\x00/") {
		return ExportConfig{}, fmt.Errorf("export %q: name must be 1-255 bytes without '/' or NUL", s)
	}
	parts := strings.Split(rest, ",")
	e := ExportConfig{Name: name, Path: parts[0]}
	if e.Path == "" {
		return ExportConfig{}, fmt.Errorf("export %q: empty path", s)
	}
	for _, p := range parts[1:] {
		switch {
		case p == "ro":
			e.ReadOnly = true
		case p == "rw":
			e.ReadOnly = false
		case p == "shared":
			e.Shared = true
		case strings.HasPrefix(p, "allow="):
			for _, h := range strings.Split(strings.TrimPrefix(p, "allow="), ":") {
				if h == "" || len(h) > 255 || strings.ContainsRune(h, 0) {
					return ExportConfig{}, fmt.Errorf("export %q: bad host ID %q in allow= (host IDs separated by ':')", s, h)
				}
				e.Allow = append(e.Allow, h)
			}
		case strings.HasPrefix(p, "size="):
			n, err := ParseSize(strings.TrimPrefix(p, "size="))
			if err != nil || n <= 0 {
				return ExportConfig{}, fmt.Errorf("export %q: bad size %q", s, p)
			}
			e.Size = n
		default:
			return ExportConfig{}, fmt.Errorf("export %q: unknown option %q (want ro, rw, size=BYTES, shared or allow=ID1:ID2)", s, p)
		}
	}
	return e, nil
}

// ParseSize parses a byte count with an optional binary suffix: 4096, 64K,
// 256M, 10G, 1T (also KiB, MiB, GiB, TiB).
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(strings.ToUpper(s))
	t = strings.TrimSuffix(strings.TrimSuffix(t, "IB"), "B")
	mult := int64(1)
	if t != "" {
		switch t[len(t)-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult != 1 {
			t = t[:len(t)-1]
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 || n > (1<<62)/mult {
		return 0, fmt.Errorf("size %q: want a number of bytes with an optional K, M, G or T suffix", s)
	}
	return n * mult, nil
}

// Store is a volume's backing storage as the target uses it: an *os.File
// of a regular file or block device satisfies it. Options.WrapStore may put
// another in front of the file, for example to inject a slow or failing
// disk in tests.
type Store interface {
	// ReadAt and WriteAt are those of io.ReaderAt and io.WriterAt; they may
	// be called concurrently on different ranges. A Store may also
	// implement VectorWriterAt.
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	// Sync makes every write that returned before it was called durable.
	Sync() error
	// Fd is the file descriptor that fallocate (trim, write zeroes) acts on.
	Fd() uintptr
}

// volume is an open export.
type volume struct {
	cfg      ExportConfig
	id       uint32
	name     string
	path     string
	readOnly bool
	file     *os.File      // the backing file, closed with the volume
	f        Store         // file, or what Options.WrapStore put in front of it
	size     atomic.Uint64 // bytes; grows online (Target.Grow), never shrinks
	blockDev bool
	// fileID is the backing file's identity: one file is one export,
	// whatever names reach it.
	fileID FileID
	growMu sync.Mutex  // serializes Grow
	m      *volMetrics // this export's series (Metrics.forExport)

	// cached counts the cache slots holding chunks of the volume (a slot
	// leaked by a failed deregistration stays counted, as in
	// rblkd_cache_used_bytes). Changed under cache.mu; the metrics
	// collector reads it without.
	cached atomic.Int64

	// ioMu orders loads (shared) against trims and write-zeroes (exclusive),
	// so that a chunk is never loaded from a range being zeroed.
	ioMu sync.RWMutex

	dirtyMu sync.Mutex
	dirty   []*chunk // the chunks queued for write-back (chunk.queued)
	spare   []*chunk // the list a pass took and gave back (passDone), reused as dirty
	wbErr   error    // first write-back error since the last flush
	// wbTimer fires wbDelay after a chunk was queued on an empty list:
	// the write-back loop's one wakeup per pass (armed by markDirty).
	wbTimer *time.Timer
	wbDelay time.Duration
	// queuedAt is when the oldest chunk on the dirty list was queued, and
	// passAt when the oldest chunk of the write-back pass under way was
	// (UnixNano, 0: none); the write-back lag gauge is the older's age.
	// Guarded by dirtyMu.
	queuedAt, passAt int64

	// passMu is held by a write-back pass from the moment it takes dirty
	// chunks off the list until their blocks are written: a flush takes
	// it too, so it never misses ranges a background pass has taken and
	// not yet written.
	passMu  sync.Mutex
	pass    wbPass // the background and flush passes' buffers (passMu)
	flushMu sync.Mutex

	// removed: RemoveExport took the export away; no new handle of it.
	removed atomic.Bool
	// stopLoop ends the volume's write-back loop; loopDone is closed
	// when it ended.
	stopLoop context.CancelFunc
	loopDone chan struct{}
}

// openVolume opens e's backing file (creating a sparse file of e.Size
// where e asks for one and the path does not exist: created) and checks
// it: a regular file or a block device, not empty. The open never blocks:
// a FIFO, a socket, a character device or a directory is refused at once
// (see package safeopen). The volume is not served yet (no id, no store
// wrapper, no metrics).
func openVolume(e ExportConfig) (v *volume, created bool, err error) {
	flags := os.O_RDWR
	if e.ReadOnly {
		flags = os.O_RDONLY
	}
	const kinds = safeopen.Regular | safeopen.BlockDevice
	f, st, err := safeopen.Open(e.Path, flags, 0, kinds)
	if errors.Is(err, os.ErrNotExist) && e.Size > 0 && !e.ReadOnly {
		f, st, err = safeopen.Open(e.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600, kinds)
		if err == nil {
			created = true
			if terr := f.Truncate(e.Size); terr != nil {
				f.Close()
				os.Remove(e.Path)
				return nil, false, fmt.Errorf("export %q: create sparse file %s: %w", e.Name, e.Path, terr)
			}
		}
	}
	if err != nil {
		return nil, false, fmt.Errorf("export %q: %w", e.Name, err) // err names the path
	}
	v = &volume{cfg: e, name: e.Name, path: e.Path, readOnly: e.ReadOnly, file: f, f: f,
		fileID: safeopen.IDOf(st), wbTimer: time.NewTimer(time.Hour)}
	v.wbTimer.Stop()
	fail := func(err error) (*volume, bool, error) {
		f.Close()
		if created {
			os.Remove(e.Path)
		}
		return nil, false, err
	}
	if st.Mode().IsRegular() {
		size := st.Size()
		if created {
			size = e.Size
		}
		v.size.Store(uint64(size))
	} else { // a block device (safeopen refused every other kind)
		end, err := f.Seek(0, io.SeekEnd)
		if err != nil {
			return fail(fmt.Errorf("export %q: size of %s: %w", e.Name, e.Path, err))
		}
		v.size.Store(uint64(end))
		v.blockDev = true
	}
	if v.size.Load() == 0 {
		return fail(fmt.Errorf("export %q: %s is empty (give size=BYTES to create it)", e.Name, e.Path))
	}
	return v, created, nil
}

// markDirty queues ch for write-back, unless it is queued already. The
// caller marked the blocks dirty before: a chunk seen queued here is taken
// off the list (takeDirty) after those blocks were marked, so the pass that
// takes it writes them.
func (v *volume) markDirty(ch *chunk) {
	if ch.queued.Load() {
		return
	}
	v.dirtyMu.Lock()
	if !ch.queued.Load() {
		ch.queued.Store(true)
		if len(v.dirty) == 0 {
			v.queuedAt = time.Now().UnixNano()
			// The pass that writes it comes wbDelay from now (a pass
			// in progress took the list before: the next one). A
			// fire not yet received is dropped: its pass would find
			// what this one finds.
			v.wbTimer.Reset(v.wbDelay)
		}
		v.dirty = append(v.dirty, ch)
	}
	v.dirtyMu.Unlock()
}

// takeDirty takes the queued chunks off the list.
func (v *volume) takeDirty() []*chunk {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	out := v.dirty
	v.dirty, v.spare = v.spare[:0], nil
	if v.passAt == 0 {
		v.passAt = v.queuedAt
	}
	v.queuedAt = 0
	for _, ch := range out {
		ch.queued.Store(false)
	}
	return out
}

// passDone ends the write-back pass that takeDirty started: what it took
// is written, or, if it failed, marked dirty and queued again, and then
// still as old as it was. taken, the list takeDirty returned, is kept for
// the next pass's queue, so that queueing allocates nothing once the list
// has grown to its size.
func (v *volume) passDone(taken []*chunk, failed bool) {
	clear(taken) // (no chunk stays referenced from the spare list)
	v.dirtyMu.Lock()
	v.spare = taken[:0]
	if failed && len(v.dirty) > 0 && v.passAt != 0 && v.passAt < v.queuedAt {
		v.queuedAt = v.passAt
	}
	v.passAt = 0
	v.dirtyMu.Unlock()
}

// writebackState returns the chunks queued for write-back and the age of
// the oldest range waiting for or in write-back (0: none).
func (v *volume) writebackState(now time.Time) (queued int, lag time.Duration) {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	oldest := v.passAt
	if oldest == 0 || (v.queuedAt != 0 && v.queuedAt < oldest) {
		oldest = v.queuedAt
	}
	if oldest != 0 {
		lag = max(now.Sub(time.Unix(0, oldest)), 0)
	}
	return len(v.dirty), lag
}

func (v *volume) setErr(err error) {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	if v.wbErr == nil {
		v.wbErr = err
	}
}

// takeErr returns and clears the first write-back error since the last call.
func (v *volume) takeErr() error {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	err := v.wbErr
	v.wbErr = nil
	return err
}

// zeroFile makes [off, off+n) of the backing file read as zeroes: by punching
// a hole (unless noHole), else by zeroing the range in place, else by writing
// zeroes.
func (v *volume) zeroFile(off, n uint64, noHole bool) error {
	fd := int(v.f.Fd())
	if !noHole {
		err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(off), int64(n))
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("punch hole: %w", err)
		}
	}
	err := unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, int64(off), int64(n))
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("zero range: %w", err)
	}
	zero := make([]byte, min(n, 1<<20))
	for n > 0 {
		k := min(n, uint64(len(zero)))
		if _, err := v.f.WriteAt(zero[:k], int64(off)); err != nil {
			return fmt.Errorf("write zeroes: %w", err)
		}
		off, n = off+k, n-k
	}
	return nil
}
