package kernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Where the kernel shows its devices; variables for tests.
var (
	sysBlock  = "/sys/block"
	sysModule = "/sys/module/nbd"
	devDir    = "/dev"
)

// Errors of this package, to test with errors.Is.
var (
	// ErrNoModule: the kernel has no NBD driver loaded.
	ErrNoModule = errors.New("the kernel has no nbd module: run `modprobe nbd`")
	// ErrNotAttached: the device has no server.
	ErrNotAttached = errors.New("not attached")
	// ErrInUse: the device is attached to a server already, or (for
	// detach) mounted or otherwise held open exclusively.
	ErrInUse = errors.New("in use")
)

// ParseDevice turns "auto" (or "") into -1 and /dev/nbdN or nbdN (or a
// symlink to one) into N.
func ParseDevice(dev string) (int, error) {
	if dev == "" || dev == "auto" {
		return -1, nil
	}
	name := dev
	if strings.ContainsRune(dev, '/') {
		if p, err := filepath.EvalSymlinks(dev); err == nil {
			name = p
		}
		name = filepath.Base(name)
	}
	num, ok := strings.CutPrefix(name, "nbd")
	if !ok || num == "" {
		return 0, fmt.Errorf("device %q: want /dev/nbdN or auto", dev)
	}
	n, err := strconv.ParseUint(num, 10, 31)
	if err != nil || (len(num) > 1 && num[0] == '0') {
		if strings.Contains(num, "p") {
			return 0, fmt.Errorf("device %q is a partition: name the whole device, /dev/nbdN", dev)
		}
		return 0, fmt.Errorf("device %q: want /dev/nbdN or auto", dev)
	}
	return int(n), nil
}

// DevicePath is /dev/nbdN.
func DevicePath(index int) string { return filepath.Join(devDir, "nbd"+strconv.Itoa(index)) }

// Status is what the kernel shows of one NBD device in sysfs.
type Status struct {
	Index int
	Path  string // /dev/nbdN
	// Attached: the device has a configuration (a server handed it
	// sockets and has not disconnected, or disconnected while the device
	// is still open).
	Attached bool
	// PID is the process that attached it (the one that sent
	// NBD_CMD_CONNECT), 0 if not attached. The kernel shows the thread
	// that sent it: a thread of a process that runs counts as the
	// process; one that is gone stays as it is.
	PID int
	// Backend is the identifier the attaching process gave
	// (/sys/block/nbdN/backend), "" if none.
	Backend string
	// Size in bytes.
	Size uint64
}

// Stat reads the state of the NBD device dev (/dev/nbdN or nbdN).
func Stat(dev string) (*Status, error) {
	index, err := ParseDevice(dev)
	if err != nil {
		return nil, err
	}
	if index < 0 {
		return nil, errors.New("stat needs a device, not auto")
	}
	return statIndex(index)
}

func statIndex(index int) (*Status, error) {
	st := &Status{Index: index, Path: DevicePath(index)}
	dir := filepath.Join(sysBlock, "nbd"+strconv.Itoa(index))
	if _, err := os.Stat(dir); err != nil {
		if _, merr := os.Stat(sysModule); merr != nil {
			return nil, ErrNoModule
		}
		return nil, fmt.Errorf("%s: no such NBD device", st.Path)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "pid")); err == nil {
		st.Attached = true
		st.PID, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		st.PID = threadGroup(st.PID)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "backend")); err == nil {
		st.Backend = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile(filepath.Join(dir, "size")); err == nil {
		if sectors, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil {
			st.Size = sectors * 512
		}
	}
	return st, nil
}

// countConnections counts the hardware queues of /dev/nbdN, one per
// socket the device was attached with.
func countConnections(index int) (int, error) {
	ents, err := os.ReadDir(filepath.Join(sysBlock, "nbd"+strconv.Itoa(index), "mq"))
	if err != nil {
		return 0, fmt.Errorf("%s: its sockets: %w", DevicePath(index), err)
	}
	n := 0
	for _, e := range ents {
		if e.IsDir() {
			n++
		}
	}
	if n == 0 {
		return 0, fmt.Errorf("%s: no hardware queue in sysfs", DevicePath(index))
	}
	return n, nil
}

// procDir is /proc; a variable for tests.
var procDir = "/proc"

// threadGroup is the process of thread tid (its Tgid), or tid when it
// cannot tell (the thread is gone).
func threadGroup(tid int) int {
	if tid <= 0 {
		return tid
	}
	b, err := os.ReadFile(filepath.Join(procDir, strconv.Itoa(tid), "status"))
	if err != nil {
		return tid
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			if pid, err := strconv.Atoi(strings.TrimSpace(v)); err == nil && pid > 0 {
				return pid
			}
		}
	}
	return tid
}
