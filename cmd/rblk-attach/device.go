package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/kernel"
	"github.com/rblk/rblk/initiator/nbd"
	"github.com/rblk/rblk/initiator/ublk"
)

// deviceFlags are the flags of attach --device (the kernel's /dev/nbdN).
type deviceFlags struct {
	device      string
	connections int
	timeout     time.Duration
}

func (d *deviceFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&d.device, "device", "", "attach as the block device /dev/nbdN, or auto for the first free one (needs root and modprobe nbd); or as /dev/ublkbN, or ublk for the next free one (Linux >= 6.0 with ublk_drv); this or --nbd-listen")
	fl.IntVar(&d.connections, "connections", 0, fmt.Sprintf("with --device: sockets the kernel gets (0: number of CPUs, at most %d); for ublk, its queues (0: one per CPU)", kernel.MaxConnections))
	fl.DurationVar(&d.timeout, "request-timeout", kernel.DefaultTimeout, "with --device: how long the kernel waits for one request before giving up on its connection (0: no limit; by default at least --reconnect-timeout + 1m)")
}

// check validates the choice between --nbd-listen and --device and, for a
// device, fails early (before the target is contacted) when it cannot
// work: no nbd module, no such device, or one attached already.
func (d *deviceFlags) check(nbdListen string) error {
	switch {
	case nbdListen == "" && d.device == "":
		return errors.New("--nbd-listen unix:PATH|tcp:HOST:PORT or --device /dev/nbdN|auto is required")
	case nbdListen != "" && d.device != "":
		return errors.New("--nbd-listen and --device exclude each other")
	case d.device == "" && (d.connections != 0 || d.timeout != kernel.DefaultTimeout):
		return errors.New("--connections and --request-timeout go with --device")
	case d.connections < 0:
		return errors.New("--connections: want 0 (automatic) or more")
	case d.device == "":
		return nil
	case ublk.IsDevice(d.device):
		return d.checkUblk()
	}
	if _, err := kernel.ParseDevice(d.device); err != nil {
		return fmt.Errorf("--device: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := kernel.Available(ctx); err != nil {
		return err
	}
	if d.device == "auto" {
		return nil
	}
	st, err := kernel.Stat(d.device)
	if err != nil {
		return err
	}
	if st.Attached {
		return fmt.Errorf("%s is attached already (by process %d, backend %q): detach it first", st.Path, st.PID, st.Backend)
	}
	return nil
}

// serveDevice attaches vol as /dev/nbdN and serves it until SIGINT or
// SIGTERM (ctx), the loss of the target session, or a disconnect by another
// process; then it detaches the device (the kernel fails what is still in
// flight on it), waits for the requests this side already has, flushes and
// closes the volume. It closes srv and vol.
func serveDevice(ctx context.Context, f attachFlags, vol *initiator.Volume, srv *nbd.Server, log *zap.Logger, transport string, grow *growHook) error {
	closeVol := func(runErr error) error {
		srv.Close()
		return closeVolume(vol, log, runErr)
	}
	timeout := f.dev.timeout
	switch {
	case timeout == 0:
		timeout = -1 // no limit, as asked
	case timeout == kernel.DefaultTimeout && f.reconnectTimeout+time.Minute > timeout:
		// IO may wait that long for the target to come back: the kernel
		// must not give up on the connection first.
		timeout = f.reconnectTimeout + time.Minute
	}
	actx, acancel := context.WithTimeout(ctx, 30*time.Second)
	exp := nbdExport(vol, f.export)
	dev, err := kernel.Attach(actx, kernel.Options{Export: exp, Server: srv, Device: f.dev.device,
		Connections: f.dev.connections, Timeout: timeout, Backend: "rblk:" + f.export + "@" + f.target, Logger: log})
	acancel()
	if err != nil {
		closeVol(nil)
		return fmt.Errorf("attach %q as %s: %w", f.export, f.dev.device, err)
	}
	log.Info("attached", zap.String("device", dev.Path()), zap.String("export", f.export), zap.String("target", f.target),
		zap.String("transport", transport), zap.Uint64("size", vol.Size()), zap.Bool("read_only", vol.ReadOnly()),
		zap.Int("connections", dev.Connections()))
	grow.set(exp.Size, vol.Size(), grow.nbdDevice(dev))
	f.state.attached(dev.Path())

	var runErr error
	select {
	case <-ctx.Done():
		log.Info("detaching: disconnecting the device, then flushing", zap.String("device", dev.Path()))
	case <-vol.Done():
		runErr = fmt.Errorf("lost the session with %s: %w", f.target, vol.Err())
		log.Error("target session down, disconnecting the device", zap.Error(vol.Err()))
	case <-dev.Done():
		if err := dev.Err(); err != nil {
			runErr = fmt.Errorf("%s: %w", dev.Path(), err)
			log.Error("device connection failed", zap.String("device", dev.Path()), zap.Error(err))
		} else {
			log.Info("device disconnected by another process: flushing and closing", zap.String("device", dev.Path()))
		}
	}
	f.state.ending(runErr)
	dctx, dcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer dcancel()
	if err := dev.Detach(dctx); err != nil && runErr == nil {
		runErr = err
	}
	return closeVol(runErr)
}

func newDetachCmd() *cobra.Command {
	var force bool
	var wait time.Duration
	cmd := &cobra.Command{
		Use:   "detach /dev/nbdN|/dev/ublkbN",
		Short: "Disconnect a device attached by rblk-attach attach --device",
		Long: `Detach disconnects /dev/nbdN. The rblk-attach process serving it finishes the
requests it has, flushes the volume, closes it and exits 0; detach waits for that
(--wait), so that the data is durable when it returns. For /dev/ublkbN it asks
the serving rblk-attach (SIGTERM) to stop and delete the device. A device in use (mounted)
is refused unless --force: its users would get IO errors.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error { return detach(args[0], force, wait) },
	}
	cmd.Flags().BoolVar(&force, "force", false, "detach even if the device is in use (mounted)")
	cmd.Flags().DurationVar(&wait, "wait", time.Minute, "wait this long for the serving rblk-attach to exit (0: do not wait)")
	return cmd
}

func detach(dev string, force bool, wait time.Duration) error {
	if ublk.IsDevice(dev) {
		return detachUblk(dev, force, wait)
	}
	st, err := kernel.Stat(dev)
	if err != nil {
		return err
	}
	if !st.Attached {
		return fmt.Errorf("%s is not attached", st.Path)
	}
	if !force {
		busy, err := kernel.InUse(st.Path)
		if err != nil {
			return err
		}
		if busy {
			return fmt.Errorf("%s is in use (mounted?): unmount it first, or pass --force", st.Path)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := kernel.Detach(ctx, st.Path); err != nil {
		return err
	}
	if wait <= 0 || st.PID <= 0 || st.PID == os.Getpid() || !strings.HasPrefix(st.Backend, "rblk") {
		return nil
	}
	// The serving rblk-attach flushes, closes the volume and exits.
	deadline := time.Now().Add(wait)
	for alive(st.PID) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s disconnected, but its rblk-attach (process %d) has not exited after %v", st.Path, st.PID, wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// alive tells whether process pid runs; a zombie has exited.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// "pid (comm) state ...", where comm may hold spaces and parentheses.
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z' && s[i+2] != 'X'
	}
	return true
}
