package target

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// Defaults of Options.
const (
	DefaultCacheSize     = 256 << 20
	DefaultChunkSize     = 1 << 20
	DefaultRevokeTimeout = 10 * time.Second
	DefaultWritebackWait = 5 * time.Millisecond
	DefaultDrainTimeout  = 10 * time.Second
)

// Options configure a Target.
type Options struct {
	// Exports are the volumes to serve. At least one.
	Exports []ExportConfig
	// CacheSize is the registered memory budget for cached chunks, shared by
	// all volumes. Default DefaultCacheSize.
	CacheSize int64
	// ChunkSize is the unit of caching and granting, a power of two of at
	// least 64 KiB. Default DefaultChunkSize.
	ChunkSize int
	// RevokeTimeout bounds how long an initiator may take to give a chunk
	// back before its session is closed. Default DefaultRevokeTimeout.
	RevokeTimeout time.Duration
	// WritebackDelay is how long dirty ranges wait to be coalesced before
	// they are written back. Default DefaultWritebackWait.
	WritebackDelay time.Duration
	// DrainTimeout bounds how long Close waits for initiators to finish
	// their IO and flush after it announced the shutdown. Default
	// DefaultDrainTimeout.
	DrainTimeout time.Duration
	// WrapStore, if set, is called once per export with its opened backing
	// file and returns the Store the target uses instead: a test puts a
	// slow or failing disk there. The file is still closed by the target.
	WrapStore func(export string, f *os.File) Store
	// Logger gets one line per session event. Default: no logs.
	Logger *zap.Logger
	// Registerer receives the target's metrics. Default: not registered.
	Registerer prometheus.Registerer
}

// Target serves volumes to initiators.
type Target struct {
	opts    Options
	log     *zap.Logger
	m       *Metrics
	cache   *cache
	vols    []*volume
	volumes map[string]*volume

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	sessions  map[*session]struct{}
	nextID    uint64
	closed    bool
	closeOnce sync.Once
	closeErr  error
}

// New opens the exports (creating sparse files where asked) and allocates
// the cache.
func New(opts Options) (*Target, error) {
	if opts.CacheSize == 0 {
		opts.CacheSize = DefaultCacheSize
	}
	if opts.ChunkSize == 0 {
		opts.ChunkSize = DefaultChunkSize
	}
	if opts.RevokeTimeout == 0 {
		opts.RevokeTimeout = DefaultRevokeTimeout
	}
	if opts.DrainTimeout == 0 {
		opts.DrainTimeout = DefaultDrainTimeout
	}
	if opts.WritebackDelay == 0 {
		opts.WritebackDelay = DefaultWritebackWait
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if cs := opts.ChunkSize; cs < 64<<10 || cs > 1<<30 || cs&(cs-1) != 0 {
		return nil, fmt.Errorf("chunk size %d: want a power of two from 64 KiB to 1 GiB", cs)
	}
	if len(opts.Exports) == 0 {
		return nil, errors.New("no exports")
	}
	t := &Target{opts: opts, log: opts.Logger, m: NewMetrics(opts.Registerer),
		volumes: make(map[string]*volume), sessions: make(map[*session]struct{})}
	for i, e := range opts.Exports {
		if t.volumes[e.Name] != nil {
			t.closeVolumes()
			return nil, fmt.Errorf("export %q given twice", e.Name)
		}
		v, err := openVolume(uint32(i+1), e)
		if err != nil {
			t.closeVolumes()
			return nil, err
		}
		if opts.WrapStore != nil {
			v.f = opts.WrapStore(e.Name, v.file)
		}
		t.vols = append(t.vols, v)
		t.volumes[e.Name] = v
	}
	c, err := newCache(opts.CacheSize, opts.ChunkSize, opts.Logger, t.m, opts.RevokeTimeout)
	if err != nil {
		t.closeVolumes()
		return nil, err
	}
	t.cache = c
	t.ctx, t.cancel = context.WithCancel(context.Background())
	for _, v := range t.vols {
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			c.writebackLoop(t.ctx, v, opts.WritebackDelay)
		}()
		t.log.Info("export", zap.String("name", v.name), zap.String("path", v.path),
			zap.Uint64("size", v.size), zap.Bool("read_only", v.readOnly))
	}
	return t, nil
}

func (t *Target) closeVolumes() {
	for _, v := range t.vols {
		v.file.Close()
	}
}

func (t *Target) exportList() *protocol.ExportList {
	l := &protocol.ExportList{}
	for _, v := range t.vols {
		l.Exports = append(l.Exports, protocol.ExportEntry{Name: v.name, Size: v.size, Flags: volFlags(v)})
	}
	sort.Slice(l.Exports, func(i, j int) bool { return l.Exports[i].Name < l.Exports[j].Name })
	return l
}

// Serve accepts initiators on l until ctx ends, l is closed, or the target
// is closed, then closes l. The sessions it started go on until the target
// is closed (see Close) or their initiators leave.
func (t *Target) Serve(ctx context.Context, l transport.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(t.ctx, cancel)
	defer stop()
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	for {
		req, err := l.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, transport.ErrClosed) {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			req.Reject(nil)
			return nil
		}
		t.wg.Add(1)
		t.mu.Unlock()
		go func() {
			defer t.wg.Done()
			t.serveSession(t.ctx, req)
		}()
	}
}

func (t *Target) serveSession(ctx context.Context, req transport.ConnRequest) {
	t.mu.Lock()
	t.nextID++
	id := t.nextID
	t.mu.Unlock()
	s := &session{t: t, id: id, ready: make(chan struct{}), handles: make(map[uint32]*openVol), chunks: make(map[*chunk]struct{})}
	s.log = t.log.With(zap.Uint64("session", id), zap.String("peer", req.RemoteAddr()))
	s.ctx, s.cancel = context.WithCancel(ctx)
	l, err := link.Accept(ctx, req, link.Options{Handler: s.handle, Logger: s.log})
	if err != nil {
		s.cancel()
		s.log.Warn("session refused", zap.Error(err))
		return
	}
	s.link = l
	close(s.ready)
	t.mu.Lock()
	t.sessions[s] = struct{}{}
	t.mu.Unlock()
	t.m.sessions.Inc()
	t.m.sessionsTotal.Inc()
	s.log.Info("session started", zap.String("local", l.Conn().LocalAddr()))

	// The session lives until its link goes down or the target stops.
	select {
	case <-ctx.Done():
	case <-l.Done():
	}
	l.Close()
	s.end()
	t.mu.Lock()
	delete(t.sessions, s)
	t.mu.Unlock()
	t.m.sessions.Dec()
	reason := l.Err()
	s.log.Info("session ended", zap.NamedError("reason", reason))
}

// Close shuts the target down cleanly: it refuses new sessions, tells every
// initiator that it is shutting down (an Error message with tag 0 and
// CodeShutdown), gives them DrainTimeout to finish their IO, flush and
// disconnect, then ends the sessions left, writes every dirty chunk back,
// syncs and closes the backing files. Safe to call twice.
func (t *Target) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		sessions := make([]*session, 0, len(t.sessions))
		for s := range t.sessions {
			sessions = append(sessions, s)
		}
		t.mu.Unlock()
		t.drain(sessions)
		t.cancel()
		t.mu.Lock()
		for s := range t.sessions {
			s.link.Close()
		}
		t.mu.Unlock()
		t.wg.Wait()
		err := t.cache.close(t.vols)
		for _, v := range t.vols {
			if cerr := v.file.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
		t.closeErr = err
	})
	return t.closeErr
}

// drain announces the shutdown to every session and waits for them to end.
func (t *Target) drain(sessions []*session) {
	if len(sessions) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.opts.DrainTimeout)
	defer cancel()
	notice := &protocol.ErrorMsg{Code: protocol.CodeShutdown, Text: "target shutting down"}
	for _, s := range sessions {
		if err := s.link.Send(ctx, 0, notice); err != nil {
			s.log.Info("shutdown notice not sent", zap.Error(err))
		}
	}
	for _, s := range sessions {
		select {
		case <-s.link.Done():
		case <-ctx.Done():
			t.log.Warn("initiators did not disconnect in time; closing their sessions", zap.Duration("waited", t.opts.DrainTimeout))
			return
		}
	}
}
