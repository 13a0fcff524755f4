package nbd

// Tests with a hand-written client, for what real clients never send.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
)

func TestHandshakeOptions(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 64)
	be2 := newMemBackend(64<<10, 4096, 64)
	ts := startServer(t, Options{Exports: []*Export{
		rwExport("a", be),
		{Name: "b", Size: 64 << 10, Backend: be2},
	}})

	rc := dialRaw(t, ts.sock)
	rc.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)

	// LIST: one NBD_REP_SERVER each, with the description, then ACK.
	rc.sendOpt(optList, nil)
	var listed []string
	for {
		r := rc.readOptReply()
		if r.typ == repAck {
			break
		}
		if r.typ != repServer || r.opt != optList {
			t.Fatalf("LIST reply %+v", r)
		}
		n := binary.BigEndian.Uint32(r.data)
		listed = append(listed, fmt.Sprintf("%s|%s", r.data[4:4+n], r.data[4+n:]))
	}
	if strings.Join(listed, ",") != "a|the a volume,b|" {
		t.Errorf("LIST: %q", listed)
	}
	// LIST with data is invalid.
	rc.sendOpt(optList, []byte{1})
	if r := rc.readOptReply(); r.typ != repErrInvalid {
		t.Errorf("LIST with data: %#x", r.typ)
	}

	// Unsupported options.
	for _, opt := range []uint32{optStructuredReply, optStartTLS, optListMetaContext, optSetMetaContext, optExtendedHeaders, 99} {
		rc.sendOpt(opt, []byte("whatever"))
		if r := rc.readOptReply(); r.typ != repErrUnsup || r.opt != opt {
			t.Errorf("option %d: reply %+v", opt, r)
		}
	}

	// INFO of an unknown export, then malformed INFOs.
	rc.sendOpt(optInfo, goData("nope"))
	if r := rc.readOptReply(); r.typ != repErrUnknown {
		t.Errorf("INFO nope: %#x", r.typ)
	}
	for _, data := range [][]byte{nil, {0, 0, 0, 9, 0, 0}, append(goData("a"), 0)} {
		rc.sendOpt(optInfo, data)
		if r := rc.readOptReply(); r.typ != repErrInvalid {
			t.Errorf("INFO % x: %#x", data, r.typ)
		}
	}

	// INFO "" with name and description: the first export.
	rc.sendOpt(optInfo, goData("", infoName, infoDescription, infoBlockSize))
	got := map[uint16][]byte{}
	for {
		r := rc.readOptReply()
		if r.typ == repAck {
			break
		}
		if r.typ != repInfo {
			t.Fatalf("INFO: %+v", r)
		}
		got[binary.BigEndian.Uint16(r.data)] = r.data[2:]
	}
	if e := got[infoExport]; len(e) != 10 || binary.BigEndian.Uint64(e) != 1<<20 ||
		binary.BigEndian.Uint16(e[8:]) != tflagHasFlags|tflagSendFlush|tflagSendFUA|tflagSendTrim|tflagSendWriteZeroes|tflagCanMultiConn {
		t.Errorf("NBD_INFO_EXPORT % x", e)
	}
	if string(got[infoName]) != "a" || string(got[infoDescription]) != "the a volume" {
		t.Errorf("name %q description %q", got[infoName], got[infoDescription])
	}
	if b := got[infoBlockSize]; len(b) != 12 || binary.BigEndian.Uint32(b) != 1 ||
		binary.BigEndian.Uint32(b[4:]) != 4096 || binary.BigEndian.Uint32(b[8:]) != 1<<20 {
		t.Errorf("NBD_INFO_BLOCK_SIZE % x", b)
	}

	// EXPORT_NAME "b" with NO_ZEROES: size and flags, no padding; then
	// transmission works.
	rc.sendOpt(optExportName, []byte("b"))
	h := rc.read(10)
	if binary.BigEndian.Uint64(h) != 64<<10 || binary.BigEndian.Uint16(h[8:]) != tflagHasFlags {
		t.Errorf("EXPORT_NAME reply % x", h)
	}
	if errno, data := rc.do(cmdRead, 0, 0, 16, nil); errno != 0 || !bytes.Equal(data, initial(16)) {
		t.Errorf("read after EXPORT_NAME: %d % x", errno, data)
	}
	rc.request(cmdDisc, 0, 1, 0, 0, nil)
	rc.expectClosed()

	// EXPORT_NAME without NO_ZEROES: 124 zero bytes follow.
	rc = dialRaw(t, ts.sock)
	rc.greet(clientFlagFixedNewstyle)
	rc.sendOpt(optExportName, []byte("a"))
	h = rc.read(10 + 124)
	if binary.BigEndian.Uint64(h) != 1<<20 || !bytes.Equal(h[10:], make([]byte, 124)) {
		t.Errorf("EXPORT_NAME reply % x", h)
	}
	if errno, _ := rc.do(cmdFlush, 0, 0, 0, nil); errno != 0 {
		t.Errorf("flush: %d", errno)
	}
	rc.request(cmdDisc, 0, 1, 0, 0, nil)
	rc.expectClosed()

	// EXPORT_NAME of an unknown export: closed.
	rc = dialRaw(t, ts.sock)
	rc.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)
	rc.sendOpt(optExportName, []byte("nope"))
	rc.expectClosed()

	// ABORT: ACK then closed.
	rc = dialRaw(t, ts.sock)
	rc.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)
	rc.sendOpt(optAbort, nil)
	if r := rc.readOptReply(); r.typ != repAck {
		t.Errorf("ABORT: %#x", r.typ)
	}
	rc.expectClosed()

	// GO of an unknown export is refused and the client may try again.
	rc = dialRaw(t, ts.sock)
	rc.greet(clientFlagFixedNewstyle | clientFlagNoZeroes)
	rc.sendOpt(optGo, goData("nope"))
	if r := rc.readOptReply(); r.typ != repErrUnknown || !strings.Contains(string(r.data), "nope") {
		t.Errorf("GO nope: %+v", r)
	}
	rc.sendOpt(optGo, goData("b"))
	for r := rc.readOptReply(); r.typ != repAck; r = rc.readOptReply() {
		if r.typ != repInfo {
			t.Fatalf("GO b: %+v", r)
		}
	}
	if errno, _ := rc.do(cmdRead, 0, 0, 1, nil); errno != 0 {
		t.Errorf("read: %d", errno)
	}
}

// TestMalformed sends garbage at each stage; each time that connection is
// closed and the server goes on serving another.
func TestMalformed(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 512)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})

	// A connection in transmission the whole time, to show others are not
	// affected.
	bystander := dialGo(t, ts.sock, "vol")

	cases := map[string]func(rc *rawClient){
		"unknown client flags": func(rc *rawClient) {
			rc.greet(clientFlagFixedNewstyle | 1<<7)
		},
		"bad option magic": func(rc *rawClient) {
			rc.greet(clientFlagFixedNewstyle)
			rc.write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		},
		"oversize option": func(rc *rawClient) {
			rc.greet(clientFlagFixedNewstyle)
			b := binary.BigEndian.AppendUint64(nil, magicIHaveOpt)
			b = binary.BigEndian.AppendUint32(b, optInfo)
			b = binary.BigEndian.AppendUint32(b, 1<<30)
			rc.write(b)
		},
		"truncated option": func(rc *rawClient) {
			rc.greet(clientFlagFixedNewstyle)
			rc.write(binary.BigEndian.AppendUint64(nil, magicIHaveOpt)[:5])
			rc.c.(*net.UnixConn).CloseWrite()
		},
		"bad request magic": func(rc *rawClient) {
			*rc = *dialGo(t, ts.sock, "vol")
			rc.write(bytes.Repeat([]byte{0xee}, requestSize))
		},
		"write over the hard limit": func(rc *rawClient) {
			*rc = *dialGo(t, ts.sock, "vol")
			rc.request(cmdWrite, 0, 1, 0, hardMaxBlock+1, nil)
		},
	}
	for name, send := range cases {
		t.Run(name, func(t *testing.T) {
			rc := dialRaw(t, ts.sock)
			rc.t = t
			send(rc)
			rc.expectClosed()
			roundTrip(t, ts.sock, "vol", 4096)
		})
	}
	if errno, _ := bystander.do(cmdRead, 0, 0, 4096, nil); errno != 0 {
		t.Errorf("bystander read: %d", errno)
	}
}

func TestRangeAndSizeErrors(t *testing.T) {
	const size = 1 << 20
	be := newMemBackend(size, 4096, 512)
	x := rwExport("vol", be)
	x.MaxBlock = 64 << 10
	ts := startServer(t, Options{Exports: []*Export{x, {Name: "noflush", Size: size, Backend: be}}})
	rc := dialGo(t, ts.sock, "vol")
	payload := bytes.Repeat([]byte{0x42}, 8192)

	check := func(what string, got, want uint32) {
		t.Helper()
		if got != want {
			t.Errorf("%s: errno %d, want %d", what, got, want)
		}
		// And the connection is still in sync.
		if errno, data := rc.do(cmdRead, 0, 100, 3, nil); errno != 0 || !bytes.Equal(data, initial(103)[100:]) {
			t.Fatalf("after %s: read errno %d % x", what, errno, data)
		}
	}
	e, _ := rc.do(cmdWrite, 0, size-4096, 8192, payload)
	check("write beyond the end", e, errNoSpc)
	e, _ = rc.do(cmdWrite, 0, 1<<63, 8192, payload)
	check("write far beyond the end", e, errNoSpc)
	e, _ = rc.do(cmdRead, 0, size-1, 2, nil)
	check("read beyond the end", e, errInval)
	e, _ = rc.do(cmdRead, 0, ^uint64(0), 2, nil)
	check("read at 2^64-1", e, errInval)
	e, _ = rc.do(cmdTrim, 0, size-1, 2, nil)
	check("trim beyond the end", e, errInval)
	e, _ = rc.do(cmdWriteZeroes, 0, size, 1, nil)
	check("write zeroes beyond the end", e, errNoSpc)
	big := bytes.Repeat([]byte{0x43}, 64<<10+1)
	e, _ = rc.do(cmdWrite, 0, 0, uint32(len(big)), big)
	check("write over MaxBlock", e, errInval)
	e, _ = rc.do(cmdRead, 0, 0, 64<<10+1, nil)
	check("read over MaxBlock", e, errInval)
	e, _ = rc.do(cmdRead, 0, 0, 40<<20, nil)
	check("read over the hard limit", e, errInval)
	e, _ = rc.do(77, 0, 0, 0, nil)
	check("unknown command", e, errInval)
	e, _ = rc.do(cmdWrite, 1<<4, 0, 1, []byte{1}) // NBD_CMD_FLAG_FAST_ZERO on a write
	check("unknown flag", e, errInval)
	e, _ = rc.do(cmdWriteZeroes, cmdFlagNoHole|cmdFlagFUA, 0, 10, nil)
	check("write zeroes, no hole, FUA", e, 0)
	e, _ = rc.do(cmdWrite, 0, 0, 0, nil)
	check("zero-length write", e, 0)
	e, _ = rc.do(cmdRead, 0, size, 0, nil)
	check("zero-length read at the end", e, 0)

	// The export without flush, FUA, trim or zero refuses them.
	rc2 := dialGo(t, ts.sock, "noflush")
	for _, c := range []struct {
		typ, flags uint16
		payload    []byte
	}{{cmdFlush, 0, nil}, {cmdTrim, 0, nil}, {cmdWriteZeroes, 0, nil}, {cmdWrite, cmdFlagFUA, []byte{1}}} {
		if e, _ := rc2.do(c.typ, c.flags, 0, uint32(len(c.payload)), c.payload); e != errInval {
			t.Errorf("command %d flags %d on an export without it: errno %d", c.typ, c.flags, e)
		}
	}

	want := initial(size)
	clear(want[:10])
	checkBytes(t, be.snapshot(), want)
	if be.noHoleZeroes.Load() != 1 {
		t.Errorf("NO_HOLE not passed on")
	}
}

func TestReadOnlyRaw(t *testing.T) {
	const size = 64 << 10
	be := newMemBackend(size, 4096, 64)
	ts := startServer(t, Options{Exports: []*Export{
		{Name: "ro", Size: size, ReadOnly: true, CanTrim: true, CanZero: true, Backend: be},
	}})
	rc := dialGo(t, ts.sock, "ro")
	if rc.flags&tflagReadOnly == 0 || rc.flags&(tflagSendTrim|tflagSendWriteZeroes) != 0 {
		t.Errorf("flags %#x", rc.flags)
	}
	for _, c := range []struct {
		typ     uint16
		payload []byte
	}{{cmdWrite, bytes.Repeat([]byte{9}, 5000)}, {cmdTrim, nil}, {cmdWriteZeroes, nil}} {
		n := uint32(len(c.payload))
		if n == 0 {
			n = 4096
		}
		if e, _ := rc.do(c.typ, 0, 0, n, c.payload); e != errPerm {
			t.Errorf("command %d: errno %d, want EPERM", c.typ, e)
		}
	}
	if e, data := rc.do(cmdRead, 0, 0, 5000, nil); e != 0 || !bytes.Equal(data, initial(5000)) {
		t.Errorf("read: %d", e)
	}
	checkBytes(t, be.snapshot(), initial(size))
}

func TestBackendErrors(t *testing.T) {
	const size = 1 << 20
	be := newMemBackend(size, 4096, 512)
	be.injectError("read", 0, 10, syscall.EIO)
	be.injectError("read", 100, 10, fmt.Errorf("wrapped: %w", syscall.ENOSPC))
	be.injectError("read", 200, 10, errors.New("no errno"))
	be.injectError("read", 300, 10, syscall.ENOENT) // not an NBD errno
	be.injectError("read", 400, 10, syscall.ESHUTDOWN)
	be.injectError("write", 500, 10, syscall.EOVERFLOW)
	be.injectError("write", 600, 10, &os.PathError{Op: "write", Path: "x", Err: syscall.ENOTSUP})
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	rc := dialGo(t, ts.sock, "vol")
	for _, c := range []struct {
		typ  uint16
		off  uint64
		want uint32
	}{
		{cmdRead, 0, errIO}, {cmdRead, 100, errNoSpc}, {cmdRead, 200, errIO}, {cmdRead, 300, errIO},
		{cmdRead, 400, errShutdown}, {cmdWrite, 500, errOverflow}, {cmdWrite, 600, errNotSup},
		{cmdRead, 700, 0}, {cmdWrite, 700, 0},
	} {
		var payload []byte
		if c.typ == cmdWrite {
			payload = make([]byte, 10)
		}
		if e, _ := rc.do(c.typ, 0, c.off, 10, payload); e != c.want {
			t.Errorf("command %d at %d: errno %d, want %d", c.typ, c.off, e, c.want)
		}
	}
}

// TestPipelining sends many requests at once; the first one is held in the
// backend, so later replies overtake it, and each reply carries its own data.
func TestPipelining(t *testing.T) {
	const size = 1 << 20
	be := newMemBackend(size, 1000, 1024)
	release := make(chan struct{})
	hook := func(op string, off uint64) {
		if op == "read" && off == 0 {
			<-release
		}
	}
	be.hook.Store(&hook)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	rc := dialGo(t, ts.sock, "vol")

	const n = 50
	for i := 0; i < n; i++ {
		rc.request(cmdRead, 0, uint64(i), uint64(i)*4099, 4099, nil)
	}
	want := initial(size)
	for i := 1; i < n; i++ {
		errno, cookie := rc.reply()
		if errno != 0 || cookie == 0 {
			t.Fatalf("reply %d: errno %d cookie %d", i, errno, cookie)
		}
		data := rc.read(4099)
		if !bytes.Equal(data, want[cookie*4099:][:4099]) {
			t.Fatalf("data of cookie %d", cookie)
		}
	}
	close(release)
	if errno, cookie := rc.reply(); errno != 0 || cookie != 0 {
		t.Fatalf("last reply: errno %d cookie %d", errno, cookie)
	}
	if !bytes.Equal(rc.read(4099), want[:4099]) {
		t.Fatal("data of cookie 0")
	}
}

// TestBackpressure: with MaxInFlight 3 and the backend stuck, at most 3
// requests reach it, and the rest wait until it moves.
func TestBackpressure(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 64)
	release := make(chan struct{})
	var entered atomic.Int64
	hook := func(op string, off uint64) {
		entered.Add(1)
		<-release
	}
	be.hook.Store(&hook)
	m := NewMetrics(nil)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}, MaxInFlight: 3, Metrics: m})
	rc := dialGo(t, ts.sock, "vol")
	for i := 0; i < 10; i++ {
		rc.request(cmdRead, 0, uint64(i), 0, 512, nil)
	}
	waitFor(t, "3 requests in the backend", func() bool { return entered.Load() == 3 })
	// The reader read a 4th request (in flight: read, not replied to) and
	// holds it, with no worker free, instead of handing it to the backend.
	waitFor(t, "a 4th request read", func() bool { return testutil.ToFloat64(m.inFlight) == 4 })
	if n := entered.Load(); n != 3 {
		t.Fatalf("%d requests in the backend with MaxInFlight 3", n)
	}
	close(release)
	for i := 0; i < 10; i++ {
		if errno, _ := rc.reply(); errno != 0 {
			t.Fatalf("errno %d", errno)
		}
		rc.read(512)
	}
}

// TestPoolExhausted: requests wait for the backend's buffers, and a READ's
// wait does not stop the reader taking later requests.
func TestPoolExhausted(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 4) // 16 KiB of buffers
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	rc := dialGo(t, ts.sock, "vol")
	payload := bytes.Repeat([]byte{5}, 16<<10)
	const n = 20
	for i := 0; i < n; i++ {
		if i%2 == 0 {
			rc.request(cmdWrite, 0, uint64(i), uint64(i)<<14, 16<<10, payload)
		} else {
			rc.request(cmdRead, 0, uint64(i), uint64(i)<<14, 16<<10, nil)
		}
	}
	for i := 0; i < n; i++ {
		errno, cookie := rc.reply()
		if errno != 0 {
			t.Fatalf("errno %d", errno)
		}
		if cookie%2 == 1 {
			rc.read(16 << 10)
		}
	}
	waitFor(t, "buffers back", func() bool { return be.lent.Load() == 0 })
	be.checkReturned(t)
}

// heldWrite starts a server whose backend holds the WRITE at offset 0 until
// release is closed, and sends that write.
func heldWrite(t *testing.T) (ts *testServer, be *memBackend, rc *rawClient, entered, release chan struct{}) {
	be = newMemBackend(1<<20, 4096, 64)
	entered, release = make(chan struct{}), make(chan struct{})
	hook := func(op string, off uint64) {
		if op == "write" && off == 0 {
			close(entered)
			<-release
		}
	}
	be.hook.Store(&hook)
	ts = startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	rc = dialGo(t, ts.sock, "vol")
	rc.request(cmdWrite, 0, 7, 0, 5, []byte("hello"))
	<-entered
	return ts, be, rc, entered, release
}

func TestDiscWaitsForInFlight(t *testing.T) {
	_, be, rc, _, release := heldWrite(t)
	rc.request(cmdDisc, 0, 8, 0, 0, nil)
	// Not closed while the write is in flight.
	rc.deadline(100 * time.Millisecond)
	var b [1]byte
	if _, err := rc.c.Read(b[:]); err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read while a write is in flight: %v", err)
	}
	rc.deadline(10 * time.Second)
	close(release)
	if errno, cookie := rc.reply(); errno != 0 || cookie != 7 {
		t.Fatalf("reply errno %d cookie %d", errno, cookie)
	}
	rc.expectClosed()
	if string(be.snapshot()[:5]) != "hello" {
		t.Error("write lost")
	}
}

// TestClientCloseWithoutDisc: a client that closes its socket loses nothing
// in flight, and ServeConn returns only after the backend finished.
func TestClientCloseWithoutDisc(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 64)
	entered, release := make(chan struct{}), make(chan struct{})
	hook := func(op string, off uint64) {
		if op == "write" && off == 0 {
			close(entered)
			<-release
		}
	}
	be.hook.Store(&hook)
	srv, err := NewServer(Options{Exports: []*Export{rwExport("vol", be)}})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	sock := t.TempDir() + "/s"
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	served := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			served <- err
			return
		}
		served <- srv.ServeConn(context.Background(), c)
	}()
	rc := dialGo(t, sock, "vol")
	rc.request(cmdWrite, 0, 1, 0, 5, []byte("hello"))
	rc.request(cmdWrite, 0, 2, 4096, 5, []byte("world"))
	<-entered
	rc.c.Close()
	select {
	case err := <-served:
		t.Fatalf("ServeConn returned (%v) while a write was in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-served; err != nil {
		t.Errorf("ServeConn: %v", err)
	}
	if d := be.snapshot(); string(d[:5]) != "hello" || string(d[4096:4101]) != "world" {
		t.Error("write lost")
	}
	be.checkReturned(t)
}

// TestCloseWaitsForInFlight: Close lets the request in flight finish and its
// reply leave, then closes.
func TestCloseWaitsForInFlight(t *testing.T) {
	ts, be, rc, _, release := heldWrite(t)
	closed := make(chan struct{})
	go func() {
		ts.Close()
		close(closed)
	}()
	select {
	case <-closed:
		t.Fatal("Close returned while a write was in flight")
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if errno, cookie := rc.reply(); errno != 0 || cookie != 7 {
		t.Fatalf("reply errno %d cookie %d", errno, cookie)
	}
	rc.expectClosed()
	<-closed
	if string(be.snapshot()[:5]) != "hello" {
		t.Error("write lost")
	}
	// Twice, and serving after Close.
	if err := ts.Close(); err != nil {
		t.Error(err)
	}
	a, b := net.Pipe()
	defer b.Close()
	if err := ts.ServeConn(context.Background(), a); !errors.Is(err, ErrServerClosed) {
		t.Errorf("ServeConn after Close: %v", err)
	}
	if _, err := net.Dial("unix", ts.sock); err == nil {
		t.Error("listener still open after Close")
	}
}

// TestContextEnds: ending the ctx of Serve stops it and its connections,
// including one in the middle of the handshake.
func TestContextEnds(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	be := newMemBackend(1<<20, 4096, 64)
	srv, err := NewServer(Options{Exports: []*Export{rwExport("vol", be)}})
	if err != nil {
		t.Fatal(err)
	}
	sock := t.TempDir() + "/s"
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, l) }()
	inTransmission := dialGo(t, sock, "vol")
	inHandshake := dialRaw(t, sock)
	inHandshake.read(18)
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	inTransmission.expectClosed()
	inHandshake.expectClosed()
	if err := srv.Close(); err != nil {
		t.Error(err)
	}
	if err := srv.Close(); err != nil {
		t.Error(err)
	}
}

// TestServeTransmission: the kernel path, on a socketpair with no handshake.
func TestServeTransmission(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	be := newMemBackend(1<<20, 4096, 64)
	srv, err := NewServer(Options{}) // the export need not be listed
	if err != nil {
		t.Fatal(err)
	}
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	toConn := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	sc, cc := toConn(fds[0]), toConn(fds[1])
	done := make(chan error, 1)
	go func() { done <- srv.ServeTransmission(context.Background(), sc, rwExport("kernel", be)) }()
	rc := &rawClient{t: t, c: cc}
	rc.deadline(10 * time.Second)
	if e, _ := rc.do(cmdWrite, cmdFlagFUA, 512, 4, []byte("abcd")); e != 0 {
		t.Fatalf("write %d", e)
	}
	if e, d := rc.do(cmdRead, 0, 510, 8, nil); e != 0 || !bytes.Equal(d[2:6], []byte("abcd")) {
		t.Fatalf("read %d %q", e, d)
	}
	rc.request(cmdDisc, 0, 0, 0, 0, nil)
	if err := <-done; err != nil {
		t.Errorf("ServeTransmission: %v", err)
	}
	// No reply to NBD_CMD_DISC: the kernel would take one for a request of
	// its ("Unexpected reply").
	rc.expectClosed()
	cc.Close()
	if err := srv.Close(); err != nil {
		t.Error(err)
	}
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	be := newMemBackend(1<<20, 4096, 64)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}, Metrics: m})
	rc := dialGo(t, ts.sock, "vol")
	rc.do(cmdWrite, 0, 0, 100, make([]byte, 100))
	rc.do(cmdRead, 0, 0, 50, nil)
	rc.do(cmdRead, 0, 1<<20, 50, nil) // EINVAL
	rc.do(cmdFlush, 0, 0, 0, nil)
	rc.do(cmdTrim, 0, 0, 4096, nil)
	rc.do(cmdWriteZeroes, 0, 0, 4096, nil)
	for _, c := range []struct {
		c    prometheus.Collector
		want float64
	}{
		{m.requests.WithLabelValues("write", "ok"), 1},
		{m.requests.WithLabelValues("read", "ok"), 1},
		{m.requests.WithLabelValues("read", "error"), 1},
		{m.requests.WithLabelValues("flush", "ok"), 1},
		{m.requests.WithLabelValues("trim", "ok"), 1},
		{m.requests.WithLabelValues("write_zeroes", "ok"), 1},
		{m.bytes.WithLabelValues("write"), 100},
		{m.bytes.WithLabelValues("read"), 50},
		{m.bytes.WithLabelValues("trim"), 4096},
		{m.inFlight, 0},
		{m.connections, 1},
	} {
		if got := testutil.ToFloat64(c.c); got != c.want {
			t.Errorf("%v: %v, want %v", c.c, got, c.want)
		}
	}
	n, err := testutil.GatherAndCount(reg, "rblk_attach_nbd_request_duration_seconds")
	if err != nil || n != 5 {
		t.Errorf("latency histograms: %d %v", n, err)
	}
	for _, name := range []string{"requests_total", "bytes_total", "requests_in_flight", "connections"} {
		if n, err := testutil.GatherAndCount(reg, "rblk_attach_nbd_"+name); err != nil || n == 0 {
			t.Errorf("%s: %d %v", name, n, err)
		}
	}
}

func TestNewServerChecks(t *testing.T) {
	be := newMemBackend(4096, 4096, 1)
	for name, e := range map[string]*Export{
		"no backend":     {Name: "x", Size: 1},
		"min not pow2":   {Name: "x", MinBlock: 3, Backend: be},
		"pref < min":     {Name: "x", MinBlock: 4096, PrefBlock: 512, Backend: be},
		"max over 32MiB": {Name: "x", MaxBlock: 64 << 20, Backend: be},
		"long name":      {Name: strings.Repeat("n", 5000), Backend: be},
	} {
		if _, err := NewServer(Options{Exports: []*Export{e}}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := NewServer(Options{Exports: []*Export{{Name: "a", Backend: be}, {Name: "a", Backend: be}}}); err == nil {
		t.Error("duplicate names accepted")
	}
}

// TestNoAllocPerIO measures the server's heap allocations per request (the
// backend and the client of this test allocate nothing per request).
func TestNoAllocPerIO(t *testing.T) {
	be := newMemBackend(1<<20, 4096, 64)
	ts := startServer(t, Options{Exports: []*Export{rwExport("vol", be)}})
	rc := dialGo(t, ts.sock, "vol")
	req := make([]byte, requestSize+4096)
	rep := make([]byte, replySize+4096)
	one := func(typ uint16) {
		binary.BigEndian.PutUint32(req[0:], magicRequest)
		binary.BigEndian.PutUint16(req[6:], typ)
		binary.BigEndian.PutUint32(req[24:], 4096)
		n, m := requestSize, replySize
		if typ == cmdWrite {
			n = len(req)
		} else {
			m = len(rep)
		}
		if _, err := rc.c.Write(req[:n]); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(rc.c, rep[:m]); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 1000; i++ { // warm the pools
		one(cmdWrite)
		one(cmdRead)
	}
	const n = 2000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := 0; i < n; i++ {
		one(cmdWrite)
		one(cmdRead)
	}
	runtime.ReadMemStats(&after)
	per := float64(after.Mallocs-before.Mallocs) / (2 * n)
	t.Logf("%.3f allocations per request", per)
	if per > 0.5 {
		t.Errorf("%.3f allocations per request", per)
	}
}
