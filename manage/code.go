package manage

import (
	"context"
	"errors"

	"github.com/rblk/rblk/pool"
	"github.com/rblk/rblk/target"
)

// Code is the kind of an error, as a remote caller gets it: the gRPC
// status codes of the same names.
type Code string

// The codes.
const (
	OK                 Code = "OK"
	InvalidArgument    Code = "InvalidArgument"
	NotFound           Code = "NotFound"
	AlreadyExists      Code = "AlreadyExists"
	ResourceExhausted  Code = "ResourceExhausted"
	FailedPrecondition Code = "FailedPrecondition"
	PermissionDenied   Code = "PermissionDenied"
	Unavailable        Code = "Unavailable"
	DeadlineExceeded   Code = "DeadlineExceeded"
	Canceled           Code = "Canceled"
	Internal           Code = "Internal"
)

// CodeOf is the code of err (OK for nil).
func CodeOf(err error) Code {
	switch {
	case err == nil:
		return OK
	case errors.Is(err, pool.ErrInvalid), errors.Is(err, target.ErrBadSize), errors.Is(err, target.ErrShrink):
		return InvalidArgument
	case errors.Is(err, pool.ErrNotFound), errors.Is(err, ErrNoPool), errors.Is(err, target.ErrNoExport),
		errors.Is(err, ErrUnknownHost):
		return NotFound
	case errors.Is(err, pool.ErrExists), errors.Is(err, target.ErrExportExists):
		return AlreadyExists
	case errors.Is(err, pool.ErrNoSpace):
		return ResourceExhausted
	case errors.Is(err, pool.ErrDamaged), errors.Is(err, target.ErrSameFile):
		return FailedPrecondition
	case errors.Is(err, target.ErrClosed):
		return Unavailable
	case errors.Is(err, context.DeadlineExceeded):
		return DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return Canceled
	}
	return Internal
}
