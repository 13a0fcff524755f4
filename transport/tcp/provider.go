package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
)

// Options tune a provider. Zero fields take their defaults.
type Options struct {
	// SendQueueDepth bounds outstanding send work requests (default 1024).
	SendQueueDepth int
	// RecvQueueDepth bounds posted receives (default 1024).
	RecvQueueDepth int
	// MaxReadsInFlight bounds outstanding RDMA READs, both those this side
	// issues and those it serves for the peer (default 128). The two sides
	// use the smaller of their values.
	MaxReadsInFlight int
	// RNRTimeout is how long an incoming SEND or WRITE WITH IMMEDIATE waits
	// for a RECV to be posted before it fails with StatusRNRRetryExceeded
	// (default 5s).
	RNRTimeout time.Duration
	// HandshakeTimeout bounds how long the listener waits for the connect
	// request of a new stream, from its accept until Accept returns it
	// (default 10s). The listener's owner may change it
	// (transport.HandshakeLimiter).
	HandshakeTimeout time.Duration
	// MaxPendingHandshakes bounds the streams whose connect request the
	// listener awaits (default 128; see transport.HandshakeLimits for what
	// happens beyond it). The listener's owner may change it.
	MaxPendingHandshakes int
	// LocalAddr, if set, is the local address Dial connects from
	// ("HOST:0" picks a port): a host with several addresses, or a test
	// that plays several hosts.
	LocalAddr string
	// Logger gets the temporary accept errors the listener retries (warn).
	// Default: no logging.
	Logger *zap.Logger

	// hideSyscallConn makes conns use their stream as a net.Conn without
	// SyscallConn (tests: the path where the writer goroutine writes all).
	hideSyscallConn bool
}

func (o Options) withDefaults() Options {
	if o.SendQueueDepth <= 0 {
		o.SendQueueDepth = 1024
	}
	if o.RecvQueueDepth <= 0 {
		o.RecvQueueDepth = 1024
	}
	if o.MaxReadsInFlight <= 0 {
		o.MaxReadsInFlight = 128
	}
	if o.RNRTimeout <= 0 {
		o.RNRTimeout = 5 * time.Second
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = 10 * time.Second
	}
	if o.MaxPendingHandshakes <= 0 {
		o.MaxPendingHandshakes = DefaultMaxPendingHandshakes
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

// DefaultMaxPendingHandshakes is the default of
// Options.MaxPendingHandshakes.
const DefaultMaxPendingHandshakes = 128

// Provider is the software provider. It implements transport.Provider.
type Provider struct {
	network string
	opts    Options
}

var _ transport.Provider = (*Provider)(nil)

// New returns a provider over network "tcp" (or "tcp4", "tcp6") or "unix"
// with default options.
func New(network string) transport.Provider { return NewWithOptions(network, Options{}) }

// NewWithOptions is New with options.
func NewWithOptions(network string, opts Options) *Provider {
	return &Provider{network: network, opts: opts.withDefaults()}
}

// Name returns the network.
func (p *Provider) Name() string { return p.network }

// Options returns the options in force, defaults filled in.
func (p *Provider) Options() Options { return p.opts }

func (p *Provider) checkNetwork() error {
	switch p.network {
	case "tcp", "tcp4", "tcp6", "unix":
		return nil
	}
	return fmt.Errorf("unsupported network %q", p.network)
}

// Dial connects to addr, sends a connect request carrying privateData and
// waits for the peer to accept or reject it. ctx bounds the whole exchange.
func (p *Provider) Dial(ctx context.Context, addr string, privateData []byte) (transport.Conn, error) {
	c, err := p.dial(ctx, addr, privateData)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", addr, err)
	}
	return c, nil
}

func (p *Provider) dial(ctx context.Context, addr string, privateData []byte) (*conn, error) {
	if err := p.checkNetwork(); err != nil {
		return nil, err
	}
	if len(privateData) > MaxConnectPrivateData {
		return nil, fmt.Errorf("private data of %d bytes exceeds %d", len(privateData), MaxConnectPrivateData)
	}
	var d net.Dialer
	if p.opts.LocalAddr != "" {
		if p.network == "unix" {
			return nil, errors.New("a local address is for tcp networks only")
		}
		la, err := net.ResolveTCPAddr(p.network, p.opts.LocalAddr)
		if err != nil {
			return nil, fmt.Errorf("local address: %w", err)
		}
		d.LocalAddr = la
	}
	nc, err := d.DialContext(ctx, p.network, addr)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			nc.Close()
		}
	}()
	stop := watchContext(ctx, nc)
	if err := writeControl(nc, frameConnect, version, uint32(p.opts.MaxReadsInFlight), privateData); err != nil {
		stop()
		return nil, ctxErr(ctx, err)
	}
	br := bufio.NewReaderSize(nc, readBufferSize)
	var h header
	pd, err := readControl(br, &h)
	if !stop() || ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, fmt.Errorf("reading accept: %w", err)
	}
	if err := nc.SetDeadline(time.Time{}); err != nil {
		return nil, err
	}
	switch h.typ() {
	case frameReject:
		if len(pd) > MaxRejectPrivateData {
			return nil, fmt.Errorf("reject private data of %d bytes", len(pd))
		}
		return nil, &transport.RejectError{PrivateData: pd}
	case frameAccept:
		if h.status() != version {
			return nil, fmt.Errorf("peer speaks protocol version %d, want %d", h.status(), version)
		}
		if len(pd) > MaxAcceptPrivateData {
			return nil, fmt.Errorf("accept private data of %d bytes", len(pd))
		}
		if h.imm() == 0 {
			return nil, errors.New("peer accepts no RDMA READ")
		}
	default:
		return nil, fmt.Errorf("unexpected %v frame during connect", h.typ())
	}
	ok = true
	return newConn(p.opts, nc, br, pd, int(h.imm())), nil
}

// readBufferSize is the size of a conn's read buffer.
const readBufferSize = 64 << 10

// watchContext makes I/O on nc fail when ctx ends. The returned stop
// reports false if ctx ended (nc's deadline may then be in the past).
func watchContext(ctx context.Context, nc net.Conn) (stop func() bool) {
	// No deadline from ctx.Deadline: the socket's timer could fire before
	// ctx's, and the failure would not be told apart from ctx ending.
	return context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
}

func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// writeControl writes a connection management frame.
func writeControl(w io.Writer, t frameType, status uint8, imm uint32, privateData []byte) error {
	buf := make([]byte, headerLen+len(privateData))
	h := (*header)(buf[:headerLen])
	h.put(t, status, uint32(len(privateData)), 0, 0, 0, imm)
	copy(buf[headerLen:], privateData)
	_, err := w.Write(buf)
	return err
}

// readControl reads a connection management frame into h and returns its
// private data. It reads no byte past the frame from r.
func readControl(r io.Reader, h *header) ([]byte, error) {
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	if err := h.check(); err != nil {
		return nil, err
	}
	switch h.typ() {
	case frameConnect, frameAccept, frameReject:
	default:
		return nil, fmt.Errorf("unexpected %v frame during connect", h.typ())
	}
	if h.length() > MaxAcceptPrivateData {
		return nil, fmt.Errorf("%v private data of %d bytes", h.typ(), h.length())
	}
	pd := make([]byte, h.length())
	if _, err := io.ReadFull(r, pd); err != nil {
		return nil, err
	}
	return pd, nil
}

// Listen listens on addr: host:port for tcp, a path for unix. A stale unix
// socket file (one nothing listens on) is removed first.
func (p *Provider) Listen(ctx context.Context, addr string) (transport.Listener, error) {
	l, err := p.listen(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	return l, nil
}

func (p *Provider) listen(ctx context.Context, addr string) (*listener, error) {
	if err := p.checkNetwork(); err != nil {
		return nil, err
	}
	if p.network == "unix" {
		if err := removeStaleSocket(ctx, addr); err != nil {
			return nil, err
		}
	}
	var lc net.ListenConfig
	nl, err := lc.Listen(ctx, p.network, addr)
	if err != nil {
		return nil, err
	}
	return p.newListener(nl), nil
}

// newListener starts accepting on nl.
func (p *Provider) newListener(nl net.Listener) *listener {
	l := &listener{
		p:          p,
		nl:         nl,
		addr:       nl.Addr().String(),
		reqs:       make(chan *connRequest),
		closing:    make(chan struct{}),
		failed:     make(chan struct{}),
		timeout:    p.opts.HandshakeTimeout,
		maxPending: p.opts.MaxPendingHandshakes,
		shaking:    make(map[net.Conn]*shake),
		byPeer:     make(map[string][]*shake),
		pending:    make(map[*connRequest]struct{}),
	}
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// removeStaleSocket removes the unix socket file at path if nothing listens
// on it.
func removeStaleSocket(ctx context.Context, path string) error {
	if len(path) == 0 || path[0] == '@' {
		return nil // abstract socket: no file
	}
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		return nil // absent, or not a socket: let Listen report it
	}
	d := net.Dialer{Timeout: time.Second}
	c, err := d.DialContext(ctx, "unix", path)
	if err == nil {
		c.Close()
		return fmt.Errorf("%s: %w", path, syscall.EADDRINUSE)
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("removing stale socket: %w", err)
		}
	}
	return nil
}

type listener struct {
	p    *Provider
	nl   net.Listener
	addr string
	reqs chan *connRequest

	closeOnce sync.Once
	closing   chan struct{}
	wg        sync.WaitGroup

	// failed is closed when the accept loop stopped on a permanent error,
	// acceptErr; Accept returns it from then on (until Close).
	failed    chan struct{}
	acceptErr error

	mu sync.Mutex
	// The limits on streams whose connect request is awaited (see
	// transport.HandshakeLimits).
	timeout    time.Duration
	maxPending int
	dropped    func(transport.DropReason, string)
	shaking    map[net.Conn]*shake       // streams whose connect request is awaited
	byPeer     map[string][]*shake       // the same, by peer address, oldest first
	pending    map[*connRequest]struct{} // requests returned by Accept, not yet answered
}

// shake is a stream whose connect request the listener awaits.
type shake struct {
	nc    net.Conn
	peer  string    // the peer's address without the port
	since time.Time // its accept
	gone  bool      // left shaking (l.mu)
}

var _ transport.HandshakeLimiter = (*listener)(nil)

// LimitHandshakes sets the timeout and the bound of streams whose connect
// request is awaited; they apply to those waiting now as well: the
// timeout from their accept, and the bound by closing the streams beyond
// it that it would have refused (the newest of the address that holds the
// most).
func (l *listener) LimitHandshakes(lim transport.HandshakeLimits) {
	l.mu.Lock()
	if lim.Timeout > 0 {
		l.timeout = lim.Timeout
		for _, sh := range l.shaking {
			sh.nc.SetReadDeadline(sh.since.Add(l.timeout))
		}
	}
	if lim.MaxPending > 0 {
		l.maxPending = lim.MaxPending
	}
	l.dropped = lim.Dropped
	var over []*shake
	for len(l.shaking) > l.maxPending {
		var most []*shake
		for _, q := range l.byPeer {
			if len(q) > len(most) {
				most = q
			}
		}
		sh := most[len(most)-1]
		l.removeLocked(sh)
		over = append(over, sh)
	}
	dropped := l.dropped
	l.mu.Unlock()
	for _, sh := range over {
		if dropped != nil {
			dropped(transport.DropLimit, sh.nc.RemoteAddr().String())
		}
		sh.nc.Close()
	}
}

func (l *listener) Addr() string { return l.addr }

// take records r as returned by Accept and not yet answered.
func (l *listener) take(r *connRequest) transport.ConnRequest {
	l.mu.Lock()
	l.pending[r] = struct{}{}
	l.mu.Unlock()
	return r
}

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	select {
	case <-l.closing:
		return nil, fmt.Errorf("accept %s: %w", l.addr, transport.ErrClosed)
	default:
	}
	select {
	case r := <-l.reqs:
		return l.take(r), nil
	case <-l.closing:
		return nil, fmt.Errorf("accept %s: %w", l.addr, transport.ErrClosed)
	case <-l.failed:
		select {
		case <-l.closing:
			return nil, fmt.Errorf("accept %s: %w", l.addr, transport.ErrClosed)
		default:
		}
		// Requests whose handshake finished before the failure still go out.
		select {
		case r := <-l.reqs:
			return l.take(r), nil
		default:
		}
		return nil, fmt.Errorf("accept %s: %w", l.addr, l.acceptErr)
	case <-ctx.Done():
		return nil, fmt.Errorf("accept %s: %w", l.addr, ctx.Err())
	}
}

func (l *listener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		close(l.closing)
		err = l.nl.Close()
		l.mu.Lock()
		for nc := range l.shaking {
			nc.Close()
		}
		var unanswered []*connRequest
		for r := range l.pending {
			unanswered = append(unanswered, r)
		}
		l.mu.Unlock()
		l.wg.Wait()
		// Requests Accept returned and nobody answered would hold their
		// stream forever: drop them.
		for _, r := range unanswered {
			if r.take() {
				r.nc.Close()
				r.closePrepared()
			}
		}
		if err != nil {
			err = fmt.Errorf("close listener %s: %w", l.addr, err)
		}
	})
	return err
}

// temporaryAcceptError reports whether an accept(2) error leaves the
// listening socket usable: out of descriptors or memory, or a connection
// that was reset before it was taken.
func temporaryAcceptError(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ECONNABORTED, syscall.ENOBUFS,
		syscall.ENOMEM, syscall.EPROTO, syscall.EPERM, syscall.EINTR, syscall.EAGAIN} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// acceptLoop accepts streams and starts their handshakes. It retries
// temporary errors with a backoff of up to a second, logging each; any other
// error ends it, and Accept returns that error from then on.
func (l *listener) acceptLoop() {
	defer l.wg.Done()
	backoff := time.Duration(0)
	for {
		nc, err := l.nl.Accept()
		if err != nil {
			select {
			case <-l.closing:
				return
			default:
			}
			if temporaryAcceptError(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				l.p.opts.Logger.Warn("tcp listener: temporary accept error; retrying",
					zap.String("addr", l.addr), zap.Duration("backoff", backoff), zap.Error(err))
				select {
				case <-time.After(backoff):
				case <-l.closing:
					return
				}
				continue
			}
			// The listening socket is unusable: tell Accept, which must not
			// block forever nor pass this for an orderly close.
			l.acceptErr = fmt.Errorf("accept loop stopped: %w", err)
			close(l.failed)
			return
		}
		backoff = 0
		now := time.Now()
		sh := &shake{nc: nc, peer: peerOf(nc.RemoteAddr()), since: now}
		l.mu.Lock()
		select {
		case <-l.closing:
			l.mu.Unlock()
			nc.Close()
			return
		default:
		}
		victim, admit := l.makeRoomLocked(sh.peer)
		dropped := l.dropped
		if admit {
			l.addLocked(sh)
			l.wg.Add(1)
		}
		l.mu.Unlock()
		if victim != nil {
			if dropped != nil {
				dropped(transport.DropEvicted, victim.nc.RemoteAddr().String())
			}
			victim.nc.Close()
		}
		if !admit {
			if dropped != nil {
				dropped(transport.DropLimit, nc.RemoteAddr().String())
			}
			nc.Close()
			continue
		}
		go l.handshake(sh)
	}
}

// peerOf is the host part of a stream's remote address: what the bound on
// waiting streams counts by.
func peerOf(a net.Addr) string {
	s := a.String()
	if h, _, err := net.SplitHostPort(s); err == nil {
		return h
	}
	return s
}

// makeRoomLocked decides whether a new stream from peer may wait for its
// connect request: yes while fewer than maxPending wait; beyond, only if
// another address holds more waiting streams than peer does, whose oldest
// is then the victim (taken out of shaking here; the caller closes it).
// l.mu is held.
func (l *listener) makeRoomLocked(peer string) (victim *shake, admit bool) {
	if len(l.shaking) < l.maxPending {
		return nil, true
	}
	var most []*shake
	for _, q := range l.byPeer {
		if len(q) > len(most) || (len(q) == len(most) && len(q) > 0 && q[0].since.Before(most[0].since)) {
			most = q
		}
	}
	if len(most) <= len(l.byPeer[peer]) {
		return nil, false
	}
	victim = most[0]
	l.removeLocked(victim)
	return victim, true
}

// addLocked records sh as waiting. l.mu is held.
func (l *listener) addLocked(sh *shake) {
	l.shaking[sh.nc] = sh
	l.byPeer[sh.peer] = append(l.byPeer[sh.peer], sh)
}

// removeLocked takes sh out of the waiting streams, once. l.mu is held.
func (l *listener) removeLocked(sh *shake) {
	if sh.gone {
		return
	}
	sh.gone = true
	delete(l.shaking, sh.nc)
	q := l.byPeer[sh.peer]
	for i, o := range q {
		if o == sh {
			q = append(q[:i], q[i+1:]...)
			break
		}
	}
	if len(q) == 0 {
		delete(l.byPeer, sh.peer)
	} else {
		l.byPeer[sh.peer] = q
	}
}

// handshake reads the connect request of a new stream and hands it to
// Accept, within the handshake timeout from the stream's accept. A stream
// that sends anything else is dropped.
func (l *listener) handshake(sh *shake) {
	defer l.wg.Done()
	nc := sh.nc
	keep := false
	forget := func() (evicted bool) {
		l.mu.Lock()
		defer l.mu.Unlock()
		evicted = sh.gone
		l.removeLocked(sh)
		return evicted
	}
	defer func() {
		if !keep {
			forget()
			nc.Close()
		}
	}()
	l.mu.Lock()
	deadline := sh.since.Add(l.timeout)
	err := nc.SetReadDeadline(deadline)
	l.mu.Unlock()
	if err != nil {
		return
	}
	// Read from the stream itself, exactly the frame: a stream that never
	// sends its connect request costs no read buffer.
	var h header
	pd, err := readControl(nc, &h)
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() && !forget() {
			l.mu.Lock()
			dropped := l.dropped
			l.mu.Unlock()
			if dropped != nil {
				dropped(transport.DropTimeout, nc.RemoteAddr().String())
			}
		}
		return
	}
	if h.typ() != frameConnect || h.status() != version || len(pd) > MaxConnectPrivateData || h.imm() == 0 {
		return
	}
	// Once handed to Accept the stream is the owner's: Close must not
	// close it any more, nor LimitHandshakes set its deadline. Until then
	// it waits at most until its deadline.
	l.mu.Lock()
	evicted := sh.gone
	l.removeLocked(sh)
	deadline = sh.since.Add(l.timeout)
	err = nc.SetReadDeadline(time.Time{})
	l.mu.Unlock()
	if evicted || err != nil {
		return // evicted meanwhile: closed already
	}
	br := bufio.NewReaderSize(nc, readBufferSize)
	r := &connRequest{l: l, nc: nc, br: br, pd: pd, peerReads: int(h.imm()), remote: nc.RemoteAddr().String(), acceptedAt: sh.since}
	wait := time.NewTimer(time.Until(deadline))
	defer wait.Stop()
	select {
	case l.reqs <- r:
		keep = true
	case <-wait.C:
		l.mu.Lock()
		dropped := l.dropped
		l.mu.Unlock()
		if dropped != nil {
			dropped(transport.DropTimeout, r.remote)
		}
	case <-l.closing:
	}
}

type connRequest struct {
	l          *listener
	nc         net.Conn
	br         *bufio.Reader
	pd         []byte
	peerReads  int
	remote     string
	acceptedAt time.Time // the stream's accept

	mu       sync.Mutex
	done     bool
	prepared *conn // of Prepare, not started until accepted
}

var _ transport.AcceptTimer = (*connRequest)(nil)

func (r *connRequest) PrivateData() []byte { return r.pd }

// AcceptedAt is when the listener accepted the request's stream, before it
// read the connect request.
func (r *connRequest) AcceptedAt() time.Time { return r.acceptedAt }

// Prepare makes the connection of the request without starting it: it
// takes registrations and receives, which the reader finds once Accept
// starts it, before it reads anything the peer sent.
func (r *connRequest) Prepare() (transport.Conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.prepared != nil {
		return r.prepared, nil
	}
	if r.done {
		return nil, fmt.Errorf("prepare %s: connection request already answered", r.remote)
	}
	r.prepared = makeConn(r.l.p.opts, r.nc, r.br, r.pd, r.peerReads)
	return r.prepared, nil
}

// closePrepared closes the conn of Prepare, if any, after the request
// failed or was rejected.
func (r *connRequest) closePrepared() {
	r.mu.Lock()
	c := r.prepared
	r.mu.Unlock()
	if c != nil {
		c.Close()
	}
}
func (r *connRequest) RemoteAddr() string { return r.remote }

// take claims the request for an answer; only the first caller gets it.
func (r *connRequest) take() bool {
	r.mu.Lock()
	first := !r.done
	r.done = true
	r.mu.Unlock()
	if first {
		r.l.mu.Lock()
		delete(r.l.pending, r)
		r.l.mu.Unlock()
	}
	return first
}

func (r *connRequest) Accept(ctx context.Context, privateData []byte) (transport.Conn, error) {
	c, err := r.accept(ctx, privateData)
	if err != nil {
		return nil, fmt.Errorf("accept %s: %w", r.remote, err)
	}
	return c, nil
}

func (r *connRequest) accept(ctx context.Context, privateData []byte) (*conn, error) {
	if len(privateData) > MaxAcceptPrivateData {
		return nil, fmt.Errorf("private data of %d bytes exceeds %d", len(privateData), MaxAcceptPrivateData)
	}
	if !r.take() {
		return nil, errors.New("connection request already answered")
	}
	r.mu.Lock()
	c := r.prepared
	r.mu.Unlock()
	fail := func(err error) (*conn, error) {
		r.nc.Close()
		r.closePrepared()
		return nil, err
	}
	if c != nil {
		c.mu.Lock()
		closed := c.state != stateOpen
		c.mu.Unlock()
		if closed {
			// Its owner closed the prepared conn: that is a reject.
			r.nc.SetWriteDeadline(time.Now().Add(r.l.p.opts.HandshakeTimeout))
			writeControl(r.nc, frameReject, version, 0, nil)
			return fail(fmt.Errorf("the prepared connection was closed: %w", transport.ErrClosed))
		}
	}
	opts := r.l.p.opts
	stop := watchContext(ctx, r.nc)
	err := writeControl(r.nc, frameAccept, version, uint32(opts.MaxReadsInFlight), privateData)
	if !stop() || ctx.Err() != nil {
		return fail(ctx.Err())
	}
	if err == nil {
		err = r.nc.SetDeadline(time.Time{})
	}
	if err != nil {
		return fail(err)
	}
	if c == nil {
		return newConn(opts, r.nc, r.br, r.pd, r.peerReads), nil
	}
	if !c.start() {
		return fail(fmt.Errorf("the prepared connection was closed: %w", transport.ErrClosed))
	}
	return c, nil
}

func (r *connRequest) Reject(privateData []byte) error {
	if len(privateData) > MaxRejectPrivateData {
		return fmt.Errorf("reject %s: private data of %d bytes exceeds %d", r.remote, len(privateData), MaxRejectPrivateData)
	}
	if !r.take() {
		return fmt.Errorf("reject %s: connection request already answered", r.remote)
	}
	// The peer sent nothing past its connect request, so closing right after
	// the write ends the stream with a FIN behind the reject, not a reset.
	r.nc.SetWriteDeadline(time.Now().Add(r.l.p.opts.HandshakeTimeout))
	err := writeControl(r.nc, frameReject, version, 0, privateData)
	r.nc.Close()
	r.closePrepared()
	if err != nil {
		return fmt.Errorf("reject %s: %w", r.remote, err)
	}
	return nil
}
