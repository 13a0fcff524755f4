package target

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
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
	// DefaultDrainLimit bounds a whole drain, progress or not: less than
	// the 300 s systemd's unit gives rblkd to stop.
	DefaultDrainLimit = 4 * time.Minute
	// DefaultKeepAlive is how long a session may stay silent before the
	// target drops it (it probes after a third of that).
	DefaultKeepAlive = 15 * time.Second
	// DefaultMaxSessions and DefaultMaxSessionsPerHost bound the sessions
	// in all and of one host ID. Each session costs its receive and send
	// buffers (about 1 MiB) and a registration of the cache.
	DefaultMaxSessions        = 1024
	DefaultMaxSessionsPerHost = 64
	// DefaultHandshakeTimeout is how long a connection may take to
	// authenticate before it is closed.
	DefaultHandshakeTimeout = 10 * time.Second
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
	// DrainTimeout bounds how long Close waits, after it announced the
	// shutdown, for initiators that make no progress (no request served,
	// no byte written back, no session ended for that long): a drain that
	// is writing back a slow disk for the initiators' flushes goes on.
	// Default DefaultDrainTimeout.
	DrainTimeout time.Duration
	// DrainLimit bounds the whole drain. Default DefaultDrainLimit.
	DrainLimit time.Duration
	// KeepAlive is how long a silent initiator keeps its session (see
	// link.Options.KeepAlive). Default DefaultKeepAlive; negative: never
	// dropped for silence.
	KeepAlive time.Duration
	// WrapStore, if set, is called once per export with its opened backing
	// file and returns the Store the target uses instead: a test puts a
	// slow or failing disk there. The file is still closed by the target.
	WrapStore func(export string, f *os.File) Store
	// Auth, if set, holds the secrets of the hosts allowed in: every
	// session must prove its host's secret before anything else (see
	// package auth). Nil: hosts name themselves and are believed.
	Auth *auth.Keys
	// TargetID names this target in the authentication. Default: the
	// host name.
	TargetID string
	// MaxSessions and MaxSessionsPerHost bound the sessions (handshaking
	// ones included) in all and of one host ID. Defaults
	// DefaultMaxSessions and DefaultMaxSessionsPerHost.
	MaxSessions        int
	MaxSessionsPerHost int
	// HandshakeTimeout bounds how long a connection may take to
	// authenticate (or, without Auth, to name its host). Default
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// Logger gets one line per session event. Default: no logs.
	Logger *zap.Logger
	// Registerer receives the target's metrics. Default: not registered.
	Registerer prometheus.Registerer
}

// Target serves volumes to initiators.
type Target struct {
	opts  Options
	log   *zap.Logger
	m     *Metrics
	cache *cache

	// volMu guards vols, volumes, nextVol and the live-changing parts of
	// each volume's cfg (Allow, Shared): exports come and go at run time
	// (see exports.go). It is never held while taking mu.
	volMu   sync.RWMutex
	vols    []*volume
	volumes map[string]*volume
	nextVol uint32
	// adminMu serializes AddExport, RemoveExport and UpdateExport.
	adminMu sync.Mutex

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// instance names this target process in VolumeInfo: random, never 0.
	instance uint64

	// progress counts what a drain waits on: requests served, write-back
	// and session ends.
	progress atomic.Uint64

	mu        sync.Mutex
	sessions  map[*session]struct{}
	accepted  int                  // sessions between accept and end, handshaking ones included
	perHost   map[string]int       // sessions by host ID, from AuthStart to end
	idents    map[ident]identEntry // the current session of each identity
	penalties map[string]time.Time // hosts dropped for not answering revokes, until when
	nextID    uint64
	nextGen   uint64
	closed    bool
	closeOnce sync.Once
	closeErr  error
}

// orDefault sets *v to d if it is the zero value.
func orDefault[T comparable](v *T, d T) {
	var zero T
	if *v == zero {
		*v = d
	}
}

// New opens the exports (creating sparse files where asked) and allocates
// the cache.
func New(opts Options) (*Target, error) {
	orDefault(&opts.CacheSize, DefaultCacheSize)
	orDefault(&opts.ChunkSize, DefaultChunkSize)
	orDefault(&opts.RevokeTimeout, DefaultRevokeTimeout)
	orDefault(&opts.DrainTimeout, DefaultDrainTimeout)
	orDefault(&opts.DrainLimit, DefaultDrainLimit)
	orDefault(&opts.KeepAlive, DefaultKeepAlive)
	orDefault(&opts.WritebackDelay, DefaultWritebackWait)
	orDefault(&opts.Logger, zap.NewNop())
	orDefault(&opts.MaxSessions, DefaultMaxSessions)
	orDefault(&opts.MaxSessionsPerHost, DefaultMaxSessionsPerHost)
	orDefault(&opts.HandshakeTimeout, DefaultHandshakeTimeout)
	if opts.TargetID == "" {
		opts.TargetID, _ = os.Hostname()
	}
	if len(opts.TargetID) > protocol.MaxNameLen {
		return nil, fmt.Errorf("target ID of %d bytes: at most %d", len(opts.TargetID), protocol.MaxNameLen)
	}
	if cs := opts.ChunkSize; cs < 64<<10 || cs > 1<<30 || cs&(cs-1) != 0 {
		return nil, fmt.Errorf("chunk size %d: want a power of two from 64 KiB to 1 GiB", cs)
	}
	if len(opts.Exports) == 0 {
		return nil, errors.New("no exports")
	}
	var inst [8]byte
	if _, err := rand.Read(inst[:]); err != nil {
		return nil, fmt.Errorf("target instance: %w", err)
	}
	t := &Target{opts: opts, log: opts.Logger, m: NewMetrics(opts.Registerer), instance: binary.BigEndian.Uint64(inst[:]) | 1,
		volumes: make(map[string]*volume), sessions: make(map[*session]struct{}),
		idents: make(map[ident]identEntry), perHost: make(map[string]int), penalties: make(map[string]time.Time)}
	for i, e := range opts.Exports {
		if t.volumes[e.Name] != nil {
			t.closeVolumes()
			return nil, fmt.Errorf("export %q given twice", e.Name)
		}
		t.nextVol = uint32(i + 1)
		v, err := openVolume(t.nextVol, e)
		if err != nil {
			t.closeVolumes()
			return nil, err
		}
		if opts.WrapStore != nil {
			v.f = opts.WrapStore(e.Name, v.file)
		}
		v.m = t.m.forExport(e.Name)
		t.vols = append(t.vols, v)
		t.volumes[e.Name] = v
	}
	c, err := newCache(opts.CacheSize, opts.ChunkSize, opts.Logger, t.m, opts.RevokeTimeout, &t.progress)
	if err != nil {
		t.closeVolumes()
		return nil, err
	}
	t.cache = c
	if opts.Registerer != nil {
		opts.Registerer.MustRegister(newExportCollector(t))
	}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	for _, v := range t.vols {
		t.startVolume(v)
		t.log.Info("export", zap.String("name", v.name), zap.String("path", v.path),
			zap.Uint64("size", v.size.Load()), zap.Bool("read_only", v.readOnly))
	}
	return t, nil
}

func (t *Target) closeVolumes() {
	for _, v := range t.vols {
		v.file.Close()
	}
}

// exportList lists the exports host may open.
func (t *Target) exportList(host string) *protocol.ExportList {
	l := &protocol.ExportList{}
	t.volMu.RLock()
	defer t.volMu.RUnlock()
	for _, v := range t.vols {
		if !v.cfg.allows(host) {
			continue
		}
		l.Exports = append(l.Exports, protocol.ExportEntry{Name: v.name, Size: v.size.Load(), Flags: volFlags(v)})
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
		if t.accepted >= t.opts.MaxSessions {
			t.mu.Unlock()
			t.m.refused.WithLabelValues("session_limit").Inc()
			t.log.Warn("session refused: too many sessions", zap.String("peer", req.RemoteAddr()), zap.Int("limit", t.opts.MaxSessions))
			em := protocol.ErrorMsg{Code: protocol.CodeBusy, Text: fmt.Sprintf("too many sessions on the target (limit %d)", t.opts.MaxSessions)}
			b, _ := protocol.Append(nil, 0, 0, &em)
			req.Reject(b)
			continue
		}
		t.accepted++
		t.wg.Add(1)
		t.mu.Unlock()
		go func() {
			defer t.wg.Done()
			t.serveSession(t.ctx, req)
			t.mu.Lock()
			t.accepted--
			t.mu.Unlock()
		}()
	}
}

func (t *Target) serveSession(ctx context.Context, req transport.ConnRequest) {
	t.mu.Lock()
	t.nextID++
	id := t.nextID
	t.mu.Unlock()
	s := &session{t: t, id: id, ready: make(chan struct{}), ended: make(chan struct{}),
		handles: make(map[uint32]*openVol), peer: peerHost(req.RemoteAddr())}
	s.log = t.log.With(zap.Uint64("session", id), zap.String("peer", req.RemoteAddr()))
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.penaltyEnd.Store(t.penaltyOf(s.peer))
	l, err := link.Accept(ctx, req, link.Options{Handler: s.handle, Logger: s.log, KeepAlive: max(t.opts.KeepAlive, 0)})
	if err != nil {
		close(s.ended)
		s.cancel()
		s.log.Warn("session refused", zap.Error(err))
		return
	}
	s.link = l
	t.mu.Lock()
	t.sessions[s] = struct{}{} // before any request: Grow finds every handle
	t.mu.Unlock()
	// Counted before any request is served: a client that got a reply
	// finds its session in rblkd_sessions.
	t.m.sessions.Inc()
	t.m.sessionsTotal.Inc()
	close(s.ready)
	s.log.Info("session started", zap.String("local", l.Conn().LocalAddr()))
	// A connection that does not authenticate in time is closed.
	handshake := time.AfterFunc(t.opts.HandshakeTimeout, func() {
		s.mu.Lock()
		st := s.state
		if st == stateNew || st == stateChallenged {
			s.state = stateRefused
		}
		s.mu.Unlock()
		if st == stateNew || st == stateChallenged {
			t.m.authFailures.WithLabelValues("timeout").Inc()
			s.log.Warn("closing a connection that did not authenticate in time", zap.Duration("timeout", t.opts.HandshakeTimeout))
			l.Close()
		}
	})

	// The session lives until its link goes down or the target stops.
	select {
	case <-ctx.Done():
	case <-l.Done():
	}
	handshake.Stop()
	l.Close()
	s.end()
	t.mu.Lock()
	delete(t.sessions, s)
	if s.counted {
		if t.perHost[s.countedHost]--; t.perHost[s.countedHost] <= 0 {
			delete(t.perHost, s.countedHost)
			t.m.hostSessions.DeleteLabelValues(s.countedHost)
		} else {
			t.m.hostSessions.WithLabelValues(s.countedHost).Set(float64(t.perHost[s.countedHost]))
		}
	}
	t.mu.Unlock()
	t.m.sessions.Dec()
	t.progress.Add(1)
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
		// An export being added or removed is finished first.
		t.adminMu.Lock()
		defer t.adminMu.Unlock()
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
		t.volMu.RLock()
		vols := slices.Clone(t.vols)
		t.volMu.RUnlock()
		err := t.cache.close(vols)
		for _, v := range vols {
			if cerr := v.file.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
		t.closeErr = err
	})
	return t.closeErr
}

// drain announces the shutdown to every session and waits for them to end,
// as long as they make progress (see Options.DrainTimeout), at most
// Options.DrainLimit.
func (t *Target) drain(sessions []*session) {
	t.drainWith(context.Background(), sessions, "target shutting down")
}

// drainWith is drain with a reason of its own in the notice (why), bounded
// by ctx too.
func (t *Target) drainWith(ctx context.Context, sessions []*session, why string) {
	if len(sessions) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, t.opts.DrainLimit)
	defer cancel()
	notice := &protocol.ErrorMsg{Code: protocol.CodeShutdown, Text: why}
	for _, s := range sessions {
		sctx, scancel := context.WithTimeout(ctx, t.opts.DrainTimeout)
		if err := s.link.Send(sctx, 0, notice); err != nil {
			s.log.Info("shutdown notice not sent", zap.Error(err))
		}
		scancel()
	}
	check := time.NewTicker(t.opts.DrainTimeout)
	defer check.Stop()
	last := t.progress.Load()
	for _, s := range sessions {
		for waiting := true; waiting; {
			select {
			case <-s.link.Done():
				waiting = false
			case <-check.C:
				if now := t.progress.Load(); now != last {
					last = now
					continue
				}
				t.log.Warn("initiators made no progress draining; closing their sessions", zap.Duration("waited", t.opts.DrainTimeout))
				return
			case <-ctx.Done():
				t.log.Warn("initiators did not disconnect in time; closing their sessions", zap.Duration("waited", t.opts.DrainLimit))
				return
			}
		}
	}
}

// reinstate gives ov its session generation and, if it is writable,
// makes s its identity's current session, after the checks of the
// export's access mode:
//   - an exclusive export (not Shared) has one writing host: another
//     host's writer makes the open fail with ErrBusy naming it, unless
//     takeover, which fences that writer first;
//   - every earlier session of the same host and export is fenced
//     (reinstatement: the host reconnected, or crashed and came back).
//
// Fencing marks the earlier handle stale (its Done and Flush are refused
// from now on), closes its connection and waits until the session
// released everything: its requests finished and its grants
// deregistered, so nothing still in flight on it can reach the cache or
// the file.
func (t *Target) reinstate(ctx context.Context, s *session, ov *openVol, takeover bool) error {
	t.mu.Lock()
	t.nextGen++
	ov.gen = t.nextGen
	if !ov.writable {
		// Read-only: nothing of it can reach the file.
		t.mu.Unlock()
		return nil
	}
	var others []identEntry
	if !t.shared(ov.v) {
		for id, e := range t.idents {
			if id.export == ov.ident.export && id != ov.ident && e.s != s {
				others = append(others, e)
			}
		}
	}
	if len(others) > 0 && !takeover {
		t.mu.Unlock()
		t.m.refused.WithLabelValues("writer_busy").Inc()
		o := others[0]
		return fmt.Errorf("export %q is held read-write by %s (session %d from %s): attach read-only, or take it over (rblk-attach --takeover): %w",
			ov.ident.export, o.ov.ident.describe(), o.s.id, o.s.peer, protocol.ErrBusy)
	}
	// The queues of the sessions fenced here are fenced with them (and
	// join them no more).
	var othersQueues, queues []identEntry
	for _, o := range others {
		delete(t.idents, o.ov.ident)
		othersQueues = append(othersQueues, o.ov.endQueues()...)
	}
	old, had := t.idents[ov.ident]
	if had && old.s != s {
		queues = old.ov.endQueues()
	}
	t.idents[ov.ident] = identEntry{s: s, ov: ov}
	if until, ok := t.penalties[ov.ident.host]; ok && ov.ident.host != "" && until.UnixNano() > s.penaltyEnd.Load() {
		s.penaltyEnd.Store(until.UnixNano())
	}
	t.mu.Unlock()
	var errs []error
	for _, o := range others {
		t.m.takeovers.Inc()
		o.s.log.Warn("fencing this session: another host takes the export over", zap.String("export", ov.ident.export),
			zap.String("holder", o.ov.ident.describe()), zap.String("new_holder", ov.ident.describe()), zap.Uint64("new_session", s.id))
		errs = append(errs, t.fence(ctx, o, fmt.Sprintf("fenced: %s took export %q over on session %d", ov.ident.describe(), ov.ident.export, s.id)))
	}
	for _, q := range othersQueues {
		errs = append(errs, t.fence(ctx, q, fmt.Sprintf("fenced: %s took export %q over on session %d", ov.ident.describe(), ov.ident.export, s.id)))
	}
	for _, q := range queues {
		errs = append(errs, t.fence(ctx, q, fmt.Sprintf("fenced: host %q opened export %q again on session %d", ov.ident.host, ov.ident.export, s.id)))
	}
	if had && old.s != s {
		old.s.log.Warn("fencing this session: its host opened the export again", zap.String("host_id", ov.ident.host),
			zap.String("export", ov.ident.export), zap.Uint64("new_session", s.id), zap.Uint64("new_generation", ov.gen))
		errs = append(errs, t.fence(ctx, old, fmt.Sprintf("fenced: host %q opened export %q again on session %d", ov.ident.host, ov.ident.export, s.id)))
	}
	return errors.Join(errs...)
}

// fence ends the session of e: its handle is stale and it gets no new
// grant at once; it is told why (if it still listens: another attach, not
// the new session's initiator reconnecting, so that it stops instead of
// fencing back); then its grants are invalidated, its connection is closed,
// and fence waits until it released everything. The notice goes before
// the invalidation: an RDMA WRITE of the session's that meets an
// invalidated grant breaks its connection (on verbs, both ends' queue
// pairs), and the notice with it. Until fence returns, nothing of the new
// holder has run, so what the old one wrote meanwhile comes before it.
func (t *Target) fence(ctx context.Context, e identEntry, why string) error {
	e.ov.fenced.Store(true)
	e.s.markFenced()
	t.m.fenced.Inc()
	nctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	notice := &protocol.ErrorMsg{Code: protocol.CodeStale, Text: why}
	err := e.s.link.Send(nctx, 0, notice)
	if err == nil {
		err = e.s.link.WaitSent(nctx)
	}
	if err != nil {
		e.s.log.Debug("fence notice not delivered", zap.Error(err))
	}
	cancel()
	e.s.dropFencedGrants()
	e.s.link.Close()
	select {
	case <-e.s.ended:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("fence session %d of %s: %w", e.s.id, e.ov.ident.describe(), ctx.Err())
	}
}

// describe names the identity in messages.
func (id ident) describe() string {
	if id.host == "" {
		return "an anonymous initiator"
	}
	return fmt.Sprintf("host %q", id.host)
}

// admitHost counts s as a session of host, within MaxSessionsPerHost.
func (t *Target) admitHost(s *session, host string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.perHost[host] >= t.opts.MaxSessionsPerHost {
		t.m.refused.WithLabelValues("host_session_limit").Inc()
		return fmt.Errorf("host %q has %d sessions, the most one host may have: %w", host, t.perHost[host], protocol.ErrBusy)
	}
	t.perHost[host]++
	t.m.hostSessions.WithLabelValues(host).Set(float64(t.perHost[host]))
	s.countedHost, s.counted = host, true
	return nil
}

// forget drops ov's identity when s was its current session, once the
// session's queues have ended (closed without a notice: the initiator
// reconnects them all); a queue leaves its session's list.
func (t *Target) forget(s *session, ov *openVol) {
	t.mu.Lock()
	if p := ov.primary; p != nil {
		for i, q := range p.queues {
			if q.ov == ov {
				p.queues = append(p.queues[:i], p.queues[i+1:]...)
				break
			}
		}
		t.mu.Unlock()
		return
	}
	e, ok := t.idents[ov.ident]
	if !ok || e.s != s || e.ov != ov {
		t.mu.Unlock()
		return
	}
	queues := ov.endQueues()
	t.mu.Unlock()
	for _, q := range queues {
		// Until every queue has ended, the identity stays: an Open of the
		// host meanwhile fences them too.
		q.s.log.Info("closing this queue: the first connection of its session ended", zap.Uint64("session_of", s.id))
		t.endQueue(q)
	}
	t.mu.Lock()
	if e, ok := t.idents[ov.ident]; ok && e.s == s && e.ov == ov {
		// Another read-write handle of the session and export keeps the
		// identity, and the export's writer, until it closes too.
		if next := s.writerLike(ov); next != nil {
			t.idents[ov.ident] = identEntry{s: s, ov: next}
		} else {
			delete(t.idents, ov.ident)
		}
	}
	t.mu.Unlock()
}

// endQueues marks ov's session as ended (no more joins) and returns its
// queues. t.mu is held.
func (ov *openVol) endQueues() []identEntry {
	ov.ended = true
	q := ov.queues
	ov.queues = nil
	return q
}

// join adds s, with ov, to the current session of ov's identity as an IO
// queue: ov gets that session's generation checked and is fenced with it.
func (t *Target) join(s *session, ov *openVol) error {
	if !ov.writable {
		// Read-only, as its Open: nothing of it can reach the file, and
		// read-only sessions are not fenced.
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.idents[ov.ident]
	switch {
	case !ok || e.ov.gen != ov.gen || e.ov.ended || e.ov.fenced.Load():
		return fmt.Errorf("join session generation %d of %s on %q: not the current session: %w", ov.gen, ov.ident.describe(), ov.ident.export, protocol.ErrStale)
	case e.ov.writable != ov.writable:
		return fmt.Errorf("join session generation %d of %s on %q: the session is writable=%v, the join %v: %w", ov.gen, ov.ident.describe(), ov.ident.export,
			e.ov.writable, ov.writable, protocol.ErrInvalid)
	case e.s == s:
		return fmt.Errorf("join session generation %d on %q: the connection is that session's own: %w", ov.gen, ov.ident.export, protocol.ErrInvalid)
	}
	ov.primary = e.ov
	e.ov.queues = append(e.ov.queues, identEntry{s: s, ov: ov})
	return nil
}

// endQueue ends a queue whose session ended without being fenced: as a
// fence without the notice (its initiator reconnects rather than stops).
func (t *Target) endQueue(q identEntry) {
	q.ov.fenced.Store(true)
	q.s.markFenced()
	q.s.dropFencedGrants()
	q.s.link.Close()
	<-q.s.ended
}

// penaltyTime is how long a host dropped for not answering a revoke gets a
// cut share of the cache.
func (t *Target) penaltyTime() time.Duration { return 3 * t.opts.RevokeTimeout }

// penalize cuts the cache share of s's host (its host IDs, and its peer
// address) for a while: a misbehaving initiator that comes back at once
// does not get its grants back at once.
func (t *Target) penalize(s *session) {
	until := time.Now().Add(t.penaltyTime())
	s.penaltyEnd.Store(until.UnixNano())
	s.mu.Lock()
	keys := []string{s.peer}
	for _, ov := range s.handles {
		if ov.ident.host != "" {
			keys = append(keys, ov.ident.host)
		}
	}
	s.mu.Unlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	for k, u := range t.penalties {
		if u.Before(now) {
			delete(t.penalties, k)
		}
	}
	for _, k := range keys {
		t.penalties[k] = until
	}
}

// penaltyOf returns until when key is penalized (UnixNano; 0 if it is not).
func (t *Target) penaltyOf(key string) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if u, ok := t.penalties[key]; ok && u.After(time.Now()) {
		return u.UnixNano()
	}
	return 0
}

// peerHost is the host part of a peer address, for penalties.
func peerHost(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return "peer:" + h
	}
	return "peer:" + addr
}

type identEntry struct {
	s  *session
	ov *openVol
}
