//go:build !linux

package kernel

import (
	"context"
	"errors"
)

var errNotLinux = errors.New("NBD devices are a Linux feature")

// Attach is Linux only.
func Attach(context.Context, Options) (*Device, error) { return nil, errNotLinux }

// Detach is Linux only.
func Detach(context.Context, string) error { return errNotLinux }

// InUse is Linux only.
func InUse(string) (bool, error) { return false, errNotLinux }

func inUse(string) (bool, error) { return false, errNotLinux }

// Available is Linux only.
func Available(context.Context) error { return errNotLinux }

// Adopt is Linux only.
func Adopt(context.Context, Options) (*Device, error) { return nil, errNotLinux }
