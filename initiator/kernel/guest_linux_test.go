//go:build linux

package kernel_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/kernel"
	"github.com/rblk/rblk/initiator/nbd"
	"github.com/rblk/rblk/target"
	"github.com/rblk/rblk/transport/tcp"
)

// TestGuestResize needs the kernel's nbd module and root, as in the qemu
// guest (testdata/guest-resize.sh runs it there; elsewhere it is skipped,
// or fails with RBLK_KERNEL_GUEST_REQUIRE=1). A target in process exports
// a volume that a Volume attaches as /dev/nbdN; the target grows it; the
// Volume's OnResize tells the device (Device.Resize): /sys/block/nbdN/size
// shows the new size (polled, at most 10 s), an O_DIRECT write and read at
// the new end of the device succeed, and after fsync the backing file has
// the write.
func TestGuestResize(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := kernel.Available(ctx); err != nil || os.Geteuid() != 0 {
		if os.Getenv("RBLK_KERNEL_GUEST_REQUIRE") == "1" {
			t.Fatalf("needs root and the nbd module: %v (euid %d)", err, os.Geteuid())
		}
		t.Skipf("needs root and the nbd module: %v (euid %d)", err, os.Geteuid())
	}
	const oldSize, newSize = 64<<20 + 32<<10, 96 << 20
	log := zaptest.NewLogger(t)
	path := filepath.Join(t.TempDir(), "vol.img")
	tg, err := target.New(target.Options{Exports: []target.ExportConfig{{Name: "vol", Path: path, Size: oldSize}},
		CacheSize: 32 << 20, Logger: log.Named("target")})
	if err != nil {
		t.Fatal(err)
	}
	p := tcp.New("tcp")
	l, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); tg.Serve(ctx, l) }()
	defer func() {
		cancel()
		<-served
		if err := tg.Close(); err != nil {
			t.Error(err)
		}
	}()

	var dev atomic.Pointer[kernel.Device]
	resized := make(chan error, 4)
	v, err := initiator.Open(ctx, initiator.Options{Provider: p, Target: l.Addr(), Export: "vol", Logger: log.Named("volume"),
		OnResize: func(_, size uint64) {
			if d := dev.Load(); d != nil {
				resized <- d.Resize(context.Background(), size)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close(context.Background())
	d, err := kernel.Attach(ctx, kernel.Options{Export: &nbd.Export{Name: "vol", Size: v.Size(), CurrentSize: v.Size,
		CanFlush: true, CanFUA: true, CanTrim: true, CanZero: true, MultiConn: true, MaxBlock: initiator.MaxRequest, Backend: v},
		Device: "auto", Connections: 2, Logger: log.Named("device")})
	if err != nil {
		t.Fatal(err)
	}
	dev.Store(d)
	defer d.Detach(context.Background())
	sizeFile := filepath.Join("/sys/block", filepath.Base(d.Path()), "size")
	sectors := func() uint64 {
		b, err := os.ReadFile(sizeFile)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		return n
	}
	if got := sectors(); got != oldSize/512 {
		t.Fatalf("%s: %d sectors before the grow, want %d", sizeFile, got, oldSize/512)
	}

	if err := tg.Grow(ctx, "vol", newSize); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-resized:
		if err != nil {
			t.Fatalf("Device.Resize: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("OnResize was not called within 10 s of the grow")
	}
	deadline := time.Now().Add(10 * time.Second)
	for sectors() != newSize/512 {
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d sectors 10 s after the resize, want %d", sizeFile, sectors(), newSize/512)
		}
		time.Sleep(10 * time.Millisecond) // polling sysfs: the kernel has no event for it here
	}
	t.Logf("%s: %d sectors after the grow", sizeFile, sectors())

	// O_DIRECT IO at the new end of the device.
	f, err := os.OpenFile(d.Path(), os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	want := bytes.Repeat([]byte("grown!!!"), 512)
	copy(buf[:4096], want)
	if _, err := f.WriteAt(buf[:4096], newSize-4096); err != nil {
		t.Fatalf("O_DIRECT write at the new end of %s: %v", d.Path(), err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.ReadAt(buf[4096:], newSize-4096); err != nil {
		t.Fatalf("O_DIRECT read at the new end of %s: %v", d.Path(), err)
	}
	if !bytes.Equal(buf[4096:], want) {
		t.Fatal("the new end reads back otherwise than written")
	}
	file, err := os.ReadFile(path)
	if err != nil || len(file) != newSize || !bytes.Equal(file[newSize-4096:], want) {
		t.Fatalf("backing file of %d bytes (%v) lacks the write at its new end after fsync", len(file), err)
	}
}
