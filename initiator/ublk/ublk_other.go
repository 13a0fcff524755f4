//go:build !linux

package ublk

import (
	"context"
	"errors"

	"github.com/rblk/rblk/initiator/blockdev"
	"go.uber.org/zap"
)

var errNotLinux = errors.New("ublk: Linux only")

// Options describe the device to make.
type Options struct {
	Backend                            blockdev.Backend
	Size                               uint64
	ReadOnly, CanTrim, CanZero, CanFUA bool
	ID, Queues, Depth                  int
	NoUserCopy                         bool
	Logger                             *zap.Logger
}

// Defaults and limits.
const (
	DefaultDepth = 128
	MaxIO        = 256 << 10
)

// Device is a stub off Linux.
type Device struct{}

// Available fails off Linux.
func Available() error { return errNotLinux }

// Attach fails off Linux.
func Attach(context.Context, Options) (*Device, error) { return nil, errNotLinux }

// InUse fails off Linux.
func InUse(string) (bool, error) { return false, errNotLinux }

// Remove fails off Linux.
func Remove(string) error { return errNotLinux }

// ServerPID fails off Linux.
func ServerPID(string) (int, bool, error) { return 0, false, errNotLinux }

// ID is -1 off Linux.
func (d *Device) ID() int { return -1 }

// Path is empty off Linux.
func (d *Device) Path() string { return "" }

// Queues is 0 off Linux.
func (d *Device) Queues() int { return 0 }

// Done is nil off Linux.
func (d *Device) Done() <-chan struct{} { return nil }

// Err is nil off Linux.
func (d *Device) Err() error { return nil }

// Detach does nothing off Linux.
func (d *Device) Detach(context.Context) error { return nil }
