package protocol

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"syscall"
	"unicode/utf8"
)

// Decoding and encoding errors. Decoders wrap them with what was being
// decoded ("decode Done: ..."), so test them with errors.Is.
var (
	// ErrBadMagic means a header did not start with Magic: the bytes are not
	// an rblk message.
	ErrBadMagic = errors.New("protocol: bad magic")

	// ErrVersion means a header had a version other than Version, or that
	// two Hellos have no version in common.
	ErrVersion = errors.New("protocol: unsupported version")

	// ErrReserved means a reserved field, or an undefined flag bit, was not
	// zero.
	ErrReserved = errors.New("protocol: reserved field not zero")

	// ErrTooLarge means a message would exceed MaxMessageSize, or a header's
	// length field exceeds MaxPayloadSize.
	ErrTooLarge = errors.New("protocol: message too large")

	// ErrTruncated means a message or payload ended before its fields did.
	ErrTruncated = errors.New("protocol: message truncated")

	// ErrTrailing means bytes were left after the last field of a payload,
	// or after the payload the header's length announces.
	ErrTrailing = errors.New("protocol: trailing bytes after message")

	// ErrUnknownType means the header's type is not one this package knows.
	ErrUnknownType = errors.New("protocol: unknown message type")

	// ErrBadField means a field holds a value the protocol forbids: an empty,
	// overlong or malformed name, an unknown mode, a Done without ranges, an
	// empty or wrapping range, an overlong error text and the like.
	ErrBadField = errors.New("protocol: invalid field")
)

// Errors a peer reports with an Error message. A *RemoteError matches the
// one of its code with errors.Is, and CodeOf maps each back to its code, so
// the target can return them from its handlers and the initiator can test
// for them.
var (
	// ErrPerm (CodePerm) means the operation is not allowed: writing to a
	// read-only volume or handle, or a write grant on one.
	ErrPerm = errors.New("protocol: operation not permitted")

	// ErrNoExport (CodeNoEnt) means no export has the name given to Open,
	// or the handle is unknown.
	ErrNoExport = errors.New("protocol: no such export")

	// ErrIO (CodeIO) means the target failed to read or write its backing
	// storage. It is also the code of errors with no better one.
	ErrIO = errors.New("protocol: I/O error")

	// ErrBusy (CodeBusy) means the target cannot take the request now (for
	// example it has no memory left to grant); the initiator may retry later.
	ErrBusy = errors.New("protocol: target busy")

	// ErrInvalid (CodeInval) means the request is well formed but its
	// arguments are not acceptable: misaligned offsets, an unsupported flag
	// for this volume and the like.
	ErrInvalid = errors.New("protocol: invalid argument")

	// ErrNoSpace (CodeNoSpc) means the backing storage is full.
	ErrNoSpace = errors.New("protocol: no space left")

	// ErrRange (CodeRange) means an offset or range lies beyond the end of
	// the volume.
	ErrRange = errors.New("protocol: out of range")

	// ErrProtocol (CodeProto) means the peer broke the protocol: a message
	// it could not decode, or one that was not expected.
	ErrProtocol = errors.New("protocol: protocol error")

	// ErrShutdown (CodeShutdown) means the target is shutting down or the
	// handle is being closed.
	ErrShutdown = errors.New("protocol: shutting down")

	// ErrAccess (CodeAccess) means access is denied: the session is not
	// authenticated (its host is unknown, its secret wrong or missing, or
	// it sent a request before authenticating; the target then closes the
	// connection), or its host is not allowed to open the export. Unlike
	// ErrPerm it never means the export is read-only.
	ErrAccess = errors.New("protocol: access denied")

	// ErrStale (CodeStale) means a grant is unknown or was revoked: ask for
	// it again.
	ErrStale = errors.New("protocol: stale grant")
)

// ErrorCode is the code of an Error message. Codes are Linux errno numbers.
type ErrorCode uint32

// Error codes.
const (
	CodePerm     ErrorCode = 1   // EPERM: ErrPerm
	CodeNoEnt    ErrorCode = 2   // ENOENT: ErrNoExport
	CodeIO       ErrorCode = 5   // EIO: ErrIO
	CodeAccess   ErrorCode = 13  // EACCES: ErrAccess
	CodeBusy     ErrorCode = 16  // EBUSY: ErrBusy
	CodeInval    ErrorCode = 22  // EINVAL: ErrInvalid
	CodeNoSpc    ErrorCode = 28  // ENOSPC: ErrNoSpace
	CodeRange    ErrorCode = 34  // ERANGE: ErrRange
	CodeProto    ErrorCode = 71  // EPROTO: ErrProtocol
	CodeShutdown ErrorCode = 108 // ESHUTDOWN: ErrShutdown
	CodeStale    ErrorCode = 116 // ESTALE: ErrStale
)

var codes = []struct {
	code     ErrorCode
	name     string
	sentinel error
}{
	{CodePerm, "EPERM", ErrPerm},
	{CodeNoEnt, "ENOENT", ErrNoExport},
	{CodeIO, "EIO", ErrIO},
	{CodeAccess, "EACCES", ErrAccess},
	{CodeBusy, "EBUSY", ErrBusy},
	{CodeInval, "EINVAL", ErrInvalid},
	{CodeNoSpc, "ENOSPC", ErrNoSpace},
	{CodeRange, "ERANGE", ErrRange},
	{CodeProto, "EPROTO", ErrProtocol},
	{CodeShutdown, "ESHUTDOWN", ErrShutdown},
	{CodeStale, "ESTALE", ErrStale},
}

func (c ErrorCode) String() string {
	for _, e := range codes {
		if e.code == c {
			return e.name
		}
	}
	return fmt.Sprintf("ErrorCode(%d)", uint32(c))
}

// sentinel returns the error of c, or nil for an unknown code.
func (c ErrorCode) sentinel() error {
	for _, e := range codes {
		if e.code == c {
			return e.sentinel
		}
	}
	return nil
}

// RemoteError is an error reported by the peer in an Error message.
type RemoteError struct {
	Code ErrorCode
	Text string
}

func (e *RemoteError) Error() string {
	if e.Text == "" {
		return fmt.Sprintf("remote error %v", e.Code)
	}
	return fmt.Sprintf("remote error %v: %s", e.Code, e.Text)
}

// Is makes errors.Is(err, ErrStale) and the like true for the sentinel error
// of the code.
func (e *RemoteError) Is(target error) bool {
	s := e.Code.sentinel()
	return s != nil && s == target
}

// Err returns the error m reports, as a *RemoteError.
func (m *ErrorMsg) Err() error {
	return &RemoteError{Code: m.Code, Text: m.Text}
}

// ErrorFor builds the Error message that reports err: its code is
// CodeOf(err), its text err.Error() cut to MaxErrorText bytes (on a rune
// boundary, invalid UTF-8 replaced) so that the message always encodes.
// A *RemoteError is passed on as it is. err must not be nil.
func ErrorFor(err error) *ErrorMsg {
	text := err.Error()
	var re *RemoteError
	if errors.As(err, &re) {
		text = re.Text
	}
	text = strings.ToValidUTF8(text, "\uFFFD")
	if len(text) > MaxErrorText {
		n := MaxErrorText
		for n > 0 && !utf8.RuneStart(text[n]) {
			n--
		}
		text = text[:n]
	}
	return &ErrorMsg{Code: CodeOf(err), Text: text}
}

// CodeOf returns the code that reports err in an Error message: the code of
// a *RemoteError, of the sentinel errors above (decoding errors give
// CodeProto), or of a syscall errno; CodeIO for anything else, 0 for nil.
func CodeOf(err error) ErrorCode {
	if err == nil {
		return 0
	}
	var re *RemoteError
	if errors.As(err, &re) && re.Code != 0 {
		return re.Code
	}
	for _, e := range codes {
		if errors.Is(err, e.sentinel) {
			return e.code
		}
	}
	for _, s := range []error{ErrBadMagic, ErrVersion, ErrReserved, ErrTooLarge,
		ErrTruncated, ErrTrailing, ErrUnknownType, ErrBadField} {
		if errors.Is(err, s) {
			return CodeProto
		}
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		switch errno {
		case syscall.EPERM, syscall.EACCES, syscall.EROFS: // file permissions, not authentication
			return CodePerm
		case syscall.ENOENT, syscall.ENODEV, syscall.ENXIO:
			return CodeNoEnt
		case syscall.EBUSY, syscall.EAGAIN:
			return CodeBusy
		case syscall.EINVAL, syscall.EOPNOTSUPP:
			return CodeInval
		case syscall.ENOSPC, syscall.EDQUOT:
			return CodeNoSpc
		case syscall.ERANGE, syscall.EFBIG, syscall.EOVERFLOW:
			return CodeRange
		case syscall.EPROTO:
			return CodeProto
		case syscall.ESHUTDOWN:
			return CodeShutdown
		case syscall.ESTALE:
			return CodeStale
		}
		return CodeIO
	}
	switch {
	case errors.Is(err, fs.ErrPermission):
		return CodePerm
	case errors.Is(err, fs.ErrNotExist):
		return CodeNoEnt
	case errors.Is(err, fs.ErrClosed):
		return CodeShutdown
	}
	return CodeIO
}
