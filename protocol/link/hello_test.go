package link

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
	"github.com/rblk/rblk/transport/transporttest"
)

// sendWatcher dials conns that report, by closing sent, the first
// completion of a SEND they poll, whatever its status.
type sendWatcher struct {
	transport.Provider
	sent chan struct{}
	once sync.Once
}

func (p *sendWatcher) Dial(ctx context.Context, addr string, pd []byte) (transport.Conn, error) {
	return wrapDial(ctx, p.Provider, addr, pd, func(c transport.Conn) transport.Conn { return &watchedConn{Conn: c, p: p} })
}

type watchedConn struct {
	transport.Conn
	p *sendWatcher
}

func (c *watchedConn) Poll(ctx context.Context, out []transport.Completion) (int, error) {
	n, err := c.Conn.Poll(ctx, out)
	for _, comp := range out[:n] {
		if comp.Op == transport.OpSend {
			c.p.once.Do(func() { close(c.p.sent) })
		}
	}
	return n, err
}

// lateAccept is a connection request whose Accept returns only once the
// peer's first SEND has completed: whatever the accepting side does after
// Accept comes after that SEND reached it.
type lateAccept struct {
	transport.ConnRequest
	sent <-chan struct{}
}

func (r *lateAccept) Accept(ctx context.Context, pd []byte) (transport.Conn, error) {
	c, err := r.ConnRequest.Accept(ctx, pd)
	if err != nil {
		return nil, err
	}
	select {
	case <-r.sent:
	case <-ctx.Done():
		c.Close()
		return nil, ctx.Err()
	}
	return c, nil
}

// TestAcceptPostsReceivesFirst: the hello of Accept announces RecvBuffers
// receive credits, so the receives must be posted when the peer learns of
// them, before the connection is accepted: the initiator's first request
// goes out as soon as Dial returns. Here the accepting side's Accept returns
// only after that first SEND completed, and a SEND that finds no receive
// fails after 50 ms (the RNR retries run out).
func TestAcceptPostsReceivesFirst(t *testing.T) {
	transporttest.CheckGoroutines(t)
	p := tcp.NewWithOptions("tcp", tcp.Options{RNRTimeout: 50 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ln, err := p.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dp := &sendWatcher{Provider: p, sent: make(chan struct{})}

	ready := make(chan struct{})
	var srv *Link
	handler := func(h protocol.Header, payload []byte) {
		<-ready
		if h.Type == protocol.TypeGrantRequest {
			go srv.Send(context.Background(), h.Tag, &protocol.Grant{Handle: 1, Length: 4096})
		}
	}
	accepted := make(chan error, 1)
	go func() {
		req, err := ln.Accept(ctx)
		if err == nil {
			srv, err = Accept(ctx, &lateAccept{ConnRequest: req, sent: dp.sent}, Options{Handler: handler, RecvBuffers: 4, SendBuffers: 4})
		}
		close(ready)
		accepted <- err
	}()
	c, err := Dial(ctx, dp, ln.Addr(), Options{Handler: func(protocol.Header, []byte) {}, RecvBuffers: 4, SendBuffers: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var g protocol.Grant
	reqErr := c.Request(ctx, &protocol.GrantRequest{Handle: 1}, &g)
	if err := <-accepted; err != nil {
		t.Errorf("accept: %v", err)
	} else {
		defer srv.Close()
	}
	if reqErr != nil {
		t.Fatalf("first request, sent as soon as Dial returned: %v", reqErr)
	}
	if g.Length != 4096 {
		t.Errorf("grant %+v", g)
	}
}

// oldDialer dials with a hello of before the optional features: its
// Features field zeroed, as an older peer sends it.
type oldDialer struct{ transport.Provider }

func (p oldDialer) Dial(ctx context.Context, addr string, pd []byte) (transport.Conn, error) {
	pd = append([]byte(nil), pd...)
	clear(pd[protocol.HeaderSize+4 : protocol.HeaderSize+8])
	return p.Provider.Dial(ctx, addr, pd)
}

// TestHelloFeatures: both ends offer the features this package knows and
// a link keeps those both offered; a peer that offers none gets none
// (an initiator then sends Open without its instance).
func TestHelloFeatures(t *testing.T) {
	pr := newPair(t, 8, 0)
	if f := pr.client.Features(); f != protocol.FeatureMask || f&protocol.FeatureOpenInstance == 0 {
		t.Errorf("dialing side: features %#x, want %#x", f, protocol.FeatureMask)
	}
	if f := pr.server.Features(); f != protocol.FeatureMask {
		t.Errorf("accepting side: features %#x, want %#x", f, protocol.FeatureMask)
	}
	old := newPairWith(t, pairConfig{recvBuffers: 8, provider: oldDialer{tcp.New("tcp")}})
	if f := old.server.Features(); f != 0 {
		t.Errorf("accepting side, older peer: features %#x, want none", f)
	}
}
