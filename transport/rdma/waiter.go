//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
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
//
// One wait at a time: its callers serialize them (Poll and Close's drain
// by pollSem, the CM channel of a conn by cmMu, a listener's by its
// Accept's semaphore). The end of a wait's context is watched by a
// context.AfterFunc that stays registered after the wait, for the next
// ones with the same context (known by its Done channel): Poll, called in
// a loop with one context, sleeps without allocating. Only a new context
// registers anew (stopping the registration before it); close stops it.
type waiter struct {
	f      *os.File
	rc     syscall.RawConn
	gen    atomic.Uint64
	expire func() // sets the read deadline in the past (made once)

	mu        sync.Mutex
	watched   <-chan struct{} // the Done channel of the context watched
	stopWatch func() bool     // ends that registration
	closed    bool
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
	w := &waiter{f: f, rc: rc}
	w.expire = func() { w.f.SetReadDeadline(aLongTimeAgo) }
	return w, nil
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
	if ctx.Done() != nil {
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	w.watch(ctx)
	err := w.rc.Read(try)
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

// watch makes the end of ctx interrupt the waits from now on: it keeps
// the registration of the last wait when ctx is its context (or one with
// the same Done channel), and makes another otherwise, or none for a
// context that never ends. A registration left from an earlier wait may
// fire during a later one (its context ended meanwhile): that wait
// returns errKicked, which its caller takes as spurious.
func (w *waiter) watch(ctx context.Context) {
	done := ctx.Done()
	w.mu.Lock()
	defer w.mu.Unlock()
	if done == w.watched || w.closed {
		return
	}
	if w.stopWatch != nil {
		w.stopWatch()
		w.stopWatch = nil
	}
	w.watched = done
	if done != nil {
		w.stopWatch = context.AfterFunc(ctx, w.expire)
	}
}

// kick interrupts a wait in progress, or the next one of a caller that read
// gen before the kick.
func (w *waiter) kick() {
	w.gen.Add(1)
	w.f.SetReadDeadline(aLongTimeAgo)
}

// close ends waits in progress (with errWaiterClosed), ends the watch of
// the last wait's context and closes the duplicate fd.
func (w *waiter) close() {
	w.mu.Lock()
	w.closed = true
	if w.stopWatch != nil {
		w.stopWatch()
		w.stopWatch = nil
	}
	w.watched = nil
	w.mu.Unlock()
	w.f.Close()
}

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
