package pool

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/internal/lockfile"
	"github.com/rblk/rblk/internal/safeopen"
)

// Sentinel errors, matched with errors.Is.
var (
	// ErrInvalid: a bad volume name or size.
	ErrInvalid = errors.New("invalid argument")
	// ErrNotFound: no volume of that name in the pool.
	ErrNotFound = errors.New("no such volume")
	// ErrExists: a volume of that name exists with another size or
	// sharing.
	ErrExists = errors.New("volume exists with other properties")
	// ErrNoSpace: the pool cannot hold the size asked for (its capacity
	// or its file system's free space), or it holds its most volumes.
	ErrNoSpace = errors.New("not enough capacity")
	// ErrInUse: another process holds the pool's directory.
	ErrInUse = errors.New("pool directory in use by another process")
	// ErrDamaged: a volume's record or data file is not what the pool
	// wrote (its data file replaced, its record unreadable): the volume
	// is not served until an operator looks at it.
	ErrDamaged = errors.New("volume damaged")
)

// testCrash, set by tests only, is asked at each step of a create and a
// delete whether the process dies there: if it says so, the operation
// stops at once, as a kill -9 would stop it, and returns errCrashed.
var testCrash func(point string) bool

var errCrashed = errors.New("crashed (test)")

func crash(point string) bool { return testCrash != nil && testCrash(point) }

// BlockSize is the unit of volume sizes: a size is a multiple of it.
const BlockSize = 4096

// DefaultMaxVolumes bounds the volumes of a pool without MaxVolumes.
const DefaultMaxVolumes = 4096

// MaxNameLen bounds a volume name's length in bytes.
const MaxNameLen = 200

// File name suffixes in a pool's directory.
const (
	dataSuffix = ".img"
	newSuffix  = ".img.new" // .NAME.img.new: a data file being created
	delSuffix  = ".img.del" // .NAME.img.del: a data file being deleted
	metaSuffix = ".meta"
	lockName   = ".rblk-pool.lock"
)

var volumeName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// CheckName says why name cannot name a volume, or nil: 1-200 bytes of
// letters, digits, '.', '_' and '-', starting with a letter or digit,
// without "..".
func CheckName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("empty volume name: %w", ErrInvalid)
	case len(name) > MaxNameLen:
		return fmt.Errorf("volume name of %d bytes: at most %d: %w", len(name), MaxNameLen, ErrInvalid)
	case strings.Contains(name, ".."):
		return fmt.Errorf("volume name %q contains \"..\": %w", name, ErrInvalid)
	case !volumeName.MatchString(name):
		return fmt.Errorf("volume name %q: want letters, digits, '.', '_' and '-', starting with a letter or digit (no '/'): %w", name, ErrInvalid)
	}
	return nil
}

// Config is a pool.
type Config struct {
	// Name names the pool (config.ValidPoolName).
	Name string
	// Dir is the pool's directory, created (0750) if missing.
	Dir string
	// Capacity bounds the sum of its volumes' sizes; 0: the size of the
	// file system Dir is on.
	Capacity int64
	// Labels are the pool's topology.
	Labels map[string]string
	// MaxVolumes bounds its volumes; 0: DefaultMaxVolumes.
	MaxVolumes int
	// Logger: what Open cleaned up, damaged volumes. Default: none.
	Logger *zap.Logger
}

// Volume is a volume of a pool.
type Volume struct {
	Pool string
	Name string
	// Path is its data file.
	Path string
	// Size is the data file's size now (it grows online: the file is
	// the truth).
	Size int64
	// Allocated is what its data file takes on disk.
	Allocated int64
	// Shared: several hosts may write it at once.
	Shared bool
	// Hosts are the host IDs it is published to, sorted.
	Hosts   []string
	Created time.Time
	// Ino is its data file's inode.
	Ino uint64
}

// Export is the name the volume is served under: POOL:NAME.
func (v Volume) Export() string { return ExportName(v.Pool, v.Name) }

// ExportName is the export name of volume name of pool.
func ExportName(pool, name string) string { return pool + ":" + name }

// record is NAME.meta.
type record struct {
	Version int       `json:"version"`
	Name    string    `json:"name"`
	Ino     uint64    `json:"ino"`
	Shared  bool      `json:"shared,omitempty"`
	Hosts   []string  `json:"hosts"`
	Created time.Time `json:"created"`
}

const recordVersion = 1

// maxRecord bounds a record's size (a record with every host of a large
// cluster stays far below).
const maxRecord = 1 << 20

// Pool is an open pool.
type Pool struct {
	cfg  Config
	log  *zap.Logger
	lock *os.File

	mu      sync.Mutex
	vols    map[string]*record
	damaged map[string]error
	// reserved is the growth ReserveGrow promised and its caller has not
	// made yet: it counts as provisioned.
	reserved int64
	closed   bool
}

// Open opens the pool of cfg: it creates its directory if missing, takes
// its lock file (ErrInUse if another process holds it), reads the
// volumes' records, and removes what a crash left (data files without a
// record, records being written). A volume whose record or data file is
// not what the pool wrote is left alone and reported (Damaged).
func Open(cfg Config) (*Pool, error) {
	if cfg.MaxVolumes == 0 {
		cfg.MaxVolumes = DefaultMaxVolumes
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if err := os.MkdirAll(cfg.Dir, 0o750); err != nil {
		return nil, fmt.Errorf("pool %q: %w", cfg.Name, err)
	}
	st, err := os.Stat(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("pool %q: %w", cfg.Name, err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("pool %q: %s is %s, not a directory", cfg.Name, cfg.Dir, safeopen.KindOf(st.Mode()))
	}
	lock, err := lockFile(filepath.Join(cfg.Dir, lockName))
	if err != nil {
		return nil, fmt.Errorf("pool %q: %w", cfg.Name, err)
	}
	p := &Pool{cfg: cfg, log: cfg.Logger.With(zap.String("pool", cfg.Name)), lock: lock, vols: map[string]*record{}, damaged: map[string]error{}}
	if err := p.load(); err != nil {
		lock.Close()
		return nil, fmt.Errorf("pool %q: %w", cfg.Name, err)
	}
	return p, nil
}

// lockFile takes the pool's lock file (package lockfile): ErrInUse if
// another process holds it.
func lockFile(name string) (*os.File, error) {
	f, err := lockfile.Lock(name)
	if errors.Is(err, lockfile.ErrLocked) {
		return nil, fmt.Errorf("%w: another process holds %s", ErrInUse, name)
	}
	return f, err
}

// load reads the records and finishes or undoes what a crash cut short:
//   - a record being written (.NAME.meta.tmp) is removed;
//   - a data file being created (.NAME.img.new) is put in place if its
//     record was written (the create had committed), else removed;
//   - a data file being deleted (.NAME.img.del) is removed, with its
//     record if that is still there (the delete had begun).
//
// A NAME.img without a record is no volume of the pool (a file put there
// by hand): it is left alone, and reported.
func (p *Pool) load() error {
	entries, err := os.ReadDir(p.cfg.Dir)
	if err != nil {
		return err
	}
	have := map[string]bool{}
	for _, e := range entries {
		have[e.Name()] = true
	}
	for _, e := range entries {
		n := e.Name()
		if !strings.HasPrefix(n, ".") && strings.HasSuffix(n, metaSuffix) {
			name := strings.TrimSuffix(n, metaSuffix)
			if CheckName(name) != nil {
				continue // not the pool's
			}
			if len(p.vols) >= p.cfg.MaxVolumes {
				return fmt.Errorf("more than %d volumes: %w", p.cfg.MaxVolumes, ErrNoSpace)
			}
			r, err := p.readRecord(name)
			if err != nil {
				p.damaged[name] = err
				p.log.Error("volume damaged: not served", zap.String("volume", name), zap.Error(err))
				continue
			}
			if r == nil {
				continue // a delete finished
			}
			p.vols[name] = r
		}
	}
	for _, e := range entries {
		n := e.Name()
		switch {
		case strings.HasPrefix(n, ".") && strings.HasSuffix(n, metaSuffix+".tmp"):
			p.log.Warn("removing a record left half-written by a crash", zap.String("file", n))
			if err := removeIfThere(filepath.Join(p.cfg.Dir, n)); err != nil {
				return err
			}
		case strings.HasPrefix(n, ".") && (strings.HasSuffix(n, newSuffix) || strings.HasSuffix(n, delSuffix)):
			name := strings.TrimSuffix(strings.TrimSuffix(strings.TrimPrefix(n, "."), newSuffix), delSuffix)
			if p.vols[name] != nil || p.damaged[name] != nil || !have[n] {
				continue
			}
			p.log.Warn("removing a data file a crash left of a create or a delete", zap.String("file", n))
			if err := removeIfThere(filepath.Join(p.cfg.Dir, n)); err != nil {
				return err
			}
		case strings.HasSuffix(n, dataSuffix) && !strings.HasPrefix(n, "."):
			name := strings.TrimSuffix(n, dataSuffix)
			if p.vols[name] == nil && p.damaged[name] == nil {
				p.log.Warn("a data file without a record is no volume of the pool: left alone (a volume of its name cannot be created)", zap.String("file", n))
			}
		}
	}
	return syncDir(p.cfg.Dir)
}

func removeIfThere(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", path, err)
	}
	return nil
}

// readRecord reads NAME.meta and checks it against NAME.img, finishing
// a create or a delete a crash cut short (see load): nil, nil for a
// delete it finished.
func (p *Pool) readRecord(name string) (*record, error) {
	b, _, err := safeopen.ReadFile(p.metaPath(name), maxRecord)
	if err != nil {
		return nil, fmt.Errorf("%w: read its record: %v", ErrDamaged, err)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%w: its record: %v", ErrDamaged, err)
	}
	if r.Version != recordVersion || r.Name != name {
		return nil, fmt.Errorf("%w: its record is version %d of %q, want version %d of %q", ErrDamaged, r.Version, r.Name, recordVersion, name)
	}
	st, err := os.Lstat(p.dataPath(name))
	if errors.Is(err, fs.ErrNotExist) {
		switch {
		case inodeIs(p.newPath(name), r.Ino):
			p.log.Warn("finishing a create a crash cut short", zap.String("volume", name))
			if err := os.Rename(p.newPath(name), p.dataPath(name)); err != nil {
				return nil, fmt.Errorf("finish the create of volume %q: %w", name, err)
			}
			st, err = os.Lstat(p.dataPath(name))
		case inodeIs(p.delPath(name), r.Ino):
			p.log.Warn("finishing a delete a crash cut short", zap.String("volume", name))
			if err := removeIfThere(p.metaPath(name)); err != nil {
				return nil, err
			}
			return nil, removeIfThere(p.delPath(name))
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w: its data file: %v", ErrDamaged, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: its data file is %s", ErrDamaged, safeopen.KindOf(st.Mode()))
	}
	if ino := st.Sys().(*syscall.Stat_t).Ino; ino != r.Ino {
		return nil, fmt.Errorf("%w: its data file is inode %d, the record says %d: replaced behind the pool's back", ErrDamaged, ino, r.Ino)
	}
	return &r, nil
}

// inodeIs reports whether path is a regular file of inode ino.
func inodeIs(path string, ino uint64) bool {
	st, err := os.Lstat(path)
	return err == nil && st.Mode().IsRegular() && st.Sys().(*syscall.Stat_t).Ino == ino
}

func (p *Pool) dataPath(name string) string { return filepath.Join(p.cfg.Dir, name+dataSuffix) }
func (p *Pool) newPath(name string) string  { return filepath.Join(p.cfg.Dir, "."+name+newSuffix) }
func (p *Pool) delPath(name string) string  { return filepath.Join(p.cfg.Dir, "."+name+delSuffix) }
func (p *Pool) metaPath(name string) string { return filepath.Join(p.cfg.Dir, name+metaSuffix) }

// Name is the pool's name.
func (p *Pool) Name() string { return p.cfg.Name }

// Labels are the pool's topology labels (a copy).
func (p *Pool) Labels() map[string]string {
	out := make(map[string]string, len(p.cfg.Labels))
	for k, v := range p.cfg.Labels {
		out[k] = v
	}
	return out
}

// Damaged returns the volumes not served and why.
func (p *Pool) Damaged() map[string]error {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]error, len(p.damaged))
	for k, v := range p.damaged {
		out[k] = v
	}
	return out
}

// Close releases the pool's lock. It is safe to call twice.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		p.lock.Close()
	}
}

// volume is r as a Volume, with its file's size now.
func (p *Pool) volume(r *record) (Volume, error) {
	v := Volume{Pool: p.cfg.Name, Name: r.Name, Path: p.dataPath(r.Name), Shared: r.Shared, Hosts: slices.Clone(r.Hosts), Created: r.Created, Ino: r.Ino}
	if v.Hosts == nil {
		v.Hosts = []string{}
	}
	st, err := os.Lstat(v.Path)
	if err != nil {
		return Volume{}, fmt.Errorf("volume %q: %w", r.Name, err)
	}
	v.Size = st.Size()
	v.Allocated = min(st.Sys().(*syscall.Stat_t).Blocks*512, v.Size)
	return v, nil
}

// Get returns volume name.
func (p *Pool) Get(name string) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.vols[name]
	if r == nil {
		if err := p.damaged[name]; err != nil {
			return Volume{}, fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, err)
		}
		return Volume{}, fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, ErrNotFound)
	}
	return p.volume(r)
}

// List returns the pool's volumes, by name.
func (p *Pool) List() ([]Volume, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Volume, 0, len(p.vols))
	for _, r := range p.vols {
		v, err := p.volume(r)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Capacity is what a pool holds and can take.
type Capacity struct {
	// Limit is the pool's capacity: configured, or its file system's
	// size.
	Limit int64
	// Provisioned is the sum of its volumes' sizes.
	Provisioned int64
	// Allocated is what its volumes take on disk.
	Allocated int64
	// Available is the largest volume (or growth) it takes now: the
	// limit less what is provisioned, and no more than its file system
	// can still give its volumes once each is written in full.
	Available int64
	// Volumes is how many volumes it holds.
	Volumes int
}

// Capacity returns the pool's capacity now.
func (p *Pool) Capacity() (Capacity, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.capacity()
}

func (p *Pool) capacity() (Capacity, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(p.cfg.Dir, &fs); err != nil {
		return Capacity{}, fmt.Errorf("pool %q: statfs %s: %w", p.cfg.Name, p.cfg.Dir, err)
	}
	c := Capacity{Limit: p.cfg.Capacity, Volumes: len(p.vols)}
	if c.Limit == 0 {
		c.Limit = int64(fs.Blocks) * fs.Bsize
	}
	for _, r := range p.vols {
		v, err := p.volume(r)
		if err != nil {
			return Capacity{}, err
		}
		c.Provisioned += v.Size
		c.Allocated += v.Allocated
	}
	// (A growth being made: the file may have grown already, or not.)
	c.Provisioned += p.reserved
	free := int64(fs.Bavail)*fs.Bsize - (c.Provisioned - c.Allocated) // what the volumes may still take
	c.Available = max(0, min(c.Limit-c.Provisioned, free))
	return c, nil
}

// checkSize says why size cannot be a volume's size, or nil.
func checkSize(size int64) error {
	if size <= 0 || size%BlockSize != 0 {
		return fmt.Errorf("size %d: want a multiple of %d bytes above 0: %w", size, BlockSize, ErrInvalid)
	}
	return nil
}

// Create creates volume name of size bytes (a multiple of BlockSize),
// empty (it reads zeros), unpublished. A volume of that name with that
// size and sharing is returned as it is (created false): a retried create
// succeeds; with another size or sharing it is ErrExists. ErrNoSpace when
// the pool cannot take it.
func (p *Pool) Create(name string, size int64, shared bool) (v Volume, created bool, err error) {
	if err := CheckName(name); err != nil {
		return Volume{}, false, err
	}
	if err := checkSize(size); err != nil {
		return Volume{}, false, fmt.Errorf("volume %q: %w", name, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return Volume{}, false, fmt.Errorf("volume %q: pool %q closed", name, p.cfg.Name)
	}
	if err := p.damaged[name]; err != nil {
		return Volume{}, false, fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, err)
	}
	if r := p.vols[name]; r != nil {
		v, err := p.volume(r)
		if err != nil {
			return Volume{}, false, err
		}
		if v.Size != size || v.Shared != shared {
			return Volume{}, false, fmt.Errorf("volume %q of pool %q is %d bytes, shared %v (asked: %d bytes, shared %v): %w",
				name, p.cfg.Name, v.Size, v.Shared, size, shared, ErrExists)
		}
		return v, false, nil
	}
	if len(p.vols) >= p.cfg.MaxVolumes {
		return Volume{}, false, fmt.Errorf("volume %q: pool %q holds %d volumes, its most: %w", name, p.cfg.Name, len(p.vols), ErrNoSpace)
	}
	c, err := p.capacity()
	if err != nil {
		return Volume{}, false, err
	}
	if size > c.Available {
		return Volume{}, false, fmt.Errorf("volume %q of %d bytes: pool %q has %d bytes available (capacity %d, provisioned %d): %w",
			name, size, p.cfg.Name, c.Available, c.Limit, c.Provisioned, ErrNoSpace)
	}
	if _, err := os.Lstat(p.dataPath(name)); !errors.Is(err, fs.ErrNotExist) {
		return Volume{}, false, fmt.Errorf("volume %q: %s is in pool %q's directory and is no volume of it (move it away): %w",
			name, p.dataPath(name), p.cfg.Name, ErrExists)
	}
	ino, err := p.createData(name, size)
	if err != nil {
		return Volume{}, false, fmt.Errorf("create volume %q in pool %q: %w", name, p.cfg.Name, err)
	}
	if crash("create: data file made") {
		return Volume{}, false, errCrashed
	}
	r := &record{Version: recordVersion, Name: name, Ino: ino, Shared: shared, Hosts: []string{}, Created: time.Now().UTC().Truncate(time.Second)}
	if err := p.writeRecord(r); err != nil {
		os.Remove(p.newPath(name))
		return Volume{}, false, fmt.Errorf("create volume %q in pool %q: %w", name, p.cfg.Name, err)
	}
	if crash("create: record written") {
		return Volume{}, false, errCrashed
	}
	// Committed: the data file goes in place (a crash before load finishes).
	if err := os.Rename(p.newPath(name), p.dataPath(name)); err != nil {
		return Volume{}, false, fmt.Errorf("create volume %q in pool %q: %w", name, p.cfg.Name, err)
	}
	if err := syncDir(p.cfg.Dir); err != nil {
		return Volume{}, false, fmt.Errorf("create volume %q in pool %q: %w", name, p.cfg.Name, err)
	}
	p.vols[name] = r
	v, err = p.volume(r)
	if err != nil {
		return Volume{}, false, err
	}
	p.log.Info("volume created", zap.String("volume", name), zap.Int64("size", size), zap.Bool("shared", shared))
	return v, true, nil
}

// createData makes .NAME.img.new a new, empty sparse file of size bytes,
// synced (one an earlier try left is removed first).
func (p *Pool) createData(name string, size int64) (ino uint64, err error) {
	if err := removeIfThere(p.newPath(name)); err != nil {
		return 0, err
	}
	f, err := os.OpenFile(p.newPath(name), os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return 0, err
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}()
	if err := f.Truncate(size); err != nil {
		return 0, err
	}
	if err := f.Sync(); err != nil {
		return 0, err
	}
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Sys().(*syscall.Stat_t).Ino, nil
}

// writeRecord puts r in place as NAME.meta: written beside it, synced,
// renamed over it, the directory synced.
func (p *Pool) writeRecord(r *record) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(p.cfg.Dir, "."+r.Name+metaSuffix+".tmp")
	if err := removeIfThere(tmp); err != nil {
		return err
	}
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("write its record: %w", err)
	}
	_, err = f.Write(append(b, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, p.metaPath(r.Name))
	}
	if err == nil {
		err = syncDir(p.cfg.Dir)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write its record: %w", err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// ReserveGrow reserves the room for volume name to grow to size bytes (a
// multiple of BlockSize, not below its size): ErrNoSpace if the pool
// cannot take the growth. The caller grows the file (the target's Grow),
// then calls release: until then the growth counts as provisioned, so
// that creates and other growths meanwhile cannot take the same room. The
// pool reads sizes from the files.
func (p *Pool) ReserveGrow(name string, size int64) (release func(), err error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	if err := checkSize(size); err != nil {
		return nil, fmt.Errorf("grow volume %q: %w", name, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.vols[name]
	if r == nil {
		return nil, fmt.Errorf("grow volume %q of pool %q: %w", name, p.cfg.Name, ErrNotFound)
	}
	v, err := p.volume(r)
	if err != nil {
		return nil, err
	}
	if size < v.Size {
		return nil, fmt.Errorf("grow volume %q to %d bytes: it is %d bytes, and volumes do not shrink: %w", name, size, v.Size, ErrInvalid)
	}
	c, err := p.capacity()
	if err != nil {
		return nil, err
	}
	grow := size - v.Size
	if grow > c.Available {
		return nil, fmt.Errorf("grow volume %q by %d bytes: pool %q has %d bytes available: %w", name, grow, p.cfg.Name, c.Available, ErrNoSpace)
	}
	p.reserved += grow
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			p.reserved -= grow
			p.mu.Unlock()
		})
	}, nil
}

// SetHosts records hosts (sorted, without repeats) as the hosts volume
// name is published to.
func (p *Pool) SetHosts(name string, hosts []string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	hosts = slices.Compact(slices.Sorted(slices.Values(hosts)))
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.vols[name]
	if r == nil {
		return fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, ErrNotFound)
	}
	if slices.Equal(r.Hosts, hosts) {
		return nil
	}
	nr := *r
	nr.Hosts = hosts
	if err := p.writeRecord(&nr); err != nil {
		return fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, err)
	}
	p.vols[name] = &nr
	return nil
}

// Delete deletes volume name: its record first (from then on it is no
// volume), then its data file. The caller stopped serving it.
func (p *Pool) Delete(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.vols[name] == nil {
		return fmt.Errorf("volume %q of pool %q: %w", name, p.cfg.Name, ErrNotFound)
	}
	// The data file out of the way first, then the record: from its
	// removal on there is no volume (a crash between: load finishes).
	if err := os.Rename(p.dataPath(name), p.delPath(name)); err != nil {
		return fmt.Errorf("delete volume %q of pool %q: %w", name, p.cfg.Name, err)
	}
	if err := syncDir(p.cfg.Dir); err != nil {
		return fmt.Errorf("delete volume %q of pool %q: %w", name, p.cfg.Name, err)
	}
	if crash("delete: data file renamed") {
		return errCrashed
	}
	if err := removeIfThere(p.metaPath(name)); err != nil {
		return fmt.Errorf("delete volume %q of pool %q: %w", name, p.cfg.Name, err)
	}
	delete(p.vols, name)
	if err := syncDir(p.cfg.Dir); err != nil {
		return fmt.Errorf("delete volume %q of pool %q: its record is removed, but: %w", name, p.cfg.Name, err)
	}
	if crash("delete: record removed") {
		return errCrashed
	}
	if err := removeIfThere(p.delPath(name)); err != nil {
		p.log.Warn("remove the data file of a deleted volume (the next start does)", zap.String("volume", name), zap.Error(err))
	}
	p.log.Info("volume deleted", zap.String("volume", name))
	return nil
}
