package safeopen

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrKind is wrapped by the error of a file that is not of a kind asked
// for (a *KindError).
var ErrKind = errors.New("not a file of the kind wanted")

// ErrTooLarge is wrapped by ReadFile's error for a file larger than its
// limit.
var ErrTooLarge = errors.New("file too large")

// Kinds are the kinds of file an open accepts, or-ed together.
type Kinds uint8

// The kinds of file.
const (
	Regular     Kinds = 1 << iota // a regular file
	BlockDevice                   // a block device
)

// KindError is the error of a file of the wrong kind.
type KindError struct {
	Path string
	// Kind is what the file is: "a FIFO", "a socket", "a character
	// device", "a directory", "a block device", "a regular file", "a
	// symbolic link", or "of an unknown kind".
	Kind string
	// Want is what was asked for: "a regular file", "a regular file or a
	// block device".
	Want string
}

func (e *KindError) Error() string { return fmt.Sprintf("%s is %s: want %s", e.Path, e.Kind, e.Want) }

// Unwrap makes errors.Is(err, ErrKind) true.
func (e *KindError) Unwrap() error { return ErrKind }

// KindOf names the kind of a file mode, as KindError.Kind does.
func KindOf(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "a regular file"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	}
	return "of an unknown kind"
}

func (k Kinds) accepts(m fs.FileMode) bool {
	switch {
	case m.IsRegular():
		return k&Regular != 0
	case m&fs.ModeDevice != 0 && m&fs.ModeCharDevice == 0:
		return k&BlockDevice != 0
	}
	return false
}

func (k Kinds) String() string {
	switch k {
	case Regular:
		return "a regular file"
	case BlockDevice:
		return "a block device"
	case Regular | BlockDevice:
		return "a regular file or a block device"
	}
	return "nothing"
}

// check returns a *KindError if m is not of a kind k accepts.
func (k Kinds) check(path string, m fs.FileMode) error {
	if k.accepts(m) {
		return nil
	}
	return &KindError{Path: path, Kind: KindOf(m), Want: k.String()}
}

// testHookBeforeOpen, if set, runs between the stat and the open (a test
// replaces the file there).
var testHookBeforeOpen func(path string)

// Open opens path with flag (os.O_RDONLY, os.O_RDWR, os.O_CREATE ...;
// perm is the mode of a file it creates) as os.OpenFile does, but refuses
// at once, without blocking, anything that is not of the kinds k: the
// error is a *KindError (errors.Is ErrKind) naming the path and its kind.
// It returns the file, in blocking mode, and what fstat said of it.
// Errors of the open itself are *fs.PathError, as os.OpenFile's.
func Open(path string, flag int, perm fs.FileMode, k Kinds) (*os.File, fs.FileInfo, error) {
	// A device of the wrong kind is not opened at all (an open may have
	// side effects: a tape rewinds, a modem line waits for a carrier);
	// the fstat below is what decides.
	if st, err := os.Stat(path); err == nil {
		if err := k.check(path, st.Mode()); err != nil {
			return nil, nil, err
		}
	}
	if testHookBeforeOpen != nil {
		testHookBeforeOpen(path)
	}
	fd, err := unix.Open(path, flag|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, uint32(perm.Perm()))
	for err == unix.EINTR {
		fd, err = unix.Open(path, flag|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, uint32(perm.Perm()))
	}
	if err != nil {
		// open(2) of a socket is ENXIO, and so is a write-only open of a
		// FIFO without a reader: say what the file is, if it is of the
		// wrong kind (it was replaced since the stat above).
		if err == unix.ENXIO {
			if st, serr := os.Stat(path); serr == nil {
				if kerr := k.check(path, st.Mode()); kerr != nil {
					return nil, nil, kerr
				}
			}
		}
		return nil, nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	var raw unix.Stat_t
	if err := unix.Fstat(fd, &raw); err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if err := k.check(path, modeOf(raw.Mode)); err != nil {
		unix.Close(fd)
		return nil, nil, err
	}
	// Regular files and block devices ignore O_NONBLOCK for IO on Linux;
	// it is cleared all the same, before os.NewFile looks at it, so that
	// the file is an ordinary blocking one wherever it is handed.
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^unix.O_NONBLOCK)
	}
	if err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("clear O_NONBLOCK on %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	return f, st, nil
}

// modeOf is the fs.FileMode type bits of a stat(2) mode.
func modeOf(m uint32) fs.FileMode {
	switch m & unix.S_IFMT {
	case unix.S_IFREG:
		return 0
	case unix.S_IFDIR:
		return fs.ModeDir
	case unix.S_IFIFO:
		return fs.ModeNamedPipe
	case unix.S_IFSOCK:
		return fs.ModeSocket
	case unix.S_IFCHR:
		return fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		return fs.ModeDevice
	case unix.S_IFLNK:
		return fs.ModeSymlink
	}
	return fs.ModeIrregular
}

// ReadFile reads a regular file of at most limit bytes, opened as Open
// does: a FIFO, socket, device or directory is refused at once with a
// *KindError, a larger file with ErrTooLarge. It returns the content and
// what fstat said of the file (its mode, for callers that check it).
func ReadFile(path string, limit int64) ([]byte, fs.FileInfo, error) {
	f, st, err := Open(path, os.O_RDONLY, 0, Regular)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	if st.Size() > limit {
		return nil, nil, fmt.Errorf("%s: %d bytes: %w (at most %d)", path, st.Size(), ErrTooLarge, limit)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	if int64(len(b)) > limit {
		return nil, nil, fmt.Errorf("%s: more than %d bytes: %w", path, limit, ErrTooLarge)
	}
	return b, st, nil
}

// ID is a file's identity: its device and inode, or for a block device
// the device it is (its rdev), whatever name it was reached by (a second
// name, a symbolic link, a hard link, a bind mount, "d/../"). Comparable.
type ID struct {
	// Dev and Ino are the file's st_dev and st_ino; for a block device,
	// Dev is its st_rdev and Ino 0.
	Dev, Ino uint64
	// Block: the file is a block device.
	Block bool
}

// IDOf is the identity of a file that fstat (or stat) described; the zero
// ID if fi does not come from the system.
func IDOf(fi fs.FileInfo) ID {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ID{}
	}
	if fi.Mode()&fs.ModeDevice != 0 && fi.Mode()&fs.ModeCharDevice == 0 {
		return ID{Dev: uint64(st.Rdev), Block: true}
	}
	return ID{Dev: uint64(st.Dev), Ino: uint64(st.Ino)}
}

func (id ID) String() string {
	if id.Block {
		return fmt.Sprintf("block device %d:%d", unix.Major(id.Dev), unix.Minor(id.Dev))
	}
	return fmt.Sprintf("inode %d on device %d:%d", id.Ino, unix.Major(id.Dev), unix.Minor(id.Dev))
}
