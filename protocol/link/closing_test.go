package link

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/tcp"
)

// closingProvider dials connections whose PostRecv answers ErrClosed once
// closing is set, as a connection the peer disconnected does while its
// completions are still to be polled.
type closingProvider struct {
	transport.Provider
	closing atomic.Bool
	refused chan struct{} // gets a value at each refused PostRecv
}

func (p *closingProvider) Dial(ctx context.Context, addr string, pd []byte) (transport.Conn, error) {
	return wrapDial(ctx, p.Provider, addr, pd, func(c transport.Conn) transport.Conn { return &closingConn{Conn: c, p: p} })
}

// wrapDial dials addr with p and returns the connection through wrap: the
// tests' providers that watch or change a dialed connection.
func wrapDial(ctx context.Context, p transport.Provider, addr string, pd []byte, wrap func(transport.Conn) transport.Conn) (transport.Conn, error) {
	c, err := p.Dial(ctx, addr, pd)
	if err != nil {
		return nil, err
	}
	return wrap(c), nil
}

type closingConn struct {
	transport.Conn
	p *closingProvider
}

func (c *closingConn) PostRecv(rrs ...transport.RecvRequest) error {
	if c.p.closing.Load() {
		select {
		case c.p.refused <- struct{}{}:
		default:
		}
		return transport.ErrClosed
	}
	return c.Conn.PostRecv(rrs...)
}

// TestReplyAfterRepostRefused: when the connection refuses a repost of a
// receive buffer because it is closing, a reply received after that still
// reaches its request (the guest's TestBeforeAuthentication over rdma: a
// wrong secret answered "link down: repost receive: connection closed"
// instead of the target's refusal, which came in the next completions).
func TestReplyAfterRepostRefused(t *testing.T) {
	cp := &closingProvider{Provider: tcp.New("tcp"), refused: make(chan struct{}, 1)}
	pr := newPairWith(t, pairConfig{recvBuffers: 8, provider: cp})
	cp.closing.Store(true)
	// A message with no reply: the client's link takes it and its repost
	// is refused.
	if err := pr.server.Send(context.Background(), 0, &protocol.Credit{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cp.refused:
	case <-time.After(10 * time.Second):
		t.Fatal("the client did not repost its receive buffer")
	}
	var g protocol.Grant
	err := pr.client.Request(context.Background(), &protocol.GrantRequest{Handle: 1, Offset: 1 << 20}, &g)
	if err != nil {
		t.Fatalf("a request after a refused repost: %v, want its reply", err)
	}
	if errors.Is(pr.client.Err(), ErrDown) {
		t.Fatalf("the link is down after a refused repost: %v", pr.client.Err())
	}
}
