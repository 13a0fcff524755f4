package link

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// pair dials a link to a listening link over the software provider. The
// server side answers GrantRequest with a Grant echoing the offset, Flush
// with OK after delay, and counts Dones, the Flushes it got and the OKs it
// sent them.
type pair struct {
	client, server *Link
	dones          atomic.Int64
	flushes        atomic.Int64 // Flush requests received
	flushReplies   atomic.Int64 // their OKs sent
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

func newPair(t *testing.T, recvBuffers int, flushDelay time.Duration) *pair {
	t.Helper()
	return newPairWith(t, pairConfig{recvBuffers: recvBuffers, flushDelay: flushDelay})
}

// pairConfig configures newPairWith.
type pairConfig struct {
	recvBuffers int
	flushDelay  time.Duration
	provider    transport.Provider // default tcp.New("tcp")
	client      func(*Options)     // changes the client's options
	server      func(*Options)     // changes the server's options
}

func newPairWith(t *testing.T, cfg pairConfig) *pair {
	t.Helper()
	transporttest.CheckGoroutines(t)
	recvBuffers, flushDelay := cfg.recvBuffers, cfg.flushDelay
	p := cfg.provider
	if p == nil {
		p = tcp.New("tcp")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pr := &pair{}
	ready := make(chan struct{})
	var srv *Link
	handler := func(h protocol.Header, payload []byte) {
		<-ready
		switch h.Type {
		case protocol.TypeDone:
			pr.dones.Add(1)
		case protocol.TypeGrantRequest:
			var g protocol.GrantRequest
			if err := g.Unmarshal(payload); err != nil {
				t.Error(err)
				return
			}
			go srv.Send(context.Background(), h.Tag, &protocol.Grant{Handle: g.Handle, Offset: g.Offset, Addr: 1, RKey: 2, Length: 4096, Generation: 3})
		case protocol.TypeFlush:
			pr.flushes.Add(1)
			go func() {
				select {
				case <-time.After(flushDelay):
					if srv.Send(context.Background(), h.Tag, &protocol.OK{}) == nil {
						pr.flushReplies.Add(1)
					}
				case <-srv.Done():
				}
			}()
		case protocol.TypeOpen:
			go srv.Send(context.Background(), h.Tag, &protocol.ErrorMsg{Code: protocol.CodeNoEnt, Text: "no such export"})
		}
	}
	accepted := make(chan error, 1)
	go func() {
		req, err := l.Accept(ctx)
		if err == nil {
			o := Options{Handler: handler, RecvBuffers: recvBuffers, SendBuffers: recvBuffers}
			if cfg.server != nil {
				cfg.server(&o)
			}
			srv, err = Accept(ctx, req, o)
		}
		close(ready)
		accepted <- err
	}()
	o := Options{Handler: func(protocol.Header, []byte) {}, RecvBuffers: recvBuffers, SendBuffers: recvBuffers}
	if cfg.client != nil {
		cfg.client(&o)
	}
	c, err := Dial(ctx, p, l.Addr(), o)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-accepted; err != nil {
		t.Fatal(err)
	}
	pr.client, pr.server = c, srv
	t.Cleanup(func() {
		c.Close()
		srv.Close()
	})
	return pr
}

func TestRequestReply(t *testing.T) {
	p := newPair(t, 8, 0)
	var g protocol.Grant
	if err := p.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1, Offset: 1 << 20}, &g); err != nil {
		t.Fatal(err)
	}
	if g.Offset != 1<<20 || g.Length != 4096 || g.Generation != 3 {
		t.Fatalf("grant %+v", g)
	}
	// An Error reply is a *protocol.RemoteError matching its sentinel.
	err := p.client.Request(context.Background(), &protocol.Open{Name: "x"}, &protocol.VolumeInfo{})
	if !errors.Is(err, protocol.ErrNoExport) {
		t.Fatalf("open: %v, want ErrNoExport", err)
	}
}

// TestCredits sends far more messages than there are receive buffers, from
// many goroutines, one-way and request/reply mixed: credits must come back
// and nothing may deadlock or be lost.
func TestCredits(t *testing.T) {
	p := newPair(t, 4, 0)
	const workers, each = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				var err error
				if i%4 == 0 {
					var g protocol.Grant
					err = p.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1, Offset: uint64(w*each + i)}, &g)
					if err == nil && g.Offset != uint64(w*each+i) {
						t.Errorf("reply to the wrong request: %d", g.Offset)
					}
				} else {
					err = p.client.Send(context.Background(), 0, &protocol.Done{Handle: 1, Generation: 1, Ranges: []protocol.Range{{Offset: 0, Length: 1}}})
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	want := int64(workers * each * 3 / 4)
	deadline := time.Now().Add(10 * time.Second)
	for p.dones.Load() != want && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := p.dones.Load(); got != want {
		t.Fatalf("server got %d Dones, want %d", got, want)
	}
}

func TestRequestContextEnds(t *testing.T) {
	p := newPair(t, 8, time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.client.Request(ctx, &protocol.Flush{Handle: 1, Generation: 1}, &protocol.OK{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("request: %v, want deadline exceeded", err)
	}
	// The late reply is dropped and the link still works. Once the server
	// sent it, the reply to the next request comes after it.
	waitFor(t, "the late reply", func() bool { return p.flushReplies.Load() == 1 })
	var g protocol.Grant
	if err := p.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1}, &g); err != nil {
		t.Fatal(err)
	}
}

func TestCloseWakesWaiters(t *testing.T) {
	p := newPair(t, 8, time.Hour)
	res := make(chan error, 1)
	go func() {
		res <- p.client.Request(context.Background(), &protocol.Flush{Handle: 1, Generation: 1}, &protocol.OK{})
	}()
	waitFor(t, "the server to get the request", func() bool { return p.flushes.Load() == 1 })
	p.server.Close()
	select {
	case err := <-res:
		if !errors.Is(err, ErrDown) {
			t.Fatalf("request: %v, want ErrDown", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a waiting request did not end when the peer closed")
	}
	select {
	case <-p.client.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed")
	}
	p.client.Close()
	p.client.Close() // twice is fine
	if err := p.client.Send(context.Background(), 0, &protocol.OK{}); !errors.Is(err, ErrDown) {
		t.Fatalf("send after close: %v", err)
	}
}

// TestRDMA reads and writes the peer's registered memory and checks that a
// bad rkey breaks the link with a remote access error.
func TestRDMA(t *testing.T) {
	p := newPair(t, 8, 0)
	remote, local := p.regions(t)
	lb := local.Bytes()
	copy(lb, "hello, target")
	ctx := context.Background()
	err := p.client.RDMA(ctx,
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 0, Length: 5}, Addr: remote.Addr() + 100, RKey: remote.RKey()},
		Op{Write: true, Local: transport.SGE{Region: local, Offset: 7, Length: 6}, Addr: remote.Addr() + 200, RKey: remote.RKey()})
	if err != nil {
		t.Fatal(err)
	}
	if string(remote.Bytes()[100:105]) != "hello" || string(remote.Bytes()[200:206]) != "target" {
		t.Fatal("RDMA WRITE did not place the data")
	}
	copy(remote.Bytes()[300:], "from target")
	if err := p.client.RDMA(ctx, Op{Local: transport.SGE{Region: local, Offset: 1000, Length: 11}, Addr: remote.Addr() + 300, RKey: remote.RKey()}); err != nil {
		t.Fatal(err)
	}
	if string(lb[1000:1011]) != "from target" {
		t.Fatal("RDMA READ did not fetch the data")
	}
	err = p.client.RDMA(ctx, Op{Local: transport.SGE{Region: local, Offset: 0, Length: 8}, Addr: remote.Addr(), RKey: remote.RKey() + 1})
	if !errors.Is(err, transport.ErrRemoteAccess) || !errors.Is(err, ErrDown) {
		t.Fatalf("READ with a bad rkey: %v, want a remote access error that took the link down", err)
	}
	select {
	case <-p.client.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("link still up after a remote access error")
	}
}

// TestMalformedMessageClosesLink: bytes that are not a protocol message
// take the receiving link down (and only it).
func TestMalformedMessageClosesLink(t *testing.T) {
	p := newPair(t, 8, 0)
	mem, err := transport.AllocMemory(4096, false)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	r, err := p.client.Conn().Register(mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	copy(r.Bytes(), "this is not an rblk message at all")
	// Post a raw SEND under the link's feet; its completion ID is unknown
	// to the link, which ignores it.
	if err := p.client.Conn().PostSend(transport.WorkRequest{ID: 1, Op: transport.OpSend, Local: transport.SGE{Region: r, Length: 34}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.server.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("server link survived a malformed message")
	}
	if err := p.server.Err(); !errors.Is(err, protocol.ErrBadMagic) {
		t.Fatalf("server link down with %v, want a bad magic error", err)
	}
}

// regions registers 512 KiB on the server, readable and writable by the
// peer, and 512 KiB on the client for local use; they go when t ends.
func (p *pair) regions(t *testing.T) (remote, local transport.Region) {
	t.Helper()
	mem, err := transport.AllocMemory(1<<20, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Free() })
	b := mem.Bytes()
	remote, err = p.server.Conn().Register(b[:1<<19], transport.AccessLocalWrite|transport.AccessRemoteRead|transport.AccessRemoteWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { remote.Deregister() })
	local, err = p.client.Conn().Register(b[1<<19:], transport.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { local.Deregister() })
	return remote, local
}
