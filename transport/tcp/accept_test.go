package tcp

import (
	"context"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport"
)

// TestAcceptPermanentFailure breaks the listening socket under the listener
// (shutdown(2) makes a blocked accept(2) fail with EINVAL, as a socket that
// is gone would): Accept must report that failure, not block until Close or
// claim an orderly close, so that the server's Serve returns an error.
func TestAcceptPermanentFailure(t *testing.T) {
	p := NewWithOptions("tcp", Options{})
	tl, err := p.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer tl.Close()
	l := tl.(*listener)
	sc, err := l.nl.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := sc.Control(func(fd uintptr) { serr = unix.Shutdown(int(fd), unix.SHUT_RDWR) }); err != nil {
		t.Fatal(err)
	}
	if serr != nil {
		t.Fatalf("shutdown: %v", serr)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = tl.Accept(ctx)
	if err == nil || errors.Is(err, transport.ErrClosed) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("accept on a broken listening socket: %v, want the accept error (not ErrClosed, not a timeout)", err)
	}
	if !errors.Is(err, syscall.EINVAL) {
		t.Errorf("accept: %v, want it to wrap EINVAL", err)
	}
	// The failure stays: a second Accept reports it too.
	if _, err2 := tl.Accept(ctx); err2 == nil || errors.Is(err2, transport.ErrClosed) || errors.Is(err2, context.DeadlineExceeded) {
		t.Errorf("second accept: %v, want the accept error again", err2)
	}
	// Close after the failure still reports ErrClosed from then on.
	tl.Close()
	if _, err := tl.Accept(ctx); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("accept after close: %v, want ErrClosed", err)
	}
}

// flakyListener fails its first n Accepts with a temporary error.
type flakyListener struct {
	net.Listener
	n     int
	errno syscall.Errno
}

func (f *flakyListener) Accept() (net.Conn, error) {
	if f.n > 0 {
		f.n--
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept", f.errno)}
	}
	return f.Listener.Accept()
}

// TestAcceptTemporaryErrors: EMFILE, ECONNABORTED and the like are retried
// (and logged), and the listener goes on accepting.
func TestAcceptTemporaryErrors(t *testing.T) {
	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ECONNABORTED, syscall.ENOBUFS} {
		t.Run(errno.Error(), func(t *testing.T) {
			core, logs := observer.New(zapcore.WarnLevel)
			p := NewWithOptions("tcp", Options{Logger: zap.New(core)})
			nl, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			l := p.newListener(&flakyListener{Listener: nl, n: 3, errno: errno})
			defer l.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			dialed := make(chan error, 1)
			go func() {
				c, err := p.Dial(ctx, l.Addr(), nil)
				if err == nil {
					c.Close()
				}
				dialed <- err
			}()
			req, err := l.Accept(ctx)
			if err != nil {
				t.Fatalf("accept after %v: %v", errno, err)
			}
			c, err := req.Accept(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			c.Close()
			if err := <-dialed; err != nil {
				t.Fatal(err)
			}
			if n := logs.FilterMessageSnippet("temporary").Len(); n != 3 {
				t.Errorf("%d warnings of a temporary accept error, want 3: %v", n, logs.All())
			}
		})
	}
}
