// Package lockfile takes a lock file: a regular file, created if missing,
// locked with flock without waiting, held until it is closed. It follows
// no symbolic link and does not block on a FIFO.
package lockfile

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrLocked: another open file holds the lock.
var ErrLocked = errors.New("locked by another process")

// Lock opens (creating it 0600) the regular file name and locks it
// (flock LOCK_EX) without waiting: ErrLocked if another open file holds
// the lock.
func Lock(name string) (*os.File, error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock file: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock file: %w", err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("lock file %s is not a regular file (%v)", name, st.Mode().Type())
	}
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock file: %w", err)
	}
	var lerr error
	if err := rc.Control(func(fd uintptr) {
		for {
			lerr = unix.Flock(int(fd), unix.LOCK_EX|unix.LOCK_NB)
			if !errors.Is(lerr, unix.EINTR) {
				return
			}
		}
	}); err != nil {
		lerr = err
	}
	switch {
	case errors.Is(lerr, unix.EWOULDBLOCK):
		f.Close()
		return nil, fmt.Errorf("%s: %w", name, ErrLocked)
	case lerr != nil:
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", name, lerr)
	}
	return f, nil
}
