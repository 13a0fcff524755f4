package kernel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/nbd"
)

// Options configure Attach.
type Options struct {
	// Export is what the device shows (required): its Size, flags and
	// Backend. Its MaxBlock must stay at 32 MiB (the default), the largest
	// request the kernel's NBD driver sends.
	Export *nbd.Export
	// Server serves the sockets (ServeTransmission); nil: a server of this
	// Device's own, closed by Detach.
	Server *nbd.Server
	// Device is /dev/nbdN, nbdN, or "auto" or "" for the first free one
	// (the kernel picks it).
	Device string
	// Connections is the number of sockets (0: DefaultConnections()).
	Connections int
	// BlockSize of the device (0: DefaultBlockSize, lowered to a power of
	// two that divides the size if it does not).
	BlockSize uint32
	// Timeout per request (0: DefaultTimeout; negative: none, which the
	// kernel turns into its 30 s default once there are several sockets).
	Timeout time.Duration
	// DeadConnTimeout (0: none): how long IO waits for a dead socket to be
	// replaced before it fails.
	DeadConnTimeout time.Duration
	// Backend identifies the server in /sys/block/nbdN/backend
	// (default "rblk").
	Backend string
	// Logger: one line per device event. Default: no logs.
	Logger *zap.Logger
}

// driver is the kernel side; the netlink driver on Linux, a fake in tests.
type driver interface {
	connect(ctx context.Context, c connectConfig) (index int, err error)
	disconnect(ctx context.Context, index int) error
	// reconfigure changes the size of a live device (resize.go).
	reconfigure(ctx context.Context, c resizeConfig) error
	// receivers is the number of the device's sockets the kernel reads
	// replies from; ok is false when it cannot tell.
	receivers(index int) (n int, ok bool)
	// stat is the device's state (Stat); connections, the number of
	// sockets it was attached with.
	stat(index int) (*Status, error)
	connections(index int) (int, error)
	// adopt hands a device whose sockets are dead new ones (adopt.go).
	adopt(ctx context.Context, c adoptConfig) error
}

// How Attach checks that the kernel reads every socket it was given.
//
// The kernel reads each socket in a work item of its own (recv_work, on the
// device's workqueue "nbdN-recv") that loops until the socket ends.
// NBD_CMD_CONNECT queues them all at once. When the kernel is slow to start
// a workqueue worker for them (a busy or memory-starved machine; under
// emulation it happened on the first attach after boot), the workqueue's
// rescuer thread takes every item still queued and runs them one after the
// other, in kernels without commit e5a30c303b07 ("workqueue: Process
// rescuer work items one-by-one using a cursor", 2026; Debian 12's 6.1 is
// one): it runs the first one, and the others wait behind it until that
// socket ends, at detach. The replies on their sockets are never read: the
// requests sent on them wait for the request timeout (3 minutes by
// default), after which the kernel gives up on the socket and sends them
// again on another one.
//
// So Attach waits, for up to receiversWait, until the kernel reads every
// socket; if it does not, Attach detaches the device and attaches it again
// (attachAttempts in all): by then the kernel has started the workers it
// was slow to start. Variables for tests.
var (
	receiversWait  = 5 * time.Second
	receiversPoll  = 25 * time.Millisecond
	attachAttempts = 3
)

// inUseCheck is inUse; tests replace it.
var inUseCheck = inUse

// Device is an attached /dev/nbdN served by this process.
type Device struct {
	index  int
	export *nbd.Export
	srv    *nbd.Server
	ownSrv bool
	drv    driver
	log    *zap.Logger
	conns  []net.Conn

	blockSize uint32 // the device's, for Resize
	backend   string // its backend identifier, which a reconfigure names

	sctx   context.Context // the backend calls' context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	done   chan struct{} // closed when every connection has ended

	mu  sync.Mutex
	err error // the first error a connection ended with

	detachOnce sync.Once
	detachErr  error
}

// Path is /dev/nbdN.
func (d *Device) Path() string { return DevicePath(d.index) }

// Index is N of /dev/nbdN.
func (d *Device) Index() int { return d.index }

// Connections is the number of sockets the kernel was given.
func (d *Device) Connections() int { return len(d.conns) }

// Done is closed once every connection has ended: after Detach, or when
// the kernel let go of the device on its own (another process sent
// NBD_CMD_DISCONNECT, such as `rblk-attach detach` or `nbd-client -d`).
// Detach must still be called then: it flushes and releases.
func (d *Device) Done() <-chan struct{} { return d.done }

// Err is the first error a connection ended with, nil if they all ended
// cleanly (NBD_CMD_DISC, or the kernel closed its socket).
func (d *Device) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

func (d *Device) setErr(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err == nil {
		d.err = err
	}
}

func (o *Options) setDefaults() {
	if o.Connections <= 0 {
		o.Connections = DefaultConnections()
	}
	switch {
	case o.Timeout == 0:
		o.Timeout = DefaultTimeout
	case o.Timeout < 0:
		o.Timeout = 0
	}
	if o.DeadConnTimeout < 0 {
		o.DeadConnTimeout = 0
	}
	if o.Backend == "" {
		o.Backend = "rblk"
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
}

// attach is Attach with the kernel side given, and the sockets' creator.
// When the kernel does not read every socket (see receiversWait), it
// detaches the device and attaches it again.
func attach(ctx context.Context, opts Options, drv driver, pair func() (mine net.Conn, theirs int, err error), closeFD func(int) error) (*Device, error) {
	opts.setDefaults()
	for attempt := 1; ; attempt++ {
		d, err := attachOnce(ctx, opts, drv, pair, closeFD)
		if err != nil {
			return nil, err
		}
		n, ok := d.waitReceivers(ctx)
		if !ok || n >= len(d.conns) {
			return d, nil
		}
		if attempt >= attachAttempts {
			d.log.Warn("the kernel does not read some of the device's sockets: requests sent on them wait for the request timeout",
				zap.String("device", d.Path()), zap.Int("read", n), zap.Int("connections", len(d.conns)), zap.Int("attempts", attempt))
			return d, nil
		}
		d.log.Warn("the kernel does not read some of the device's sockets (its workqueue rescuer runs their receive works one after the other): attaching again",
			zap.String("device", d.Path()), zap.Int("read", n), zap.Int("connections", len(d.conns)), zap.Duration("waited", receiversWait))
		d.detachOnce.Do(func() { d.detachErr = d.detach(ctx, false) })
		if d.detachErr != nil {
			return nil, fmt.Errorf("attach %s again: %w", d.Path(), d.detachErr)
		}
		opts.Device = d.Path()
	}
}

// waitReceivers waits until the kernel reads every socket, for up to
// receiversWait, and returns how many it reads; ok is false when it cannot
// tell (or ctx ended, or the connections ended).
func (d *Device) waitReceivers(ctx context.Context) (n int, ok bool) {
	deadline := time.Now().Add(receiversWait)
	for {
		n, ok = d.drv.receivers(d.index)
		if !ok || n >= len(d.conns) {
			return n, ok
		}
		if !time.Now().Before(deadline) {
			// None at all: this kernel does not show its workers' items.
			return n, n > 0
		}
		select {
		case <-ctx.Done():
			return n, false
		case <-d.done:
			return n, false
		case <-time.After(receiversPoll):
		}
	}
}

// attachOnce attaches the device once; opts has its defaults.
func attachOnce(ctx context.Context, opts Options, drv driver, pair func() (mine net.Conn, theirs int, err error), closeFD func(int) error) (*Device, error) {
	e := opts.Export
	flags, err := ServerFlags(e, opts.Connections)
	if err != nil {
		return nil, err
	}
	if e.Backend == nil {
		return nil, fmt.Errorf("export %q has no backend", e.Name)
	}
	if e.MaxBlock != 0 && e.MaxBlock < 32<<20 {
		return nil, fmt.Errorf("export %q: MaxBlock %d is under the 32 MiB the kernel may send", e.Name, e.MaxBlock)
	}
	index, err := ParseDevice(opts.Device)
	if err != nil {
		return nil, err
	}
	bs, err := blockSize(e.Size, opts.BlockSize)
	if err != nil {
		return nil, fmt.Errorf("export %q: %w", e.Name, err)
	}
	if opts.BlockSize != 0 && bs != opts.BlockSize {
		opts.Logger.Warn("block size lowered to divide the volume's size",
			zap.Uint32("asked", opts.BlockSize), zap.Uint32("block_size", bs))
	}

	d, theirs, err := newDevice(opts, drv, bs, opts.Connections, pair)
	// The kernel's ends: it takes its own reference to each during
	// NBD_CMD_CONNECT, so they are closed here whatever happens.
	defer func() {
		for _, fd := range theirs {
			closeFD(fd)
		}
	}()
	if err != nil {
		return nil, err
	}

	cfg := connectConfig{Index: index, SizeBytes: e.Size, BlockSizeBytes: uint64(bs), Timeout: opts.Timeout,
		DeadConnTimeout: opts.DeadConnTimeout, ServerFlags: flags, Backend: opts.Backend, FDs: theirs}
	got, err := drv.connect(ctx, cfg)
	if err != nil {
		d.abort()
		if index >= 0 && errors.Is(err, ErrInUse) {
			return nil, fmt.Errorf("%s is attached already: %w", DevicePath(index), err)
		}
		return nil, err
	}
	d.index = got
	d.log.Info("nbd device attached", zap.String("device", d.Path()), zap.String("export", e.Name),
		zap.Uint64("size", e.Size), zap.Uint32("block_size", bs), zap.Int("connections", len(d.conns)),
		zap.String("server_flags", fmt.Sprintf("%#x", flags)), zap.Duration("timeout", opts.Timeout))
	return d, nil
}

// newDevice makes a Device of n socketpairs, served from the start (the
// kernel may read the partition table as soon as it has the sockets), and
// returns the kernel's ends, which the caller closes whatever happens.
func newDevice(opts Options, drv driver, bs uint32, n int, pair func() (mine net.Conn, theirs int, err error)) (*Device, []int, error) {
	d := &Device{index: -1, export: opts.Export, srv: opts.Server, drv: drv, log: opts.Logger, done: make(chan struct{}),
		blockSize: bs, backend: opts.Backend}
	if d.srv == nil {
		var err error
		if d.srv, err = nbd.NewServer(nbd.Options{Logger: opts.Logger}); err != nil {
			return nil, nil, err
		}
		d.ownSrv = true
	}
	d.sctx, d.cancel = context.WithCancel(context.Background())
	var theirs []int
	for range n {
		c, fd, err := pair()
		if err != nil {
			d.serve() // (nothing to serve: it closes done)
			d.abort()
			return nil, theirs, fmt.Errorf("socketpair: %w", err)
		}
		d.conns = append(d.conns, c)
		theirs = append(theirs, fd)
	}
	d.serve()
	return d, theirs, nil
}

// serve runs ServeTransmission on each of our ends.
func (d *Device) serve() {
	d.wg.Add(len(d.conns))
	for i, c := range d.conns {
		go func() {
			defer d.wg.Done()
			if err := d.srv.ServeTransmission(d.sctx, c, d.export); err != nil {
				d.setErr(fmt.Errorf("connection %d: %w", i, err))
			}
		}()
	}
	go func() {
		d.wg.Wait()
		close(d.done)
	}()
}

// abort stops serving a device the kernel never got.
func (d *Device) abort() {
	for _, c := range d.conns {
		c.Close()
	}
	d.cancel()
	<-d.done
	if d.ownSrv {
		d.srv.Close()
	}
}

// Detach disconnects the device and returns once this side is done with it:
//
//  1. NBD_CMD_DISCONNECT, unless the kernel let go already (Done closed).
//     The kernel sends NBD_CMD_DISC on every socket, shuts the sockets down
//     and fails the requests it still waits for with EIO: it does not drain
//     them. A file system still mounted on the device sees IO errors from
//     then on, so unmount first; Detach logs a warning when the device is
//     held exclusively (mounted).
//  2. Each connection's server stops reading at NBD_CMD_DISC (or at the end
//     of the stream), lets the requests it already read run to completion
//     in the backend, and ends. Detach waits for all of them.
//  3. Backend.Flush (for a writable export): every write that reached the
//     server is durable when Detach returns nil.
//
// If ctx ends first, the backend calls still running are cancelled. Safe to
// call more than once: later calls return the first one's result.
func (d *Device) Detach(ctx context.Context) error {
	d.detachOnce.Do(func() { d.detachErr = d.detach(ctx, true) })
	return d.detachErr
}

// detach is Detach; checkInUse: warn when the device is held exclusively,
// which opens it. Attach, detaching a device to attach it again, does not:
// the first open reads the partition table, and on a device with an unread
// socket that read may wait for the request timeout.
func (d *Device) detach(ctx context.Context, checkInUse bool) error {
	var errs []error
	select {
	case <-d.done:
		d.log.Info("nbd device was disconnected by another process", zap.String("device", d.Path()))
	default:
		if checkInUse {
			if busy, err := inUseCheck(d.Path()); err == nil && busy {
				d.log.Warn("detaching a device that is in use (mounted?): its users get IO errors from now on",
					zap.String("device", d.Path()))
			}
		}
		if err := d.drv.disconnect(ctx, d.index); err != nil {
			errs = append(errs, fmt.Errorf("disconnect %s: %w", d.Path(), err))
			// The kernel may still hold the sockets: end them from here.
			for _, c := range d.conns {
				c.Close()
			}
		}
	}
	select {
	case <-d.done:
	case <-ctx.Done():
		d.cancel()
		for _, c := range d.conns {
			c.Close()
		}
		<-d.done
		errs = append(errs, fmt.Errorf("detach %s: requests in flight: %w", d.Path(), ctx.Err()))
	}
	d.cancel()
	if d.ownSrv {
		d.srv.Close()
	}
	if !d.export.ReadOnly {
		if err := d.export.Backend.Flush(ctx); err != nil {
			errs = append(errs, fmt.Errorf("flush after detaching %s: %w", d.Path(), err))
		}
	}
	err := errors.Join(errs...)
	d.log.Info("nbd device detached", zap.String("device", d.Path()), zap.NamedError("error", err))
	return err
}
