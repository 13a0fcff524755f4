package initiator

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/nbd"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// Defaults of Options.
const (
	DefaultPoolSize = 64 << 20
	DefaultSlotSize = 256 << 10
	// MaxRequest is the largest NBD request served, the limit the NBD
	// protocol asks clients to stay under.
	MaxRequest = 32 << 20
	// DefaultReconnectTimeout is how long IO waits for the target to come
	// back after the connection is lost.
	DefaultReconnectTimeout = 2 * time.Minute
	// DefaultKeepAlive is how long the link to the target may stay silent
	// before it is declared dead (probed after a third of it), as NVMe's
	// keep-alive timeout.
	DefaultKeepAlive = 15 * time.Second
	// DefaultIOTimeout bounds every request to the target but flushes: a
	// grant, an RDMA READ or WRITE, a trim.
	DefaultIOTimeout = 30 * time.Second
	// DefaultFlushTimeout bounds a flush (or FUA write), which waits for
	// the target's write-back to a possibly slow disk.
	DefaultFlushTimeout = 2 * time.Minute
)

// Options configure Open.
type Options struct {
	// Provider carries the connection; Target is its address.
	Provider transport.Provider
	Target   string
	// Export is the volume's name.
	Export string
	// HostID is this host's stable identity (see HostID in package
	// protocol). When the volume reconnects, or the host attaches again
	// after a crash, the target fences every earlier session of the same
	// host ID and export before the new one does IO. Empty: anonymous, no
	// fencing.
	HostID string
	// ReadOnly opens the volume for reading only.
	ReadOnly bool
	// PoolSize is the registered memory for IO buffers (default
	// DefaultPoolSize); it bounds the bytes of requests in flight, and must
	// be at least MaxRequest.
	PoolSize int
	// ReconnectTimeout bounds how long the volume tries to reconnect after
	// the connection to the target is lost, while IO waits. Zero means
	// DefaultReconnectTimeout; negative means no reconnection.
	ReconnectTimeout time.Duration
	// KeepAlive is how long the link may stay silent before it is taken
	// down and the reconnect path runs. Zero means DefaultKeepAlive;
	// negative disables it.
	KeepAlive time.Duration
	// IOTimeout bounds each request but flushes; FlushTimeout bounds
	// flushes and FUA writes. A request not answered in time takes the
	// link down (the reconnect path runs and the request is done again).
	// Zero means DefaultIOTimeout and DefaultFlushTimeout.
	IOTimeout    time.Duration
	FlushTimeout time.Duration
	// Logger gets one line per session event. Default: no logs.
	Logger *zap.Logger
	// Metrics, if not nil, are updated; see NewMetrics.
	Metrics *Metrics
}

// grant is a chunk of the target's memory this initiator may use.
type grant struct {
	off      uint64
	addr     uint64
	rkey     uint32
	length   uint64
	gen      uint64
	writable bool
	valid    bool          // usable: new IO may take references
	refs     int           // IO in flight on it
	fetching chan struct{} // non-nil while the GrantRequest is in flight
}

// session is one connection to the target with the volume open on it.
// Grants belong to a session: a new session starts with none.
type session struct {
	v      *Volume
	link   *link.Link
	region transport.Region // the IO buffers, registered on this connection
	info   protocol.VolumeInfo
	grants map[uint64]*grant // guarded by v.mu
	wg     sync.WaitGroup    // revoke and drain goroutines

	inflight int  // operations using the session (v.mu)
	draining bool // the target is shutting down: no new operations (v.mu)
}

// Volume is an open remote volume. It implements nbd.Backend: reads are
// RDMA READs from granted chunks of the target's memory, writes are RDMA
// WRITEs followed by a Done message.
//
// When the connection to the target is lost, the volume reconnects (for up
// to Options.ReconnectTimeout) while IO waits, and IO that was in flight is
// done again on the new connection. Writes the target acknowledged but had
// not made durable may have been lost with the target's memory; if there were
// any (writes since the last successful flush), the next Flush fails with EIO
// once, as a disk reports a lost volatile write cache.
type Volume struct {
	opts Options
	log  *zap.Logger
	m    *Metrics
	info protocol.VolumeInfo // of the first session: size, chunk size, flags
	mem  *transport.Memory
	pool *bufPool

	mu      sync.Mutex
	cond    *sync.Cond    // signalled when a grant's refs drop to zero
	sess    *session      // nil while reconnecting
	changed chan struct{} // closed and replaced when sess changes
	failed  error         // set when the volume gave up or was closed
	done    chan struct{} // closed with failed

	writes    atomic.Uint64 // writes acknowledged
	flushedAt uint64        // writes covered by the last successful flush (mu)
	lost      bool          // writes may have been lost with a session (mu)

	stop      chan struct{}
	superDone chan struct{}
	closeOnce sync.Once
	closeErr  error
}

var _ nbd.Backend = (*Volume)(nil)

// ErrClosed is returned by IO on a closed volume.
var ErrClosed = errors.New("volume closed")

// ErrFenced is why a volume failed when the target fenced its session
// because the same host ID opened the export again on another session.
var ErrFenced = errors.New("fenced by a newer session of this host ID and export")

// ErrLostWrites is returned by Flush once after a lost connection when
// writes acknowledged since the previous flush may not have reached the
// backing file.
var ErrLostWrites = errors.New("writes since the last flush may have been lost with the connection to the target")

// Open connects to the target, opens the export and sets up the IO buffers.
func Open(ctx context.Context, opts Options) (*Volume, error) {
	if opts.PoolSize == 0 {
		opts.PoolSize = DefaultPoolSize
	}
	if opts.PoolSize < MaxRequest {
		return nil, fmt.Errorf("buffer pool of %d bytes: need at least %d", opts.PoolSize, MaxRequest)
	}
	if opts.ReconnectTimeout == 0 {
		opts.ReconnectTimeout = DefaultReconnectTimeout
	}
	if opts.KeepAlive == 0 {
		opts.KeepAlive = DefaultKeepAlive
	}
	if opts.IOTimeout <= 0 {
		opts.IOTimeout = DefaultIOTimeout
	}
	if opts.FlushTimeout <= 0 {
		opts.FlushTimeout = DefaultFlushTimeout
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	v := &Volume{opts: opts, log: opts.Logger, m: opts.Metrics, changed: make(chan struct{}),
		done: make(chan struct{}), stop: make(chan struct{}), superDone: make(chan struct{})}
	v.cond = sync.NewCond(&v.mu)
	mem, err := transport.AllocMemory(opts.PoolSize, false)
	if err != nil {
		return nil, fmt.Errorf("open volume %q: IO buffers: %w", opts.Export, err)
	}
	v.mem = mem
	v.pool = newBufPool(mem.Bytes(), DefaultSlotSize)
	s, err := v.connect(ctx)
	if err != nil {
		mem.Free()
		return nil, err
	}
	v.info = s.info
	v.sess = s
	v.m.sessions.Set(1)
	transportInfo := opts.Provider.Name()
	if di, ok := s.link.Conn().(interface{ DeviceInfo() string }); ok {
		transportInfo += ": " + di.DeviceInfo() // device, port, GID, addresses
	}
	v.log.Info("volume opened", zap.String("export", opts.Export), zap.String("target", opts.Target),
		zap.String("transport", transportInfo), zap.Uint64("size", v.info.VolumeSize),
		zap.Uint32("chunk_size", v.info.ChunkSize), zap.Bool("read_only", v.ReadOnly()))
	go v.supervise(s)
	return v, nil
}

// connect dials the target, opens the volume and registers the IO buffers.
func (v *Volume) connect(ctx context.Context) (*session, error) {
	s := &session{v: v, grants: make(map[uint64]*grant)}
	l, err := link.Dial(ctx, v.opts.Provider, v.opts.Target, link.Options{Handler: s.handle, Logger: v.log,
		KeepAlive: max(v.opts.KeepAlive, 0), RequestTimeout: v.opts.IOTimeout})
	if err != nil {
		return nil, err
	}
	s.link = l
	mode := protocol.ModeReadWrite
	if v.opts.ReadOnly {
		mode = protocol.ModeReadOnly
	}
	err = l.Request(ctx, &protocol.Open{Mode: mode, Name: v.opts.Export, HostID: v.opts.HostID}, &s.info)
	if errors.Is(err, protocol.ErrPerm) && mode == protocol.ModeReadWrite {
		// A read-only export: attach it read-only, as a disk with its
		// write-protect switch on.
		v.log.Info("the export is read-only: opening it read-only", zap.String("export", v.opts.Export))
		err = l.Request(ctx, &protocol.Open{Mode: protocol.ModeReadOnly, Name: v.opts.Export, HostID: v.opts.HostID}, &s.info)
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q on %s: %w", v.opts.Export, v.opts.Target, err)
	}
	if s.info.ChunkSize == 0 || s.info.VolumeSize == 0 {
		l.Close()
		return nil, fmt.Errorf("open volume %q: target reports size %d, chunk size %d: %w", v.opts.Export, s.info.VolumeSize, s.info.ChunkSize, protocol.ErrProtocol)
	}
	if v.info.ChunkSize != 0 && (s.info.VolumeSize != v.info.VolumeSize || s.info.ChunkSize != v.info.ChunkSize) {
		l.Close()
		return nil, fmt.Errorf("volume %q changed on %s: size %d, chunk size %d, was %d and %d", v.opts.Export, v.opts.Target,
			s.info.VolumeSize, s.info.ChunkSize, v.info.VolumeSize, v.info.ChunkSize)
	}
	s.region, err = l.Conn().Register(v.mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q: register IO buffers: %w", v.opts.Export, err)
	}
	return s, nil
}

// teardown closes the session's connection and waits for its goroutines.
func (s *session) teardown() {
	s.link.Close()
	s.wg.Wait()
	s.region.Deregister()
	s.v.mu.Lock()
	for idx, g := range s.grants {
		if g.valid {
			s.v.m.grantsHeld.Dec()
		}
		g.valid = false
		delete(s.grants, idx)
	}
	s.v.mu.Unlock()
}

// supervise waits for the session to go down and reconnects.
func (v *Volume) supervise(s *session) {
	defer close(v.superDone)
	for {
		select {
		case <-v.stop:
			return
		case <-s.link.Done():
		}
		v.mu.Lock()
		v.sess = nil
		unflushed := v.writes.Load() > v.flushedAt
		v.mu.Unlock()
		v.m.sessions.Set(0)
		if err := v.Err(); err != nil {
			s.teardown()
			return // failed (fenced): no reconnection
		}
		v.log.Warn("connection to the target lost", zap.String("target", v.opts.Target), zap.Error(s.link.Err()))
		s.teardown()
		if v.opts.ReconnectTimeout < 0 {
			v.fail(fmt.Errorf("connection to %s lost: %w", v.opts.Target, s.link.Err()))
			return
		}
		ns, err := v.reconnect()
		if err != nil {
			v.fail(err)
			return
		}
		// The same target process kept its cache, and wrote back every
		// chunk the lost session held writable (its last Dones may be
		// lost): nothing acknowledged is lost. Another process (a
		// restart) may have lost what was not flushed. Without a host ID
		// the old session may outlive the reconnect, so no such promise.
		sameTarget := ns.info.Instance == s.info.Instance && v.opts.HostID != ""
		v.mu.Lock()
		if unflushed && !sameTarget {
			v.lost = true
		}
		v.sess = ns
		close(v.changed)
		v.changed = make(chan struct{})
		v.mu.Unlock()
		v.m.sessions.Set(1)
		v.m.reconnects.Inc()
		if unflushed && !sameTarget {
			v.log.Warn("reconnected to another target instance: writes since the last flush may be lost; the next flush reports it",
				zap.String("target", v.opts.Target), zap.String("export", v.opts.Export))
		} else {
			v.log.Info("reconnected", zap.String("target", v.opts.Target), zap.String("export", v.opts.Export),
				zap.Bool("same_target_instance", sameTarget))
		}
		s = ns
	}
}

// reconnect dials until it succeeds, the timeout passes or the volume closes.
func (v *Volume) reconnect() (*session, error) {
	deadline := time.Now().Add(v.opts.ReconnectTimeout)
	wait := 50 * time.Millisecond
	var lastErr error
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		go func() {
			select {
			case <-v.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		s, err := v.connect(ctx)
		cancel()
		if err == nil {
			return s, nil
		}
		lastErr = err
		if attempt == 1 || attempt%20 == 0 {
			v.log.Info("reconnecting", zap.String("target", v.opts.Target), zap.Int("attempt", attempt), zap.Error(err))
		}
		select {
		case <-v.stop:
			return nil, ErrClosed
		case <-time.After(wait):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("target %s did not come back within %v: %w", v.opts.Target, v.opts.ReconnectTimeout, lastErr)
		}
		wait = min(wait*2, 2*time.Second)
	}
}

// fail ends the volume: IO fails from now on.
func (v *Volume) fail(err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.failed != nil {
		return
	}
	v.failed = err
	close(v.done)
	close(v.changed)
	v.changed = make(chan struct{})
	if !errors.Is(err, ErrClosed) {
		v.log.Error("volume failed", zap.String("export", v.opts.Export), zap.Error(err))
	}
}

// current returns the session to do IO on, waiting while reconnecting.
// The caller calls put when it no longer uses it.
func (v *Volume) current(ctx context.Context) (*session, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for {
		if v.failed != nil {
			return nil, v.failed
		}
		if s := v.sess; s != nil && !s.draining && s.link.Err() == nil {
			s.inflight++
			return s, nil
		}
		// Reconnecting, draining, or the link just went down and
		// supervise has not noticed yet: changed is closed when the next
		// session is in place or the volume fails.
		ch := v.changed
		v.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			v.mu.Lock()
			return nil, ctx.Err()
		}
		v.mu.Lock()
	}
}

func (v *Volume) put(s *session) {
	v.mu.Lock()
	s.inflight--
	if s.inflight == 0 && s.draining {
		v.cond.Broadcast()
	}
	v.mu.Unlock()
}

// Size is the volume's size in bytes.
func (v *Volume) Size() uint64 { return v.info.VolumeSize }

// ReadOnly reports whether writes are refused.
func (v *Volume) ReadOnly() bool {
	return v.opts.ReadOnly || v.info.Flags&protocol.VolReadOnly != 0
}

// Flags are the volume's capabilities as the target reports them.
func (v *Volume) Flags() protocol.VolumeFlags { return v.info.Flags }

// ChunkSize is the target's unit of granting.
func (v *Volume) ChunkSize() uint64 { return uint64(v.info.ChunkSize) }

// Done is closed when the volume is closed or gave up reconnecting.
func (v *Volume) Done() <-chan struct{} { return v.done }

// Err is why the volume ended (ErrClosed after Close), or nil.
func (v *Volume) Err() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.failed
}

// handle runs on the link's completion goroutine.
func (s *session) handle(h protocol.Header, payload []byte) {
	switch h.Type {
	case protocol.TypeRevoke:
		var r protocol.Revoke
		if err := r.Unmarshal(payload); err != nil {
			s.protocolError(fmt.Errorf("decode Revoke: %w", err))
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.revoke(h.Tag, &r)
		}()
	case protocol.TypeError:
		var em protocol.ErrorMsg
		if err := em.Unmarshal(payload); err != nil {
			s.protocolError(fmt.Errorf("decode Error: %w", err))
			return
		}
		if em.Code == protocol.CodeStale {
			// Fenced: this host opened the export again on another
			// session (another attach, or this one after the target saw
			// it reconnect). Reconnecting would fence that one in turn.
			v := s.v
			v.fail(fmt.Errorf("%w: %s", ErrFenced, em.Text))
			go s.link.Close()
			return
		}
		if em.Code != protocol.CodeShutdown {
			s.protocolError(fmt.Errorf("error notice from target: %w", em.Err()))
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.drain()
		}()
	default:
		s.protocolError(fmt.Errorf("unexpected %v from target: %w", h.Type, protocol.ErrProtocol))
	}
}

// drain answers the target's shutdown notice: no new IO starts on the
// session, IO in flight finishes (and sends its Done), then a flush makes
// every acknowledged write durable and the connection is closed. IO waits
// for the reconnection meanwhile, and nothing is reported lost.
func (s *session) drain() {
	v := s.v
	v.log.Info("target is shutting down: finishing IO in flight and flushing", zap.String("target", v.opts.Target))
	v.mu.Lock()
	s.draining = true
	for s.inflight > 0 && s.link.Err() == nil {
		v.cond.Wait()
	}
	v.mu.Unlock()
	writes := v.writes.Load()
	if err := s.link.RequestWithin(context.Background(), v.opts.FlushTimeout, s.flushMsg(), &protocol.OK{}); err == nil {
		v.mu.Lock()
		v.flushedAt = max(v.flushedAt, writes)
		v.mu.Unlock()
	} else {
		v.log.Warn("flush before the target's shutdown failed", zap.Error(err))
	}
	s.link.Close()
}

func (s *session) protocolError(err error) {
	s.v.m.errors.WithLabelValues("protocol").Inc()
	s.v.log.Error("protocol error, closing the connection", zap.Error(err))
	go s.link.Close()
}

// revoke stops new IO on the grant, waits for IO in flight on it (whose
// Done messages are sent before they release it), then acknowledges.
func (s *session) revoke(tag uint64, r *protocol.Revoke) {
	v := s.v
	v.m.revokes.Inc()
	idx := r.Offset / uint64(s.info.ChunkSize)
	v.mu.Lock()
	// The Revoke may overtake the reply of a grant being fetched: wait for
	// the fetch to finish before deciding whether this generation is held.
	for {
		g := s.grants[idx]
		if g == nil || g.fetching == nil {
			break
		}
		ch := g.fetching
		v.mu.Unlock()
		select {
		case <-ch:
		case <-s.link.Done():
		}
		v.mu.Lock()
		if s.link.Err() != nil {
			break
		}
	}
	if g := s.grants[idx]; g != nil && g.valid && g.gen == r.Generation {
		g.valid = false
		delete(s.grants, idx)
		v.m.grantsHeld.Dec()
		for g.refs > 0 {
			v.cond.Wait()
		}
	}
	v.mu.Unlock()
	ack := protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation}
	if err := s.link.Send(context.Background(), tag, &ack); err != nil && s.link.Err() == nil {
		v.log.Warn("revoke ack", zap.Error(err))
	}
}

// tryAcquire takes a reference on the grant of every chunk of idxs if all
// of them are held and usable, and reports whether it did.
func (s *session) tryAcquire(b *ioBuf, idxs []uint64, write bool) bool {
	v := s.v
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, idx := range idxs {
		if g := s.grants[idx]; g == nil || !g.valid || (write && !g.writable) {
			return false
		}
	}
	for _, idx := range idxs {
		g := s.grants[idx]
		g.refs++
		b.grants = append(b.grants, g)
	}
	return true
}

// acquire makes sure the chunks idxs are granted, then takes a reference on
// each, all at once: no reference is held while waiting for a grant, so a
// revoke never waits on an IO that waits on another grant. With a single
// chunk it always makes progress: a grant just fetched is referenced before
// a revoke of it can take effect.
func (s *session) acquire(ctx context.Context, b *ioBuf, idxs []uint64, write bool) error {
	v := s.v
	v.mu.Lock()
	for {
		missing := -1
		for i, idx := range idxs {
			if g := s.grants[idx]; g == nil || !g.valid || (write && !g.writable) {
				missing = i
				break
			}
		}
		if missing < 0 {
			for _, idx := range idxs {
				g := s.grants[idx]
				g.refs++
				b.grants = append(b.grants, g)
			}
			v.mu.Unlock()
			return nil
		}
		idx := idxs[missing]
		if g := s.grants[idx]; g != nil && g.fetching != nil {
			ch := g.fetching
			v.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return ctx.Err()
			case <-s.link.Done():
				return s.link.Err()
			}
			v.mu.Lock()
			continue
		}
		g := &grant{fetching: make(chan struct{})}
		old := s.grants[idx]
		s.grants[idx] = g
		v.mu.Unlock()
		if old != nil && old.valid {
			v.m.grantsHeld.Dec() // replaced by a writable one
		}
		err := s.fetch(ctx, idx, g)
		v.mu.Lock()
		close(g.fetching)
		g.fetching = nil
		if err != nil {
			if s.grants[idx] == g {
				delete(s.grants, idx)
			}
			v.mu.Unlock()
			return err
		}
	}
}

// fetch asks the target for a grant of chunk idx and fills g.
func (s *session) fetch(ctx context.Context, idx uint64, g *grant) error {
	v := s.v
	start := time.Now()
	req := protocol.GrantRequest{Handle: s.info.Handle, Offset: idx * uint64(s.info.ChunkSize)}
	if !v.ReadOnly() {
		req.Flags = protocol.GrantWrite
	}
	var gr protocol.Grant
	v.m.grantRequests.Inc()
	if err := s.link.Request(ctx, &req, &gr); err != nil {
		v.m.errors.WithLabelValues("grant").Inc()
		return fmt.Errorf("grant of chunk at %d: %w", req.Offset, err)
	}
	v.m.grantSeconds.Observe(time.Since(start).Seconds())
	if gr.Offset != req.Offset || gr.Length == 0 || gr.Length > s.info.ChunkSize {
		s.protocolError(fmt.Errorf("grant for %d covers %d+%d: %w", req.Offset, gr.Offset, gr.Length, protocol.ErrProtocol))
		return protocol.ErrProtocol
	}
	v.mu.Lock()
	g.off, g.addr, g.rkey, g.length, g.gen = gr.Offset, gr.Addr, gr.RKey, uint64(gr.Length), gr.Generation
	g.writable = gr.Flags&protocol.GrantWrite != 0
	g.valid = true
	v.mu.Unlock()
	v.m.grantsHeld.Inc()
	return nil
}

func (v *Volume) releaseGrants(b *ioBuf) {
	v.mu.Lock()
	for _, g := range b.grants {
		g.refs--
		if g.refs == 0 && !g.valid {
			v.cond.Broadcast()
		}
	}
	v.mu.Unlock()
	clear(b.grants)
	b.grants = b.grants[:0]
}

// ops fills b.ops with one operation per piece of the volume range
// [lo, hi), within one chunk and one buffer segment, of a request of b at
// off. b.grants holds the grants of the chunks of [lo, hi), in order.
func (s *session) ops(b *ioBuf, off, lo, hi uint64, write bool) {
	b.ops = b.ops[:0]
	cs := uint64(s.info.ChunkSize)
	first := lo / cs
	slot := s.v.pool.slotSize
	pos := off
	for si, seg := range b.Segs {
		end := pos + uint64(len(seg))
		if end <= lo {
			pos = end
			continue
		}
		if pos >= hi {
			break
		}
		for p := max(pos, lo); p < min(end, hi); {
			g := b.grants[p/cs-first]
			n := min(min(end, hi)-p, g.off+g.length-p)
			b.ops = append(b.ops, link.Op{Write: write, Addr: g.addr + (p - g.off), RKey: g.rkey,
				Local: transport.SGE{Region: s.region, Offset: b.slots[si]*slot + int(p-pos), Length: int(n)}})
			p += n
		}
		pos = end
	}
}

func (v *Volume) check(off, n uint64) error {
	if n == 0 {
		return nil
	}
	if off >= v.info.VolumeSize || n > v.info.VolumeSize-off {
		return fmt.Errorf("range %d+%d beyond the volume's %d bytes: %w", off, n, v.info.VolumeSize, syscall.EINVAL)
	}
	return nil
}

// Alloc lends registered memory for a request of n bytes.
func (v *Volume) Alloc(ctx context.Context, n int) (*nbd.Buffer, error) {
	b, err := v.pool.alloc(ctx, n)
	if err != nil {
		return nil, err
	}
	return &b.Buffer, nil
}

// Free gives a buffer back.
func (v *Volume) Free(nb *nbd.Buffer) { v.pool.release(nb.Priv.(*ioBuf)) }

func bufLen(b *ioBuf) uint64 {
	var n uint64
	for _, s := range b.Segs {
		n += uint64(len(s))
	}
	return n
}

// ReadAt reads into b from the volume at off with RDMA READs.
func (v *Volume) ReadAt(ctx context.Context, nb *nbd.Buffer, off uint64) error {
	return v.io(ctx, nb.Priv.(*ioBuf), off, false, false)
}

// WriteAt writes b at off with RDMA WRITEs, then tells the target with a
// Done message; with fua it waits until the target made the range durable.
func (v *Volume) WriteAt(ctx context.Context, nb *nbd.Buffer, off uint64, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("write to read-only volume %q: %w", v.opts.Export, syscall.EPERM)
	}
	return v.io(ctx, nb.Priv.(*ioBuf), off, true, fua)
}

// retry runs op on the current session until it succeeds, fails for a
// reason other than a lost connection, or no session comes back.
func (v *Volume) retry(ctx context.Context, what string, op func(*session) error) error {
	for {
		s, err := v.current(ctx)
		if err != nil {
			v.m.errors.WithLabelValues(what).Inc()
			return v.mapErr(fmt.Errorf("%s: %w", what, err))
		}
		err = op(s)
		v.put(s)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, link.ErrDown) && v.opts.ReconnectTimeout >= 0 && ctx.Err() == nil:
			continue // done again once reconnected
		}
		v.m.errors.WithLabelValues(what).Inc()
		return v.mapErr(fmt.Errorf("%s: %w", what, err))
	}
}

func (v *Volume) io(ctx context.Context, b *ioBuf, off uint64, write, fua bool) error {
	n := bufLen(b)
	if n == 0 {
		return nil
	}
	if err := v.check(off, n); err != nil {
		return err
	}
	op := "read"
	if write {
		op = "write"
	}
	v.plan(b, off, n)
	err := v.retry(ctx, op, func(s *session) error {
		if s.tryAcquire(b, b.idxs, write) {
			// The usual case: every chunk is granted; one chain of work
			// requests does the whole request.
			return s.rdma(ctx, b, off, off, off+n, write, fua)
		}
		// Chunk by chunk, holding one grant at a time, so that a request
		// larger than the target's cache, or many requests at once, always
		// make progress.
		cs := uint64(s.info.ChunkSize)
		for i := range b.idxs {
			lo, hi := max(off, b.idxs[i]*cs), min(off+n, (b.idxs[i]+1)*cs)
			if err := s.acquire(ctx, b, b.idxs[i:i+1], write); err != nil {
				return err
			}
			if err := s.rdma(ctx, b, off, lo, hi, write, fua); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil && write {
		v.writes.Add(1)
	}
	return err
}

// rdma moves the volume range [lo, hi) of the request of b at off, whose
// grants b.grants holds referenced, and releases them. A write is followed
// by its Done, sent before the grants are released so that the target sees
// it before any RevokeAck for those chunks.
func (s *session) rdma(ctx context.Context, b *ioBuf, off, lo, hi uint64, write, fua bool) error {
	v := s.v
	defer v.releaseGrants(b)
	op := "read"
	if write {
		op = "write"
	}
	s.ops(b, off, lo, hi, write)
	start := time.Now()
	if err := s.link.RDMA(ctx, b.ops...); err != nil {
		return err
	}
	v.m.rdmaSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	v.m.rdmaOps.WithLabelValues(op).Add(float64(len(b.ops)))
	v.m.rdmaBytes.WithLabelValues(op).Add(float64(hi - lo))
	if write {
		return s.done(ctx, b, lo, hi-lo, fua)
	}
	return nil
}

// plan fills b.idxs with the chunks of [off, off+n).
func (v *Volume) plan(b *ioBuf, off, n uint64) {
	cs := uint64(v.info.ChunkSize)
	b.idxs = b.idxs[:0]
	for idx := off / cs; idx*cs < off+n; idx++ {
		b.idxs = append(b.idxs, idx)
	}
}

// done reports a written range.
func (s *session) done(ctx context.Context, b *ioBuf, off, n uint64, fua bool) error {
	d := &b.done
	b.ranges[0] = protocol.Range{Offset: off, Length: n}
	*d = protocol.Done{Handle: s.info.Handle, Generation: s.info.Generation, Ranges: b.ranges[:]}
	if !fua {
		return s.link.Send(ctx, 0, d)
	}
	d.Flags = protocol.DoneFUA
	start := time.Now()
	err := s.link.RequestWithin(ctx, s.v.opts.FlushTimeout, d, &protocol.OK{})
	s.v.m.controlSeconds.WithLabelValues("fua").Observe(time.Since(start).Seconds())
	return err
}

// flushMsg is the Flush of the session's handle and generation.
func (s *session) flushMsg() protocol.Message {
	return &protocol.Flush{Handle: s.info.Handle, Generation: s.info.Generation}
}

// mapErr turns an error into one whose errno the NBD server can report.
func (v *Volume) mapErr(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return err
	}
	var code syscall.Errno
	switch protocol.CodeOf(err) {
	case protocol.CodePerm:
		code = syscall.EPERM
	case protocol.CodeInval, protocol.CodeRange:
		code = syscall.EINVAL
	case protocol.CodeNoSpc:
		code = syscall.ENOSPC
	default:
		code = syscall.EIO
	}
	if errors.Is(err, link.ErrDown) {
		code = syscall.EIO
	}
	return fmt.Errorf("%w: %w", code, err)
}

// control sends a request whose reply is OK, again after a reconnection,
// waiting at most timeout for each reply.
func (v *Volume) control(ctx context.Context, op string, timeout time.Duration, mk func(s *session) protocol.Message) error {
	start := time.Now()
	err := v.retry(ctx, op, func(s *session) error {
		return s.link.RequestWithin(ctx, timeout, mk(s), &protocol.OK{})
	})
	v.m.controlSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	return err
}

// Flush returns once every write completed before it is durable on the
// target. After a lost connection with writes not yet flushed it fails
// once with EIO (ErrLostWrites).
func (v *Volume) Flush(ctx context.Context) error {
	writes := v.writes.Load()
	if err := v.control(ctx, "flush", v.opts.FlushTimeout, (*session).flushMsg); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lost {
		v.lost = false
		v.m.errors.WithLabelValues("lost_writes").Inc()
		return fmt.Errorf("flush: %w: %w", syscall.EIO, ErrLostWrites)
	}
	v.flushedAt = max(v.flushedAt, writes)
	return nil
}

// Trim discards a range; it then reads as zeroes.
func (v *Volume) Trim(ctx context.Context, off, n uint64, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("trim on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	var flags uint32
	if fua {
		flags = protocol.FlagFUA
	}
	return v.control(ctx, "trim", v.opts.IOTimeout, func(s *session) protocol.Message {
		return &protocol.Trim{Handle: s.info.Handle, Flags: flags, Offset: off, Length: n}
	})
}

// WriteZeroes zeroes a range, keeping it allocated if noHole.
func (v *Volume) WriteZeroes(ctx context.Context, off, n uint64, noHole, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("write zeroes on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	var flags uint32
	if fua {
		flags |= protocol.FlagFUA
	}
	if noHole {
		flags |= protocol.FlagNoHole
	}
	return v.control(ctx, "write_zeroes", v.opts.IOTimeout, func(s *session) protocol.Message {
		return &protocol.WriteZeroes{Handle: s.info.Handle, Flags: flags, Offset: off, Length: n}
	})
}

// Close flushes (for a writable volume), closes the volume on the target
// and the connection. Safe to call twice.
func (v *Volume) Close(ctx context.Context) error {
	v.closeOnce.Do(func() {
		var errs []error
		v.mu.Lock()
		s, failed := v.sess, v.failed
		v.mu.Unlock()
		if failed == nil && s != nil && s.link.Err() == nil {
			if !v.ReadOnly() {
				if err := v.Flush(ctx); err != nil {
					errs = append(errs, err)
				}
			}
			if err := s.link.Request(ctx, &protocol.Close{Handle: s.info.Handle}, &protocol.OK{}); err != nil {
				errs = append(errs, fmt.Errorf("close volume: %w", err))
			}
		} else if failed != nil {
			errs = append(errs, failed)
		}
		close(v.stop)
		<-v.superDone
		v.mu.Lock()
		s = v.sess
		v.sess = nil
		v.mu.Unlock()
		if s != nil {
			s.teardown()
		}
		v.fail(ErrClosed)
		v.mem.Free()
		v.m.sessions.Set(0)
		v.closeErr = errors.Join(errs...)
		v.log.Info("volume closed", zap.String("export", v.opts.Export), zap.NamedError("error", v.closeErr))
	})
	return v.closeErr
}

// List asks the target at addr for its exports.
func List(ctx context.Context, p transport.Provider, addr string) ([]protocol.ExportEntry, error) {
	l, err := link.Dial(ctx, p, addr, link.Options{RecvBuffers: 8, SendBuffers: 8,
		Handler: func(protocol.Header, []byte) {}})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	var el protocol.ExportList
	if err := l.Request(ctx, &protocol.ListExports{}, &el); err != nil {
		return nil, fmt.Errorf("list exports of %s: %w", addr, err)
	}
	sort.Slice(el.Exports, func(i, j int) bool { return el.Exports[i].Name < el.Exports[j].Name })
	return el.Exports, nil
}

// NBDExport describes v as an NBD export named name.
func (v *Volume) NBDExport(name string) *nbd.Export {
	f := v.Flags()
	return &nbd.Export{
		Name: name, Description: fmt.Sprintf("rblk volume %q on %s", v.opts.Export, v.opts.Target),
		Size: v.info.VolumeSize, ReadOnly: v.ReadOnly(),
		CanTrim: !v.ReadOnly() && f&protocol.VolCanTrim != 0, CanZero: !v.ReadOnly() && f&protocol.VolCanZero != 0,
		CanFlush: true, CanFUA: !v.ReadOnly(), MultiConn: true,
		MinBlock: 1, PrefBlock: 4096, MaxBlock: MaxRequest, Backend: v,
	}
}
