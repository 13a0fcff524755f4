package safeopen

import (
	"bytes"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// within runs f and fails t if it does not return in 10 seconds: an open
// that blocks (a FIFO without a writer) would hang the test otherwise.
func within(t *testing.T, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the open blocked for 10s")
	}
}

func mkfifo(t *testing.T, path string) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
}

func listenUnix(t *testing.T, path string) {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// loopDevice attaches a loop device to a small file and returns its path;
// it skips the test where that cannot be done (not root, no losetup, no
// loop devices).
func loopDevice(t *testing.T) string {
	t.Helper()
	img := filepath.Join(t.TempDir(), "loop.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device (needs root and losetup): %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	return dev
}

// TestOpenKinds: a regular file (and one reached through a symbolic link)
// opens, and is in blocking mode; a directory, a FIFO (read-only,
// read-write and write-only: each would block or fail otherwise), a
// socket, a character device and, where regular files only are wanted, a
// block device are refused at once with a *KindError naming the path and
// the kind.
func TestOpenKinds(t *testing.T) {
	dir := t.TempDir()
	reg := filepath.Join(dir, "file")
	if err := os.WriteFile(reg, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(reg, link); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	mkfifo(t, fifo)
	fifoLink := filepath.Join(dir, "fifo-link")
	if err := os.Symlink(fifo, fifoLink); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "sock")
	listenUnix(t, sock)

	for _, c := range []struct {
		path string
		flag int
		k    Kinds
		kind string // "" if it opens
	}{
		{reg, os.O_RDONLY, Regular, ""},
		{reg, os.O_RDWR, Regular | BlockDevice, ""},
		{link, os.O_RDWR, Regular, ""},
		{dir, os.O_RDONLY, Regular, "a directory"},
		{dir, os.O_RDONLY, Regular | BlockDevice, "a directory"},
		{fifo, os.O_RDONLY, Regular, "a FIFO"},
		{fifo, os.O_RDWR, Regular | BlockDevice, "a FIFO"},
		{fifo, os.O_WRONLY, Regular, "a FIFO"},
		{fifoLink, os.O_RDONLY, Regular, "a FIFO"},
		{sock, os.O_RDONLY, Regular, "a socket"},
		{sock, os.O_RDWR, Regular | BlockDevice, "a socket"},
		{"/dev/null", os.O_RDONLY, Regular, "a character device"},
		{"/dev/null", os.O_RDWR, Regular | BlockDevice, "a character device"},
	} {
		var f *os.File
		var st fs.FileInfo
		var err error
		within(t, func() { f, st, err = Open(c.path, c.flag, 0, c.k) })
		if c.kind == "" {
			if err != nil {
				t.Errorf("Open(%s, %#x): %v", c.path, c.flag, err)
				continue
			}
			if !st.Mode().IsRegular() {
				t.Errorf("Open(%s): fstat says %v", c.path, st.Mode())
			}
			if nb, err := isNonblock(f); err != nil || nb {
				t.Errorf("Open(%s): O_NONBLOCK still set (%v)", c.path, err)
			}
			f.Close()
			continue
		}
		var ke *KindError
		if !errors.As(err, &ke) || !errors.Is(err, ErrKind) || ke.Kind != c.kind {
			t.Errorf("Open(%s, %#x, %v): %v, want a KindError saying %s", c.path, c.flag, c.k, err, c.kind)
			continue
		}
		if want := c.path + " is " + c.kind + ": want " + c.k.String(); err.Error() != want {
			t.Errorf("Open(%s): %q, want %q", c.path, err, want)
		}
		if f != nil {
			t.Errorf("Open(%s) returned a file with its error", c.path)
		}
	}
	// A path that does not exist: the open's own error.
	if _, _, err := Open(filepath.Join(dir, "none"), os.O_RDONLY, 0, Regular); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Open of a missing file: %v, want ErrNotExist", err)
	}
	// O_CREATE|O_EXCL creates a regular file.
	created := filepath.Join(dir, "new")
	f, _, err := Open(created, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600, Regular|BlockDevice)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if st, err := os.Stat(created); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("created file: %v, %v; want mode 0600", st, err)
	}
}

func isNonblock(f *os.File) (bool, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var fl int
	var ferr error
	raw.Control(func(fd uintptr) { fl, ferr = unix.FcntlInt(fd, unix.F_GETFL, 0) })
	return fl&syscall.O_NONBLOCK != 0, ferr
}

// TestOpenBlockDevice: a block device opens where asked for, is refused
// where only regular files are, and its ID is its device number whatever
// node names it.
func TestOpenBlockDevice(t *testing.T) {
	dev := loopDevice(t)
	f, st, err := Open(dev, os.O_RDONLY, 0, Regular|BlockDevice)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	id := IDOf(st)
	if !id.Block || id.Ino != 0 {
		t.Errorf("ID of %s: %+v, want a block device's", dev, id)
	}
	// A second node of the same device (mknod elsewhere) is the same ID.
	raw, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		t.Fatal("no Stat_t")
	}
	node := filepath.Join(t.TempDir(), "second-node")
	if err := syscall.Mknod(node, syscall.S_IFBLK|0o600, int(raw.Rdev)); err != nil {
		t.Skipf("mknod: %v", err)
	}
	f2, st2, err := Open(node, os.O_RDONLY, 0, Regular|BlockDevice)
	if err != nil {
		t.Fatal(err)
	}
	f2.Close()
	if IDOf(st2) != id {
		t.Errorf("ID of a second node of %s: %v, want %v", dev, IDOf(st2), id)
	}
	_, _, err = Open(dev, os.O_RDONLY, 0, Regular)
	if want := dev + " is a block device: want a regular file"; err == nil || err.Error() != want {
		t.Errorf("Open of a block device for a regular file: %v, want %q", err, want)
	}
}

// TestOpenReplaced: a file replaced between the stat and the open (by a
// FIFO, a socket) is refused by what the open reached (fstat), not by the
// stat of the name, and the open does not block.
func TestOpenReplaced(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		name, kind string
		make       func(path string)
	}{
		{"fifo", "a FIFO", func(p string) { mkfifo(t, p) }},
		{"socket", "a socket", func(p string) { listenUnix(t, p) }},
	} {
		path := filepath.Join(dir, c.name)
		if err := os.WriteFile(path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		testHookBeforeOpen = func(p string) {
			os.Remove(p)
			c.make(p)
		}
		var err error
		within(t, func() { _, _, err = Open(path, os.O_RDONLY, 0, Regular) })
		testHookBeforeOpen = nil
		if !errors.Is(err, ErrKind) || !strings.Contains(err.Error(), path+" is "+c.kind) {
			t.Errorf("%s put in place of a regular file before the open: %v, want %s refused", c.name, err, c.kind)
		}
	}
}

// TestReadFile: a regular file is read; a FIFO is refused at once (a
// plain os.ReadFile would block for a writer); a file over the limit is
// refused.
func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	reg := filepath.Join(dir, "f")
	if err := os.WriteFile(reg, []byte("hello\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	b, st, err := ReadFile(reg, 1<<10)
	if err != nil || !bytes.Equal(b, []byte("hello\n")) || st.Mode().Perm() != 0o640 {
		t.Errorf("ReadFile: %q, %v, %v", b, st, err)
	}
	if _, _, err := ReadFile(reg, 3); !errors.Is(err, ErrTooLarge) {
		t.Errorf("ReadFile over its limit: %v, want ErrTooLarge", err)
	}
	fifo := filepath.Join(dir, "fifo")
	mkfifo(t, fifo)
	within(t, func() { _, _, err = ReadFile(fifo, 1<<10) })
	if want := fifo + " is a FIFO: want a regular file"; err == nil || err.Error() != want {
		t.Errorf("ReadFile of a FIFO: %v, want %q", err, want)
	}
}

// TestIDOf: one file under a second name (hard link), a symbolic link and
// a "d/../" path is one ID; another file is another.
func TestIDOf(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a")
	b := filepath.Join(dir, "b")
	for _, p := range []string{a, b} {
		if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	hard := filepath.Join(dir, "hard")
	if err := os.Link(a, hard); err != nil {
		t.Fatal(err)
	}
	sym := filepath.Join(dir, "sym")
	if err := os.Symlink(a, sym); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	id := func(p string) ID {
		f, st, err := Open(p, os.O_RDONLY, 0, Regular)
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		return IDOf(st)
	}
	ida := id(a)
	if ida == (ID{}) || ida.Block {
		t.Fatalf("ID of a regular file: %+v", ida)
	}
	for _, p := range []string{hard, sym, dir + "/d/../a"} {
		if got := id(p); got != ida {
			t.Errorf("ID of %s: %v, want %v (the same file)", p, got, ida)
		}
	}
	if id(b) == ida {
		t.Error("two files have one ID")
	}
}
