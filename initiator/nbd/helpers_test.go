package nbd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// testServer is a Server serving on a unix socket in a test's temporary
// directory.
type testServer struct {
	*Server
	sock string
}

// startServer serves opts on a unix socket until the test ends.
func startServer(t *testing.T, opts Options) *testServer {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = zaptest.NewLogger(t)
	}
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &testServer{Server: srv, sock: sock}
}

// uri is the NBD URI of an export of ts.
func (ts *testServer) uri(name string) string {
	return fmt.Sprintf("nbd+unix:///%s?socket=%s", name, ts.sock)
}

// rawClient is a hand-written NBD client, to send what real clients won't.
type rawClient struct {
	t     *testing.T
	c     net.Conn
	size  uint64
	flags uint16
}

func dialRaw(t *testing.T, sock string) *rawClient {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rc := &rawClient{t: t, c: c}
	rc.deadline(10 * time.Second)
	return rc
}

func (rc *rawClient) deadline(d time.Duration) {
	_ = rc.c.SetDeadline(time.Now().Add(d))
}

func (rc *rawClient) write(b []byte) {
	rc.t.Helper()
	if _, err := rc.c.Write(b); err != nil {
		rc.t.Fatalf("client write: %v", err)
	}
}

func (rc *rawClient) read(n int) []byte {
	rc.t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(rc.c, b); err != nil {
		rc.t.Fatalf("client read of %d bytes: %v", n, err)
	}
	return b
}

// greet reads the server greeting and sends the client flags.
func (rc *rawClient) greet(clientFlags uint32) {
	rc.t.Helper()
	g := rc.read(18)
	if binary.BigEndian.Uint64(g) != magicNBD || binary.BigEndian.Uint64(g[8:]) != magicIHaveOpt {
		rc.t.Fatalf("bad greeting % x", g)
	}
	if f := binary.BigEndian.Uint16(g[16:]); f != flagFixedNewstyle|flagNoZeroes {
		rc.t.Fatalf("handshake flags %#x", f)
	}
	rc.write(binary.BigEndian.AppendUint32(nil, clientFlags))
}

func (rc *rawClient) sendOpt(opt uint32, data []byte) {
	rc.t.Helper()
	b := binary.BigEndian.AppendUint64(nil, magicIHaveOpt)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	rc.write(append(b, data...))
}

type optReply struct {
	opt, typ uint32
	data     []byte
}

func (rc *rawClient) readOptReply() optReply {
	rc.t.Helper()
	h := rc.read(20)
	if m := binary.BigEndian.Uint64(h); m != magicOptReply {
		rc.t.Fatalf("option reply magic %#x", m)
	}
	r := optReply{opt: binary.BigEndian.Uint32(h[8:]), typ: binary.BigEndian.Uint32(h[12:])}
	r.data = rc.read(int(binary.BigEndian.Uint32(h[16:])))
	return r
}

// goData is the data of NBD_OPT_INFO or NBD_OPT_GO.
func goData(name string, infos ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = binary.BigEndian.AppendUint16(b, i)
	}
	return b
}

// dialGo connects and enters transmission on export name with NBD_OPT_GO.
func dialGo(t *testing.T, sock, name string) *rawClient {
	t.Helper()
	rc := dialRaw(t, sock)
	rc.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)
	rc.sendOpt(optGo, goData(name, infoBlockSize))
	for {
		r := rc.readOptReply()
		if r.opt != optGo {
			t.Fatalf("reply to option %d", r.opt)
		}
		switch r.typ {
		case repAck:
			if rc.flags == 0 {
				t.Fatal("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT")
			}
			rc.deadline(30 * time.Second)
			return rc
		case repInfo:
			if binary.BigEndian.Uint16(r.data) == infoExport {
				rc.size = binary.BigEndian.Uint64(r.data[2:])
				rc.flags = binary.BigEndian.Uint16(r.data[10:])
			}
		default:
			t.Fatalf("NBD_OPT_GO %q: reply %#x %q", name, r.typ, r.data)
		}
	}
}

// request sends one request header and its payload.
func (rc *rawClient) request(typ, flags uint16, cookie, off uint64, length uint32, payload []byte) {
	rc.t.Helper()
	rc.write(requestBytes(typ, flags, cookie, off, length, payload))
}

// requestBytes is the wire form of one request and its payload.
func requestBytes(typ, flags uint16, cookie, off uint64, length uint32, payload []byte) []byte {
	b := make([]byte, requestSize, requestSize+len(payload))
	binary.BigEndian.PutUint32(b[0:], magicRequest)
	binary.BigEndian.PutUint16(b[4:], flags)
	binary.BigEndian.PutUint16(b[6:], typ)
	binary.BigEndian.PutUint64(b[8:], cookie)
	binary.BigEndian.PutUint64(b[16:], off)
	binary.BigEndian.PutUint32(b[24:], length)
	return append(b, payload...)
}

// reply reads a simple reply header: the error and the cookie.
func (rc *rawClient) reply() (errno uint32, cookie uint64) {
	rc.t.Helper()
	h := rc.read(replySize)
	if m := binary.BigEndian.Uint32(h); m != magicSimpleReply {
		rc.t.Fatalf("reply magic %#x", m)
	}
	return binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
}

// do sends a request and waits for its reply (no other request in flight);
// for a successful READ it returns the data.
func (rc *rawClient) do(typ, flags uint16, off uint64, length uint32, payload []byte) (uint32, []byte) {
	rc.t.Helper()
	const cookie = 0xc0ffee
	rc.request(typ, flags, cookie, off, length, payload)
	errno, got := rc.reply()
	if got != cookie {
		rc.t.Fatalf("reply for cookie %#x, want %#x", got, cookie)
	}
	if typ == cmdRead && errno == 0 {
		return 0, rc.read(int(length))
	}
	return errno, nil
}

// expectClosed checks that the server closed the connection.
func (rc *rawClient) expectClosed() {
	rc.t.Helper()
	rc.deadline(10 * time.Second)
	var b [1]byte
	n, err := rc.c.Read(b[:])
	if err == nil {
		rc.t.Fatalf("connection still open (read %d bytes)", n)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		rc.t.Fatal("connection still open after 10s")
	}
}

// roundTrip writes then reads back a few bytes on a fresh connection, to
// show that the server still serves.
func roundTrip(t *testing.T, sock, name string, off uint64) {
	t.Helper()
	rc := dialGo(t, sock, name)
	want := []byte(fmt.Sprintf("still serving at %d", off))
	if errno, _ := rc.do(cmdWrite, 0, off, uint32(len(want)), want); errno != 0 {
		t.Fatalf("write: errno %d", errno)
	}
	errno, got := rc.do(cmdRead, 0, off, uint32(len(want)), nil)
	if errno != 0 || string(got) != string(want) {
		t.Fatalf("read: errno %d, %q", errno, got)
	}
	rc.request(cmdDisc, 0, 0, 0, 0, nil)
	rc.expectClosed()
}

// rwExport is the usual writable export of the tests.
func rwExport(name string, be *memBackend) *Export {
	return &Export{
		Name: name, Description: "the " + name + " volume", Size: uint64(len(be.data)),
		CanTrim: true, CanZero: true, CanFlush: true, CanFUA: true, MultiConn: true,
		MaxBlock: 1 << 20, Backend: be,
	}
}

// waitFor polls cond for up to 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
