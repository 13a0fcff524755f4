package rawsock

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t testing.TB) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := l.Accept()
		ch <- res{c, err}
	}()
	a, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Cleanup(func() { a.Close(); r.c.Close() })
	return a.(*net.TCPConn), r.c.(*net.TCPConn)
}

// unixPair returns the two ends of a socketpair as net.Conns, as
// rblk-attach makes for the kernel's NBD device.
func unixPair(t testing.TB) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var cs [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		cs[i] = c
	}
	t.Cleanup(func() { cs[0].Close(); cs[1].Close() })
	return cs[0], cs[1]
}

func TestSyscallConnOnlyNetConns(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, ok := SyscallConn(a); ok {
		t.Fatal("SyscallConn took a net.Pipe")
	}
	if r := NewReader(a); r != io.Reader(a) {
		t.Fatalf("NewReader(net.Pipe) = %T, want the conn itself", r)
	}
	tc, _ := tcpPair(t)
	if _, ok := SyscallConn(tc); !ok {
		t.Fatal("SyscallConn refused a *net.TCPConn")
	}
	uc, _ := unixPair(t)
	if _, ok := uc.(*net.UnixConn); !ok {
		t.Fatalf("FileConn of a socketpair is a %T", uc)
	}
	if _, ok := NewReader(uc).(*Reader); !ok {
		t.Fatal("NewReader of a *net.UnixConn is not a Reader")
	}
}

// TestReadWrite carries a stream both ways through Reader and Writev, in
// pieces larger than the socket buffers, so that both sides wait in the
// poller and the writes come back short.
func TestReadWrite(t *testing.T) {
	for _, tc := range []struct {
		name string
		pair func(testing.TB) (net.Conn, net.Conn)
	}{
		{"tcp", func(t testing.TB) (net.Conn, net.Conn) { a, b := tcpPair(t); return a, b }},
		{"unix", unixPair},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := tc.pair(t)
			want := make([]byte, 8<<20)
			for i := range want {
				want[i] = byte(i*7 + i>>13)
			}
			errc := make(chan error, 1)
			go func() { errc <- writeAll(a, want) }()
			got, err := io.ReadAll(io.LimitReader(NewReader(b), int64(len(want))))
			if err != nil {
				t.Fatal(err)
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("the bytes read are not those written")
			}
			// The end of the stream is io.EOF.
			a.Close()
			n, err := NewReader(b).Read(make([]byte, 16))
			if n != 0 || err != io.EOF {
				t.Fatalf("read after the peer closed: %d, %v; want 0, io.EOF", n, err)
			}
		})
	}
}

// writeAll writes p to c with Writev inside RawConn.Write, waiting for
// room as the NBD server's and the tcp transport's writers do.
func writeAll(c net.Conn, p []byte) error {
	rc, ok := SyscallConn(c)
	if !ok {
		return errors.New("no raw conn")
	}
	var werr syscall.Errno
	for len(p) > 0 {
		// Three segments, to check the iovec handling.
		k := min(len(p), 300<<10)
		segs := [][]byte{p[:k/3], p[k/3 : 2*k/3], p[2*k/3 : k]}
		iov := make([]unix.Iovec, 0, 3)
		for _, s := range segs {
			if len(s) > 0 {
				v := unix.Iovec{Base: &s[0]}
				v.SetLen(len(s))
				iov = append(iov, v)
			}
		}
		n := 0
		err := rc.Write(func(fd uintptr) bool {
			n, werr = Writev(fd, iov)
			return werr != unix.EAGAIN
		})
		if err != nil {
			return err
		}
		if werr != 0 {
			return werr
		}
		p = p[n:]
	}
	return nil
}

// TestReadWakes: a Read that waits ends with the deadline's error, and
// with net.ErrClosed when the conn is closed under it.
func TestReadWakes(t *testing.T) {
	_, b := tcpPair(t)
	r := NewReader(b)
	if err := b.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Read(make([]byte, 8)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v, want os.ErrDeadlineExceeded", err)
	}
	if err := b.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		close(started)
		_, err := r.Read(make([]byte, 8))
		errc <- err
	}()
	<-started
	b.Close() // wakes the read whether it waits already or not yet
	if err := <-errc; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read of a closed conn: %v, want net.ErrClosed", err)
	}
}

// TestReadReset: a connection reset by the peer is ECONNRESET, as an
// *os.SyscallError.
func TestReadReset(t *testing.T) {
	a, b := tcpPair(t)
	if err := a.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	a.Close() // linger 0: an RST
	_, err := NewReader(b).Read(make([]byte, 8))
	var se *os.SyscallError
	if !errors.Is(err, syscall.ECONNRESET) || !errors.As(err, &se) {
		t.Fatalf("read after an RST: %v, want an *os.SyscallError of ECONNRESET", err)
	}
}

// TestMain makes the test binary an echo server for BenchmarkPingPong
// when it is started with RAWSOCK_ECHO=1: it echoes what comes on fd 3.
func TestMain(m *testing.M) {
	if os.Getenv("RAWSOCK_ECHO") == "1" {
		buf := make([]byte, 64)
		for {
			n, err := syscall.Read(3, buf)
			if n <= 0 || err != nil {
				os.Exit(0)
			}
			if _, err := syscall.Write(3, buf[:n]); err != nil {
				os.Exit(0)
			}
		}
	}
	os.Exit(m.Run())
}

// BenchmarkPingPong: one byte to an echo server in another process and
// back over a socketpair, the pattern of an IO path at queue depth 1 (this
// process idles while the other works), with the net package's Read and
// Write against Reader and Writev. ctxsw/op counts this process's context
// switches (all threads, the runtime's monitor included), cpu-ns/op its
// CPU time.
func BenchmarkPingPong(b *testing.B) {
	for _, raw := range []bool{false, true} {
		name := "net"
		if raw {
			name = "raw"
		}
		b.Run(name, func(b *testing.B) {
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				b.Fatal(err)
			}
			peer := os.NewFile(uintptr(fds[1]), "echo")
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "RAWSOCK_ECHO=1")
			cmd.ExtraFiles = []*os.File{peer}
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			peer.Close()
			f := os.NewFile(uintptr(fds[0]), "ping")
			x, err := net.FileConn(f)
			f.Close()
			if err != nil {
				b.Fatal(err)
			}
			defer func() {
				x.Close()
				cmd.Wait()
			}()
			rx := io.Reader(x)
			if raw {
				rx = NewReader(x)
			}
			buf := make([]byte, 1)
			ping := func() {
				if err := write1(x, buf, raw); err != nil {
					b.Fatal(err)
				}
				if _, err := rx.Read(buf); err != nil {
					b.Fatal(err)
				}
			}
			ping() // the echo server is up
			ru0 := rusage(b)
			b.ResetTimer()
			for range b.N {
				ping()
			}
			b.StopTimer()
			ru1 := rusage(b)
			b.ReportMetric(float64(ru1.Nvcsw+ru1.Nivcsw-ru0.Nvcsw-ru0.Nivcsw)/float64(b.N), "ctxsw/op")
			cpu := time.Duration(ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano())
			b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
		})
	}
}

func write1(c net.Conn, p []byte, raw bool) error {
	if !raw {
		_, err := c.Write(p)
		return err
	}
	return writeAll(c, p)
}

// rusage is this process's resource usage (all threads).
func rusage(b *testing.B) unix.Rusage {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return ru
}
