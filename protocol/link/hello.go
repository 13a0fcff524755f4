package link

import (
	"context"
	"errors"
	"fmt"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/transport"
)

func (o *Options) hello() []byte {
	h := protocol.Hello{MinVersion: protocol.Version, MaxVersion: protocol.Version, Features: protocol.FeatureMask,
		RecvCredits: uint16(o.RecvBuffers), MaxMessage: protocol.MaxMessageSize}
	b, err := protocol.Append(nil, 0, 0, &h)
	if err != nil {
		panic(err) // a Hello of constants always encodes
	}
	return b
}

func parseHello(b []byte) (*protocol.Hello, error) {
	_, m, err := protocol.Decode(b)
	if err != nil {
		return nil, fmt.Errorf("hello: %w", err)
	}
	h, ok := m.(*protocol.Hello)
	if !ok {
		return nil, fmt.Errorf("hello: got %v: %w", m.Type(), protocol.ErrProtocol)
	}
	if h.RecvCredits < 2 || h.MaxMessage < protocol.MaxMessageSize {
		return nil, fmt.Errorf("hello: peer offers %d receive buffers of %d bytes: %w", h.RecvCredits, h.MaxMessage, protocol.ErrProtocol)
	}
	return h, nil
}

// Dial connects to addr with p, exchanging hellos in the connection's
// private data, and starts a link on the connection.
func Dial(ctx context.Context, p transport.Provider, addr string, opts Options) (*Link, error) {
	opts.setDefaults()
	conn, err := p.Dial(ctx, addr, opts.hello())
	if err != nil {
		var rej *transport.RejectError
		if errors.As(err, &rej) {
			if _, m, derr := protocol.Decode(rej.PrivateData); derr == nil {
				if em, ok := m.(*protocol.ErrorMsg); ok {
					return nil, fmt.Errorf("connect %s: %w", addr, &protocol.RemoteError{Code: em.Code, Text: em.Text})
				}
			}
		}
		return nil, fmt.Errorf("connect %s: %w", addr, err)
	}
	peer, err := parseHello(conn.PeerPrivateData())
	var features uint32
	if err == nil {
		_, features, err = protocol.Negotiate(localHello, *peer)
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("connect %s: %w", addr, err)
	}
	l, err := setup(conn, int(peer.RecvCredits), opts)
	if err != nil {
		conn.Close()
		return nil, err
	}
	l.features = features
	l.start()
	return l, nil
}

// Accept checks the hello of an incoming connection request, accepts it and
// starts a link. A request with an unusable hello is rejected with an Error
// message in the reject's private data. The receives the hello announces
// are posted on the prepared connection before it is accepted, so that they
// are there for the peer's first SENDs, which may come as soon as its Dial
// returns (without relying on the peer's RNR retries).
func Accept(ctx context.Context, req transport.ConnRequest, opts Options) (*Link, error) {
	opts.setDefaults()
	peer, err := parseHello(req.PrivateData())
	var features uint32
	if err == nil {
		_, features, err = protocol.Negotiate(localHello, *peer)
	}
	if err != nil {
		em := protocol.ErrorMsg{Code: protocol.CodeProto, Text: trimText(err.Error(), 150)}
		b, _ := protocol.Append(nil, 0, 0, &em)
		req.Reject(b)
		return nil, fmt.Errorf("accept %s: %w", req.RemoteAddr(), err)
	}
	conn, err := req.Prepare()
	if err != nil {
		return nil, fmt.Errorf("accept %s: %w", req.RemoteAddr(), err)
	}
	l, err := setup(conn, int(peer.RecvCredits), opts)
	if err != nil {
		req.Reject(nil)
		conn.Close()
		return nil, fmt.Errorf("accept %s: %w", req.RemoteAddr(), err)
	}
	accepted, err := req.Accept(ctx, opts.hello())
	if err == nil && accepted != conn {
		err = errors.New("the provider accepted a connection other than the one it prepared")
		accepted.Close()
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("accept %s: %w", req.RemoteAddr(), err)
	}
	l.features = features
	l.start()
	return l, nil
}

// localHello is what this side offers, for Negotiate.
var localHello = protocol.Hello{MinVersion: protocol.Version, MaxVersion: protocol.Version, Features: protocol.FeatureMask}

// Features are the optional protocol features both sides offered in their
// Hellos (see protocol.FeatureMask): a side uses a feature only if it is
// here. A link made with New has none.
func (l *Link) Features() uint32 { return l.features }

func trimText(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}
