//go:build linux

package kernel

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"runtime"
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

// The kernel threads running a receive work of /dev/nbdN, as /proc shows
// them: a worker running an item of workqueue "nbdN-recv" ("+"), the
// workqueue's rescuer running one; not a worker that ran one last ("-"),
// an idle rescuer, another device's, or another task.
func TestCountReceivers(t *testing.T) {
	proc := t.TempDir()
	for pid, comm := range map[string]string{
		"12":   "kworker/u5:1+nbd0-recv",
		"13":   "nbd0-recv+nbd0-recv",
		"14":   "kworker/u5:2-nbd0-recv",
		"15":   "nbd0-recv",
		"16":   "kworker/u5:3+nbd10-recv",
		"18":   "kworker/u5:4+knbd10-recv",
		"17":   "bash",
		"self": "kworker/u5:1+nbd0-recv",
	} {
		if err := os.Mkdir(proc+"/"+pid, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(proc+"/"+pid+"/comm", []byte(comm+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(proc+"/uptime", []byte("1.0 2.0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for index, want := range map[int]int{0: 2, 10: 2} {
		if n, ok := countReceivers(proc, index); n != want || !ok {
			t.Errorf("nbd%d: %d receivers (ok %v), want %d", index, n, ok, want)
		}
	}
	// No task named after nbd1's workqueue: the kernel does not show it.
	if n, ok := countReceivers(proc, 1); n != 0 || ok {
		t.Errorf("nbd1: %d receivers, ok %v; want 0, false", n, ok)
	}
	if _, ok := countReceivers(proc+"/none", 0); ok {
		t.Error("no /proc: ok")
	}
}

// threadGroup maps a thread of this process (the kernel's pid file names
// the thread that sent NBD_CMD_CONNECT) to this process.
func TestThreadGroup(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid := unix.Gettid()
	if got := threadGroup(tid); got != os.Getpid() {
		t.Errorf("threadGroup(%d) = %d, want this process %d", tid, got, os.Getpid())
	}
	if got := threadGroup(0); got != 0 {
		t.Errorf("threadGroup(0) = %d", got)
	}
}
