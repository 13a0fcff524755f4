package uring

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func newRing(t *testing.T, entries, flags uint32) *Ring {
	t.Helper()
	r, err := New(entries, flags)
	if errors.Is(err, ErrUnsupported) {
		t.Skipf("no io_uring here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestNop(t *testing.T) {
	for _, flags := range []uint32{0, SetupSQE128} {
		r := newRing(t, 4, flags)
		if r.Entries() != 4 {
			t.Fatalf("entries %d, want 4", r.Entries())
		}
		// Fill the queue: the fifth entry does not fit until a Submit.
		for i := range 4 {
			s := r.GetSQE()
			if s == nil {
				t.Fatalf("entry %d: queue full", i)
			}
			s.Opcode = OpNop
			s.UserData = uint64(100 + i)
		}
		if r.GetSQE() != nil {
			t.Fatal("got a fifth entry from a ring of 4")
		}
		if r.Pending() != 4 {
			t.Fatalf("pending %d, want 4", r.Pending())
		}
		seen := 0
		for seen < 4 {
			n, err := r.Submit(uint32(4 - seen))
			if err != nil {
				t.Fatal(err)
			}
			_ = n
			for {
				c, ok := r.PeekCQE()
				if !ok {
					break
				}
				r.Seen()
				if c.Res != 0 || c.UserData != uint64(100+seen) {
					t.Fatalf("completion %d: %+v", seen, c)
				}
				seen++
			}
		}
		if r.Pending() != 0 {
			t.Fatalf("pending %d after submitting all", r.Pending())
		}
		if _, ok := r.PeekCQE(); ok {
			t.Fatal("a completion left over")
		}
	}
}

func TestReadWriteFile(t *testing.T) {
	r := newRing(t, 8, SetupSQE128)
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := bytes.Repeat([]byte("rblk ublk uring "), 512) // 8 KiB
	s := r.GetSQE()
	s.Opcode, s.FD = OpWrite, int32(f.Fd())
	s.Addr, s.Len, s.Off = uint64(uintptr(unsafe.Pointer(&want[0]))), uint32(len(want)), 4096
	s.UserData = 1
	c, err := r.Do()
	if err != nil || c.Res != int32(len(want)) || c.UserData != 1 {
		t.Fatalf("write: %+v, %v", c, err)
	}
	got := make([]byte, 4096+len(want))
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[4096:], want) || !bytes.Equal(got[:4096], make([]byte, 4096)) {
		t.Fatal("the file does not hold what the ring wrote")
	}
	back := make([]byte, len(want))
	s = r.GetSQE()
	s.Opcode, s.FD = OpRead, int32(f.Fd())
	s.Addr, s.Len, s.Off = uint64(uintptr(unsafe.Pointer(&back[0]))), uint32(len(back)), 4096
	s.UserData = 2
	if c, err = r.Do(); err != nil || c.Res != int32(len(back)) || c.UserData != 2 {
		t.Fatalf("read: %+v, %v", c, err)
	}
	if !bytes.Equal(back, want) {
		t.Fatal("the ring read other bytes than the file's")
	}
	// A bad descriptor fails in the completion, not in Submit.
	s = r.GetSQE()
	s.Opcode, s.FD, s.Addr, s.Len = OpRead, -1, uint64(uintptr(unsafe.Pointer(&back[0]))), 1
	if c, err = r.Do(); err != nil || c.Res != -int32(unix.EBADF) {
		t.Fatalf("read of fd -1: %+v, %v; want res -EBADF", c, err)
	}
}

// eventfdValue is where the ring reads the eventfd: not on a stack, which
// may move while the kernel holds its address.
var eventfdValue [8]byte

// An eventfd read completes when another goroutine writes the eventfd: how
// the ublk queues learn of the backend's completions.
func TestEventfdWakeup(t *testing.T) {
	r := newRing(t, 4, 0)
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	val := &eventfdValue
	s := r.GetSQE()
	s.Opcode, s.FD, s.Addr, s.Len, s.UserData = OpRead, int32(efd), uint64(uintptr(unsafe.Pointer(&val[0]))), 8, 7
	if _, err := r.Submit(0); err != nil {
		t.Fatal(err)
	}
	if _, ok := r.PeekCQE(); ok {
		t.Fatal("the eventfd read completed before a write")
	}
	go func() {
		one := [8]byte{3}
		unix.Write(efd, one[:])
	}()
	c, err := r.Do()
	if err != nil || c.Res != 8 || c.UserData != 7 || val[0] != 3 {
		t.Fatalf("eventfd read: %+v, %v, value %d", c, err, val[0])
	}
}

func TestCmdArea(t *testing.T) {
	for _, tc := range []struct {
		flags uint32
		n     int
	}{{0, 16}, {SetupSQE128, 80}} {
		r := newRing(t, 2, tc.flags)
		s := r.GetSQE()
		if got := len(r.Cmd(s)); got != tc.n {
			t.Fatalf("flags %#x: command area of %d bytes, want %d", tc.flags, got, tc.n)
		}
		if off := uintptr(unsafe.Pointer(&r.Cmd(s)[0])) - uintptr(unsafe.Pointer(s)); off != 48 {
			t.Fatalf("command at offset %d, want 48", off)
		}
	}
}
