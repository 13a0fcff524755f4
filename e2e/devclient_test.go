package e2e

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// blockDev lets the tests' NBD client (nbdClient) work on the kernel's
// /dev/nbdN that rblk-attach --device serves (RBLK_E2E_DEVICE=nbd): each
// command becomes the system call that makes the kernel send it, on the
// device opened with O_DIRECT (no page cache between the test and
// rblk-attach): READ pread, WRITE pwrite, FLUSH fdatasync, TRIM
// BLKDISCARD, WRITE_ZEROES BLKZEROOUT. The kernel turns an NBD error reply
// into EIO, and refuses a write to a read-only device with EPERM, as the
// NBD errors the tests expect (NBD's EIO and EPERM are Linux's numbers).
// A command sent without waiting (send) runs in its own goroutine; recv
// takes the results in the order the commands finish.
type blockDev struct {
	f       *os.File
	path    string
	replies chan devReply
	wg      sync.WaitGroup
}

type devReply struct {
	handle uint64
	errno  uint32
}

// dialDevice opens path (read-write, or read-only if the device is) as the
// NBD client of export name: the size and the read-only flag come from the
// device.
func dialDevice(t *testing.T, path, name string) *nbdClient {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|syscall.O_DIRECT, 0)
	ro := false
	if errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
		f, err = os.OpenFile(path, os.O_RDONLY|syscall.O_DIRECT, 0)
		ro = true
	}
	if err != nil {
		t.Fatalf("open %s (export %q): %v", path, name, err)
	}
	d := &blockDev{f: f, path: path, replies: make(chan devReply, 64)}
	t.Cleanup(func() { d.wg.Wait(); f.Close() })
	var size uint64
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&size))); e != 0 {
		t.Fatalf("BLKGETSIZE64 %s: %v", path, e)
	}
	if v, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET); err == nil && v != 0 {
		ro = true
	}
	n := &nbdClient{dev: d, size: size}
	if ro {
		n.flags |= nbdFlagReadOnly
	}
	return n
}

// alignedBuf is a buffer of n bytes at a 4 KiB boundary, as O_DIRECT
// wants.
func alignedBuf(n int) []byte {
	const align = 4096
	b := make([]byte, n+align)
	off := int(uintptr(unsafe.Pointer(&b[0])) & (align - 1))
	if off != 0 {
		off = align - off
	}
	return b[off : off+n : off+n]
}

// errnoOf is the NBD error for err: the errno of a failed system call (EIO
// for a short transfer or any other error).
func errnoOf(err error) uint32 {
	var e syscall.Errno
	if errors.As(err, &e) {
		return uint32(e)
	}
	return uint32(syscall.EIO)
}

// op does one command on the device and returns its NBD error (0: OK) and
// a READ's data.
func (d *blockDev) op(typ uint16, off uint64, length uint32, payload []byte) (uint32, []byte) {
	fd := int(d.f.Fd())
	switch typ {
	case nbdCmdRead:
		b := alignedBuf(int(length))
		n, err := d.f.ReadAt(b, int64(off))
		if err != nil || n != len(b) {
			return errnoOf(err), nil
		}
		return 0, append([]byte(nil), b...)
	case nbdCmdWrite:
		b := alignedBuf(len(payload))
		copy(b, payload)
		n, err := d.f.WriteAt(b, int64(off))
		if err != nil || n != len(b) {
			return errnoOf(err), nil
		}
		return 0, nil
	case nbdCmdFlush:
		if err := unix.Fdatasync(fd); err != nil {
			return errnoOf(err), nil
		}
		return 0, nil
	case nbdCmdTrim, nbdCmdWriteZeroes:
		req := unix.BLKDISCARD
		if typ == nbdCmdWriteZeroes {
			req = unix.BLKZEROOUT
		}
		r := [2]uint64{off, uint64(length)}
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(unsafe.Pointer(&r[0]))); e != 0 {
			return uint32(e), nil
		}
		return 0, nil
	case nbdCmdDisc:
		return 0, nil
	}
	return uint32(syscall.EINVAL), nil
}

// start runs a command in the background; its reply goes to recv.
func (d *blockDev) start(handle uint64, typ uint16, off uint64, length uint32, payload []byte) {
	payload = append([]byte(nil), payload...)
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		errno, _ := d.op(typ, off, length, payload)
		d.replies <- devReply{handle: handle, errno: errno}
	}()
}

// recv waits for the next command started by start to finish.
func (d *blockDev) recv(timeout time.Duration) (uint64, uint32, error) {
	select {
	case r := <-d.replies:
		return r.handle, r.errno, nil
	case <-time.After(timeout):
		return 0, 0, fmt.Errorf("read NBD reply: no command on %s finished within %v", d.path, timeout)
	}
}
