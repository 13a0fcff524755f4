package nbd

import "testing"

// TestWireValues pins every wire value to the number in the NBD
// specification, so that a change in go-nbd, where some come from, cannot
// slip through.
func TestWireValues(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want uint64
	}{
		{"NBDMAGIC", magicNBD, 0x4e42444d41474943},
		{"IHAVEOPT", magicIHaveOpt, 0x49484156454F5054},
		{"option reply magic", magicOptReply, 0x3e889045565a9},
		{"NBD_FLAG_FIXED_NEWSTYLE", uint64(flagFixedNewstyle), 1},
		{"NBD_FLAG_NO_ZEROES", uint64(flagNoZeroes), 2},
		{"NBD_FLAG_C_FIXED_NEWSTYLE", uint64(clientFlagFixedNewstyle), 1},
		{"NBD_FLAG_C_NO_ZEROES", uint64(clientFlagNoZeroes), 2},
		{"NBD_OPT_EXPORT_NAME", uint64(optExportName), 1},
		{"NBD_OPT_ABORT", uint64(optAbort), 2},
		{"NBD_OPT_LIST", uint64(optList), 3},
		{"NBD_OPT_STARTTLS", uint64(optStartTLS), 5},
		{"NBD_OPT_INFO", uint64(optInfo), 6},
		{"NBD_OPT_GO", uint64(optGo), 7},
		{"NBD_OPT_STRUCTURED_REPLY", uint64(optStructuredReply), 8},
		{"NBD_REP_ACK", uint64(repAck), 1},
		{"NBD_REP_SERVER", uint64(repServer), 2},
		{"NBD_REP_INFO", uint64(repInfo), 3},
		{"NBD_REP_ERR_UNSUP", uint64(repErrUnsup), 1<<31 + 1},
		{"NBD_REP_ERR_INVALID", uint64(repErrInvalid), 1<<31 + 3},
		{"NBD_REP_ERR_UNKNOWN", uint64(repErrUnknown), 1<<31 + 6},
		{"NBD_INFO_EXPORT", uint64(infoExport), 0},
		{"NBD_INFO_NAME", uint64(infoName), 1},
		{"NBD_INFO_DESCRIPTION", uint64(infoDescription), 2},
		{"NBD_INFO_BLOCK_SIZE", uint64(infoBlockSize), 3},
		{"NBD_FLAG_HAS_FLAGS", uint64(tflagHasFlags), 1 << 0},
		{"NBD_FLAG_READ_ONLY", uint64(tflagReadOnly), 1 << 1},
		{"NBD_FLAG_SEND_FLUSH", uint64(tflagSendFlush), 1 << 2},
		{"NBD_FLAG_SEND_FUA", uint64(tflagSendFUA), 1 << 3},
		{"NBD_FLAG_SEND_TRIM", uint64(tflagSendTrim), 1 << 5},
		{"NBD_FLAG_SEND_WRITE_ZEROES", uint64(tflagSendWriteZeroes), 1 << 6},
		{"NBD_FLAG_CAN_MULTI_CONN", uint64(tflagCanMultiConn), 1 << 8},
		{"NBD_REQUEST_MAGIC", uint64(magicRequest), 0x25609513},
		{"NBD_SIMPLE_REPLY_MAGIC", uint64(magicSimpleReply), 0x67446698},
		{"NBD_CMD_READ", uint64(cmdRead), 0},
		{"NBD_CMD_WRITE", uint64(cmdWrite), 1},
		{"NBD_CMD_DISC", uint64(cmdDisc), 2},
		{"NBD_CMD_FLUSH", uint64(cmdFlush), 3},
		{"NBD_CMD_TRIM", uint64(cmdTrim), 4},
		{"NBD_CMD_WRITE_ZEROES", uint64(cmdWriteZeroes), 6},
		{"NBD_CMD_FLAG_FUA", uint64(cmdFlagFUA), 1 << 0},
		{"NBD_CMD_FLAG_NO_HOLE", uint64(cmdFlagNoHole), 1 << 1},
		{"EPERM", uint64(errPerm), 1},
		{"EIO", uint64(errIO), 5},
		{"ENOMEM", uint64(errNoMem), 12},
		{"EINVAL", uint64(errInval), 22},
		{"ENOSPC", uint64(errNoSpc), 28},
		{"EOVERFLOW", uint64(errOverflow), 75},
		{"ENOTSUP", uint64(errNotSup), 95},
		{"ESHUTDOWN", uint64(errShutdown), 108},
	} {
		if c.got != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.got, c.want)
		}
	}
}
