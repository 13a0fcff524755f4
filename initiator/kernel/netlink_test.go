package kernel

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestConstants pins every value to include/uapi/linux/nbd-netlink.h and
// include/uapi/linux/nbd.h (and the NBD protocol for the flags the kernel's
// header lacks).
func TestConstants(t *testing.T) {
	for _, c := range []struct {
		name      string
		got, want int
	}{
		{"NBD_GENL_VERSION", genlVersion, 1},
		{"NBD_CMD_CONNECT", nbdCmdConnect, 1},
		{"NBD_CMD_DISCONNECT", nbdCmdDisconnect, 2},
		{"NBD_CMD_RECONFIGURE", nbdCmdReconfigure, 3},
		{"NBD_CMD_LINK_DEAD", nbdCmdLinkDead, 4},
		{"NBD_CMD_STATUS", nbdCmdStatus, 5},
		{"NBD_ATTR_INDEX", nbdAttrIndex, 1},
		{"NBD_ATTR_SIZE_BYTES", nbdAttrSizeBytes, 2},
		{"NBD_ATTR_BLOCK_SIZE_BYTES", nbdAttrBlockSizeBytes, 3},
		{"NBD_ATTR_TIMEOUT", nbdAttrTimeout, 4},
		{"NBD_ATTR_SERVER_FLAGS", nbdAttrServerFlags, 5},
		{"NBD_ATTR_CLIENT_FLAGS", nbdAttrClientFlags, 6},
		{"NBD_ATTR_SOCKETS", nbdAttrSockets, 7},
		{"NBD_ATTR_DEAD_CONN_TIMEOUT", nbdAttrDeadConnTimeout, 8},
		{"NBD_ATTR_DEVICE_LIST", nbdAttrDeviceList, 9},
		{"NBD_ATTR_BACKEND_IDENTIFIER", nbdAttrBackendIdentifier, 10},
		{"NBD_SOCK_ITEM", nbdSockItem, 1},
		{"NBD_SOCK_FD", nbdSockFD, 1},
		{"NBD_DEVICE_ITEM", nbdDeviceItem, 1},
		{"NBD_DEVICE_INDEX", nbdDeviceIndex, 1},
		{"NBD_DEVICE_CONNECTED", nbdDeviceConnected, 2},
		{"NBD_CFLAG_DESTROY_ON_DISCONNECT", clientFlagDestroyOnDisconnect, 1},
		{"NBD_CFLAG_DISCONNECT_ON_CLOSE", clientFlagDisconnectOnClose, 2},
		{"NBD_FLAG_HAS_FLAGS", FlagHasFlags, 1},
		{"NBD_FLAG_READ_ONLY", FlagReadOnly, 2},
		{"NBD_FLAG_SEND_FLUSH", FlagSendFlush, 4},
		{"NBD_FLAG_SEND_FUA", FlagSendFUA, 8},
		{"NBD_FLAG_ROTATIONAL", FlagRotational, 16},
		{"NBD_FLAG_SEND_TRIM", FlagSendTrim, 32},
		{"NBD_FLAG_SEND_WRITE_ZEROES", FlagSendWriteZeroes, 64},
		{"NBD_FLAG_CAN_MULTI_CONN", FlagCanMultiConn, 256},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
	if genlFamilyName != "nbd" {
		t.Errorf("NBD_GENL_FAMILY_NAME = %q", genlFamilyName)
	}
}

// unhex reads hex with spaces, newlines and # comments.
func unhex(t *testing.T, s string) []byte {
	t.Helper()
	var clean strings.Builder
	for line := range strings.SplitSeq(s, "\n") {
		line, _, _ = strings.Cut(line, "#")
		clean.WriteString(strings.Join(strings.Fields(line), ""))
	}
	b, err := hex.DecodeString(clean.String())
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// littleEndian: netlink attributes are in host byte order; the golden bytes
// below are those of a little-endian host.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

const goldenConnect = `
08 00 01 00  03 00 00 00                 # NBD_ATTR_INDEX u32 3
0c 00 02 00  00 00 00 20 00 00 00 00     # NBD_ATTR_SIZE_BYTES u64 512 MiB
0c 00 03 00  00 10 00 00 00 00 00 00     # NBD_ATTR_BLOCK_SIZE_BYTES u64 4096
0c 00 04 00  78 00 00 00 00 00 00 00     # NBD_ATTR_TIMEOUT u64 120 s
0c 00 05 00  6d 01 00 00 00 00 00 00     # NBD_ATTR_SERVER_FLAGS u64 0x16d
0c 00 08 00  05 00 00 00 00 00 00 00     # NBD_ATTR_DEAD_CONN_TIMEOUT u64 5 s
09 00 0a 00  72 62 6c 6b 00 00 00 00     # NBD_ATTR_BACKEND_IDENTIFIER "rblk\0", padded
1c 00 07 80                              # NBD_ATTR_SOCKETS, nested (NLA_F_NESTED)
  0c 00 01 80                            #   NBD_SOCK_ITEM, nested
    08 00 01 00  07 00 00 00             #     NBD_SOCK_FD u32 7
  0c 00 01 80                            #   NBD_SOCK_ITEM, nested
    08 00 01 00  08 00 00 00             #     NBD_SOCK_FD u32 8
`

func TestEncodeConnectGolden(t *testing.T) {
	cfg := connectConfig{
		Index: 3, SizeBytes: 512 << 20, BlockSizeBytes: 4096,
		Timeout: 2 * time.Minute, DeadConnTimeout: 4500 * time.Millisecond, // rounded up to 5 s
		ServerFlags: FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagSendWriteZeroes | FlagCanMultiConn,
		Backend:     "rblk", FDs: []int{7, 8},
	}
	got, err := encodeConnect(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if littleEndian {
		if want := unhex(t, goldenConnect); !bytes.Equal(got, want) {
			t.Errorf("NBD_CMD_CONNECT attributes:\n got %x\nwant %x", got, want)
		}
	}
	back, err := decodeConnect(got)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DeadConnTimeout = 5 * time.Second
	if !reflect.DeepEqual(back, cfg) {
		t.Errorf("parsed back:\n got %+v\nwant %+v", back, cfg)
	}
}

func TestEncodeConnectAuto(t *testing.T) {
	cfg := connectConfig{Index: -1, SizeBytes: 1 << 30, BlockSizeBytes: 512,
		ServerFlags: FlagHasFlags | FlagReadOnly | FlagSendFlush, FDs: []int{3}}
	got, err := encodeConnect(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// No NBD_ATTR_INDEX (the kernel picks a free device), no backend,
	// timeouts sent as 0.
	const golden = `
0c 00 02 00  00 00 00 40 00 00 00 00     # NBD_ATTR_SIZE_BYTES 1 GiB
0c 00 03 00  00 02 00 00 00 00 00 00     # NBD_ATTR_BLOCK_SIZE_BYTES 512
0c 00 04 00  00 00 00 00 00 00 00 00     # NBD_ATTR_TIMEOUT 0
0c 00 05 00  07 00 00 00 00 00 00 00     # NBD_ATTR_SERVER_FLAGS HAS_FLAGS|READ_ONLY|SEND_FLUSH
0c 00 08 00  00 00 00 00 00 00 00 00     # NBD_ATTR_DEAD_CONN_TIMEOUT 0
10 00 07 80  0c 00 01 80  08 00 01 00  03 00 00 00   # one socket, fd 3
`
	if littleEndian {
		if want := unhex(t, golden); !bytes.Equal(got, want) {
			t.Errorf("got %x\nwant %x", got, want)
		}
	}
	back, err := decodeConnect(got)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, cfg) {
		t.Errorf("parsed back:\n got %+v\nwant %+v", back, cfg)
	}
}

func TestEncodeConnectErrors(t *testing.T) {
	if _, err := encodeConnect(connectConfig{Index: -1}); err == nil {
		t.Error("no sockets: no error")
	}
	if _, err := encodeConnect(connectConfig{Index: -1, FDs: []int{-1}}); err == nil {
		t.Error("fd -1: no error")
	}
}

func TestEncodeIndex(t *testing.T) {
	got, err := encodeIndex(5)
	if err != nil {
		t.Fatal(err)
	}
	if littleEndian {
		if want := unhex(t, "08 00 01 00  05 00 00 00"); !bytes.Equal(got, want) {
			t.Errorf("NBD_CMD_DISCONNECT attributes: got %x, want %x", got, want)
		}
	}
	if _, err := encodeIndex(-1); err == nil {
		t.Error("index -1: no error")
	}
	// The reply of NBD_CMD_CONNECT carries the same attribute.
	index, err := decodeIndex(got)
	if err != nil || index != 5 {
		t.Errorf("decodeIndex = %d, %v", index, err)
	}
	if _, err := decodeIndex(nil); err == nil {
		t.Error("reply without an index: no error")
	}
	if _, err := decodeIndex([]byte{8, 0}); err == nil {
		t.Error("truncated reply: no error")
	}
}

func TestSeconds(t *testing.T) {
	for d, want := range map[time.Duration]uint64{
		0: 0, -time.Second: 0, time.Nanosecond: 1, time.Second: 1, 1500 * time.Millisecond: 2, 2 * time.Minute: 120,
	} {
		if got := seconds(d); got != want {
			t.Errorf("seconds(%v) = %d, want %d", d, got, want)
		}
	}
}
