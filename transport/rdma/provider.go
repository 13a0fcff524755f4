//go:build linux

package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// listenBacklog is the backlog of rdma_listen.
const listenBacklog = 128

// rnrRetryInfinite makes a SEND that finds no RECV posted retry forever.
const rnrRetryInfinite = 7

// minRNRTimer is the RNR NAK timer asked of the peer (0.64 ms); the RDMA CM
// leaves 0, which means 655 ms.
const minRNRTimer = 12

// rejectConsumerDefined is the IB CM reject reason of rdma_reject.
const rejectConsumerDefined = 28

type provider struct {
	// stack is the RDMA CM and the verbs: librdmacm and libibverbs, or a
	// test's device.
	stack verbs.Stack
	opts  Options
	log   *zap.Logger
	// chunk is the longest chain posted with one call: postChunk (tests
	// take less).
	chunk int
	// hooks, set by tests only, run at chosen points of the conns'
	// code; nil in a program.
	hooks *testHooks
	// flushTimeout is flushTimeout (tests take less).
	flushTimeout time.Duration
	// fp are the failpoints injecting faults (nil: none).
	fp *failpoints

	// vectors holds, per device name, the completion vector the next
	// connection's CQ takes (round robin over num_comp_vectors).
	vecMu   sync.Mutex
	vectors map[string]int
}

// nextCompVector returns the completion vector for the CQ of a new
// connection on device dev, which has n: each connection has its own CQ,
// and their interrupts are spread over the device's vectors round robin
// rather than all on vector 0.
func (p *provider) nextCompVector(dev string, n int) int {
	if n <= 1 {
		return 0
	}
	p.vecMu.Lock()
	defer p.vecMu.Unlock()
	if p.vectors == nil {
		p.vectors = make(map[string]int)
	}
	v := p.vectors[dev] % n
	p.vectors[dev] = v + 1
	return v
}

// newProviderOn returns the provider over stack.
func newProviderOn(stack verbs.Stack, devs []string, opts Options) (*provider, error) {
	// Opening an event channel opens /dev/infiniband/rdma_cm: fail now, with
	// the reason, rather than at the first Listen or Dial.
	ch, err := stack.NewEventChannel()
	if err != nil {
		return nil, fmt.Errorf("RDMA devices %v found, but the RDMA CM is unusable (modprobe rdma_ucm; check /dev/infiniband/rdma_cm): %w", devs, err)
	}
	ch.Destroy()
	return &provider{stack: stack, opts: opts, log: opts.Logger, chunk: postChunk, flushTimeout: flushTimeout}, nil
}

func (p *provider) Name() string { return "rdma" }

// FailpointCounts reports how many faults each failpoint of FailpointsEnv
// injected (a program built with the tag failpoints), by name; nil without
// failpoints. Type-assert the provider to
// interface{ FailpointCounts() map[string]uint64 }.
func (p *provider) FailpointCounts() map[string]uint64 {
	if p.fp == nil {
		return nil
	}
	return p.fp.counts()
}

// resolve parses host:port; an empty host is the IPv4 wildcard when
// listening.
func resolve(ctx context.Context, addr string, listen bool) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return netip.AddrPort{}, err
	}
	pn, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		n, lerr := net.DefaultResolver.LookupPort(ctx, "tcp", port)
		if lerr != nil {
			return netip.AddrPort{}, fmt.Errorf("port %q: %w", port, lerr)
		}
		pn = uint64(n)
	}
	if host == "" {
		if !listen {
			return netip.AddrPort{}, fmt.Errorf("address %q has no host", addr)
		}
		return netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(pn)), nil
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		return netip.AddrPortFrom(ip.Unmap().WithZone(""), uint16(pn)), nil
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host)
	if err != nil {
		return netip.AddrPort{}, err
	}
	best := ips[0]
	for _, ip := range ips {
		if ip.Unmap().Is4() {
			best = ip
			break
		}
	}
	return netip.AddrPortFrom(best.Unmap(), uint16(pn)), nil
}

// encodePrivateData frames private data for a CM message whose private data
// field has capacity bytes. The receiver of an IB/RoCE CM message gets the
// whole field, zero-padded, so the length travels too: a length byte before
// the data, or, for data that fills the field, the flow-control bit of the
// connect/accept parameters (which the RDMA CM carries through and nothing
// else uses) and no length byte.
func encodePrivateData(pd []byte, capacity int) (enc []byte, flow uint8) {
	if len(pd) == capacity {
		return pd, 1
	}
	enc = make([]byte, 1+len(pd))
	enc[0] = byte(len(pd))
	copy(enc[1:], pd)
	return enc, 0
}

func decodePrivateData(b []byte, flow uint8, capacity int) ([]byte, error) {
	if flow&1 != 0 {
		return bytes.Clone(b[:min(len(b), capacity)]), nil
	}
	if len(b) == 0 {
		return nil, nil
	}
	n := int(b[0])
	if n > len(b)-1 {
		return nil, fmt.Errorf("malformed private data: length %d in %d bytes", n, len(b))
	}
	return bytes.Clone(b[1 : 1+n]), nil
}

// idInfo describes the device, port and GID an id uses, and its address.
func idInfo(id verbs.CMID) string {
	gid := id.SGID()
	return fmt.Sprintf("%s port %d gid %s %s", id.DeviceName(), id.Port(), netip.AddrFrom16(gid), id.LocalAddr())
}

// Listen binds an RDMA CM id to addr and listens.
func (p *provider) Listen(ctx context.Context, addr string) (transport.Listener, error) {
	l, err := p.listen(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("rdma listen %s: %w", addr, err)
	}
	return l, nil
}

func (p *provider) listen(ctx context.Context, addr string) (*listener, error) {
	ap, err := resolve(ctx, addr, true)
	if err != nil {
		return nil, err
	}
	ch, err := p.stack.NewEventChannel()
	if err != nil {
		return nil, err
	}
	w, err := newWaiter(ch.Fd(), "rdma-cm-listener")
	if err != nil {
		ch.Destroy()
		return nil, err
	}
	id, err := p.stack.NewID(ch)
	if err == nil {
		if err = id.Bind(ap); err != nil {
			if errors.Is(err, syscall.EADDRNOTAVAIL) || errors.Is(err, syscall.ENODEV) {
				err = fmt.Errorf("%w (no RDMA device has the address %s: use the address of an RDMA device's network interface)", err, ap.Addr())
			}
		} else {
			err = id.Listen(listenBacklog)
		}
		if err != nil {
			id.Destroy()
		}
	}
	if err != nil {
		w.close()
		ch.Destroy()
		return nil, err
	}
	l := &listener{p: p, ch: ch, w: w, id: id, sem: make(chan struct{}, 1), done: make(chan struct{})}
	l.addr = id.LocalAddr().String()
	if id.DeviceName() != "" {
		l.info = idInfo(id)
	} else {
		l.info = "any device " + l.addr
	}
	p.log.Debug("rdma listening", zap.String("addr", l.addr), zap.String("device", l.info))
	return l, nil
}

type listener struct {
	p      *provider
	ch     verbs.EventChannel
	w      *waiter
	id     verbs.CMID
	addr   string
	info   string
	sem    chan struct{} // held by Accept, and by Close for good
	done   chan struct{} // closed when Close is done
	closed atomic.Bool
	once   sync.Once
	// failed is why the listener cannot accept any more (its device was
	// removed): every Accept returns it, until Close (sem).
	failed error
}

var _ transport.Listener = (*listener)(nil)

func (l *listener) Addr() string { return l.addr }

// DeviceInfo names the device, port and GID the listener is bound to, and
// its address: "rxe0 port 1 gid ::ffff:192.0.2.1 192.0.2.1:7480".
func (l *listener) DeviceInfo() string { return l.info }

func (l *listener) Accept(ctx context.Context) (transport.ConnRequest, error) {
	if l.closed.Load() {
		return nil, transport.ErrClosed
	}
	select {
	case l.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-l.done:
		return nil, transport.ErrClosed
	}
	defer func() { <-l.sem }()
	for {
		if l.closed.Load() {
			return nil, transport.ErrClosed
		}
		if l.failed != nil {
			return nil, l.failed
		}
		ev, err := waitEvent(ctx, l.ch, l.w)
		if err != nil {
			if errors.Is(err, errWaiterClosed) || l.closed.Load() {
				return nil, transport.ErrClosed
			}
			if ctx.Err() != nil {
				return nil, err
			}
			return nil, fmt.Errorf("rdma accept on %s: %w", l.addr, err)
		}
		if ev.Type != verbs.EventConnectRequest {
			l.p.log.Debug("rdma listener event", zap.String("addr", l.addr), zap.Stringer("event", ev.Type), zap.Int("status", ev.Status))
			if err := l.eventErr(ev); err != nil {
				l.p.log.Error("rdma listener: cannot accept any more", zap.String("addr", l.addr), zap.Error(err))
				l.failed = err
				return nil, err
			}
			continue
		}
		req, err := l.request(ev)
		if err != nil {
			l.p.log.Warn("rdma connect request dropped", zap.String("addr", l.addr), zap.Error(err))
			continue
		}
		return req, nil
	}
}

// eventErr is the error that an event other than a connect request makes
// of the listener, or nil if it goes on listening. Device removal is not
// an orderly close (ErrClosed): a server must fail on it, and exit non-zero
// so that its supervisor restarts it once a device is back.
func (l *listener) eventErr(ev verbs.Event) error {
	if ev.Type == verbs.EventDeviceRemoval {
		return fmt.Errorf("rdma accept on %s (%s): %v: %w", l.addr, l.info, ev.Type, transport.ErrDeviceRemoved)
	}
	return nil
}

// request moves the id of a connect request to an event channel of its
// own, so that the connection outlives the listener.
func (l *listener) request(ev verbs.Event) (*connReq, error) {
	id := ev.ID
	fail := func(err error) (*connReq, error) {
		id.Reject(nil)
		id.Destroy()
		return nil, err
	}
	pd, err := decodePrivateData(ev.Conn.PrivateData, ev.Conn.FlowControl, MaxConnectPrivateData)
	if err != nil {
		return fail(err)
	}
	ch, err := l.p.stack.NewEventChannel()
	if err != nil {
		return fail(err)
	}
	if err := id.Migrate(ch); err != nil {
		ch.Destroy()
		return fail(err)
	}
	w, err := newWaiter(ch.Fd(), "rdma-cm-conn")
	if err != nil {
		id.Reject(nil)
		id.Destroy()
		ch.Destroy()
		return nil, err
	}
	return &connReq{
		p:      l.p,
		id:     id,
		ch:     ch,
		w:      w,
		pd:     pd,
		param:  ev.Conn,
		remote: id.PeerAddr().String(),
	}, nil
}

func (l *listener) Close() error {
	l.once.Do(func() {
		l.closed.Store(true)
		l.w.close() // a blocked Accept returns
		l.sem <- struct{}{}
		// Connect requests not yet taken are destroyed (and rejected) with
		// the listening id.
		if err := l.id.Destroy(); err != nil {
			l.p.log.Warn("rdma listener close", zap.String("addr", l.addr), zap.Error(err))
		}
		l.ch.Destroy()
		close(l.done)
	})
	return nil
}

// connReq is a connect request with its own event channel.
type connReq struct {
	p      *provider
	id     verbs.CMID
	ch     verbs.EventChannel
	w      *waiter
	pd     []byte
	param  verbs.ConnParam
	remote string

	mu       sync.Mutex
	state    string // "" while pending, then what became of it
	prepared *conn  // of Prepare: owns id, ch and w from then on
}

var _ transport.ConnRequest = (*connReq)(nil)

func (r *connReq) PrivateData() []byte { return bytes.Clone(r.pd) }
func (r *connReq) RemoteAddr() string  { return r.remote }

// release destroys what the request owns, when no conn took it over.
func (r *connReq) release() {
	r.w.close()
	r.id.Destroy()
	r.ch.Destroy()
}

// Prepare creates the QP of the request on its cm_id (rdma_create_qp puts
// it in the INIT state, where receives may be posted) without accepting:
// the standard way to have receives posted before rdma_accept.
func (r *connReq) Prepare() (transport.Conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.prepared != nil {
		return r.prepared, nil
	}
	if r.state != "" {
		return nil, fmt.Errorf("prepare %s: request already %s", r.remote, r.state)
	}
	c, err := newConn(r.p, r.id, r.ch, r.w)
	if err != nil {
		r.state = "failed"
		r.id.Reject(nil)
		r.release()
		return nil, fmt.Errorf("prepare %s: %w", r.remote, err)
	}
	c.peerPD = r.pd
	c.remote = r.remote
	r.prepared = c
	return c, nil
}

// closeRequest ends a request that was not accepted: the prepared conn,
// which owns the id, is closed (its receives flush), or what the request
// owns is released.
func (r *connReq) closeRequest() {
	if r.prepared != nil {
		r.prepared.Close()
		return
	}
	r.release()
}

func (r *connReq) Reject(privateData []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state != "" {
		return fmt.Errorf("reject %s: request already %s", r.remote, r.state)
	}
	if len(privateData) > MaxRejectPrivateData {
		return fmt.Errorf("reject %s: private data of %d bytes exceeds %d", r.remote, len(privateData), MaxRejectPrivateData)
	}
	r.state = "rejected"
	enc, _ := encodePrivateData(privateData, MaxRejectPrivateData+1)
	var err error
	if c := r.prepared; c != nil {
		// The prepared conn owns the id: its teardown, if its owner
		// closed it, destroyed the id (and so refused the peer); cmMu
		// keeps the teardown off the id meanwhile.
		c.cmMu.Lock()
		if c.state() < stateClosed {
			err = r.id.Reject(enc)
		}
		c.cmMu.Unlock()
	} else {
		err = r.id.Reject(enc)
	}
	r.closeRequest()
	if err != nil {
		return fmt.Errorf("reject %s: %w", r.remote, err)
	}
	return nil
}

func (r *connReq) Accept(ctx context.Context, privateData []byte) (transport.Conn, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state != "" {
		return nil, fmt.Errorf("accept %s: request already %s", r.remote, r.state)
	}
	if len(privateData) > MaxAcceptPrivateData {
		return nil, fmt.Errorf("accept %s: private data of %d bytes exceeds %d", r.remote, len(privateData), MaxAcceptPrivateData)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r.state = "accepted"
	c, err := r.accept(ctx, privateData)
	if err != nil {
		r.state = "failed"
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil, err
		}
		return nil, fmt.Errorf("accept %s: %w", r.remote, err)
	}
	return c, nil
}

// accept accepts the request with a conn (the prepared one, or a new one)
// and waits for the peer's ESTABLISHED. On failure the conn is closed,
// which destroys the id (and so refuses the peer).
func (r *connReq) accept(ctx context.Context, privateData []byte) (*conn, error) {
	c := r.prepared
	if c == nil {
		var err error
		if c, err = newConn(r.p, r.id, r.ch, r.w); err != nil {
			r.id.Reject(nil)
			r.release()
			return nil, err
		}
	}
	// Hold the CM channel (and the id) until start hands it to the CM
	// goroutine: the owner of a prepared conn may close it meanwhile, and
	// its teardown waits for cmMu before it destroys them.
	c.cmMu.Lock()
	fail := func(err error) (*conn, error) {
		c.cmMu.Unlock()
		c.Close()
		return nil, err
	}
	if st := c.state(); st != stateConnecting {
		return fail(fmt.Errorf("the prepared connection is %v: %w", st, transport.ErrClosed))
	}
	// What the peer's request says it issues and serves, seen from here.
	resp := min(c.respRes, max(r.param.ResponderResources, 1))
	init := min(c.initDepth, max(r.param.InitiatorDepth, 1))
	c.limits.MaxReadsInFlight = int(init)
	c.peerPD = r.pd
	enc, flow := encodePrivateData(privateData, MaxAcceptPrivateData)
	err := r.id.Accept(verbs.ConnParam{
		PrivateData:        enc,
		ResponderResources: resp,
		InitiatorDepth:     init,
		FlowControl:        flow,
		RetryCount:         7,
		RNRRetryCount:      rnrRetryInfinite,
	})
	if err != nil {
		return fail(err)
	}
	// The QP is ready to receive: ask the peer to retry a SEND that comes
	// before its RECV soon rather than after 655 ms.
	if err := c.qp.SetMinRNRTimer(minRNRTimer); err != nil {
		c.log.Debug("rdma: min RNR timer not set", zap.Error(err))
	}
	for {
		ev, err := waitEvent(ctx, r.ch, r.w)
		if err != nil {
			if errors.Is(err, errWaiterClosed) {
				err = fmt.Errorf("the prepared connection was closed: %w", transport.ErrClosed)
			}
			return fail(err)
		}
		switch ev.Type {
		case verbs.EventEstablished:
			c.setNames()
			if err := c.start(); err != nil {
				return fail(err)
			}
			return c, nil
		case verbs.EventRejected, verbs.EventConnectError, verbs.EventUnreachable, verbs.EventDisconnected, verbs.EventDeviceRemoval:
			err := fmt.Errorf("waiting for the peer to confirm: %v (status %d)", ev.Type, ev.Status)
			if ev.Type == verbs.EventDeviceRemoval {
				err = fmt.Errorf("%w: %w", err, transport.ErrDeviceRemoved)
			}
			return fail(err)
		}
	}
}

// Dial connects to addr through the RDMA CM.
func (p *provider) Dial(ctx context.Context, addr string, privateData []byte) (transport.Conn, error) {
	c, err := p.dial(ctx, addr, privateData)
	if err != nil {
		return nil, fmt.Errorf("rdma dial %s: %w", addr, err)
	}
	return c, nil
}

// cmWait waits for an event of a dialing id, any but the ones to ignore.
func cmWait(ctx context.Context, ch verbs.EventChannel, w *waiter) (verbs.Event, error) {
	for {
		ev, err := waitEvent(ctx, ch, w)
		if err != nil || (ev.Type != verbs.EventAddrChange && ev.Type != verbs.EventTimewaitExit) {
			return ev, err
		}
	}
}

func statusErr(status int) error {
	if status < 0 {
		return syscall.Errno(-status)
	}
	return fmt.Errorf("status %d", status)
}

func (p *provider) dial(ctx context.Context, addr string, privateData []byte) (*conn, error) {
	if len(privateData) > MaxConnectPrivateData {
		return nil, fmt.Errorf("private data of %d bytes exceeds %d", len(privateData), MaxConnectPrivateData)
	}
	ap, err := resolve(ctx, addr, false)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ch, err := p.stack.NewEventChannel()
	if err != nil {
		return nil, err
	}
	w, err := newWaiter(ch.Fd(), "rdma-cm-conn")
	if err != nil {
		ch.Destroy()
		return nil, err
	}
	id, err := p.stack.NewID(ch)
	if err != nil {
		w.close()
		ch.Destroy()
		return nil, err
	}
	var c *conn
	ok := false
	defer func() {
		if ok {
			return
		}
		if c != nil {
			c.Close() // destroys id, ch and w too
			return
		}
		w.close()
		id.Destroy()
		ch.Destroy()
	}()

	timeout := p.opts.ResolveTimeout
	if d, ok := ctx.Deadline(); ok {
		timeout = min(timeout, max(time.Until(d), time.Millisecond))
	}
	if err := id.ResolveAddr(ap, timeout); err != nil {
		return nil, err
	}
	ev, err := cmWait(ctx, ch, w)
	if err != nil {
		return nil, err
	}
	if ev.Type != verbs.EventAddrResolved {
		return nil, fmt.Errorf("rdma_resolve_addr %s: %v: %w (is %s the address of an RDMA device's network interface, and reachable?)", ap, ev.Type, statusErr(ev.Status), ap.Addr())
	}
	if err := id.ResolveRoute(timeout); err != nil {
		return nil, err
	}
	if ev, err = cmWait(ctx, ch, w); err != nil {
		return nil, err
	}
	if ev.Type != verbs.EventRouteResolved {
		return nil, fmt.Errorf("rdma_resolve_route %s: %v: %w", ap, ev.Type, statusErr(ev.Status))
	}
	if c, err = newConn(p, id, ch, w); err != nil {
		return nil, err
	}
	enc, flow := encodePrivateData(privateData, MaxConnectPrivateData)
	err = id.Connect(verbs.ConnParam{
		PrivateData:        enc,
		ResponderResources: c.respRes,
		InitiatorDepth:     c.initDepth,
		FlowControl:        flow,
		RetryCount:         7,
		RNRRetryCount:      rnrRetryInfinite,
	})
	if err != nil {
		return nil, fmt.Errorf("%w (to %s)", err, ap)
	}
	if ev, err = cmWait(ctx, ch, w); err != nil {
		return nil, err
	}
	switch ev.Type {
	case verbs.EventEstablished:
	case verbs.EventRejected:
		if ev.Status == rejectConsumerDefined {
			pd, err := decodePrivateData(ev.Conn.PrivateData, 0, MaxRejectPrivateData+1)
			if err != nil {
				pd = nil
			}
			return nil, &transport.RejectError{PrivateData: pd}
		}
		return nil, fmt.Errorf("rdma_connect %s: rejected by the peer's connection manager (%s): %w", ap, rejectReason(ev.Status), syscall.ECONNREFUSED)
	default:
		return nil, fmt.Errorf("rdma_connect %s: %v: %w", ap, ev.Type, statusErr(ev.Status))
	}
	pd, err := decodePrivateData(ev.Conn.PrivateData, ev.Conn.FlowControl, MaxAcceptPrivateData)
	if err != nil {
		return nil, err
	}
	c.peerPD = pd
	c.limits.MaxReadsInFlight = int(c.initDepth)
	if d := ev.Conn.InitiatorDepth; d > 0 && d < c.initDepth {
		c.limits.MaxReadsInFlight = int(d)
	}
	if err := c.qp.SetMinRNRTimer(minRNRTimer); err != nil {
		c.log.Debug("rdma: min RNR timer not set", zap.Error(err))
	}
	c.setNames()
	// Nobody else has c yet: start cannot fail, and hands cmMu over.
	c.cmMu.Lock()
	if err := c.start(); err != nil {
		c.cmMu.Unlock()
		return nil, err
	}
	ok = true
	return c, nil
}

// rejectReason names the IB CM reject reasons seen when nobody accepts.
func rejectReason(status int) string {
	switch status {
	case 1:
		return "no QP available"
	case 2:
		return "no EE context available"
	case 3:
		return "no resources"
	case 4:
		return "timeout"
	case 8:
		return "invalid service ID: nothing listens on that port"
	case 28:
		return "rejected by the application"
	}
	return fmt.Sprintf("reason %d", status)
}
