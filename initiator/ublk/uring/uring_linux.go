package uring

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrUnsupported is returned by New when the kernel has no io_uring
// (ENOSYS), or it is disabled (sysctl kernel.io_uring_disabled).
var ErrUnsupported = errors.New("uring: io_uring is not available")

// Setup flags (io_uring_params.flags) and others of <linux/io_uring.h>.
const (
	SetupSQE128       = 1 << 10 // 128-byte entries: room for 80 bytes of command
	SetupCoopTaskrun  = 1 << 8
	SetupSingleIssuer = 1 << 12
	SetupDeferTaskrun = 1 << 13
	enterGetEvents    = 1 << 0
	featSingleMmap    = 1 << 0
	offSQRing         = 0
	offCQRing         = 0x8000000
	offSQEs           = 0x10000000
	sqeSize           = 64
	cqeSize           = 16
	sqeCmdOffset      = 48 // sqe->cmd
	sqeCmdLen64       = 16 // bytes of command in a 64-byte entry
	sqeCmdLen128      = 80 // and in a 128-byte one
	sysIOUringSetup   = unix.SYS_IO_URING_SETUP
	sysIOUringEnter   = unix.SYS_IO_URING_ENTER
	maxEntries        = 32768
	paramsSize        = 120 // sizeof(struct io_uring_params)
)

// The kernel's layouts, checked at compile time.
var (
	_ [paramsSize - unsafe.Sizeof(params{})]byte
	_ [unsafe.Sizeof(params{}) - paramsSize]byte
	_ [sqeSize - unsafe.Sizeof(SQE{})]byte
	_ [unsafe.Sizeof(SQE{}) - sqeSize]byte
)

// Opcodes.
const (
	OpNop      = 0
	OpRead     = 22
	OpWrite    = 23
	OpURingCmd = 46
)

type sqRingOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqRingOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqRingOffsets
	cqOff                                                                  cqRingOffsets
}

// SQE is a submission entry, as the kernel lays it out. Fields the binding
// does not use are padding.
type SQE struct {
	Opcode   uint8
	Flags    uint8
	IOPrio   uint16
	FD       int32
	Off      uint64 // for IORING_OP_URING_CMD: cmd_op in the low 32 bits
	Addr     uint64
	Len      uint32
	OpFlags  uint32
	UserData uint64
	_        [8]byte           // buf_index, personality, splice_fd_in
	cmd      [sqeCmdLen64]byte // and 64 more bytes with SQE128
}

// CQE is a completion entry.
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// Ring is one io_uring instance.
type Ring struct {
	fd      int
	ringMem []byte // SQ and CQ rings, one mapping (IORING_FEAT_SINGLE_MMAP)
	cqMem   []byte // the CQ ring when mapped apart
	sqeMem  []byte
	sqe128  bool

	sqHead, sqTail, sqMask *uint32
	sqArray                unsafe.Pointer
	sqEntries              uint32
	cqHead, cqTail, cqMask *uint32
	cqes                   unsafe.Pointer

	tail     uint32 // local SQ tail: entries prepared
	toSubmit uint32 // prepared, not yet taken by io_uring_enter
}

// New sets up a ring of entries submission entries (a power of two is
// used) with the given setup flags (SetupSQE128…).
func New(entries uint32, flags uint32) (*Ring, error) {
	if entries == 0 || entries > maxEntries {
		return nil, fmt.Errorf("uring: %d entries: want 1 to %d", entries, maxEntries)
	}
	var p params
	p.flags = flags
	fd, _, errno := unix.Syscall(sysIOUringSetup, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		if errno == unix.ENOSYS || (errno == unix.EPERM && flags == 0) {
			return nil, fmt.Errorf("%w: io_uring_setup: %w", ErrUnsupported, errno)
		}
		return nil, fmt.Errorf("uring: io_uring_setup: %w", errno)
	}
	r := &Ring{fd: int(fd), sqe128: flags&SetupSQE128 != 0}
	if err := r.mmap(&p); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

func (r *Ring) mmap(p *params) error {
	sqSize := int(p.sqOff.array) + int(p.sqEntries)*4
	cqSize := int(p.cqOff.cqes) + int(p.cqEntries)*cqeSize
	single := p.features&featSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	r.ringMem, err = unix.Mmap(r.fd, offSQRing, sqSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("uring: mmap SQ ring: %w", err)
	}
	cq := r.ringMem
	if !single {
		if r.cqMem, err = unix.Mmap(r.fd, offCQRing, cqSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
			return fmt.Errorf("uring: mmap CQ ring: %w", err)
		}
		cq = r.cqMem
	}
	esz := sqeSize
	if r.sqe128 {
		esz = 2 * sqeSize
	}
	if r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*esz, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fmt.Errorf("uring: mmap SQEs: %w", err)
	}
	sq := unsafe.Pointer(&r.ringMem[0])
	r.sqHead = (*uint32)(unsafe.Add(sq, p.sqOff.head))
	r.sqTail = (*uint32)(unsafe.Add(sq, p.sqOff.tail))
	r.sqMask = (*uint32)(unsafe.Add(sq, p.sqOff.ringMask))
	r.sqArray = unsafe.Add(sq, p.sqOff.array)
	r.sqEntries = p.sqEntries
	c := unsafe.Pointer(&cq[0])
	r.cqHead = (*uint32)(unsafe.Add(c, p.cqOff.head))
	r.cqTail = (*uint32)(unsafe.Add(c, p.cqOff.tail))
	r.cqMask = (*uint32)(unsafe.Add(c, p.cqOff.ringMask))
	r.cqes = unsafe.Add(c, p.cqOff.cqes)
	r.tail = atomic.LoadUint32(r.sqTail)
	return nil
}

// Close unmaps and closes the ring; the kernel cancels what is in flight.
func (r *Ring) Close() error {
	for _, m := range [][]byte{r.sqeMem, r.cqMem, r.ringMem} {
		if m != nil {
			unix.Munmap(m)
		}
	}
	r.sqeMem, r.cqMem, r.ringMem = nil, nil, nil
	if r.fd < 0 {
		return nil
	}
	err := unix.Close(r.fd)
	r.fd = -1
	return err
}

// Entries is the size of the submission queue.
func (r *Ring) Entries() uint32 { return r.sqEntries }

// Pending is the number of entries prepared and not submitted yet.
func (r *Ring) Pending() uint32 { return r.toSubmit }

// GetSQE returns the next free submission entry, zeroed, or nil when the
// submission queue is full (Submit, then try again). The entry goes to the
// kernel with the next Submit.
func (r *Ring) GetSQE() *SQE {
	head := atomic.LoadUint32(r.sqHead)
	if r.tail-head >= r.sqEntries {
		return nil
	}
	idx := r.tail & *r.sqMask
	esz := uintptr(sqeSize)
	if r.sqe128 {
		esz *= 2
	}
	p := unsafe.Pointer(&r.sqeMem[uintptr(idx)*esz])
	clear(unsafe.Slice((*byte)(p), esz))
	*(*uint32)(unsafe.Add(r.sqArray, uintptr(idx)*4)) = idx
	r.tail++
	r.toSubmit++
	atomic.StoreUint32(r.sqTail, r.tail)
	return (*SQE)(p)
}

// Cmd is the command area of an IORING_OP_URING_CMD entry: 16 bytes, 80
// with SQE128. It is only valid on an entry of this ring.
func (r *Ring) Cmd(s *SQE) []byte {
	n := sqeCmdLen64
	if r.sqe128 {
		n = sqeCmdLen128
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s.cmd[0])), n)
}

// Submit hands the prepared entries to the kernel and, with wait > 0,
// waits until that many completions are ready (or a signal interrupts the
// wait: the caller looks at the completion queue and calls again). It
// returns the number of entries the kernel took.
func (r *Ring) Submit(wait uint32) (int, error) {
	flags := uintptr(0)
	if wait > 0 {
		flags = enterGetEvents
	}
	for {
		n, _, errno := unix.Syscall6(sysIOUringEnter, uintptr(r.fd), uintptr(r.toSubmit), uintptr(wait), flags, 0, 0)
		switch errno {
		case 0:
			r.toSubmit -= uint32(n)
			return int(n), nil
		case unix.EINTR:
			if wait > 0 {
				return 0, nil // the caller reaps what is there and comes back
			}
			continue
		case unix.EAGAIN, unix.EBUSY:
			// No memory for the entries, or the CQ would overflow: the
			// caller reaps completions and calls again.
			return 0, nil
		}
		return 0, fmt.Errorf("uring: io_uring_enter: %w", errno)
	}
}

// PeekCQE returns the oldest completion, if any; Seen releases it.
func (r *Ring) PeekCQE() (CQE, bool) {
	head := atomic.LoadUint32(r.cqHead)
	if head == atomic.LoadUint32(r.cqTail) {
		return CQE{}, false
	}
	c := (*CQE)(unsafe.Add(r.cqes, uintptr(head&*r.cqMask)*cqeSize))
	return *c, true
}

// Seen releases the completion PeekCQE returned.
func (r *Ring) Seen() {
	atomic.StoreUint32(r.cqHead, atomic.LoadUint32(r.cqHead)+1)
}

// Do submits what is prepared and waits for one completion, which it
// returns: for rings used one command at a time.
func (r *Ring) Do() (CQE, error) {
	for {
		if c, ok := r.PeekCQE(); ok {
			r.Seen()
			return c, nil
		}
		if _, err := r.Submit(1); err != nil {
			return CQE{}, err
		}
	}
}
