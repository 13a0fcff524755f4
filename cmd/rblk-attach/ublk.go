package main

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator"
	"github.com/rblk/rblk/initiator/kernel"
	"github.com/rblk/rblk/initiator/ublk"
	"github.com/rblk/rblk/protocol"
)

// checkUblk fails early (before the target is contacted) when --device
// ublk cannot work: no ublk driver (one line), or the device exists.
func (d *deviceFlags) checkUblk() error {
	if d.timeout != kernel.DefaultTimeout {
		return fmt.Errorf("--request-timeout goes with NBD devices: ublk requests wait as long as the volume's IO (--io-timeout, --reconnect-timeout)")
	}
	if err := ublk.Available(); err != nil {
		return err
	}
	id, _ := ublk.ParseDevice(d.device)
	if id >= 0 {
		if pid, _, err := ublk.ServerPID(d.device); err == nil {
			return fmt.Errorf("%s exists already (served by process %d): detach it first", d.device, pid)
		}
	}
	return nil
}

// serveUblk attaches vol as /dev/ublkbN (--device ublk or /dev/ublkbN)
// and serves it as serveDevice does /dev/nbdN: until SIGINT or SIGTERM
// (ctx), the loss of the target session, or the device's end; then it
// stops the device, waits for the requests this side has, flushes and
// closes the volume.
func serveUblk(ctx context.Context, f attachFlags, vol *initiator.Volume, log *zap.Logger, transport string, grow *growHook) error {
	id, _ := ublk.ParseDevice(f.dev.device)
	fl, ro := vol.Flags(), vol.ReadOnly()
	actx, acancel := context.WithTimeout(ctx, 30*time.Second)
	size := vol.Size()
	dev, err := ublk.Attach(actx, ublk.Options{Backend: vol, Size: size, ReadOnly: ro,
		CanTrim: !ro && fl&protocol.VolCanTrim != 0, CanZero: !ro && fl&protocol.VolCanZero != 0, CanFUA: !ro,
		ID: id, Queues: f.dev.connections, Logger: log})
	acancel()
	if err != nil {
		closeVolume(vol, log, nil)
		return fmt.Errorf("attach %q as %s: %w", f.export, f.dev.device, err)
	}
	log.Info("attached", zap.String("device", dev.Path()), zap.String("export", f.export), zap.String("target", f.target),
		zap.String("transport", transport), zap.Uint64("size", vol.Size()), zap.Bool("read_only", ro),
		zap.Int("queues", dev.Queues()))
	grow.set(size, vol.Size(), grow.ublkDevice(dev.Path()))
	f.state.attached(dev.Path())

	var runErr error
	select {
	case <-ctx.Done():
		log.Info("detaching: stopping the device, then flushing", zap.String("device", dev.Path()))
	case <-vol.Done():
		runErr = fmt.Errorf("lost the session with %s: %w", f.target, vol.Err())
		log.Error("target session down, stopping the device", zap.Error(vol.Err()))
	case <-dev.Done():
		if err := dev.Err(); err != nil {
			runErr = fmt.Errorf("%s: %w", dev.Path(), err)
			log.Error("device failed", zap.String("device", dev.Path()), zap.Error(err))
		} else {
			log.Info("device stopped by another process: flushing and closing", zap.String("device", dev.Path()))
		}
	}
	f.state.ending(runErr)
	dctx, dcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer dcancel()
	if err := dev.Detach(dctx); err != nil && runErr == nil {
		runErr = err
	}
	return closeVolume(vol, log, runErr)
}

// detachUblk makes the rblk-attach serving /dev/ublkbN stop it, flush and
// exit (SIGTERM), and waits for that.
func detachUblk(dev string, force bool, wait time.Duration) error {
	pid, live, err := ublk.ServerPID(dev)
	if err != nil {
		return err
	}
	if pid <= 0 || !alive(pid) {
		// Its server was killed: the kernel keeps the device until deleted.
		if err := ublk.Remove(dev); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "%s had no serving process: removed\n", dev)
		return nil
	}
	if !live {
		return fmt.Errorf("%s is not live (process %d serves it): wait for it, or end that process", dev, pid)
	}
	if !force {
		busy, err := ublk.InUse(dev)
		if err != nil {
			return err
		}
		if busy {
			return fmt.Errorf("%s is in use (mounted?): unmount it first, or pass --force", dev)
		}
	}
	if pid == os.Getpid() {
		return fmt.Errorf("%s is served by this process", dev)
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return fmt.Errorf("detach %s: signal its rblk-attach (process %d): %w", dev, pid, err)
	}
	if wait <= 0 {
		return nil
	}
	deadline := time.Now().Add(wait)
	for alive(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: its rblk-attach (process %d) has not exited after %v", dev, pid, wait)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}
