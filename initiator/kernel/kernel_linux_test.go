//go:build linux

package kernel

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	"golang.org/x/sys/unix"
)

// Without the nbd module (as on the build machines) the error is the one
// line that says what to do.
func TestNoModule(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := Available(ctx)
	if err == nil {
		t.Skip("this kernel has the nbd module loaded")
	}
	if !errors.Is(err, ErrNoModule) || err.Error() != "the kernel has no nbd module: run `modprobe nbd`" {
		t.Fatalf("Available: %v", err)
	}
	_, err = Attach(ctx, Options{Export: testExport(newMemBackend(1 << 20))})
	if !errors.Is(err, ErrNoModule) {
		t.Errorf("Attach: %v", err)
	}
	if err := Detach(ctx, "/dev/nbd0"); err == nil {
		t.Error("Detach without the module: no error")
	}
}

// The real sockets: the fake kernel gets a duplicate of each kernel end, as
// the kernel takes its own reference, and Attach closes the originals.
func TestAttachSocketpair(t *testing.T) {
	k := newFakeKernel(t)
	var theirs []int
	pair := func() (net.Conn, int, error) {
		c, fd, err := socketpair()
		if err != nil {
			return nil, -1, err
		}
		dup, err := unix.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(dup), "kernel-end")
		kc, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		k.mu.Lock()
		k.ends[fd] = kc
		k.mu.Unlock()
		theirs = append(theirs, fd)
		return c, fd, nil
	}
	be := newMemBackend(1 << 20)
	dev, err := attach(context.Background(), Options{Export: testExport(be), Connections: 2, Logger: zaptest.NewLogger(t)},
		k, pair, unix.Close)
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range theirs {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); !errors.Is(err, unix.EBADF) {
			t.Errorf("kernel end %d still open after Attach", fd)
		}
	}
	data := bytes.Repeat([]byte{0xa5}, 1<<20)
	s0, s1 := k.socks[0], k.socks[1]
	if r := s0.wait(s0.send(nbdCmdWrite, 0, 0, 1<<20, data)); r.errno != 0 {
		t.Fatalf("WRITE: errno %d", r.errno)
	}
	if r := s1.wait(s1.send(nbdCmdRead, 0, 0, 1<<20, nil)); r.errno != 0 || !bytes.Equal(r.data, data) {
		t.Fatalf("READ: errno %d", r.errno)
	}
	if err := dev.Detach(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := dev.Err(); err != nil {
		t.Errorf("Err after a clean disconnect: %v", err)
	}
	if ev := be.Events(); !slices.Equal(ev, []string{"write 0+1048576", "flush"}) {
		t.Errorf("backend calls %q", ev)
	}
}
