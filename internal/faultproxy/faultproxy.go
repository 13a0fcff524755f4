package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// Direction is one half of a proxied connection.
type Direction int

const (
	// ClientToServer carries the bytes the client (who dialed the proxy)
	// sends to the server (the proxy's target).
	ClientToServer Direction = iota
	// ServerToClient carries the server's bytes to the client.
	ServerToClient
)

func (d Direction) String() string {
	switch d {
	case ClientToServer:
		return "client->server"
	case ServerToClient:
		return "server->client"
	}
	return fmt.Sprintf("Direction(%d)", int(d))
}

// ErrClosed is returned by operations on a closed proxy, and by Release
// when the side the bytes go to is closed.
var ErrClosed = errors.New("faultproxy: closed")

// Proxy accepts TCP connections and forwards each to the target.
type Proxy struct {
	target string
	ln     net.Listener

	closeOnce sync.Once
	closed    chan struct{}
	wg        sync.WaitGroup

	mu       sync.Mutex
	conns    []*Conn
	changed  chan struct{} // closed and replaced when conns grows
	stallNew bool          // connections accepted from now on start stalled
	delayNew [2]time.Duration
}

// New listens on listen (HOST:PORT; port 0 picks a free one) and forwards
// every connection it accepts to target.
func New(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listen %s: %w", listen, err)
	}
	p := &Proxy{target: target, ln: ln, closed: make(chan struct{}), changed: make(chan struct{})}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr is the address clients dial: the listener's HOST:PORT.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address connections are forwarded to.
func (p *Proxy) Target() string { return p.target }

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			select {
			case <-p.closed:
				return
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		client := nc.(*net.TCPConn)
		var d net.Dialer
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		sc, err := d.DialContext(ctx, "tcp", p.target)
		cancel()
		if err != nil {
			// The target is down: the client sees a reset, as it would
			// dialing the target itself.
			client.SetLinger(0)
			client.Close()
			continue
		}
		p.mu.Lock()
		select {
		case <-p.closed:
			p.mu.Unlock()
			resetConn(client)
			resetConn(sc.(*net.TCPConn))
			return
		default:
		}
		c := newConn(p, len(p.conns), client, sc.(*net.TCPConn))
		c.stalled = p.stallNew
		c.delay = p.delayNew
		p.conns = append(p.conns, c)
		close(p.changed)
		p.changed = make(chan struct{})
		p.wg.Add(2)
		go c.pipe(ClientToServer)
		go c.pipe(ServerToClient)
		p.mu.Unlock()
	}
}

// Conns returns every connection accepted so far, oldest first, open or not.
func (p *Proxy) Conns() []*Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*Conn(nil), p.conns...)
}

// Accepted is the number of connections accepted so far.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// WaitConn waits until the connection with index i (0 for the first one
// accepted) exists and returns it, or returns ctx's error.
func (p *Proxy) WaitConn(ctx context.Context, i int) (*Conn, error) {
	for {
		p.mu.Lock()
		if i < len(p.conns) {
			c := p.conns[i]
			p.mu.Unlock()
			return c, nil
		}
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
		case <-p.closed:
			return nil, fmt.Errorf("wait for connection %d: %w", i, ErrClosed)
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for connection %d (%d accepted): %w", i, p.Accepted(), ctx.Err())
		}
	}
}

// ResetAll resets every open connection (see Conn.Reset). Connections
// accepted later are forwarded as usual.
func (p *Proxy) ResetAll() {
	for _, c := range p.Conns() {
		c.Reset()
	}
}

// StallAll stalls every connection, and every connection accepted until
// ResumeAll: the client's connect succeeds at the TCP level, and then
// nothing passes.
func (p *Proxy) StallAll() {
	p.mu.Lock()
	p.stallNew = true
	p.mu.Unlock()
	for _, c := range p.Conns() {
		c.Stall()
	}
}

// ResumeAll ends StallAll: every connection forwards again.
func (p *Proxy) ResumeAll() {
	p.mu.Lock()
	p.stallNew = false
	p.mu.Unlock()
	for _, c := range p.Conns() {
		c.Resume()
	}
}

// SetDelayAll sets the delay of direction dir on every connection, and on
// those accepted later.
func (p *Proxy) SetDelayAll(dir Direction, d time.Duration) {
	p.mu.Lock()
	p.delayNew[dir] = d
	p.mu.Unlock()
	for _, c := range p.Conns() {
		c.SetDelay(dir, d)
	}
}

// Close stops accepting, resets every connection and waits for all the
// proxy's goroutines. Calling it again does nothing and returns nil.
func (p *Proxy) Close() error {
	var err error
	p.closeOnce.Do(func() {
		p.mu.Lock()
		close(p.closed)
		p.mu.Unlock()
		err = p.ln.Close()
		for _, c := range p.Conns() {
			c.kill()
		}
		p.wg.Wait()
	})
	return err
}

// Stats is a snapshot of one connection, indexed by Direction.
type Stats struct {
	// Received counts the bytes read from the sending side.
	Received [2]int64
	// Delivered counts the bytes written to the receiving side (held-back
	// bytes once released included).
	Delivered [2]int64
	// Dropped counts the bytes read that could not be delivered because
	// the receiving side was gone.
	Dropped [2]int64
	// Held is the number of bytes held back now.
	Held [2]int
	// ClientClosed and ServerClosed report that the side's socket ended:
	// closed by its peer (EOF or reset) or by the proxy.
	ClientClosed, ServerClosed bool
}

// ReceivedAtLeast is a condition for WaitFor: at least n bytes were read from the
// sender of dir.
func ReceivedAtLeast(dir Direction, n int64) func(Stats) bool {
	return func(s Stats) bool { return s.Received[dir] >= n }
}

// HeldAtLeast is a condition for WaitFor: at least n bytes of dir are held
// back.
func HeldAtLeast(dir Direction, n int) func(Stats) bool {
	return func(s Stats) bool { return s.Held[dir] >= n }
}

// Conn is one proxied connection.
type Conn struct {
	p      *Proxy
	id     int
	client *net.TCPConn
	server *net.TCPConn

	wmu [2]sync.Mutex // serializes writes to the receiving side of a direction

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every change
	stalled bool
	delay   [2]time.Duration
	hold    [2]bool
	held    [2][]byte
	stats   Stats
	killed  bool // the proxy closed both sides
	// eofPending: the sender of a direction closed its side while bytes
	// were held back; Release passes the EOF on after them.
	eofPending [2]bool
	gone       [2]bool // by side: [0] client socket closed, [1] server socket closed
	piped      int     // pipes that returned
}

func newConn(p *Proxy, id int, client, server *net.TCPConn) *Conn {
	return &Conn{p: p, id: id, client: client, server: server, changed: make(chan struct{})}
}

// ID is the connection's index in the proxy, in accept order from 0.
func (c *Conn) ID() int { return c.id }

func (c *Conn) String() string { return fmt.Sprintf("faultproxy conn %d", c.id) }

// notify wakes every waiter. c.mu is held.
func (c *Conn) notify() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// Stats returns a snapshot of the connection.
func (c *Conn) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stats
	s.Held = [2]int{len(c.held[0]), len(c.held[1])}
	return s
}

// WaitFor waits until cond holds of the connection's stats, or returns
// ctx's error (with the last stats).
func (c *Conn) WaitFor(ctx context.Context, cond func(Stats) bool) error {
	for {
		c.mu.Lock()
		s := c.stats
		s.Held = [2]int{len(c.held[0]), len(c.held[1])}
		ch := c.changed
		c.mu.Unlock()
		if cond(s) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("%v: wait: %w (stats %+v)", c, ctx.Err(), s)
		}
	}
}

// Done reports whether both sockets of the connection are closed.
func (c *Conn) Done() bool {
	s := c.Stats()
	return s.ClientClosed && s.ServerClosed
}

// Reset closes both sockets with SO_LINGER 0: both peers see a reset.
// Bytes held back are dropped.
func (c *Conn) Reset() {
	c.mu.Lock()
	c.held = [2][]byte{}
	c.hold = [2]bool{}
	c.mu.Unlock()
	c.closeSide(0, true)
	c.closeSide(1, true)
}

// ResetClientSideOnly resets the client's socket and keeps the server's
// open: the server sees nothing, what it sends is dropped, and bytes held
// back from the client can still be delivered to it with Release.
func (c *Conn) ResetClientSideOnly() {
	c.closeSide(0, true)
}

// CloseServerSide closes the server's socket of the connection (a FIN, not a
// reset), for a connection whose client side is gone.
func (c *Conn) CloseServerSide() {
	c.closeSide(1, false)
}

// Stall stops forwarding in both directions; the sockets stay open and
// nothing is sent on them until Resume.
func (c *Conn) Stall() {
	c.mu.Lock()
	c.stalled = true
	c.notify()
	c.mu.Unlock()
}

// Resume ends a Stall.
func (c *Conn) Resume() {
	c.mu.Lock()
	c.stalled = false
	c.notify()
	c.mu.Unlock()
}

// SetDelay makes dir deliver every chunk of bytes d after it was read (0:
// at once).
func (c *Conn) SetDelay(dir Direction, d time.Duration) {
	c.mu.Lock()
	c.delay[dir] = d
	c.notify()
	c.mu.Unlock()
}

// HoldBack keeps the bytes read in dir from now on instead of delivering
// them, until Release.
func (c *Conn) HoldBack(dir Direction) {
	c.mu.Lock()
	c.hold[dir] = true
	c.notify()
	c.mu.Unlock()
}

// Release delivers the bytes held back in dir, in order, to the receiving
// side, and forwards dir normally again. It works after the sending side
// is gone too. It returns the number of bytes written and ErrClosed (or the
// write's error) if the receiving side could not take them.
func (c *Conn) Release(dir Direction) (int, error) {
	c.wmu[dir].Lock()
	defer c.wmu[dir].Unlock()
	c.mu.Lock()
	b := c.held[dir]
	c.held[dir] = nil
	c.hold[dir] = false
	dstGone := c.gone[dstSide(dir)]
	eof := c.eofPending[dir]
	c.eofPending[dir] = false
	c.notify()
	c.mu.Unlock()
	defer c.maybeFinish()
	if len(b) > 0 && dstGone {
		c.account(dir, 0, len(b))
		return 0, fmt.Errorf("%v: release %d bytes %v: %w", c, len(b), dir, ErrClosed)
	}
	var n int
	if len(b) > 0 {
		var err error
		n, err = c.dst(dir).Write(b)
		c.account(dir, n, len(b)-n)
		if err != nil {
			return n, fmt.Errorf("%v: release %d bytes %v: %w", c, len(b), dir, err)
		}
	}
	if eof && !dstGone {
		// The sender closed its side while its bytes were held: pass the
		// EOF on after them.
		c.dst(dir).CloseWrite()
	}
	return n, nil
}

func (c *Conn) src(dir Direction) *net.TCPConn {
	if dir == ClientToServer {
		return c.client
	}
	return c.server
}

func (c *Conn) dst(dir Direction) *net.TCPConn {
	if dir == ClientToServer {
		return c.server
	}
	return c.client
}

// side of the sender of dir: 0 client, 1 server.
func srcSide(dir Direction) int { return int(dir) }
func dstSide(dir Direction) int { return 1 - int(dir) }

func (c *Conn) account(dir Direction, delivered, dropped int) {
	c.mu.Lock()
	c.stats.Delivered[dir] += int64(delivered)
	c.stats.Dropped[dir] += int64(dropped)
	c.notify()
	c.mu.Unlock()
}

func (c *Conn) sock(side int) *net.TCPConn {
	if side == 0 {
		return c.client
	}
	return c.server
}

// closeSide closes the socket of side (0 client, 1 server), with a reset if
// rst, once.
func (c *Conn) closeSide(side int, rst bool) {
	c.mu.Lock()
	if c.gone[side] {
		c.mu.Unlock()
		return
	}
	c.gone[side] = true
	if side == 0 {
		c.stats.ClientClosed = true
	} else {
		c.stats.ServerClosed = true
	}
	c.notify()
	c.mu.Unlock()
	s := c.sock(side)
	if rst {
		s.SetLinger(0)
	}
	s.Close()
}

// kill closes both sides with a reset and wakes the pipes for good.
func (c *Conn) kill() {
	c.mu.Lock()
	c.killed = true
	c.held = [2][]byte{}
	c.notify()
	c.mu.Unlock()
	c.closeSide(0, true)
	c.closeSide(1, true)
}

// waitRunning waits while the connection is stalled. It returns false if
// the pipe of dir must end.
func (c *Conn) waitRunning(dir Direction) bool {
	for {
		c.mu.Lock()
		if c.killed || c.gone[srcSide(dir)] {
			c.mu.Unlock()
			return false
		}
		if !c.stalled {
			c.mu.Unlock()
			return true
		}
		ch := c.changed
		c.mu.Unlock()
		<-ch
	}
}

// waitUnstalled waits while the connection is stalled. It returns false if
// the connection was killed.
func (c *Conn) waitUnstalled() bool {
	for {
		c.mu.Lock()
		if c.killed {
			c.mu.Unlock()
			return false
		}
		if !c.stalled {
			c.mu.Unlock()
			return true
		}
		ch := c.changed
		c.mu.Unlock()
		<-ch
	}
}

// waitUntil waits until t, or until the connection is killed (false).
func (c *Conn) waitUntil(t time.Time) bool {
	for {
		d := time.Until(t)
		if d <= 0 {
			return true
		}
		c.mu.Lock()
		if c.killed {
			c.mu.Unlock()
			return false
		}
		ch := c.changed
		c.mu.Unlock()
		timer := time.NewTimer(d)
		select {
		case <-timer.C:
		case <-ch:
			timer.Stop()
		}
	}
}

// pipe forwards dir until its sending side ends.
func (c *Conn) pipe(dir Direction) {
	defer c.p.wg.Done()
	defer c.pipeDone()
	src := c.src(dir)
	buf := make([]byte, 256<<10)
	for {
		if !c.waitRunning(dir) {
			return
		}
		n, err := src.Read(buf)
		if n > 0 {
			read := time.Now()
			c.mu.Lock()
			c.stats.Received[dir] += int64(n)
			c.notify()
			c.mu.Unlock()
			// Bytes read just before a Stall wait for the Resume too.
			if !c.waitUnstalled() {
				return
			}
			c.mu.Lock()
			if c.hold[dir] {
				c.held[dir] = append(c.held[dir], buf[:n]...)
				c.notify()
				c.mu.Unlock()
			} else {
				d := c.delay[dir]
				c.mu.Unlock()
				if d > 0 && !c.waitUntil(read.Add(d)) {
					return
				}
				c.deliver(dir, buf[:n])
			}
		}
		if err != nil {
			c.srcEnded(dir, err)
			return
		}
	}
}

// deliver writes b to the receiving side of dir, or drops it if that side
// is gone.
func (c *Conn) deliver(dir Direction, b []byte) {
	c.wmu[dir].Lock()
	defer c.wmu[dir].Unlock()
	c.mu.Lock()
	if c.hold[dir] {
		// HoldBack came while this chunk waited for its delay.
		c.held[dir] = append(c.held[dir], b...)
		c.notify()
		c.mu.Unlock()
		return
	}
	gone := c.gone[dstSide(dir)]
	c.mu.Unlock()
	if gone {
		c.account(dir, 0, len(b))
		return
	}
	n, err := c.dst(dir).Write(b)
	c.account(dir, n, len(b)-n)
	if err != nil {
		// The receiver is gone: it reset the connection, which the pipe of
		// the other direction sees and passes on.
		c.mu.Lock()
		c.notify()
		c.mu.Unlock()
	}
}

// srcEnded handles the end of the sending side of dir: an EOF is passed on
// as a half-close unless bytes are held back for later, a reset as a reset.
func (c *Conn) srcEnded(dir Direction, err error) {
	// Under the write lock of dir, so that a Release runs wholly before or
	// after: the EOF or reset is passed on after the held bytes.
	c.wmu[dir].Lock()
	defer c.wmu[dir].Unlock()
	c.mu.Lock()
	killed := c.killed
	byUs := c.gone[srcSide(dir)]
	holding := c.hold[dir] || len(c.held[dir]) > 0
	c.mu.Unlock()
	if killed || byUs {
		// The proxy closed it (Reset, ResetClientSideOnly, Close).
		return
	}
	if errors.Is(err, io.EOF) {
		c.mu.Lock()
		if srcSide(dir) == 0 {
			c.stats.ClientClosed = true
		} else {
			c.stats.ServerClosed = true
		}
		c.eofPending[dir] = holding
		c.notify()
		c.mu.Unlock()
		if !holding {
			c.dst(dir).CloseWrite()
		}
		return
	}
	// A reset (or another error): the sender's socket is dead; so is the
	// connection, for the receiver too, unless bytes wait for it.
	c.closeSide(srcSide(dir), true)
	if !holding {
		c.closeSide(dstSide(dir), true)
	}
}

// pipeDone closes the sockets once both pipes returned and nothing is held
// back.
func (c *Conn) pipeDone() {
	c.mu.Lock()
	c.piped++
	c.mu.Unlock()
	c.maybeFinish()
}

func (c *Conn) maybeFinish() {
	c.mu.Lock()
	finish := c.piped == 2 && len(c.held[0]) == 0 && len(c.held[1]) == 0 && !c.hold[0] && !c.hold[1]
	c.mu.Unlock()
	if finish {
		c.closeSide(0, false)
		c.closeSide(1, false)
	}
}

func resetConn(c *net.TCPConn) {
	c.SetLinger(0)
	c.Close()
}
