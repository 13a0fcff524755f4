//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

var (
	// errKicked: the wait was interrupted by kick (or a stale context
	// watcher); the caller looks at its state again.
	errKicked = errors.New("rdma: wait interrupted")
	// errWaiterClosed: the waiter was closed.
	errWaiterClosed = errors.New("rdma: waiter closed")
)

var aLongTimeAgo = time.Unix(1, 0)

// waiter waits for a non-blocking fd of a verbs channel (a completion
// channel or an RDMA CM event channel) to be readable through Go's network
// poller, so that no OS thread sleeps in C. It polls a duplicate of the fd
// (the channel keeps and closes its own), and is interrupted by setting a
// read deadline in the past: for the end of a context, and for kick.
type waiter struct {
	f   *os.File
	rc  syscall.RawConn
	gen atomic.Uint64
}

func newWaiter(fd int, name string) (*waiter, error) {
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%s: dup fd %d: %w", name, fd, err)
	}
	// The duplicate shares the O_NONBLOCK of the channel's fd, so os.NewFile
	// registers it with the poller.
	f := os.NewFile(uintptr(nfd), name)
	rc, err := f.SyscallConn()
	if err == nil {
		err = f.SetReadDeadline(time.Time{})
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: fd %d cannot be polled: %w", name, fd, err)
	}
	return &waiter{f: f, rc: rc}, nil
}

// wait calls try (whose argument is meaningless), and while it returns
// false sleeps until the fd is readable and calls it again. It returns nil once try returned true,
// ctx.Err() when ctx ends first, errKicked when kick was called since the
// caller read gen (or spuriously), and errWaiterClosed after close.
func (w *waiter) wait(ctx context.Context, gen uint64, try func(uintptr) bool) error {
	if w.f.SetReadDeadline(time.Time{}) != nil {
		return errWaiterClosed
	}
	if w.gen.Load() != gen {
		return errKicked
	}
	var stop func() bool
	if ctx.Done() != nil {
		if err := ctx.Err(); err != nil {
			return err
		}
		stop = context.AfterFunc(ctx, func() { w.f.SetReadDeadline(aLongTimeAgo) })
	}
	err := w.rc.Read(try)
	if stop != nil {
		stop()
	}
	switch {
	case err == nil:
		return nil
	case errors.Is(err, os.ErrDeadlineExceeded):
		if err := ctx.Err(); err != nil {
			return err
		}
		return errKicked
	default:
		return errWaiterClosed
	}
}

// kick interrupts a wait in progress, or the next one of a caller that read
// gen before the kick.
func (w *waiter) kick() {
	w.gen.Add(1)
	w.f.SetReadDeadline(aLongTimeAgo)
}

// close ends waits in progress (with errWaiterClosed) and closes the
// duplicate fd.
func (w *waiter) close() { w.f.Close() }

// waitEvent waits for the next event of an RDMA CM channel.
func waitEvent(ctx context.Context, ch verbs.EventChannel, w *waiter) (verbs.Event, error) {
	for {
		var ev verbs.Event
		var gerr error
		err := w.wait(ctx, w.gen.Load(), func(uintptr) bool {
			ev, gerr = ch.GetEvent()
			return !errors.Is(gerr, syscall.EAGAIN)
		})
		switch {
		case err == nil:
			return ev, gerr
		case errors.Is(err, errKicked):
			continue
		}
		return ev, err
	}
}
