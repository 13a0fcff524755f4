package tcp

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/transporttest"
)

func TestHeaderRoundTrip(t *testing.T) {
	var h header
	h.put(frameWriteImm, 7, 4096, 1<<40+3, 0xdeadbeefcafe, 0x12345678, 0x9abcdef0)
	if h.magic() != magic || h.typ() != frameWriteImm || h.status() != 7 || h.length() != 4096 ||
		h.seq() != 1<<40+3 || h.addr() != 0xdeadbeefcafe || h.rkey() != 0x12345678 || h.imm() != 0x9abcdef0 {
		t.Fatalf("round trip: %v %x", &h, h[:])
	}
	if err := h.check(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		mod  func(h *header)
	}{
		{"magic", func(h *header) { h[0] = 'x' }},
		{"type0", func(h *header) { h[2] = 0 }},
		{"typeHigh", func(h *header) { h[2] = byte(frameTypeEnd) }},
		{"length", func(h *header) { h.put(frameSend, 0, maxPayload+1, 1, 0, 0, 0) }},
		{"ackPayload", func(h *header) { h.put(frameAck, 0, 1, 1, 0, 0, 0) }},
	} {
		g := h
		tc.mod(&g)
		if err := g.check(); err == nil {
			t.Errorf("%s: bad header accepted", tc.name)
		}
	}
	if testing.AllocsPerRun(100, func() { h.put(frameSend, 0, 1, 2, 3, 4, 5) }) != 0 {
		t.Error("encoding a header allocates")
	}
}

// rawPeer is a hand-driven peer speaking the wire protocol.
type rawPeer struct {
	t  *testing.T
	nc net.Conn
	br *bufio.Reader
}

// dialRaw connects to l as a raw peer and completes the handshake, returning
// the accepted conn too.
func dialRaw(t *testing.T, l transport.Listener) (*rawPeer, transport.Conn) {
	t.Helper()
	nc, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	if err := writeControl(nc, frameConnect, version, 4, []byte("raw")); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c, err := req.Accept(ctx, []byte("ok"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	p := &rawPeer{t: t, nc: nc, br: bufio.NewReader(nc)}
	var h header
	pd, err := readControl(p.br, &h)
	if err != nil || h.typ() != frameAccept || string(pd) != "ok" {
		t.Fatalf("handshake: %v %v %q", err, h.typ(), pd)
	}
	return p, c
}

func (p *rawPeer) send(t frameType, status uint8, length uint32, seq, addr uint64, rkey, imm uint32, payload []byte) {
	p.t.Helper()
	var h header
	h.put(t, status, length, seq, addr, rkey, imm)
	if _, err := p.nc.Write(append(h[:], payload...)); err != nil {
		p.t.Fatal(err)
	}
}

// next reads the next frame and its payload.
func (p *rawPeer) next() (header, []byte) {
	p.t.Helper()
	p.nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	var h header
	if _, err := io.ReadFull(p.br, h[:]); err != nil {
		p.t.Fatalf("reading a frame: %v", err)
	}
	if err := h.check(); err != nil {
		p.t.Fatal(err)
	}
	payload := make([]byte, h.length())
	if _, err := io.ReadFull(p.br, payload); err != nil {
		p.t.Fatal(err)
	}
	return h, payload
}

func listenTCP(t *testing.T, opts Options) transport.Listener {
	t.Helper()
	l, err := NewWithOptions("tcp", opts).Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// expectBroken checks that c broke: its posted receive is flushed and Poll
// ends with ErrClosed carrying want.
func expectBroken(t *testing.T, c transport.Conn, want string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := make([]transport.Completion, 4)
	for {
		n, err := c.Poll(ctx, out)
		for _, comp := range out[:n] {
			if comp.Status != transport.StatusFlushed {
				t.Errorf("completion %+v, want flushed", comp)
			}
		}
		if err == nil {
			continue
		}
		if !errors.Is(err, transport.ErrClosed) {
			t.Fatalf("poll: %v, want ErrClosed", err)
		}
		if !strings.Contains(err.Error(), want) {
			t.Errorf("poll: %v, want a cause mentioning %q", err, want)
		}
		return
	}
}

// checkListener checks that l still accepts a working connection.
func checkListener(t *testing.T, l transport.Listener) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dialed := make(chan transport.Conn, 1)
	go func() {
		c, err := New("tcp").Dial(ctx, l.Addr(), nil)
		if err != nil {
			t.Error(err)
		}
		dialed <- c
	}()
	req, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b, err := req.Accept(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a := <-dialed
	if a == nil {
		t.FailNow()
	}
	defer a.Close()
	ra, _ := a.Register(make([]byte, 8), transport.AccessLocalWrite)
	rb, _ := b.Register(make([]byte, 8), transport.AccessLocalWrite)
	if err := b.PostRecv(transport.RecvRequest{ID: 1, Local: transport.SGE{Region: rb, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	if err := a.PostSend(transport.WorkRequest{ID: 2, Op: transport.OpSend, Local: transport.SGE{Region: ra, Length: 8}}); err != nil {
		t.Fatal(err)
	}
	out := make([]transport.Completion, 1)
	if n, err := b.Poll(ctx, out); err != nil || n != 1 || out[0].Status != transport.StatusSuccess {
		t.Fatalf("after a bad peer, a new connection: %v %+v", err, out)
	}
}

func TestMalformedFrames(t *testing.T) {
	for _, tc := range []struct {
		name string
		send func(p *rawPeer)
		want string
	}{
		{"Garbage", func(p *rawPeer) { p.nc.Write([]byte(strings.Repeat("garbage!", 8))) }, "bad frame magic"},
		{"Oversize", func(p *rawPeer) { p.send(frameSend, 0, 1<<31, 1, 0, 0, 0, nil) }, "exceeds"},
		{"UnknownType", func(p *rawPeer) { p.send(frameType(200), 0, 0, 1, 0, 0, 0, nil) }, "unknown frame type"},
		{"SeqGap", func(p *rawPeer) { p.send(frameWrite, 0, 0, 5, 0, 0, 0, nil) }, "seq 5, want 1"},
		{"ConnectAgain", func(p *rawPeer) { p.send(frameConnect, version, 0, 0, 0, 0, 1, nil) }, "unexpected CONNECT"},
		{"UnaskedAck", func(p *rawPeer) { p.send(frameAck, 0, 0, 3, 0, 0, 0, nil) }, "ACK for seq 3"},
		{"UnaskedReadResponse", func(p *rawPeer) { p.send(frameReadResp, 0, 4, 1, 0, 0, 0, []byte("data")) }, "READ response"},
		{"TruncatedPayload", func(p *rawPeer) {
			p.send(frameSend, 0, 1000, 1, 0, 0, 0, []byte("short"))
			p.nc.(*net.TCPConn).CloseWrite()
		}, "unexpected EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			transporttest.CheckGoroutines(t)
			l := listenTCP(t, Options{})
			p, c := dialRaw(t, l)
			r, err := c.Register(make([]byte, 4096), transport.AccessLocalWrite)
			if err != nil {
				t.Fatal(err)
			}
			if err := c.PostRecv(transport.RecvRequest{ID: 1, Local: transport.SGE{Region: r, Length: 4096}}); err != nil {
				t.Fatal(err)
			}
			tc.send(p)
			expectBroken(t, c, tc.want)
			checkListener(t, l)
		})
	}
}

// TestGarbageBeforeConnect: a stream that does not start with a connect
// request is dropped; the listener goes on.
func TestGarbageBeforeConnect(t *testing.T) {
	transporttest.CheckGoroutines(t)
	l := listenTCP(t, Options{HandshakeTimeout: 200 * time.Millisecond})
	for _, garbage := range []string{"GET / HTTP/1.0\r\n\r\n" + strings.Repeat("x", 64), ""} {
		nc, err := net.Dial("tcp", l.Addr())
		if err != nil {
			t.Fatal(err)
		}
		nc.Write([]byte(garbage)) // "" : a peer that says nothing
		nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := nc.Read(make([]byte, 1)); err == nil {
			t.Errorf("the listener answered %d bytes to garbage %q", n, garbage)
		}
		nc.Close()
	}
	// An oversize connect request.
	nc, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	writeControl(nc, frameConnect, version, 4, make([]byte, MaxConnectPrivateData+1))
	nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := nc.Read(make([]byte, 1)); err == nil {
		t.Error("the listener answered an oversize connect request")
	}
	nc.Close()
	checkListener(t, l)
}

// TestNakOnTheWire: the responder refuses a WRITE to an unknown rkey with a
// NAK carrying StatusRemoteAccessError, after acknowledging what preceded.
func TestNakOnTheWire(t *testing.T) {
	transporttest.CheckGoroutines(t)
	l := listenTCP(t, Options{})
	p, c := dialRaw(t, l)
	r, err := c.Register(make([]byte, 64), transport.AccessLocalWrite|transport.AccessRemoteWrite|transport.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	copy(r.Bytes()[8:], "readable")
	p.send(frameWrite, 0, 4, 1, r.Addr(), r.RKey(), 0, []byte("abcd"))
	p.send(frameReadReq, 0, 0, 2, r.Addr()+8, r.RKey(), 8, nil)
	p.send(frameWrite, 0, 4, 3, r.Addr(), r.RKey()+1, 0, []byte("efgh"))
	// The READ response and ACKs (of at most 2) come in some order, then the NAK.
	gotResp := false
	for {
		h, data := p.next()
		switch {
		case h.typ() == frameReadResp && h.seq() == 2 && string(data) == "readable" && !gotResp:
			gotResp = true
			continue
		case h.typ() == frameAck && h.seq() <= 2:
			continue
		case h.typ() == frameNak && h.seq() == 3 && gotResp:
			if st := transport.Status(h.status()); st != transport.StatusRemoteAccessError {
				t.Errorf("NAK with %v, want remote access error", st)
			}
		default:
			t.Fatalf("unexpected %v %q", &h, data)
		}
		break
	}
	// The responder ends the stream after the NAK.
	p.nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := p.br.ReadByte(); err != io.EOF {
		t.Errorf("after the NAK: %v, want EOF", err)
	}
	p.nc.Close()
	expectBroken(t, c, "refused request 3")
	// Poll's end orders this after the conn's goroutines.
	if string(r.Bytes()[:4]) != "abcd" {
		t.Errorf("first write not placed: %q", r.Bytes()[:4])
	}
}

// TestReadsBeyondResponderResources: a peer that sends more READs than it
// was told the responder serves is refused.
func TestReadsBeyondResponderResources(t *testing.T) {
	transporttest.CheckGoroutines(t)
	l := listenTCP(t, Options{MaxReadsInFlight: 2})
	p, c := dialRaw(t, l)
	r, err := c.Register(make([]byte, 1<<20), transport.AccessRemoteRead)
	if err != nil {
		t.Fatal(err)
	}
	// Stop reading so that the READ responses pile up at the responder.
	for i := range 64 {
		p.send(frameReadReq, 0, 0, uint64(i+1), r.Addr(), r.RKey(), 1<<20, nil)
	}
	for {
		h, _ := p.next()
		if h.typ() == frameNak {
			if transport.Status(h.status()) != transport.StatusRemoteInvalidRequest {
				t.Errorf("NAK with status %d", h.status())
			}
			break
		}
	}
	p.nc.Close()
	expectBroken(t, c, "refused request")
}

// TestConformanceNoSyscallConn runs the data path over streams without
// SyscallConn, where no write is made inline: the writer goroutine writes
// everything.
func TestConformanceNoSyscallConn(t *testing.T) {
	p := NewWithOptions("tcp", Options{hideSyscallConn: true})
	transporttest.Run(t, transporttest.PairFunc(p, func(*testing.T) string { return "127.0.0.1:0" }))
}
