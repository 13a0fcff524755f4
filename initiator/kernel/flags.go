package kernel

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"github.com/rblk/rblk/initiator/nbd"
)

// Defaults of Options.
const (
	// MaxConnections bounds the default number of connections: the kernel
	// gives each its own hardware queue (and a worker), and past a few the
	// rblk volume, which shares one session with the target, gains nothing.
	MaxConnections = 4
	// DefaultBlockSize is the logical and physical block size of the device.
	DefaultBlockSize = 4096
	// DefaultTimeout is how long the kernel waits for the reply to one
	// request. When it expires the kernel gives up on that connection: with
	// several it marks the socket dead and resends the request on another
	// one, with a single one it fails the request and shuts the device
	// down; either way the socket is not replaced. rblk's server answers
	// every request, with EIO at once when the target is gone for good, so
	// only a stall hits this limit: the initiator waiting for the target
	// to come back (initiator.DefaultReconnectTimeout, 2 minutes), or a
	// flush of a large dirty cache on a slow target disk. Three minutes
	// cover both and still unwedge a stuck device eventually.
	DefaultTimeout = 3 * time.Minute
	// DefaultDeadConnTimeout is 0: this package never hands the kernel a
	// new socket (NBD_CMD_RECONFIGURE) for a dead one, so waiting for one
	// would only delay the IO errors.
	DefaultDeadConnTimeout = 0
)

// DefaultConnections is the number of sockets handed to the kernel when
// Options.Connections is 0: the number of CPUs, capped at MaxConnections.
func DefaultConnections() int {
	return max(1, min(runtime.NumCPU(), MaxConnections))
}

// ServerFlags are the transmission flags of export e served over conns
// sockets, computed as package nbd computes them for its handshake, so that
// the kernel sends only commands the server accepts: HAS_FLAGS; READ_ONLY;
// SEND_FLUSH and SEND_FUA after CanFlush and CanFUA; SEND_TRIM and
// SEND_WRITE_ZEROES after CanTrim and CanZero on a writable export;
// CAN_MULTI_CONN after MultiConn. More than one socket needs MultiConn: the
// kernel refuses several sockets without CAN_MULTI_CONN, rightly so, since a
// flush on one connection must cover the writes of all of them.
func ServerFlags(e *nbd.Export, conns int) (uint64, error) {
	if e == nil {
		return 0, errors.New("no export")
	}
	if conns > 1 && !e.MultiConn {
		return 0, fmt.Errorf("export %q is not multi-conn: it can be served over one connection only", e.Name)
	}
	f := uint64(FlagHasFlags)
	if e.ReadOnly {
		f |= FlagReadOnly
	}
	if e.CanFlush {
		f |= FlagSendFlush
	}
	if e.CanFUA {
		f |= FlagSendFUA
	}
	if e.CanTrim && !e.ReadOnly {
		f |= FlagSendTrim
	}
	if e.CanZero && !e.ReadOnly {
		f |= FlagSendWriteZeroes
	}
	if e.MultiConn {
		f |= FlagCanMultiConn
	}
	return f, nil
}

// blockSize picks the device's block size: want (DefaultBlockSize if 0) when
// it divides size, otherwise the largest smaller power of two from 512 that
// does, so that the device ends exactly where the volume does.
func blockSize(size uint64, want uint32) (uint32, error) {
	if want == 0 {
		want = DefaultBlockSize
	}
	if want < 512 || want > 4096 || want&(want-1) != 0 {
		// The kernel takes 512 up to the page size.
		return 0, fmt.Errorf("block size %d: want a power of two from 512 to 4096", want)
	}
	if size == 0 {
		return 0, errors.New("the export's size is 0")
	}
	for bs := want; bs >= 512; bs /= 2 {
		if size%uint64(bs) == 0 {
			return bs, nil
		}
	}
	return 0, fmt.Errorf("size %d is not a multiple of 512 bytes: the kernel cannot show it as a block device", size)
}
