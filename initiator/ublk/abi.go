package ublk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// The ublk ABI, <linux/ublk_cmd.h>. Structures are little-endian: ublk
// runs on little-endian hosts only here (amd64, arm64).
const (
	cmdGetDevInfo = 0x02
	cmdAddDev     = 0x04
	cmdDelDev     = 0x05
	cmdStartDev   = 0x06
	cmdStopDev    = 0x07
	cmdSetParams  = 0x08

	ioFetchReq         = 0x20
	ioCommitAndFetch   = 0x21
	ioNeedGetData      = 0x22
	ioResOK            = 0
	ioResNeedGetData   = 1
	ctrlCmdSize        = 32 // struct ublksrv_ctrl_cmd
	ioCmdSize          = 16 // struct ublksrv_io_cmd
	devInfoSize        = 64 // struct ublksrv_ctrl_dev_info
	paramsLen          = 60 // struct ublk_params up to the discard parameters
	iodSize            = 24 // struct ublksrv_io_desc
	maxQueueDepth      = 4096
	cmdBufOffset       = 0 // UBLKSRV_CMD_BUF_OFFSET
	fNeedGetData       = 1 << 2
	fURingCmdCompInTsk = 1 << 1
	fCmdIoctlEncode    = 1 << 6
	fUserCopy          = 1 << 7 // 6.5+: data moves by pread/pwrite on /dev/ublkcN
	ioBufOffset        = 0x80000000
	tagShift           = 25 // UBLK_TAG_OFF
	qidShift           = 41 // UBLK_QID_OFF

	opRead        = 0
	opWrite       = 1
	opFlush       = 2
	opDiscard     = 3
	opWriteZeroes = 5
	ioFFUA        = 1 << 13
	ioFNoUnmap    = 1 << 15

	attrReadOnly      = 1 << 0
	attrVolatileCache = 1 << 2
	attrFUA           = 1 << 3
	paramTypeBasic    = 1 << 0
	paramTypeDiscard  = 1 << 1

	stateLive = 1
)

// ioctlEncode is the ioctl-encoded form of a ublk command,
// _IOWR('u', nr, size), which kernels since 6.4 accept (and 6.12 prefers);
// older ones take the bare number.
func ioctlEncode(nr uint32, size uint32) uint32 {
	const iocRead, iocWrite = 2, 1
	return (iocRead|iocWrite)<<30 | size<<16 | uint32('u')<<8 | nr
}

func ctrlOp(nr uint32, legacy bool) uint32 {
	if legacy {
		return nr
	}
	return ioctlEncode(nr, ctrlCmdSize)
}

func ioOp(nr uint32, legacy bool) uint32 {
	if legacy {
		return nr
	}
	return ioctlEncode(nr, ioCmdSize)
}

// ctrlCmd is struct ublksrv_ctrl_cmd.
type ctrlCmd struct {
	devID   uint32
	queueID uint16
	len     uint16
	addr    uint64
	data0   uint64
}

func (c *ctrlCmd) put(b []byte) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], c.devID)
	le.PutUint16(b[4:], c.queueID)
	le.PutUint16(b[6:], c.len)
	le.PutUint64(b[8:], c.addr)
	le.PutUint64(b[16:], c.data0)
	le.PutUint64(b[24:], 0)
}

// putIOCmd fills struct ublksrv_io_cmd.
func putIOCmd(b []byte, q, tag uint16, result int32, addr uint64) {
	le := binary.LittleEndian
	le.PutUint16(b[0:], q)
	le.PutUint16(b[2:], tag)
	le.PutUint32(b[4:], uint32(result))
	le.PutUint64(b[8:], addr)
}

// devInfo is struct ublksrv_ctrl_dev_info.
type devInfo struct {
	queues, depth, state uint16
	maxIOBytes           uint32
	id                   uint32
	pid                  int32
	flags                uint64
}

func (d *devInfo) marshal(b *[devInfoSize]byte) {
	*b = [devInfoSize]byte{}
	le := binary.LittleEndian
	le.PutUint16(b[0:], d.queues)
	le.PutUint16(b[2:], d.depth)
	le.PutUint16(b[4:], d.state)
	le.PutUint32(b[8:], d.maxIOBytes)
	le.PutUint32(b[12:], d.id)
	le.PutUint32(b[16:], uint32(d.pid))
	le.PutUint64(b[24:], d.flags)
}

func (d *devInfo) unmarshal(b *[devInfoSize]byte) {
	le := binary.LittleEndian
	d.queues = le.Uint16(b[0:])
	d.depth = le.Uint16(b[2:])
	d.state = le.Uint16(b[4:])
	d.maxIOBytes = le.Uint32(b[8:])
	d.id = le.Uint32(b[12:])
	d.pid = int32(le.Uint32(b[16:]))
	d.flags = le.Uint64(b[24:])
}

// params is the part of struct ublk_params this package sets.
type params struct {
	attrs                          uint32
	logicalShift, physicalShift    uint8
	optShift, minShift             uint8
	maxSectors                     uint32
	devSectors                     uint64
	discard                        bool
	discardGranularity             uint32
	maxDiscardSectors, maxWZSector uint32
}

func (p *params) marshal(b *[64]byte) {
	*b = [64]byte{}
	le := binary.LittleEndian
	types := uint32(paramTypeBasic)
	if p.discard {
		types |= paramTypeDiscard
	}
	le.PutUint32(b[0:], paramsLen)
	le.PutUint32(b[4:], types)
	// struct ublk_param_basic at 8
	le.PutUint32(b[8:], p.attrs)
	b[12], b[13], b[14], b[15] = p.logicalShift, p.physicalShift, p.optShift, p.minShift
	le.PutUint32(b[16:], p.maxSectors)
	le.PutUint32(b[20:], 0) // chunk_sectors
	le.PutUint64(b[24:], p.devSectors)
	le.PutUint64(b[32:], 0) // virt_boundary_mask
	// struct ublk_param_discard at 40
	if p.discard {
		le.PutUint32(b[40:], 0) // discard_alignment
		le.PutUint32(b[44:], p.discardGranularity)
		le.PutUint32(b[48:], p.maxDiscardSectors)
		le.PutUint32(b[52:], p.maxWZSector)
		le.PutUint16(b[56:], 1) // max_discard_segments: the driver wants 1
	}
}

// iod is struct ublksrv_io_desc, read from the queue's shared array.
type iod struct {
	opFlags, sectors uint32
	start            uint64
}

func (d iod) op() uint8 { return uint8(d.opFlags) }

// ParseDevice parses the --device value for ublk: "ublk" (the next free
// id: -1) or /dev/ublkbN.
func ParseDevice(dev string) (int, error) {
	if dev == "ublk" {
		return -1, nil
	}
	base := filepath.Base(dev)
	if filepath.Dir(dev) != "/dev" || !strings.HasPrefix(base, "ublkb") {
		return 0, fmt.Errorf("%q: want ublk or /dev/ublkbN", dev)
	}
	n, err := strconv.Atoi(strings.TrimPrefix(base, "ublkb"))
	if err != nil || n < 0 || n > 1<<20 {
		return 0, fmt.Errorf("%q: want ublk or /dev/ublkbN", dev)
	}
	return n, nil
}

// IsDevice tells whether dev names a ublk device for ParseDevice.
func IsDevice(dev string) bool {
	_, err := ParseDevice(dev)
	return err == nil
}

// DevicePath is the block device of ublk device id.
func DevicePath(id int) string { return "/dev/ublkb" + strconv.Itoa(id) }

func charPath(id int) string { return "/dev/ublkc" + strconv.Itoa(id) }

// ErrNoDriver is returned when the kernel has no ublk driver.
var ErrNoDriver = errors.New("ublk: the kernel has no ublk_drv (Linux >= 6.0 with CONFIG_BLK_DEV_UBLK; modprobe ublk_drv)")

// userCopyPos is where request tag of queue q is read or written in
// /dev/ublkcN with UBLK_F_USER_COPY.
func userCopyPos(q, tag uint16) int64 {
	return ioBufOffset + int64(q)<<qidShift + int64(tag)<<tagShift
}

// roundUp rounds n up to a multiple of the power of two a.
func roundUp(n, a int) int { return (n + a - 1) &^ (a - 1) }

// cmdBufOffsetOf is where queue q's descriptor array is mapped in
// /dev/ublkcN: the driver spaces the queues by the array of the largest
// depth, whatever the device's.
func cmdBufOffsetOf(q, pageSize int) int64 {
	return cmdBufOffset + int64(q)*int64(roundUp(maxQueueDepth*iodSize, pageSize))
}
