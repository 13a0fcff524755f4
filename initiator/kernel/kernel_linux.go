//go:build linux

package kernel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// Adopt serves the device opts.Device in place of a server that is gone
// (an rblk-attach killed, or restarted with its container), without
// detaching it: a file system mounted on it stays mounted. The device must
// be attached with opts.Backend as its backend identifier and none of its
// sockets read any more (every one dead: the kernel saw its server's end
// close); otherwise ErrInUse, or ErrNotAttached. Adopt makes as many new
// socketpairs, serves them, and hands the kernel their other ends with one
// NBD_CMD_RECONFIGURE, which also sets the request and dead-connection
// timeouts again and grows the device when opts.Export is larger.
//
// What the kernel holds is not lost: requests queued after the sockets
// died wait for a new socket for the dead-connection timeout the device
// was attached with (Options.DeadConnTimeout: 0 fails them at once, so
// only a device attached with one can be adopted without IO errors), and
// go out on the new sockets. Requests that were sent on a dead socket and
// never answered are sent again once their request timeout
// (Options.Timeout) expires; a write sent again is the same write, so
// nothing is applied out of order: the dead server is gone.
func Adopt(ctx context.Context, opts Options) (*Device, error) {
	return adopt(ctx, opts, netlinkDriver{}, socketpair, unix.Close)
}

// Attach creates opts.Connections socketpairs, serves this process's end of
// each with opts.Server.ServeTransmission for opts.Export, and hands the
// other ends to the kernel's NBD driver with one NBD_CMD_CONNECT. It returns
// once the device is usable: Path names it. Needs CAP_SYS_ADMIN and the nbd
// module (ErrNoModule otherwise).
func Attach(ctx context.Context, opts Options) (*Device, error) {
	return attach(ctx, opts, netlinkDriver{}, socketpair, unix.Close)
}

// Detach disconnects /dev/nbdN (or nbdN) whoever serves it: the kernel sends
// NBD_CMD_DISC to its server, which for rblk-attach flushes the volume and
// exits. ErrNotAttached if the device has no server.
func Detach(ctx context.Context, dev string) error {
	index, err := ParseDevice(dev)
	if err != nil {
		return err
	}
	if index < 0 {
		return errors.New("detach needs a device, not auto")
	}
	st, err := statIndex(index)
	if err != nil {
		return err
	}
	if !st.Attached {
		return fmt.Errorf("%s: %w", st.Path, ErrNotAttached)
	}
	return netlinkDriver{}.disconnect(ctx, index)
}

// InUse tells whether dev is held exclusively: mounted, or a member of a
// device-mapper or RAID device. It opens the device with O_EXCL, which fails
// with EBUSY then.
func InUse(dev string) (bool, error) {
	index, err := ParseDevice(dev)
	if err != nil {
		return false, err
	}
	if index < 0 {
		return false, errors.New("in use: needs a device, not auto")
	}
	return inUse(DevicePath(index))
}

func inUse(path string) (bool, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.EBUSY) {
			return true, nil
		}
		return false, &os.PathError{Op: "open", Path: path, Err: err}
	}
	unix.Close(fd)
	return false, nil
}

// socketpair makes a connected pair of unix stream sockets: a net.Conn of
// ours and the kernel's descriptor.
func socketpair() (net.Conn, int, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, -1, os.NewSyscallError("socketpair", err)
	}
	f := os.NewFile(uintptr(fds[0]), "nbd-server")
	c, err := net.FileConn(f) // dups the descriptor
	f.Close()
	if err != nil {
		unix.Close(fds[1])
		return nil, -1, err
	}
	return c, fds[1], nil
}

// netlinkDriver talks to the kernel's "nbd" generic netlink family.
type netlinkDriver struct{}

// receivers counts the kernel threads that read the sockets of /dev/nbdN.
func (netlinkDriver) receivers(index int) (int, bool) { return countReceivers("/proc", index) }

// countReceivers counts the tasks under proc running a work item of the
// workqueue "nbdN-recv", where the NBD driver reads each socket of /dev/nbdN
// in an item of its own (recv_work) until the socket ends. While a
// workqueue worker runs an item, its /proc/PID/comm is its name, "+" and the
// workqueue's: "kworker/u5:1+nbd0-recv", or "nbd0-recv+nbd0-recv" for the
// workqueue's rescuer thread (since Linux 4.18). ok is false when no task
// shows the workqueue's name at all, not even its rescuer (named after it):
// a kernel that names it otherwise.
func countReceivers(proc string, index int) (n int, ok bool) {
	ents, err := os.ReadDir(proc)
	if err != nil {
		return 0, false
	}
	wq := fmt.Sprintf("nbd%d-recv", index)
	for _, e := range ents {
		name := e.Name()
		if name == "" || name[0] < '0' || name[0] > '9' {
			continue
		}
		b, err := os.ReadFile(filepath.Join(proc, name, "comm"))
		if err != nil {
			continue
		}
		// Older kernels name it "knbdN-recv".
		comm := strings.TrimSuffix(string(b), "\n")
		if strings.HasSuffix(comm, wq) {
			ok = true
			if strings.HasSuffix(comm, "+"+wq) || strings.HasSuffix(comm, "+k"+wq) {
				n++
			}
		}
	}
	return n, ok
}

// dial opens a generic netlink socket and finds the nbd family; ctx's
// deadline (or its end) bounds every exchange on it.
func (netlinkDriver) dial(ctx context.Context) (*genetlink.Conn, genetlink.Family, func(), error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, genetlink.Family{}, nil, fmt.Errorf("generic netlink: %w", err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	closeAll := func() {
		stop()
		c.Close()
	}
	fam, err := c.GetFamily(genlFamilyName)
	if err != nil {
		closeAll()
		if errors.Is(err, syscall.ENOENT) {
			return nil, genetlink.Family{}, nil, ErrNoModule
		}
		return nil, genetlink.Family{}, nil, fmt.Errorf("generic netlink family %q: %w", genlFamilyName, ctxErr(ctx, err))
	}
	return c, fam, closeAll, nil
}

// ctxErr prefers the context's error to the deadline error it caused.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

// kernelErr words the errors the NBD driver answers with.
func kernelErr(cmd string, err error) error {
	switch {
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		return fmt.Errorf("%s: NBD devices need CAP_SYS_ADMIN (run as root): %w", cmd, err)
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("%s: %w: %w", cmd, ErrInUse, err)
	case errors.Is(err, unix.EINVAL):
		return fmt.Errorf("%s: the kernel refused it (its log, dmesg, says why): %w", cmd, err)
	}
	return fmt.Errorf("%s: %w", cmd, err)
}

func (n netlinkDriver) connect(ctx context.Context, cfg connectConfig) (int, error) {
	data, err := encodeConnect(cfg)
	if err != nil {
		return -1, err
	}
	c, fam, closeConn, err := n.dial(ctx)
	if err != nil {
		return -1, err
	}
	defer closeConn()
	// No NLM_F_ACK: on success the kernel answers with a message carrying
	// the index, on failure with an error.
	msgs, err := c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: nbdCmdConnect, Version: genlVersion},
		Data:   data,
	}, fam.ID, netlink.Request)
	if err != nil {
		return -1, kernelErr("NBD_CMD_CONNECT", ctxErr(ctx, err))
	}
	for _, m := range msgs {
		if index, err := decodeIndex(m.Data); err == nil {
			return index, nil
		}
	}
	return -1, errors.New("NBD_CMD_CONNECT: the kernel's reply names no device")
}

func (n netlinkDriver) disconnect(ctx context.Context, index int) error {
	data, err := encodeIndex(index)
	if err != nil {
		return err
	}
	return n.executeAck(ctx, nbdCmdDisconnect, "NBD_CMD_DISCONNECT", data)
}

// executeAck sends the command cmd (called name in errors) with data and
// waits for the kernel's ack: it sends no reply to a disconnect or a
// reconfigure.
func (n netlinkDriver) executeAck(ctx context.Context, cmd uint8, name string, data []byte) error {
	c, fam, closeConn, err := n.dial(ctx)
	if err != nil {
		return err
	}
	defer closeConn()
	_, err = c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: genlVersion},
		Data:   data,
	}, fam.ID, netlink.Request|netlink.Acknowledge)
	if err != nil {
		return kernelErr(name, ctxErr(ctx, err))
	}
	return nil
}

func (n netlinkDriver) reconfigure(ctx context.Context, cfg resizeConfig) error {
	data, err := encodeResize(cfg)
	if err != nil {
		return err
	}
	return n.executeAck(ctx, nbdCmdReconfigure, "NBD_CMD_RECONFIGURE", data)
}

func (n netlinkDriver) adopt(ctx context.Context, cfg adoptConfig) error {
	data, err := encodeAdopt(cfg)
	if err != nil {
		return err
	}
	return n.executeAck(ctx, nbdCmdReconfigure, "NBD_CMD_RECONFIGURE", data)
}

// connections counts the device's sockets: the kernel gives it a hardware
// queue per socket (nbd_start_device), each a directory of
// /sys/block/nbdN/mq.
func (netlinkDriver) connections(index int) (int, error) { return countConnections(index) }

func (netlinkDriver) stat(index int) (*Status, error) { return statIndex(index) }

// Available reports ErrNoModule when the kernel has no NBD driver, or why
// its netlink interface cannot be reached; nil when Attach can try.
func Available(ctx context.Context) error {
	_, _, closeConn, err := netlinkDriver{}.dial(ctx)
	if err != nil {
		return err
	}
	closeConn()
	return nil
}
