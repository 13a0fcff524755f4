package rawsock

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Reader reads a socket with raw read(2) calls and waits for it to become
// readable in the runtime's network poller, as net.Conn's Read does; its
// deadlines and Close work as on the net.Conn. Read of one Reader is not
// safe for concurrent use.
type Reader struct {
	rc  syscall.RawConn
	fn  func(fd uintptr) bool
	p   []byte
	n   int
	err syscall.Errno
}

// SyscallConn returns the raw conn of c when c is a *net.TCPConn or a
// *net.UnixConn. Only the net package's own conns qualify: their
// descriptors are non-blocking, and a raw read(2) or writev(2) of a
// blocking one would hold its thread and the goroutine's P until it ended.
func SyscallConn(c net.Conn) (syscall.RawConn, bool) {
	var sc syscall.Conn
	switch t := c.(type) {
	case *net.TCPConn:
		sc = t
	case *net.UnixConn:
		sc = t
	default:
		return nil, false
	}
	rc, err := sc.SyscallConn()
	return rc, err == nil
}

// NewReader returns a Reader of c when SyscallConn takes c, and c itself
// otherwise.
func NewReader(c net.Conn) io.Reader {
	rc, ok := SyscallConn(c)
	if !ok {
		return c
	}
	r := &Reader{rc: rc}
	r.fn = r.read
	return r
}

// Read reads what the socket has, up to len(p) bytes, waiting until it has
// something. At the end of the stream it returns io.EOF; a failed read(2)
// returns an *os.SyscallError of its errno.
func (r *Reader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	r.p, r.n, r.err = p, 0, 0
	err := r.rc.Read(r.fn)
	r.p = nil
	switch {
	case err != nil:
		return 0, err
	case r.err != 0:
		return 0, os.NewSyscallError("read", r.err)
	case r.n == 0:
		return 0, io.EOF
	}
	return r.n, nil
}

// read is the function of RawConn.Read: false (wait, then call again)
// when the socket is empty.
func (r *Reader) read(fd uintptr) bool {
	r.n, r.err = Read(fd, r.p)
	return r.err != syscall.EAGAIN
}

// Read is one read(2) into p (not empty) from fd, a raw call: for the
// function of the RawConn.Read of a conn that SyscallConn takes. It
// retries EINTR; on an error it returns 0 bytes.
func Read(fd uintptr, p []byte) (int, syscall.Errno) {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), 0
	}
}

// Writev is one writev(2) of iov (not empty) on fd, a raw call: for the
// function of the RawConn.Write of a conn that SyscallConn takes. It
// retries EINTR.
func Writev(fd uintptr, iov []unix.Iovec) (int, syscall.Errno) {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&iov[0])), uintptr(len(iov)))
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), 0
	}
}
