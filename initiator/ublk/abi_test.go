package ublk

import (
	"encoding/binary"
	"testing"
)

// The ioctl-encoded commands, as <linux/ublk_cmd.h> of 6.4+ spells them
// (UBLK_U_CMD_ADD_DEV = _IOWR('u', 0x04, struct ublksrv_ctrl_cmd)…).
func TestIoctlEncoding(t *testing.T) {
	for _, tc := range []struct {
		name string
		got  uint32
		want uint32
	}{
		{"UBLK_U_CMD_ADD_DEV", ctrlOp(cmdAddDev, false), 0xc0207504},
		{"UBLK_U_CMD_START_DEV", ctrlOp(cmdStartDev, false), 0xc0207506},
		{"UBLK_U_CMD_STOP_DEV", ctrlOp(cmdStopDev, false), 0xc0207507},
		{"UBLK_U_CMD_SET_PARAMS", ctrlOp(cmdSetParams, false), 0xc0207508},
		{"UBLK_U_IO_FETCH_REQ", ioOp(ioFetchReq, false), 0xc0107520},
		{"UBLK_U_IO_COMMIT_AND_FETCH_REQ", ioOp(ioCommitAndFetch, false), 0xc0107521},
		{"UBLK_U_IO_NEED_GET_DATA", ioOp(ioNeedGetData, false), 0xc0107522},
		{"UBLK_CMD_ADD_DEV (legacy)", ctrlOp(cmdAddDev, true), 0x04},
		{"UBLK_IO_FETCH_REQ (legacy)", ioOp(ioFetchReq, true), 0x20},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %#x, want %#x", tc.name, tc.got, tc.want)
		}
	}
}

func TestCommandLayout(t *testing.T) {
	var b [ctrlCmdSize]byte
	(&ctrlCmd{devID: 7, queueID: 0xffff, len: 64, addr: 0x1122334455667788, data0: 4242}).put(b[:])
	le := binary.LittleEndian
	if le.Uint32(b[0:]) != 7 || le.Uint16(b[4:]) != 0xffff || le.Uint16(b[6:]) != 64 ||
		le.Uint64(b[8:]) != 0x1122334455667788 || le.Uint64(b[16:]) != 4242 {
		t.Fatalf("ublksrv_ctrl_cmd % x", b)
	}
	var io [ioCmdSize]byte
	putIOCmd(io[:], 3, 127, -5, 0xdeadbeef000)
	if le.Uint16(io[0:]) != 3 || le.Uint16(io[2:]) != 127 || int32(le.Uint32(io[4:])) != -5 || le.Uint64(io[8:]) != 0xdeadbeef000 {
		t.Fatalf("ublksrv_io_cmd % x", io)
	}
	in := devInfo{queues: 2, depth: 128, maxIOBytes: MaxIO, id: ^uint32(0), pid: 99, flags: fNeedGetData | fCmdIoctlEncode}
	var ib [devInfoSize]byte
	in.marshal(&ib)
	if le.Uint16(ib[0:]) != 2 || le.Uint16(ib[2:]) != 128 || le.Uint32(ib[8:]) != MaxIO || le.Uint32(ib[12:]) != ^uint32(0) ||
		le.Uint32(ib[16:]) != 99 || le.Uint64(ib[24:]) != 0x44 {
		t.Fatalf("ublksrv_ctrl_dev_info % x", ib)
	}
	var out devInfo
	out.unmarshal(&ib)
	if out != in {
		t.Fatalf("round trip: %+v, want %+v", out, in)
	}
}

func TestParamsLayout(t *testing.T) {
	p := params{attrs: attrVolatileCache | attrFUA, logicalShift: 9, physicalShift: 12, optShift: 12, minShift: 9,
		maxSectors: MaxIO >> 9, devSectors: 1 << 21, discard: true, discardGranularity: 4096,
		maxDiscardSectors: 1 << 21, maxWZSector: 1 << 20}
	var b [64]byte
	p.marshal(&b)
	le := binary.LittleEndian
	switch {
	case le.Uint32(b[0:]) != paramsLen, le.Uint32(b[4:]) != paramTypeBasic|paramTypeDiscard:
		t.Fatalf("header % x", b[:8])
	case le.Uint32(b[8:]) != 0xc, b[12] != 9, b[13] != 12, le.Uint32(b[16:]) != 512, le.Uint64(b[24:]) != 1<<21:
		t.Fatalf("basic % x", b[8:40])
	case le.Uint32(b[44:]) != 4096, le.Uint32(b[48:]) != 1<<21, le.Uint32(b[52:]) != 1<<20, le.Uint16(b[56:]) != 1:
		t.Fatalf("discard % x", b[40:60])
	}
	p.discard = false
	p.marshal(&b)
	if le.Uint32(b[4:]) != paramTypeBasic || le.Uint32(b[48:]) != 0 {
		t.Fatal("discard parameters set without the discard type")
	}
}

func TestCmdBufOffset(t *testing.T) {
	// The driver spaces queues by round_up(4096 * 24, PAGE_SIZE).
	if got := cmdBufOffsetOf(0, 4096); got != 0 {
		t.Fatalf("queue 0 at %d", got)
	}
	if got := cmdBufOffsetOf(3, 4096); got != 3*98304 {
		t.Fatalf("queue 3 at %d, want %d", got, 3*98304)
	}
	if got := cmdBufOffsetOf(1, 65536); got != 131072 {
		t.Fatalf("queue 1 with 64 KiB pages at %d, want 131072", got)
	}
}

func TestUserCopyPos(t *testing.T) {
	// UBLKSRV_IO_BUF_OFFSET + (q_id << UBLK_QID_OFF) + (tag << UBLK_TAG_OFF)
	if got := userCopyPos(0, 0); got != 0x80000000 {
		t.Fatalf("queue 0 tag 0 at %#x", got)
	}
	if got, want := userCopyPos(1, 3), int64(0x80000000+1<<41+3<<25); got != want {
		t.Fatalf("queue 1 tag 3 at %#x, want %#x", got, want)
	}
}

func TestParseDevice(t *testing.T) {
	for _, tc := range []struct {
		in   string
		id   int
		fail bool
	}{
		{"ublk", -1, false}, {"/dev/ublkb0", 0, false}, {"/dev/ublkb12", 12, false},
		{"/dev/ublkc0", 0, true}, {"/dev/nbd0", 0, true}, {"ublkb0", 0, true}, {"/dev/ublkb", 0, true}, {"/dev/ublkb-1", 0, true},
	} {
		id, err := ParseDevice(tc.in)
		if (err != nil) != tc.fail || (!tc.fail && id != tc.id) {
			t.Errorf("ParseDevice(%q) = %d, %v", tc.in, id, err)
		}
		if IsDevice(tc.in) == tc.fail {
			t.Errorf("IsDevice(%q) = %v", tc.in, !tc.fail)
		}
	}
	if DevicePath(3) != "/dev/ublkb3" || charPath(3) != "/dev/ublkc3" {
		t.Fatal("device paths")
	}
}
