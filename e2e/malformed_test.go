package e2e

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// frameHeader builds a header of the software transport's frames (32
// bytes, big endian: magic "RB", type, status, length, seq, addr, rkey,
// imm), to send malformed ones.
func frameHeader(magic uint16, typ byte, length uint32) []byte {
	h := make([]byte, 32)
	binary.BigEndian.PutUint16(h[0:2], magic)
	h[2] = typ
	binary.BigEndian.PutUint32(h[4:8], length)
	return h
}

// TestMalformedClient sends garbage to rblkd's port: rblkd must close that
// connection and stay up, and an attached initiator must keep working.
func TestMalformedClient(t *testing.T) {
	t.Parallel()
	onlyTransport(t, "tcp", "writes malformed frames of the software transport to rblkd's TCP port")
	needTools(t, "qemu-io")
	dir := t.TempDir()
	backing := filepath.Join(dir, "vol.img")
	tg := startTarget(t, []string{"vol=" + backing + ",size=4M,shared"}, "--chunk-size", "64K")
	a := startAttach(t, tg, "vol")
	qemuIO(t, a.uri("vol"), []qop{{kind: 'w', pattern: 0xa1, off: 0, n: 65536}, {kind: 'r', pattern: 0xa1, off: 0, n: 65536}})
	waitMetric(t, tg.metrics, "rblkd_sessions", func(v float64) bool { return v == 1 }, "1 with one initiator")

	truncated := append(frameHeader(0x5242, 1, 56), 1, 2, 3)
	for _, c := range []struct {
		name    string
		payload []byte
	}{
		{"random bytes", randomBytes(5, 64<<10)},
		{"HTTP request", []byte("GET /metrics HTTP/1.1\r\nHost: rblkd\r\n\r\n")},
		{"zeroes", make([]byte, 4096)},
		{"bad magic", frameHeader(0xdead, 1, 0)},
		{"unknown frame type", frameHeader(0x5242, 200, 0)},
		{"length beyond the limit", frameHeader(0x5242, 1, 0xffffffff)},
		{"SEND before CONNECT", append(frameHeader(0x5242, 4, 16), make([]byte, 16)...)},
		{"truncated CONNECT, then EOF", truncated},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, err := net.DialTimeout("tcp", tg.addr, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(15 * time.Second))
			// rblkd may close while we write: that is a pass too.
			if _, err := conn.Write(c.payload); err == nil {
				conn.(*net.TCPConn).CloseWrite()
			}
			// Whatever rblkd answers, it must then close the connection.
			_, err = io.Copy(io.Discard, conn)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("rblkd kept the connection open 15s after %s", c.name)
			}
			if tg.exited() {
				t.Fatalf("rblkd exited after %s: %v", c.name, tg.waitErr)
			}
		})
	}

	// The attached initiator still works, and so does a new one, which sees
	// the first one's writes.
	qemuIO(t, a.uri("vol"), []qop{{kind: 'w', pattern: 0xb2, off: 1 << 20, n: 65536}, {kind: 'r', pattern: 0xa1, off: 0, n: 65536}})
	b := startAttach(t, tg, "vol")
	qemuIO(t, b.uri("vol"), []qop{{kind: 'r', pattern: 0xb2, off: 1 << 20, n: 65536}, {kind: 'r', pattern: 0xa1, off: 0, n: 65536},
		{kind: 'w', pattern: 0xc3, off: 2 << 20, n: 4096}, {kind: 'f'}})
	waitMetric(t, tg.metrics, "rblkd_sessions", func(v float64) bool { return v == 2 }, "2 with two initiators")
	b.stop(t, stopTimeout)
	a.stop(t, stopTimeout)
	tg.stop(t, stopTimeout)

	got, err := os.ReadFile(backing)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 4<<20)
	copy(want[0:], bytes.Repeat([]byte{0xa1}, 65536))
	copy(want[1<<20:], bytes.Repeat([]byte{0xb2}, 65536))
	copy(want[2<<20:], bytes.Repeat([]byte{0xc3}, 4096))
	if d := firstDiff(got, want); d != "" {
		t.Fatalf("backing file: %s", d)
	}
}
