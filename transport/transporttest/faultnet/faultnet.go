package faultnet

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rblk/rblk/transport"
)

// Provider wraps a provider; the conns it dials and accepts are *Conn.
type Provider struct {
	inner transport.Provider

	mu    sync.Mutex
	conns []*Conn
}

var _ transport.Provider = (*Provider)(nil)

// Wrap returns a fault-injecting provider over p.
func Wrap(p transport.Provider) *Provider { return &Provider{inner: p} }

// Name is the wrapped provider's name.
func (p *Provider) Name() string { return p.inner.Name() }

// Listen listens with the wrapped provider; the conns it accepts are *Conn.
func (p *Provider) Listen(ctx context.Context, addr string) (transport.Listener, error) {
	l, err := p.inner.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return &listener{Listener: l, p: p}, nil
}

// Dial dials with the wrapped provider and returns a *Conn.
func (p *Provider) Dial(ctx context.Context, addr string, privateData []byte) (transport.Conn, error) {
	c, err := p.inner.Dial(ctx, addr, privateData)
	if err != nil {
		return nil, err
	}
	return p.track(c), nil
}

func (p *Provider) track(c transport.Conn) *Conn {
	fc := &Conn{Conn: c}
	p.mu.Lock()
	p.conns = append(p.conns, fc)
	p.mu.Unlock()
	return fc
}

// Conns returns every conn made so far, dialed or accepted, oldest first.
func (p *Provider) Conns() []*Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*Conn(nil), p.conns...)
}

// DisconnectAll disconnects every conn made so far.
func (p *Provider) DisconnectAll() {
	for _, c := range p.Conns() {
		c.Disconnect()
	}
}

type listener struct {
	transport.Listener
	p *Provider
}

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	r, err := l.Listener.Accept(ctx)
	if err != nil {
		return nil, err
	}
	return &connRequest{ConnRequest: r, p: l.p}, nil
}

type connRequest struct {
	transport.ConnRequest
	p *Provider

	mu       sync.Mutex
	prepared *Conn // the *Conn of Prepare, which Accept returns too
}

// Prepare prepares with the wrapped request and returns a *Conn, the one
// Accept returns.
func (r *connRequest) Prepare() (transport.Conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.prepared != nil {
		return r.prepared, nil
	}
	c, err := r.ConnRequest.Prepare()
	if err != nil {
		return nil, err
	}
	r.prepared = r.p.track(c)
	return r.prepared, nil
}

func (r *connRequest) Accept(ctx context.Context, privateData []byte) (transport.Conn, error) {
	c, err := r.ConnRequest.Accept(ctx, privateData)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	fc := r.prepared
	r.mu.Unlock()
	if fc != nil && fc.Conn == c {
		return fc, nil
	}
	return r.p.track(c), nil
}

// Conn is a conn whose faults a test controls. Everything not overridden
// goes to the wrapped conn, regions included.
type Conn struct {
	transport.Conn

	delay        atomic.Int64 // time.Duration
	loseSend     atomic.Bool  // the next SEND is lost with the connection
	disconnected atomic.Bool

	mu   sync.Mutex
	held []transport.Completion // polled while a delay was cut short by ctx
	gate chan struct{}          // while not nil, Poll keeps what it got (Hold)
}

// Disconnect breaks the connection as if the cable was pulled: the
// connection fails under its owner, whose requests in flight and posted
// receives complete with StatusFlushed before Poll reports
// transport.ErrClosed, and the peer sees the connection break too. The
// owner's Close is still allowed.
func (c *Conn) Disconnect() {
	c.disconnected.Store(true)
	c.Conn.Close()
}

// LoseNextSend makes the next SEND posted on c vanish with the connection:
// the work requests before it in the same post go out, the SEND does not,
// and c is disconnected, as if the cable was pulled while the SEND was on
// the wire. The poster learns nothing until the connection breaks.
func (c *Conn) LoseNextSend() { c.loseSend.Store(true) }

// PostSend posts wrs, unless LoseNextSend is armed and wrs holds a SEND.
func (c *Conn) PostSend(wrs ...transport.WorkRequest) error {
	if c.loseSend.Load() {
		for i, wr := range wrs {
			if wr.Op == transport.OpSend && c.loseSend.CompareAndSwap(true, false) {
				var err error
				if i > 0 {
					err = c.Conn.PostSend(wrs[:i]...)
				}
				c.Disconnect()
				return err
			}
		}
	}
	return c.Conn.PostSend(wrs...)
}

// Disconnected reports whether Disconnect was called.
func (c *Conn) Disconnected() bool { return c.disconnected.Load() }

// Delay holds the completions of every later Poll for d before returning
// them, as a slow completion path would; 0 stops delaying.
func (c *Conn) Delay(d time.Duration) { c.delay.Store(int64(d)) }

// Hold makes Poll keep the completions it gets, from now until Release,
// as a completion path that stalls would: the owner sees none of them
// meanwhile, then all of them, in order. Its peer is not affected.
func (c *Conn) Hold() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gate == nil {
		c.gate = make(chan struct{})
	}
}

// Release ends Hold: Poll returns what it kept.
func (c *Conn) Release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gate != nil {
		close(c.gate)
		c.gate = nil
	}
}

// Poll polls the wrapped conn, then holds what it got for the delay, or
// until Release after Hold.
func (c *Conn) Poll(ctx context.Context, out []transport.Completion) (int, error) {
	if err := c.waitRelease(ctx); err != nil {
		return 0, err
	}
	c.mu.Lock()
	if len(c.held) > 0 {
		n := copy(out, c.held)
		c.held = c.held[n:]
		c.mu.Unlock()
		return n, nil
	}
	c.mu.Unlock()
	n, err := c.Conn.Poll(ctx, out)
	if n == 0 {
		return n, err
	}
	// Held from now on (Hold came while this Poll waited), or delayed.
	c.mu.Lock()
	gate := c.gate
	c.mu.Unlock()
	var wait <-chan time.Time
	if gate == nil {
		d := time.Duration(c.delay.Load())
		if d <= 0 {
			return n, err
		}
		t := time.NewTimer(d)
		defer t.Stop()
		wait = t.C
	}
	select {
	case <-wait:
		return n, nil
	case <-gate:
		return n, nil
	case <-ctx.Done():
		c.mu.Lock()
		c.held = append(c.held, out[:n]...)
		c.mu.Unlock()
		return 0, ctx.Err()
	}
}

// waitRelease waits while the conn is held (Hold), or until ctx ends.
func (c *Conn) waitRelease(ctx context.Context) error {
	c.mu.Lock()
	gate := c.gate
	c.mu.Unlock()
	if gate == nil {
		return nil
	}
	select {
	case <-gate:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
