package e2e

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// A minimal NBD client (fixed newstyle, NBD_OPT_EXPORT_NAME, simple
// replies) for what the Debian tools cannot do: send a command the server
// did not advertise (a WRITE to a read-only export) and read a whole export
// into memory to compare it byte for byte.

const (
	nbdCmdRead        = 0
	nbdCmdWrite       = 1
	nbdCmdDisc        = 2
	nbdCmdFlush       = 3
	nbdCmdTrim        = 4
	nbdCmdWriteZeroes = 6

	nbdFlagReadOnly = 1 << 1

	nbdEPERM = 1

	nbdRequestMagic = 0x25609513
	nbdReplyMagic   = 0x67446698
	nbdOptMagic     = 0x49484156454F5054 // "IHAVEOPT"
)

type nbdClient struct {
	c      net.Conn
	dev    *blockDev // the kernel's device instead of c (devclient_test.go)
	size   uint64
	flags  uint16
	handle uint64
}

// dialNBD connects to the NBD server on the unix socket sock and selects
// export name. With RBLK_E2E_DEVICE=nbd, sock (attacher.sock) is the
// kernel's /dev/nbdN, and the client works through the device (dialDevice).
func dialNBD(t *testing.T, sock, name string) *nbdClient {
	t.Helper()
	if strings.HasPrefix(sock, "/dev/") {
		return dialDevice(t, sock, name)
	}
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		t.Fatalf("dial NBD %s: %v", sock, err)
	}
	n := &nbdClient{c: c}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(30 * time.Second))
	var greet [18]byte
	if _, err := io.ReadFull(c, greet[:]); err != nil {
		t.Fatalf("NBD greeting: %v", err)
	}
	if string(greet[:8]) != "NBDMAGIC" || binary.BigEndian.Uint64(greet[8:16]) != nbdOptMagic {
		t.Fatalf("NBD greeting % x: not fixed newstyle", greet)
	}
	hs := binary.BigEndian.Uint16(greet[16:18])
	noZeroes := hs&2 != 0
	cflags := uint32(1) // NBD_FLAG_C_FIXED_NEWSTYLE
	if noZeroes {
		cflags |= 2
	}
	msg := binary.BigEndian.AppendUint32(nil, cflags)
	msg = binary.BigEndian.AppendUint64(msg, nbdOptMagic)
	msg = binary.BigEndian.AppendUint32(msg, 1) // NBD_OPT_EXPORT_NAME
	msg = binary.BigEndian.AppendUint32(msg, uint32(len(name)))
	msg = append(msg, name...)
	if _, err := c.Write(msg); err != nil {
		t.Fatalf("NBD option: %v", err)
	}
	reply := make([]byte, 10)
	if !noZeroes {
		reply = make([]byte, 10+124)
	}
	if _, err := io.ReadFull(c, reply); err != nil {
		t.Fatalf("NBD export %q: %v", name, err)
	}
	n.size = binary.BigEndian.Uint64(reply[0:8])
	n.flags = binary.BigEndian.Uint16(reply[8:10])
	c.SetDeadline(time.Time{})
	return n
}

// do sends one command and waits for its simple reply. It returns the NBD
// error code and, for a successful READ, the data.
func (n *nbdClient) do(typ uint16, off uint64, length uint32, payload []byte) (uint32, []byte, error) {
	n.handle++
	if n.dev != nil {
		errno, data := n.dev.op(typ, off, length, payload)
		return errno, data, nil
	}
	req := nbdRequest(n.handle, typ, off, length, payload)
	n.c.SetDeadline(time.Now().Add(60 * time.Second))
	defer n.c.SetDeadline(time.Time{})
	if _, err := n.c.Write(req); err != nil {
		return 0, nil, err
	}
	if typ == nbdCmdDisc {
		return 0, nil, nil
	}
	var hdr [16]byte
	if _, err := io.ReadFull(n.c, hdr[:]); err != nil {
		return 0, nil, err
	}
	if m := binary.BigEndian.Uint32(hdr[0:4]); m != nbdReplyMagic {
		return 0, nil, fmt.Errorf("reply magic %#x", m)
	}
	errno := binary.BigEndian.Uint32(hdr[4:8])
	if h := binary.BigEndian.Uint64(hdr[8:16]); h != n.handle {
		return 0, nil, fmt.Errorf("reply handle %d, want %d", h, n.handle)
	}
	if typ != nbdCmdRead || errno != 0 {
		return errno, nil, nil
	}
	data := make([]byte, length)
	if _, err := io.ReadFull(n.c, data); err != nil {
		return 0, nil, err
	}
	return 0, data, nil
}

// readAll reads the whole export in 64 KiB requests (aligned, so each
// stays within one chunk of any chunk size rblkd accepts).
func (n *nbdClient) readAll(t *testing.T) []byte {
	t.Helper()
	out := make([]byte, 0, n.size)
	for off := uint64(0); off < n.size; {
		k := min(n.size-off, 64<<10)
		errno, data, err := n.do(nbdCmdRead, off, uint32(k), nil)
		if err != nil || errno != 0 {
			t.Fatalf("NBD READ %d at %d: errno %d, %v", k, off, errno, err)
		}
		out = append(out, data...)
		off += k
	}
	return out
}

// close sends NBD_CMD_DISC and closes the connection.
func (n *nbdClient) close() {
	n.do(nbdCmdDisc, 0, 0, nil)
	if n.dev != nil {
		return // (the device is closed by a cleanup, once what was sent has finished)
	}
	n.c.Close()
}

// nbdRequest encodes an NBD request (simple, no flags) followed by payload.
func nbdRequest(handle uint64, typ uint16, off uint64, length uint32, payload []byte) []byte {
	req := binary.BigEndian.AppendUint32(nil, nbdRequestMagic)
	req = binary.BigEndian.AppendUint16(req, 0)
	req = binary.BigEndian.AppendUint16(req, typ)
	req = binary.BigEndian.AppendUint64(req, handle)
	req = binary.BigEndian.AppendUint64(req, off)
	req = binary.BigEndian.AppendUint32(req, length)
	return append(req, payload...)
}
