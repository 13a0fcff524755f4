package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/kernel"
)

// growHook passes the volume's growth on the target (rblkd export grow)
// to the front end serving it: the kernel's /dev/nbdN is resized, an NBD
// socket's clients see the new size at their next handshake, a ublk
// device keeps its size. Until a front end is set it only logs.
type growHook struct {
	log    *zap.Logger
	export string

	mu      sync.Mutex
	resize  func(oldSize, newSize uint64) // the front end's; nil: log only
	current uint64                        // the size the front end has
}

func newGrowHook(log *zap.Logger, export string) *growHook {
	return &growHook{log: log, export: export}
}

// onResize is the volume's Options.OnResize.
func (g *growHook) onResize(oldSize, newSize uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.resize == nil {
		g.log.Info(fmt.Sprintf("%s grew from %s to %s", g.export, humanSize(oldSize), humanSize(newSize)),
			zap.String("export", g.export), zap.Uint64("old_size", oldSize), zap.Uint64("size", newSize))
		return
	}
	if newSize > g.current {
		g.resize(g.current, newSize)
		g.current = newSize
	}
}

// set makes resize the front end's, which was set up with the size
// attached; a grow since then (the volume's size is now) is passed on at
// once.
func (g *growHook) set(attached, now uint64, resize func(oldSize, newSize uint64)) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.resize, g.current = resize, attached
	if now > attached {
		resize(attached, now)
		g.current = now
	}
}

// nbdSocket is the resize of an NBD socket front end: each client's
// handshake gives the size then.
func (g *growHook) nbdSocket(oldSize, newSize uint64) {
	g.log.Info(fmt.Sprintf("%s grew from %s to %s; NBD clients see the new size at their next handshake",
		g.export, humanSize(oldSize), humanSize(newSize)), zap.String("export", g.export),
		zap.Uint64("old_size", oldSize), zap.Uint64("size", newSize))
}

// nbdDevice returns the resize of the kernel's /dev/nbdN.
func (g *growHook) nbdDevice(dev *kernel.Device) func(oldSize, newSize uint64) {
	return func(oldSize, newSize uint64) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		fields := []zap.Field{zap.String("export", g.export), zap.String("device", dev.Path()),
			zap.Uint64("old_size", oldSize), zap.Uint64("size", newSize)}
		if err := dev.Resize(ctx, newSize); err != nil {
			g.log.Error(fmt.Sprintf("%s grew from %s to %s; %s keeps its old size: %v", g.export, humanSize(oldSize),
				humanSize(newSize), dev.Path(), err), append(fields, zap.Error(err))...)
			return
		}
		g.log.Info(fmt.Sprintf("%s grew from %s to %s; %s resized", g.export, humanSize(oldSize), humanSize(newSize), dev.Path()),
			fields...)
	}
}

// ublkDevice returns the "resize" of /dev/ublkbN: the kernel has no
// command to change a live ublk device's size before Linux 6.16
// (UBLK_U_CMD_UPDATE_SIZE), so it keeps its old size until attached again.
func (g *growHook) ublkDevice(path string) func(oldSize, newSize uint64) {
	return func(oldSize, newSize uint64) {
		g.log.Warn(fmt.Sprintf("%s grew from %s to %s; %s keeps its old size until it is attached again (ublk devices are not resized live)",
			g.export, humanSize(oldSize), humanSize(newSize), path), zap.String("export", g.export), zap.String("device", path),
			zap.Uint64("old_size", oldSize), zap.Uint64("size", newSize))
	}
}
