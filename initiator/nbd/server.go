package nbd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/internal/rawsock"
)

// Buffer and Backend are the block-device contract (package blockdev), named
// here for the NBD server's users.
type (
	Buffer  = blockdev.Buffer
	Backend = blockdev.Backend
)

// Export is one volume offered by the server.
type Export struct {
	Name, Description string
	Size              uint64
	// CurrentSize, if set, is the export's size now, which may grow (a
	// volume grown online): handshakes advertise it instead of Size, and
	// requests are checked against it. Clients learn a new size at their
	// next handshake; the kernel's device when told (kernel.Device.Resize).
	CurrentSize func() uint64

	ReadOnly, CanTrim, CanZero, CanFlush, CanFUA, MultiConn bool

	// MinBlock, PrefBlock and MaxBlock are advertised with
	// NBD_INFO_BLOCK_SIZE; MaxBlock is also enforced (EINVAL over it, the
	// payload of such a WRITE is consumed). Defaults 1, 4096 and 32 MiB if
	// zero; MaxBlock may not exceed 32 MiB.
	MinBlock, PrefBlock, MaxBlock uint32

	Backend Backend
}

// Options configure a Server.
type Options struct {
	// Exports are looked up by name; the first one is also the default
	// export (name "").
	Exports []*Export
	// MaxInFlight bounds the requests handled concurrently per connection
	// (default 128).
	MaxInFlight int
	// Logger gets one line per connection event (connect, export chosen,
	// disconnect with reason), never one per IO. nil → zap.NewNop().
	Logger *zap.Logger
	// Metrics may be nil.
	Metrics *Metrics
}

// ErrServerClosed is returned by Serve, ServeConn and ServeTransmission when
// they are called after Close.
var ErrServerClosed = errors.New("nbd: server closed")

// Server is an NBD server (fixed newstyle handshake, simple replies).
type Server struct {
	exports     []*export
	byName      map[string]*export
	maxInFlight int
	log         *zap.Logger
	metrics     *Metrics

	reqMu   sync.Mutex
	freeReq []*request // for reuse, so that no IO allocates
	nextID  atomic.Uint64

	mu        sync.Mutex
	closed    bool
	done      chan struct{} // closed by Close
	conns     map[*conn]struct{}
	listeners map[net.Listener]struct{}
	wg        sync.WaitGroup // Serve loops and connections
}

// export is an Export with its defaults applied and its flags computed; the
// caller's Export is never modified.
type export struct {
	*Export
	min, pref, max uint32
	flags          uint16
}

// size is the export's size now.
func (x *export) size() uint64 {
	if x.CurrentSize != nil {
		return x.CurrentSize()
	}
	return x.Size
}

const (
	defaultMinBlock    = 1
	defaultPrefBlock   = 4096
	defaultMaxBlock    = hardMaxBlock
	defaultMaxInFlight = 128
)

func newExport(e *Export) (*export, error) {
	if e == nil {
		return nil, errors.New("nbd: nil export")
	}
	if e.Backend == nil {
		return nil, fmt.Errorf("nbd: export %q has no backend", e.Name)
	}
	if len(e.Name) > optionNameMaxLength || len(e.Description) > optionNameMaxLength {
		return nil, fmt.Errorf("nbd: export %q: name or description longer than %d bytes", e.Name, optionNameMaxLength)
	}
	x := &export{Export: e, min: e.MinBlock, pref: e.PrefBlock, max: e.MaxBlock}
	if x.min == 0 {
		x.min = defaultMinBlock
	}
	if x.pref == 0 {
		x.pref = max(defaultPrefBlock, x.min)
	}
	if x.max == 0 {
		x.max = defaultMaxBlock
	}
	pow2 := func(v uint32) bool { return v&(v-1) == 0 }
	switch {
	case !pow2(x.min) || x.min > 64<<10:
		return nil, fmt.Errorf("nbd: export %q: MinBlock %d is not a power of two ≤ 64 KiB", e.Name, x.min)
	case !pow2(x.pref) || x.pref < x.min:
		return nil, fmt.Errorf("nbd: export %q: PrefBlock %d is not a power of two ≥ MinBlock", e.Name, x.pref)
	case x.max > hardMaxBlock:
		return nil, fmt.Errorf("nbd: export %q: MaxBlock %d over the 32 MiB limit", e.Name, x.max)
	case x.max < x.pref || x.max%x.min != 0:
		return nil, fmt.Errorf("nbd: export %q: MaxBlock %d is not a multiple of MinBlock ≥ PrefBlock", e.Name, x.max)
	}
	x.flags = tflagHasFlags
	if e.ReadOnly {
		x.flags |= tflagReadOnly
	}
	if e.CanFlush {
		x.flags |= tflagSendFlush
	}
	if e.CanFUA {
		x.flags |= tflagSendFUA
	}
	if e.CanTrim && !e.ReadOnly {
		x.flags |= tflagSendTrim
	}
	if e.CanZero && !e.ReadOnly {
		x.flags |= tflagSendWriteZeroes
	}
	if e.MultiConn {
		x.flags |= tflagCanMultiConn
	}
	return x, nil
}

// NewServer checks the exports and returns a server for them.
func NewServer(opts Options) (*Server, error) {
	s := &Server{
		byName:      make(map[string]*export),
		maxInFlight: opts.MaxInFlight,
		log:         opts.Logger,
		metrics:     opts.Metrics,
		done:        make(chan struct{}),
		conns:       make(map[*conn]struct{}),
		listeners:   make(map[net.Listener]struct{}),
	}
	if s.maxInFlight <= 0 {
		s.maxInFlight = defaultMaxInFlight
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	for _, e := range opts.Exports {
		x, err := newExport(e)
		if err != nil {
			return nil, err
		}
		if _, dup := s.byName[e.Name]; dup {
			return nil, fmt.Errorf("nbd: export %q listed twice", e.Name)
		}
		s.byName[e.Name] = x
		s.exports = append(s.exports, x)
	}
	return s, nil
}

// lookup finds an export by name; "" is the first export unless one is
// really named "".
func (s *Server) lookup(name string) *export {
	if x, ok := s.byName[name]; ok {
		return x
	}
	if name == "" && len(s.exports) > 0 {
		return s.exports[0]
	}
	return nil
}

// Serve accepts connections on l until ctx ends, Close is called or l is
// closed, handling each in its own goroutine (handshake, then transmission).
// When ctx ends or Close is called it closes l. It returns after every
// connection goroutine it started has exited: nil when stopped by ctx, Close
// or the closing of l, otherwise the error of Accept.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()

	var stopped atomic.Bool
	stop := context.AfterFunc(ctx, func() {
		stopped.Store(true)
		l.Close()
	})
	defer stop()

	var conns sync.WaitGroup
	defer conns.Wait()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()

	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if stopped.Load() || s.isClosed() || errors.Is(err, net.ErrClosed) {
				return nil
			}
			if isTemporaryAccept(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("nbd: accept failed, retrying", zap.Error(err), zap.Duration("backoff", backoff))
				select {
				case <-time.After(backoff):
					continue
				case <-ctx.Done():
					return nil
				case <-s.done:
					return nil
				}
			}
			return err
		}
		backoff = 0
		conns.Add(1)
		go func() {
			defer conns.Done()
			_ = s.ServeConn(ctx, nc) // logged there
		}()
	}
}

func isTemporaryAccept(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.EINTR)
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// ServeConn runs the handshake and transmission phase on one connection and
// returns when it ends; c is closed then. It returns nil when the client
// disconnected (with NBD_CMD_DISC or by closing the socket, or by
// NBD_OPT_ABORT) or the server was closed, ctx.Err() when ctx ended, and an
// error saying why otherwise (protocol violation, socket error). Requests
// still in flight when the connection ends are completed before it returns.
// The backend's methods are called with ctx.
func (s *Server) ServeConn(ctx context.Context, c net.Conn) error {
	cn, err := s.newConn(ctx, c)
	if err != nil {
		return err
	}
	defer s.dropConn(cn)
	x, err := cn.handshake()
	if err != nil {
		return cn.finish(err)
	}
	return cn.finish(cn.transmit(x))
}

// ServeTransmission runs only the transmission phase for export e on c (for
// the kernel /dev/nbdX path, where the handshake is skipped and the kernel
// gets one end of a socketpair). e need not be one of Options.Exports. It
// returns like ServeConn.
func (s *Server) ServeTransmission(ctx context.Context, c net.Conn, e *Export) error {
	x, err := newExport(e)
	if err != nil {
		c.Close()
		return err
	}
	cn, err := s.newConn(ctx, c)
	if err != nil {
		return err
	}
	defer s.dropConn(cn)
	cn.export = x
	cn.log.Info("nbd: export chosen", zap.String("export", e.Name), zap.String("by", "transmission only"),
		zap.Uint64("size", x.size()), zap.Uint16("flags", x.flags))
	return cn.finish(cn.transmit(x))
}

func (s *Server) newConn(ctx context.Context, nc net.Conn) (*conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		nc.Close()
		return nil, ErrServerClosed
	}
	c := &conn{
		s:   s,
		nc:  nc,
		br:  bufio.NewReaderSize(rawsock.NewReader(nc), readBufferSize),
		ctx: ctx,
	}
	id := s.nextID.Add(1)
	c.index = int(id - 1)
	c.log = s.log.With(zap.Uint64("conn", id), zap.Stringer("remote", addrOf(nc)))
	c.initWriter()
	s.conns[c] = struct{}{}
	s.wg.Add(1)
	c.stopCtx = context.AfterFunc(ctx, func() { c.shutdown(ctx.Err()) })
	if m := s.metrics; m != nil {
		m.connections.Inc()
	}
	c.log.Info("nbd: connected")
	return c, nil
}

func (s *Server) dropConn(c *conn) {
	c.stopCtx()
	if m := s.metrics; m != nil {
		m.connections.Dec()
	}
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	s.wg.Done()
}

// addrOf names the peer for logs; a socketpair end or a pipe has none.
func addrOf(nc net.Conn) fmt.Stringer {
	if a := nc.RemoteAddr(); a != nil && a.String() != "" && a.String() != "@" {
		return a
	}
	return stringer("local")
}

type stringer string

func (s stringer) String() string { return string(s) }

// Close stops every Serve (closing its listener) and every connection: each
// stops reading requests, completes the requests in flight and sends their
// replies (the backend calls end when they end, or when the ctx given to
// Serve or ServeConn ends), then is closed. Close waits for all of that. It
// is safe to call more than once, and concurrently.
func (s *Server) Close() error {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.done)
		for l := range s.listeners {
			l.Close()
		}
		for c := range s.conns {
			c.shutdown(errClosedByServer)
		}
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}
