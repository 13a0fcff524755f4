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
	"github.com/rblk/rblk/internal/attachstate"
)

// deviceFlags are the flags of attach --device (the kernel's /dev/nbdN).
type deviceFlags struct {
	device          string
	connections     int
	timeout         time.Duration
	deadConnTimeout time.Duration
	adopt           bool
}

func (d *deviceFlags) register(fl *pflag.FlagSet) {
	fl.StringVar(&d.device, "device", "", "attach as the block device /dev/nbdN, or auto for the first free one (needs root and modprobe nbd); or as /dev/ublkbN, or ublk for the next free one (Linux >= 6.0 with ublk_drv); this or --nbd-listen")
	fl.IntVar(&d.connections, "connections", 0, fmt.Sprintf("with --device: sockets the kernel gets (0: number of CPUs, at most %d); for ublk, its queues (0: one per CPU)", kernel.MaxConnections))
	fl.DurationVar(&d.timeout, "request-timeout", kernel.DefaultTimeout, "with --device: how long the kernel waits for one request before giving up on its connection (0: no limit; by default at least --reconnect-timeout + 1m)")
	fl.DurationVar(&d.deadConnTimeout, "dead-conn-timeout", 0, "with --device /dev/nbdN: when this process dies, how long the kernel holds the device's IO for another rblk-attach to adopt it (--adopt) before failing it (0: it fails at once)")
	fl.BoolVar(&d.adopt, "adopt", false, "with --device /dev/nbdN: serve that device, attached to this export and target by an rblk-attach that died, without detaching it (what the kernel held for it goes on; see --dead-conn-timeout)")
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
	case d.device == "" && (d.connections != 0 || d.timeout != kernel.DefaultTimeout || d.deadConnTimeout != 0 || d.adopt):
		return errors.New("--connections, --request-timeout, --dead-conn-timeout and --adopt go with --device")
	case d.deadConnTimeout < 0:
		return errors.New("--dead-conn-timeout: want 0 (none) or more")
	case d.adopt && (d.device == "auto" || ublk.IsDevice(d.device)):
		return errors.New("--adopt needs the device to adopt, /dev/nbdN")
	case d.deadConnTimeout != 0 && ublk.IsDevice(d.device):
		return errors.New("--dead-conn-timeout goes with NBD devices")
	case d.adopt && d.connections != 0:
		return errors.New("--adopt takes the device's own number of connections: leave out --connections")
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
	switch {
	case d.adopt && !st.Attached:
		return fmt.Errorf("--adopt: %s is not attached: attach it without --adopt", st.Path)
	case !d.adopt && st.Attached:
		return fmt.Errorf("%s is attached already (by process %d, backend %q): detach it first, or --adopt it if its rblk-attach died", st.Path, st.PID, st.Backend)
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
	kopts := kernel.Options{Export: exp, Server: srv, Device: f.dev.device, Connections: f.dev.connections, Timeout: timeout,
		DeadConnTimeout: f.dev.deadConnTimeout, Backend: backendID(f.export, f.target), Logger: log}
	attachDev, verb := kernel.Attach, "attach"
	if f.dev.adopt {
		attachDev, verb = kernel.Adopt, "adopt"
	}
	dev, err := attachDev(actx, kopts)
	acancel()
	if err != nil {
		closeVol(nil)
		return fmt.Errorf("%s %q as %s: %w", verb, f.export, f.dev.device, err)
	}
	log.Info("attached", zap.String("device", dev.Path()), zap.String("export", f.export), zap.String("target", f.target),
		zap.String("transport", transport), zap.Uint64("size", vol.Size()), zap.Bool("read_only", vol.ReadOnly()),
		zap.Int("connections", dev.Connections()), zap.Bool("adopted", f.dev.adopt))
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

// backendID is the backend identifier of an attached device
// (/sys/block/nbdN/backend): the export and the target, as given. An
// adoption must name the same (the kernel refuses another).
func backendID(export, target string) string { return "rblk:" + export + "@" + target }

func newDetachCmd() *cobra.Command {
	var force bool
	var wait time.Duration
	var stateDir string
	cmd := &cobra.Command{
		Use:   "detach /dev/nbdN|/dev/ublkbN",
		Short: "Disconnect a device attached by rblk-attach attach --device",
		Long: `Detach disconnects /dev/nbdN. The rblk-attach process serving it finishes the
requests it has, flushes the volume, closes it and exits 0; detach waits for that
(--wait), so that the data is durable when it returns. For /dev/ublkbN it asks
the serving rblk-attach (SIGTERM) to stop and delete the device. A device in use (mounted)
is refused unless --force: its users would get IO errors.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error { return detach(args[0], force, wait, stateDir) },
	}
	cmd.Flags().BoolVar(&force, "force", false, "detach even if the device is in use (mounted)")
	cmd.Flags().StringVar(&stateDir, "state-dir", attachstate.DefaultDir, "folder of the attaches' status files, where an adopted device's rblk-attach is found")
	cmd.Flags().DurationVar(&wait, "wait", time.Minute, "wait this long for the serving rblk-attach to exit (0: do not wait)")
	return cmd
}

func detach(dev string, force bool, wait time.Duration, stateDir string) error {
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
	pid := server(st, stateDir)
	if wait <= 0 || pid <= 0 || pid == os.Getpid() || !strings.HasPrefix(st.Backend, "rblk") {
		return nil
	}
	// The serving rblk-attach flushes, closes the volume and exits.
	deadline := time.Now().Add(wait)
	for alive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s disconnected, but its rblk-attach (process %d) has not exited after %v", st.Path, pid, wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// server is the process serving an attached device: the one that attached
// it (the kernel's pid file) while it runs, else the one that adopted it,
// found by its status file in stateDir; 0 if none runs.
func server(st *kernel.Status, stateDir string) int {
	if st.PID > 0 && alive(st.PID) {
		return st.PID
	}
	es, _ := attachstate.List(stateDir)
	for _, e := range es {
		if e.Device == st.Path && attachstate.Alive(e) {
			return e.PID
		}
	}
	return 0
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
