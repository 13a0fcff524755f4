package kernel

import (
	"context"
	"errors"
	"fmt"
	"net"

	"go.uber.org/zap"
)

// ErrServed: Adopt found the device's sockets still read, by a server
// that runs (it is not dead: detach it, or stop it, first).
var ErrServed = errors.New("its server still runs")

// adopt is Adopt with the kernel side given, and the sockets' creator.
func adopt(ctx context.Context, opts Options, drv driver, pair func() (mine net.Conn, theirs int, err error), closeFD func(int) error) (*Device, error) {
	opts.setDefaults()
	e := opts.Export
	if e.Backend == nil {
		return nil, fmt.Errorf("export %q has no backend", e.Name)
	}
	index, err := ParseDevice(opts.Device)
	if err != nil {
		return nil, err
	}
	if index < 0 {
		return nil, errors.New("adopt needs a device, /dev/nbdN, not auto")
	}
	path := DevicePath(index)
	st, err := drv.stat(index)
	if err != nil {
		return nil, err
	}
	switch {
	case !st.Attached:
		return nil, fmt.Errorf("adopt %s: %w (attach it instead)", path, ErrNotAttached)
	case st.Backend != opts.Backend:
		return nil, fmt.Errorf("adopt %s: it serves %q, not %q", path, st.Backend, opts.Backend)
	case e.Size < st.Size:
		return nil, fmt.Errorf("adopt %s: the volume has %d bytes, the device %d", path, e.Size, st.Size)
	}
	if n, ok := drv.receivers(index); ok && n > 0 {
		return nil, fmt.Errorf("adopt %s: the kernel reads %d of its sockets: %w (process %d attached it)", path, n, ErrServed, st.PID)
	}
	n, err := drv.connections(index)
	if err != nil {
		return nil, err
	}
	if _, err := ServerFlags(e, n); err != nil {
		return nil, err
	}
	bs, err := blockSize(e.Size, opts.BlockSize)
	if err != nil {
		return nil, fmt.Errorf("export %q: %w", e.Name, err)
	}
	d, theirs, err := newDevice(opts, drv, bs, n, pair)
	// The kernel takes its own reference to the sockets it keeps.
	defer func() {
		for _, fd := range theirs {
			closeFD(fd)
		}
	}()
	if err != nil {
		return nil, err
	}
	d.index = index
	cfg := adoptConfig{Index: index, Backend: opts.Backend, Timeout: opts.Timeout, DeadConnTimeout: opts.DeadConnTimeout, FDs: theirs}
	if e.Size > st.Size {
		cfg.SizeBytes = e.Size
	}
	if err := drv.adopt(ctx, cfg); err != nil {
		d.abort()
		return nil, fmt.Errorf("adopt %s: %w", path, err)
	}
	// The kernel drops a socket beyond the dead ones without a word:
	// count those it reads.
	got, ok := d.waitReceivers(ctx)
	if !ok && ctx.Err() == nil {
		// waitReceivers calls none at all "cannot tell", which on attach
		// it may be; here the kernel showed the workqueue before.
		got, ok = drv.receivers(index)
	}
	switch {
	case ok && got == 0:
		d.abort()
		return nil, fmt.Errorf("adopt %s: the kernel took none of %d sockets: %w", path, n, ErrServed)
	case ok && got < n:
		d.log.Warn("the kernel reads only some of the adopted device's sockets: requests sent on the others wait for the request timeout",
			zap.String("device", path), zap.Int("read", got), zap.Int("connections", n))
	}
	d.log.Info("nbd device adopted", zap.String("device", path), zap.String("export", e.Name),
		zap.Uint64("size", e.Size), zap.Int("connections", n), zap.Int("previous_pid", st.PID),
		zap.Duration("timeout", opts.Timeout), zap.Duration("dead_conn_timeout", opts.DeadConnTimeout))
	return d, nil
}
