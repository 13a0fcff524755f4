package target_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/target"
)

// bounded runs f and fails t if it has not returned in 10 seconds (an
// open of a FIFO blocks for ever; the goroutine is then left behind).
func bounded(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		buf := make([]byte, 1<<20)
		n := runtime.Stack(buf, true)
		t.Fatalf("%s blocked for 10s\n%s", what, buf[:n])
	}
}

// oddFiles makes a FIFO, a listening unix socket and a directory in dir
// and returns them with /dev/null, by the kind the refusal names.
func oddFiles(t *testing.T, dir string) map[string]string {
	t.Helper()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	sub := filepath.Join(dir, "dir")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	return map[string]string{"a FIFO": fifo, "a socket": sock, "a directory": sub, "a character device": "/dev/null"}
}

// TestExportFileKinds: an export of a FIFO (read-only or read-write, at
// New and by AddExport), a socket, a character device or a directory is
// refused at once, the error naming the path and what it is; the target
// goes on serving, and an AddExport after it works.
func TestExportFileKinds(t *testing.T) {
	dir := t.TempDir()
	odd := oddFiles(t, dir)
	for kind, path := range odd {
		for _, ro := range []bool{true, false} {
			var err error
			bounded(t, "New of "+kind, func() {
				var tg *target.Target
				tg, err = target.New(target.Options{Exports: []target.ExportConfig{{Name: "v", Path: path, ReadOnly: ro}}})
				if err == nil {
					tg.Close()
				}
			})
			if want := path + " is " + kind + ": want a regular file or a block device"; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("New with an export of %s (read-only %v): %v, want an error saying %q", kind, ro, err, want)
			}
		}
	}

	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10}, target.ExportConfig{})
	ctx := context.Background()
	for kind, path := range odd {
		for _, ro := range []bool{true, false} {
			var err error
			bounded(t, "AddExport of "+kind, func() {
				err = e.tg.AddExport(ctx, target.ExportConfig{Name: "odd", Path: path, ReadOnly: ro})
			})
			if want := `export "odd": ` + path + " is " + kind; err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("AddExport of %s (read-only %v): %v, want an error saying %q", kind, ro, err, want)
			}
		}
	}
	if st := e.tg.Exports(); len(st) != 1 || st[0].Config.Name != "vol" {
		t.Errorf("exports after the refusals: %+v", st)
	}
	var err error
	bounded(t, "AddExport after the refusals", func() {
		err = e.tg.AddExport(ctx, target.ExportConfig{Name: "next", Path: filepath.Join(dir, "next.img"), Size: 1 << 20})
	})
	if err != nil {
		t.Fatalf("AddExport after the refusals: %v", err)
	}
}

// sameFileNames makes a file and four other names of it: a hard link, a
// symbolic link, a path through "d/../" and a symbolic link to its folder.
func sameFileNames(t *testing.T, dir string) (first string, others map[string]string) {
	t.Helper()
	first = filepath.Join(dir, "a.img")
	if err := os.WriteFile(first, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	hard := filepath.Join(dir, "hard.img")
	if err := os.Link(first, hard); err != nil {
		t.Fatal(err)
	}
	sym := filepath.Join(dir, "sym.img")
	if err := os.Symlink(first, sym); err != nil {
		t.Fatal(err)
	}
	dirLink := filepath.Join(dir, "dirlink")
	if err := os.Symlink(dir, dirLink); err != nil {
		t.Fatal(err)
	}
	return first, map[string]string{"hard link": hard, "symbolic link": sym, "d/../": dir + "/d/../a.img",
		"linked folder": filepath.Join(dirLink, "a.img")}
}

// TestSameFileExport: one file is one export. A second export of it under
// any other name (hard link, symbolic link, "d/../", a folder reached by a
// link) is refused naming the first, at New and by AddExport (read-only
// too); once the first is removed, the file may be exported again.
func TestSameFileExport(t *testing.T) {
	dir := t.TempDir()
	first, others := sameFileNames(t, dir)
	for how, path := range others {
		_, err := target.New(target.Options{Exports: []target.ExportConfig{{Name: "a", Path: first}, {Name: "b", Path: path}}})
		want := `export "b": ` + path + ` is the same file as export "a" (` + first + `)`
		if !errors.Is(err, target.ErrSameFile) || err.Error() != want {
			t.Errorf("New with a second export by a %s: %v, want %q", how, err, want)
		}
	}

	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10}, target.ExportConfig{})
	ctx := context.Background()
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "a", Path: first}); err != nil {
		t.Fatal(err)
	}
	for how, path := range others {
		for _, ro := range []bool{false, true} {
			err := e.tg.AddExport(ctx, target.ExportConfig{Name: "b", Path: path, ReadOnly: ro})
			want := `add export "b": ` + path + ` is the same file as export "a" (` + first + `)`
			if !errors.Is(err, target.ErrSameFile) || err.Error() != want {
				t.Errorf("AddExport by a %s (read-only %v): %v, want %q", how, ro, err, want)
			}
		}
	}
	st := e.tg.Exports()
	if len(st) != 2 || st[0].File == st[1].File {
		t.Fatalf("exports: %+v, want a and vol, of two files", st)
	}
	if name, ok := e.tg.SameFile(st[0].File); !ok || name != "a" {
		t.Errorf("SameFile of a's file: %q %v", name, ok)
	}
	// a's path may change live to another name of its file, not to
	// another file.
	cfg := st[0].Config
	cfg.Path = others["d/../"]
	if err := e.tg.UpdateExport(ctx, cfg); err != nil {
		t.Errorf("UpdateExport to another name of the file: %v", err)
	}
	if st := e.tg.Exports(); st[0].Config.Path != others["d/../"] {
		t.Errorf("path after the update: %s", st[0].Config.Path)
	}
	cfg.Path = e.path
	if err := e.tg.UpdateExport(ctx, cfg); !errors.Is(err, target.ErrNotLive) {
		t.Errorf("UpdateExport to another file: %v, want ErrNotLive", err)
	}
	if err := e.tg.RemoveExport(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "b", Path: others["symbolic link"]}); err != nil {
		t.Fatalf("AddExport of the file once its first export is gone: %v", err)
	}
}

// TestPreparedExport: PrepareExport opens and checks without serving;
// Discard closes, and removes a file it created; AddPrepared serves it.
func TestPreparedExport(t *testing.T) {
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10}, target.ExportConfig{})
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "new.img")
	p, err := e.tg.PrepareExport(ctx, target.ExportConfig{Name: "n", Path: path, Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if !p.Created() || p.Size() != 1<<20 || len(e.tg.Exports()) != 1 {
		t.Fatalf("prepared: created %v, size %d, exports %+v", p.Created(), p.Size(), e.tg.Exports())
	}
	p.Discard()
	p.Discard()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the file a discarded export created is left: %v", err)
	}
	if err := e.tg.AddPrepared(ctx, p); err == nil {
		t.Error("AddPrepared of a discarded export succeeded")
	}
	p, err = e.tg.PrepareExport(ctx, target.ExportConfig{Name: "n", Path: path, Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.tg.AddPrepared(ctx, p); err != nil {
		t.Fatal(err)
	}
	p.Discard() // does nothing now
	if _, err := os.Stat(path); err != nil || len(e.tg.Exports()) != 2 {
		t.Fatalf("after AddPrepared: %v, %+v", err, e.tg.Exports())
	}
	// Prepared twice, the second is refused at AddPrepared: the file is
	// served.
	p2, err := e.tg.PrepareExport(ctx, target.ExportConfig{Name: "n2", Path: path})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.tg.AddPrepared(ctx, p2); !errors.Is(err, target.ErrSameFile) {
		t.Errorf("AddPrepared of a served file: %v", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("a refused AddPrepared of an existing file removed it: %v", err)
	}
}

// TestCloseDuringRemove: Close while RemoveExport drains a session whose
// initiator never leaves (DrainTimeout of a minute) and an AddExport waits
// behind it: Close ends that drain at once (the other export's initiator
// leaves when told) and returns in bounded time; the
// waiting AddExport gives up; every dirty byte of both exports is in the
// backing files.
func TestCloseDuringRemove(t *testing.T) {
	dir := t.TempDir()
	otherPath := filepath.Join(dir, "other.img")
	e, _ := startWith(t, make([]byte, 1<<20), target.Options{CacheSize: 1 << 20, ChunkSize: 64 << 10,
		DrainTimeout: time.Minute, DrainLimit: 5 * time.Minute, WritebackDelay: time.Hour}, target.ExportConfig{})
	ctx := context.Background()
	if err := e.tg.AddExport(ctx, target.ExportConfig{Name: "other", Path: otherPath, Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	keep, keepNotices, err := e.openNotified("host-a", "vol")
	if err != nil {
		t.Fatal(err)
	}
	gone, notices, err := e.openNotified("host-b", "other")
	if err != nil {
		t.Fatal(err)
	}
	kept, removed := []byte("dirty in the export that stays"), []byte("dirty in the export being removed")
	if err := keep.writeChunk(t, 8192, kept, keep.info.Generation); err != nil {
		t.Fatal(err)
	}
	if err := gone.writeChunk(t, 4096, removed, gone.info.Generation); err != nil {
		t.Fatal(err)
	}
	removeErr := make(chan error, 1)
	go func() { removeErr <- e.tg.RemoveExport(ctx, "other") }()
	<-notices // the drain started; the client ignores the notice
	addErr := make(chan error, 1)
	go func() {
		addErr <- e.tg.AddExport(ctx, target.ExportConfig{Name: "late", Path: filepath.Join(dir, "late.img"), Size: 1 << 20})
	}()
	// The initiator of the export that stays answers Close's notice as
	// rblk-attach does: it flushes and leaves.
	go func() {
		<-keepNotices
		keep.Request(ctx, &protocol.Flush{Handle: keep.info.Handle, Generation: keep.info.Generation}, &protocol.OK{})
		keep.Close()
	}()
	var closeErr error
	bounded(t, "Close during a RemoveExport's drain", func() { closeErr = e.tg.Close() })
	if closeErr != nil {
		t.Fatal(closeErr)
	}
	// The removal, cut short, either finished or kept the export (which
	// Close then wrote back).
	if err := <-removeErr; err != nil && !strings.Contains(err.Error(), "the export stays") {
		t.Errorf("RemoveExport cut short by Close: %v", err)
	}
	if err := <-addErr; !errors.Is(err, target.ErrClosed) {
		t.Errorf("AddExport waiting behind the removal: %v, want ErrClosed", err)
	}
	if got := readFile(t, e.path)[8192:][:len(kept)]; !bytes.Equal(got, kept) {
		t.Errorf("the staying export's file holds %q, want %q", got, kept)
	}
	if got := readFile(t, otherPath)[4096:][:len(removed)]; !bytes.Equal(got, removed) {
		t.Errorf("the removed export's file holds %q, want %q", got, removed)
	}
}

// TestSameBlockDevice: a block device is one export whatever node names
// it: a second node of the same device (mknod elsewhere) is refused,
// naming the first. Needs root and a loop device (skipped without).
func TestSameBlockDevice(t *testing.T) {
	img := filepath.Join(t.TempDir(), "loop.img")
	if err := os.WriteFile(img, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
	if err != nil {
		t.Skipf("no loop device (needs root and losetup): %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	var st syscall.Stat_t
	if err := syscall.Stat(dev, &st); err != nil {
		t.Fatal(err)
	}
	node := filepath.Join(t.TempDir(), "second-node")
	if err := syscall.Mknod(node, syscall.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		t.Skipf("mknod: %v", err)
	}
	_, err = target.New(target.Options{Exports: []target.ExportConfig{{Name: "a", Path: dev, ReadOnly: true}, {Name: "b", Path: node, ReadOnly: true}}})
	if want := `export "b": ` + node + ` is the same file as export "a" (` + dev + `)`; !errors.Is(err, target.ErrSameFile) || err.Error() != want {
		t.Errorf("New with two nodes of one block device: %v, want %q", err, want)
	}
	tg, err := target.New(target.Options{Exports: []target.ExportConfig{{Name: "a", Path: dev, ReadOnly: true}}, CacheSize: 1 << 20, ChunkSize: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	if st := tg.Exports(); len(st) != 1 || !st[0].BlockDevice || st[0].Size != 4<<20 {
		t.Errorf("export of a loop device: %+v", st)
	}
	if err := tg.AddExport(context.Background(), target.ExportConfig{Name: "b", Path: node, ReadOnly: true}); !errors.Is(err, target.ErrSameFile) {
		t.Errorf("AddExport of a second node: %v, want ErrSameFile", err)
	}
}
