package initiator

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
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
)

// Options configure Open.
type Options struct {
	// Provider carries the connection; Target is its address.
	Provider transport.Provider
	Target   string
	// Export is the volume's name.
	Export string
	// ReadOnly opens the volume for reading only.
	ReadOnly bool
	// PoolSize is the registered memory for IO buffers (default
	// DefaultPoolSize); it bounds the bytes of requests in flight, and must
	// be at least MaxRequest.
	PoolSize int
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

// Volume is an open remote volume. It implements nbd.Backend: reads are
// RDMA READs from granted chunks of the target's memory, writes are RDMA
// WRITEs followed by a Done message.
type Volume struct {
	opts Options
	log  *zap.Logger
	m    *Metrics
	link *link.Link
	info protocol.VolumeInfo

	mem    *transport.Memory
	region transport.Region
	pool   *bufPool

	mu     sync.Mutex
	cond   *sync.Cond // signalled when a grant's refs drop to zero
	grants map[uint64]*grant

	wg        sync.WaitGroup // revoke goroutines
	closeOnce sync.Once
	closeErr  error
}

var _ nbd.Backend = (*Volume)(nil)

// ErrClosed is returned by IO on a closed volume.
var ErrClosed = errors.New("volume closed")

// Open connects to the target, opens the export and sets up the IO buffers.
func Open(ctx context.Context, opts Options) (*Volume, error) {
	if opts.PoolSize == 0 {
		opts.PoolSize = DefaultPoolSize
	}
	if opts.PoolSize < MaxRequest {
		return nil, fmt.Errorf("buffer pool of %d bytes: need at least %d", opts.PoolSize, MaxRequest)
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Metrics == nil {
		opts.Metrics = NewMetrics(nil)
	}
	v := &Volume{opts: opts, log: opts.Logger, m: opts.Metrics, grants: make(map[uint64]*grant)}
	v.cond = sync.NewCond(&v.mu)
	l, err := link.Dial(ctx, opts.Provider, opts.Target, link.Options{Handler: v.handle, Logger: opts.Logger})
	if err != nil {
		return nil, err
	}
	v.link = l
	mode := protocol.ModeReadWrite
	if opts.ReadOnly {
		mode = protocol.ModeReadOnly
	}
	if err := l.Request(ctx, &protocol.Open{Mode: mode, Name: opts.Export}, &v.info); err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q on %s: %w", opts.Export, opts.Target, err)
	}
	if v.info.ChunkSize == 0 || v.info.VolumeSize == 0 {
		l.Close()
		return nil, fmt.Errorf("open volume %q: target reports size %d, chunk size %d: %w", opts.Export, v.info.VolumeSize, v.info.ChunkSize, protocol.ErrProtocol)
	}
	v.mem, err = transport.AllocMemory(opts.PoolSize, false)
	if err == nil {
		v.region, err = l.Conn().Register(v.mem.Bytes(), transport.AccessLocalWrite)
		if err != nil {
			v.mem.Free()
		}
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q: IO buffers: %w", opts.Export, err)
	}
	v.pool = newBufPool(v.region, DefaultSlotSize)
	v.m.sessions.Set(1)
	v.log.Info("volume opened", zap.String("export", opts.Export), zap.String("target", opts.Target),
		zap.String("transport", opts.Provider.Name()), zap.Uint64("size", v.info.VolumeSize),
		zap.Uint32("chunk_size", v.info.ChunkSize), zap.Bool("read_only", v.ReadOnly()))
	return v, nil
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

// Done is closed when the session with the target is down.
func (v *Volume) Done() <-chan struct{} { return v.link.Done() }

// Err is why the session went down, or nil.
func (v *Volume) Err() error { return v.link.Err() }

// handle runs on the link's completion goroutine.
func (v *Volume) handle(h protocol.Header, payload []byte) {
	switch h.Type {
	case protocol.TypeRevoke:
		var r protocol.Revoke
		if err := r.Unmarshal(payload); err != nil {
			v.protocolError(fmt.Errorf("decode Revoke: %w", err))
			return
		}
		v.wg.Add(1)
		go func() {
			defer v.wg.Done()
			v.revoke(h.Tag, &r)
		}()
	default:
		v.protocolError(fmt.Errorf("unexpected %v from target: %w", h.Type, protocol.ErrProtocol))
	}
}

func (v *Volume) protocolError(err error) {
	v.m.errors.WithLabelValues("protocol").Inc()
	v.log.Error("protocol error, closing session", zap.Error(err))
	go v.link.Close()
}

// revoke stops new IO on the grant, waits for IO in flight on it (whose
// Done messages are sent before they release it), then acknowledges.
func (v *Volume) revoke(tag uint64, r *protocol.Revoke) {
	v.m.revokes.Inc()
	idx := r.Offset / uint64(v.info.ChunkSize)
	v.mu.Lock()
	// The Revoke may overtake the reply of a grant being fetched: wait for
	// the fetch to finish before deciding whether this generation is held.
	for {
		g := v.grants[idx]
		if g == nil || g.fetching == nil {
			break
		}
		ch := g.fetching
		v.mu.Unlock()
		select {
		case <-ch:
		case <-v.link.Done():
		}
		v.mu.Lock()
		if v.link.Err() != nil {
			break
		}
	}
	if g := v.grants[idx]; g != nil && g.valid && g.gen == r.Generation {
		g.valid = false
		delete(v.grants, idx)
		v.m.grantsHeld.Dec()
		for g.refs > 0 {
			v.cond.Wait()
		}
	}
	v.mu.Unlock()
	ack := protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation}
	if err := v.link.Send(context.Background(), tag, &ack); err != nil && v.link.Err() == nil {
		v.log.Warn("revoke ack", zap.Error(err))
	}
}

// acquire makes sure the chunks idxs are granted, then takes a reference on
// each, all at once: no reference is held while waiting for a grant, so a
// revoke never waits on an IO that waits on another grant.
func (v *Volume) acquire(ctx context.Context, b *ioBuf, write bool) error {
	v.mu.Lock()
	for {
		missing := -1
		for i, idx := range b.idxs {
			if g := v.grants[idx]; g == nil || !g.valid || (write && !g.writable) {
				missing = i
				break
			}
		}
		if missing < 0 {
			for _, idx := range b.idxs {
				g := v.grants[idx]
				g.refs++
				b.grants = append(b.grants, g)
			}
			v.mu.Unlock()
			return nil
		}
		idx := b.idxs[missing]
		if g := v.grants[idx]; g != nil && g.fetching != nil {
			ch := g.fetching
			v.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return ctx.Err()
			case <-v.link.Done():
				return v.linkErr()
			}
			v.mu.Lock()
			continue
		}
		g := &grant{fetching: make(chan struct{})}
		old := v.grants[idx]
		v.grants[idx] = g
		v.mu.Unlock()
		if old != nil && old.valid {
			v.m.grantsHeld.Dec() // replaced by a writable one
		}
		err := v.fetch(ctx, idx, g)
		v.mu.Lock()
		close(g.fetching)
		g.fetching = nil
		if err != nil {
			if v.grants[idx] == g {
				delete(v.grants, idx)
			}
			v.mu.Unlock()
			return err
		}
	}
}

func (v *Volume) linkErr() error {
	if err := v.link.Err(); err != nil {
		return fmt.Errorf("%w: %w", syscall.ESHUTDOWN, err)
	}
	return syscall.ESHUTDOWN
}

// fetch asks the target for a grant of chunk idx and fills g.
func (v *Volume) fetch(ctx context.Context, idx uint64, g *grant) error {
	start := time.Now()
	req := protocol.GrantRequest{Handle: v.info.Handle, Offset: idx * uint64(v.info.ChunkSize)}
	if !v.ReadOnly() {
		req.Flags = protocol.GrantWrite
	}
	var gr protocol.Grant
	v.m.grantRequests.Inc()
	if err := v.link.Request(ctx, &req, &gr); err != nil {
		v.m.errors.WithLabelValues("grant").Inc()
		return fmt.Errorf("grant of chunk at %d: %w", req.Offset, err)
	}
	v.m.grantSeconds.Observe(time.Since(start).Seconds())
	if gr.Offset != req.Offset || gr.Length == 0 || gr.Length > v.info.ChunkSize {
		v.protocolError(fmt.Errorf("grant for %d covers %d+%d: %w", req.Offset, gr.Offset, gr.Length, protocol.ErrProtocol))
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

// plan fills b.idxs with the chunks of [off, off+n).
func (v *Volume) plan(b *ioBuf, off, n uint64) {
	cs := uint64(v.info.ChunkSize)
	b.idxs = b.idxs[:0]
	for idx := off / cs; idx*cs < off+n; idx++ {
		b.idxs = append(b.idxs, idx)
	}
}

// ops fills b.ops with one operation per piece of b's segments within one
// chunk. b.grants holds the grants of b.idxs.
func (v *Volume) ops(b *ioBuf, off uint64, write bool) {
	b.ops = b.ops[:0]
	cs := uint64(v.info.ChunkSize)
	first := off / cs
	pos := off
	for si, seg := range b.Segs {
		for so := 0; so < len(seg); {
			g := b.grants[pos/cs-first]
			n := min(uint64(len(seg)-so), g.off+g.length-pos)
			b.ops = append(b.ops, link.Op{Write: write, Addr: g.addr + (pos - g.off), RKey: g.rkey,
				Local: transport.SGE{Region: v.region, Offset: b.slots[si]*v.pool.slotSize + so, Length: int(n)}})
			so += int(n)
			pos += n
		}
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
	for attempt := 0; ; attempt++ {
		if err := v.acquire(ctx, b, write); err != nil {
			v.m.errors.WithLabelValues(op).Inc()
			return v.mapErr(err)
		}
		v.ops(b, off, write)
		start := time.Now()
		err := v.link.RDMA(ctx, b.ops...)
		if err == nil {
			v.m.rdmaSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
			v.m.rdmaOps.WithLabelValues(op).Add(float64(len(b.ops)))
			v.m.rdmaBytes.WithLabelValues(op).Add(float64(n))
		}
		if err == nil && write {
			err = v.done(ctx, b, off, n, fua)
		}
		v.releaseGrants(b)
		if errors.Is(err, transport.ErrQueueFull) && attempt < 100 {
			time.Sleep(time.Duration(attempt+1) * 50 * time.Microsecond)
			continue
		}
		if err != nil {
			v.m.errors.WithLabelValues(op).Inc()
			return v.mapErr(err)
		}
		return nil
	}
}

// done reports a written range; it is sent before the grants are released
// so that the target sees it before any RevokeAck for those chunks.
func (v *Volume) done(ctx context.Context, b *ioBuf, off, n uint64, fua bool) error {
	d := &b.done
	b.ranges[0] = protocol.Range{Offset: off, Length: n}
	*d = protocol.Done{Handle: v.info.Handle, Ranges: b.ranges[:]}
	if !fua {
		return v.link.Send(ctx, 0, d)
	}
	d.Flags = protocol.DoneFUA
	start := time.Now()
	err := v.link.Request(ctx, d, &protocol.OK{})
	v.m.controlSeconds.WithLabelValues("fua").Observe(time.Since(start).Seconds())
	return err
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

func (v *Volume) control(ctx context.Context, op string, m protocol.Message) error {
	start := time.Now()
	err := v.link.Request(ctx, m, &protocol.OK{})
	v.m.controlSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil {
		v.m.errors.WithLabelValues(op).Inc()
		return v.mapErr(fmt.Errorf("%s: %w", op, err))
	}
	return nil
}

// Flush returns once every write completed before it is durable on the target.
func (v *Volume) Flush(ctx context.Context) error {
	return v.control(ctx, "flush", &protocol.Flush{Handle: v.info.Handle})
}

// Trim discards a range; it then reads as zeroes.
func (v *Volume) Trim(ctx context.Context, off, n uint64, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("trim on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	t := &protocol.Trim{Handle: v.info.Handle, Offset: off, Length: n}
	if fua {
		t.Flags = protocol.FlagFUA
	}
	return v.control(ctx, "trim", t)
}

// WriteZeroes zeroes a range, keeping it allocated if noHole.
func (v *Volume) WriteZeroes(ctx context.Context, off, n uint64, noHole, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("write zeroes on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	z := &protocol.WriteZeroes{Handle: v.info.Handle, Offset: off, Length: n}
	if fua {
		z.Flags |= protocol.FlagFUA
	}
	if noHole {
		z.Flags |= protocol.FlagNoHole
	}
	return v.control(ctx, "write_zeroes", z)
}

// Close flushes (for a writable volume), closes the volume on the target
// and the connection. Safe to call twice.
func (v *Volume) Close(ctx context.Context) error {
	v.closeOnce.Do(func() {
		var errs []error
		if v.link.Err() == nil {
			if !v.ReadOnly() {
				if err := v.Flush(ctx); err != nil {
					errs = append(errs, err)
				}
			}
			if err := v.link.Request(ctx, &protocol.Close{Handle: v.info.Handle}, &protocol.OK{}); err != nil {
				errs = append(errs, fmt.Errorf("close volume: %w", err))
			}
		}
		v.link.Close()
		v.wg.Wait()
		v.region.Deregister()
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

