//go:build !linux

package uring

import "errors"

// ErrUnsupported is returned by New off Linux.
var ErrUnsupported = errors.New("uring: io_uring is Linux only")

// Ring is a stub off Linux.
type Ring struct{}

// New fails off Linux.
func New(entries uint32, flags uint32) (*Ring, error) { return nil, ErrUnsupported }

// Close does nothing off Linux.
func (r *Ring) Close() error { return nil }
