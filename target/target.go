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
	// DefaultLivenessProbe bounds how long a live attach has to answer the
	// KeepAlive that checks it when another attach of its host opens its
	// export (see Options.LivenessProbe).
	DefaultLivenessProbe = 5 * time.Second
	// DefaultMaxUnauthenticated bounds the connections waiting to
	// authenticate: each costs a session's buffers (about 150 KB) until
	// the handshake timeout.
	DefaultMaxUnauthenticated = 128
	// DefaultMaxHandlesPerSession bounds the handles of one session (an
	// initiator opens one per session).
	DefaultMaxHandlesPerSession = 16
)

// Defaults of the limits on failed authentications and on log lines
// (Options.FailedAuthPerPeer, FailedAuthPerHost, LogLimit).
var (
	DefaultFailedAuthPerPeer = RateLimit{Burst: 10, Every: time.Second}
	DefaultFailedAuthPerHost = RateLimit{Burst: 30, Every: 200 * time.Millisecond}
	DefaultLogLimit          = RateLimit{Burst: 20, Every: time.Second}
)

// failedAuthDelay is how late a wrong proof for a host over
// FailedAuthPerHost is answered (at most until the handshake timeout).
const failedAuthDelay = time.Second

// probeFresh is how long the answer of a liveness probe stands for the
// Opens that did not wait for it: more Opens meanwhile send no more
// KeepAlives.
const probeFresh = time.Second

// maxProbeRounds bounds how often one Open waits for a liveness probe
// (the holder it checks may change meanwhile) before it is refused.
const maxProbeRounds = 4

// Options configure a Target.
type Options struct {
	// Exports are the volumes to serve at start; there may be none (a
	// storage node whose volumes are created at run time: AddExport).
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
	// no write-back written, no session ended for that long, and no
	// request of theirs being served): a drain that is writing back a
	// slow disk for the initiators' flushes goes on, however long one
	// write takes (DrainLimit bounds it). Default DefaultDrainTimeout.
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
	// MaxSessions and MaxSessionsPerHost bound the authenticated sessions
	// (on a target without Auth: those whose host named itself) in all
	// and of one host ID: a session counts from its accepted proof to its
	// end. A connection that comes while MaxSessions are authenticated is
	// refused at once. Defaults DefaultMaxSessions and
	// DefaultMaxSessionsPerHost.
	MaxSessions        int
	MaxSessionsPerHost int
	// MaxUnauthenticated bounds the connections that have not
	// authenticated yet, apart from MaxSessions; a listener that holds
	// streams before their connect request (transport.HandshakeLimiter)
	// holds at most as many more. Beyond it, a new connection from the
	// peer address that holds the most of them is refused at once
	// (protocol.ErrBusy); one from another address takes the place of the
	// oldest connection of the address that holds the most, so that a
	// flood from one address keeps no other host out. Default
	// DefaultMaxUnauthenticated.
	MaxUnauthenticated int
	// HandshakeTimeout bounds how long a connection may take to
	// authenticate (or, without Auth, to name its host), from its accept
	// (transport.AcceptTimer) or else from Serve's. Default
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// LivenessProbe bounds the check of a live session when another attach
	// (another instance) of the same host opens its export read-write: the
	// session that does not answer a KeepAlive in that time is fenced and
	// the Open goes on; one that answers keeps the export. At most
	// KeepAlive when that is positive. Default DefaultLivenessProbe.
	LivenessProbe time.Duration
	// MaxHandlesPerSession bounds the handles (Open, Join) a session has
	// open at once; more are refused with protocol.ErrBusy. Default
	// DefaultMaxHandlesPerSession.
	MaxHandlesPerSession int
	// FailedAuthPerPeer limits failed authentications (unknown host, no
	// or a wrong secret, requests before authentication) by peer address:
	// beyond it, AuthStart from that address is refused at once until it
	// has a token back. Default DefaultFailedAuthPerPeer.
	FailedAuthPerPeer RateLimit
	// FailedAuthPerHost limits wrong proofs by host ID: beyond it, a wrong
	// proof for that host is answered a second late (a right one never
	// waits, so an attacker who knows a host ID cannot lock its host out).
	// Default DefaultFailedAuthPerHost.
	FailedAuthPerHost RateLimit
	// LogLimit bounds the log lines a client can cause at will (refused
	// connections and authentications, handshake timeouts, opens, failed
	// requests): by peer address and kind of line. Default
	// DefaultLogLimit.
	LogLimit RateLimit
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
	// admin serializes AddExport, RemoveExport, UpdateExport and Grow
	// (see adminLock in exports.go).
	admin adminLock

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// instance names this target process in VolumeInfo: random, never 0.
	instance uint64

	// progress counts what a drain waits on: requests served, write-back
	// and session ends.
	progress atomic.Uint64

	// logLimit bounds the log lines clients can multiply (loglimit.go).
	logLimit *logLimiter

	// authMu guards the limits of failed authentications.
	authMu    sync.Mutex
	peerFails *buckets // by peer address
	hostFails *buckets // wrong proofs by host ID

	mu        sync.Mutex
	sessions  map[*session]struct{}
	perHost   map[string]int       // authenticated sessions by host ID
	idents    map[ident]identEntry // the current session of each identity
	probes    map[ident]*probe     // the last liveness probe of each identity's current session
	penalties map[string]time.Time // hosts dropped for not answering revokes, until when
	nextID    uint64
	nextGen   uint64
	closed    bool
	closeOnce sync.Once
	closeErr  error
	// Sessions counted against the limits (guarded by mu too).
	authed   int                   // authenticated sessions
	unauth   int                   // accepted connections not authenticated yet
	unauthBy map[string][]*preauth // the same by peer address, oldest first
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
	orDefault(&opts.LivenessProbe, DefaultLivenessProbe)
	if opts.KeepAlive > 0 {
		opts.LivenessProbe = min(opts.LivenessProbe, opts.KeepAlive)
	}
	orDefault(&opts.MaxUnauthenticated, DefaultMaxUnauthenticated)
	orDefault(&opts.MaxHandlesPerSession, DefaultMaxHandlesPerSession)
	orDefault(&opts.FailedAuthPerPeer, DefaultFailedAuthPerPeer)
	orDefault(&opts.FailedAuthPerHost, DefaultFailedAuthPerHost)
	orDefault(&opts.LogLimit, DefaultLogLimit)
	for name, v := range map[string]int{"max sessions": opts.MaxSessions, "max sessions per host": opts.MaxSessionsPerHost,
		"max unauthenticated": opts.MaxUnauthenticated, "max handles per session": opts.MaxHandlesPerSession} {
		if v < 1 {
			return nil, fmt.Errorf("%s %d: want at least 1", name, v)
		}
	}
	for name, l := range map[string]RateLimit{"failed authentications per peer": opts.FailedAuthPerPeer,
		"failed authentications per host": opts.FailedAuthPerHost, "log limit": opts.LogLimit} {
		if l.Burst < 1 || l.Every <= 0 {
			return nil, fmt.Errorf("%s %+v: want a burst of at least 1 and a positive interval", name, l)
		}
	}
	if opts.HandshakeTimeout < 0 {
		return nil, fmt.Errorf("handshake timeout %v: want a positive duration", opts.HandshakeTimeout)
	}
	if opts.TargetID == "" {
		opts.TargetID, _ = os.Hostname()
	}
	if len(opts.TargetID) > protocol.MaxNameLen {
		return nil, fmt.Errorf("target ID of %d bytes: at most %d", len(opts.TargetID), protocol.MaxNameLen)
	}
	if cs := opts.ChunkSize; cs < 64<<10 || cs > 1<<30 || cs&(cs-1) != 0 {
		return nil, fmt.Errorf("chunk size %d: want a power of two from 64 KiB to 1 GiB", cs)
	}
	var inst [8]byte
	if _, err := rand.Read(inst[:]); err != nil {
		return nil, fmt.Errorf("target instance: %w", err)
	}
	t := &Target{opts: opts, log: opts.Logger, m: NewMetrics(opts.Registerer), instance: binary.BigEndian.Uint64(inst[:]) | 1,
		volumes: make(map[string]*volume), sessions: make(map[*session]struct{}),
		idents: make(map[ident]identEntry), probes: make(map[ident]*probe), perHost: make(map[string]int), penalties: make(map[string]time.Time),
		admin:    newAdminLock(),
		unauthBy: make(map[string][]*preauth), peerFails: newBuckets(opts.FailedAuthPerPeer, maxFailKeys),
		hostFails: newBuckets(opts.FailedAuthPerHost, maxFailKeys)}
	t.logLimit = newLogLimiter(opts.LogLimit, t.m.logSuppressed)
	for i, e := range opts.Exports {
		if t.volumes[e.Name] != nil {
			t.closeVolumes()
			return nil, fmt.Errorf("export %q given twice", e.Name)
		}
		v, _, err := openVolume(e)
		if err != nil {
			t.closeVolumes()
			return nil, err
		}
		if o := t.sameFileLocked(v.fileID); o != nil {
			v.file.Close()
			t.closeVolumes()
			return nil, fmt.Errorf("export %q: %w", e.Name, sameFileError(e.Path, o.name, o.cfg.Path))
		}
		t.nextVol = uint32(i + 1)
		v.id = t.nextVol
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
// is closed (see Close) or their initiators leave. A listener that holds
// streams before their connect request (transport.HandshakeLimiter) gets
// the target's HandshakeTimeout and MaxUnauthenticated.
func (t *Target) Serve(ctx context.Context, l transport.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(t.ctx, cancel)
	defer stop()
	go func() {
		<-ctx.Done()
		l.Close()
	}()
	if hl, ok := l.(transport.HandshakeLimiter); ok {
		hl.LimitHandshakes(transport.HandshakeLimits{Timeout: t.opts.HandshakeTimeout, MaxPending: t.opts.MaxUnauthenticated,
			Dropped: t.droppedBeforeConnect})
	}
	for {
		req, err := l.Accept(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, transport.ErrClosed) {
				return nil
			}
			return fmt.Errorf("accept: %w", err)
		}
		if !t.admit(req) {
			return nil
		}
	}
}

// preauth is a connection accepted and not authenticated yet, counted in
// Target.unauth (Target.mu).
type preauth struct {
	peer   string
	since  time.Time // its accept: its handshake timeout runs from there
	cancel context.CancelFunc
	gone   bool // no longer counted: authenticated, ended, or evicted
}

// admit starts a session for req within the limits, or refuses it; false:
// the target is closed.
func (t *Target) admit(req transport.ConnRequest) bool {
	since := time.Now()
	if at, ok := req.(transport.AcceptTimer); ok {
		if a := at.AcceptedAt(); !a.IsZero() && a.Before(since) {
			since = a
		}
	}
	peer := peerHost(req.RemoteAddr())
	ctx, cancel := context.WithCancel(t.ctx)
	pre := &preauth{peer: peer, since: since, cancel: cancel}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		cancel()
		req.Reject(nil)
		return false
	}
	if t.authed >= t.opts.MaxSessions {
		t.mu.Unlock()
		cancel()
		t.m.refused.WithLabelValues("session_limit").Inc()
		t.logLimit.limited(t.log, peer).Warn("session refused: too many sessions", zap.String("peer", req.RemoteAddr()), zap.Int("limit", t.opts.MaxSessions))
		t.reject(req, fmt.Sprintf("too many sessions on the target (limit %d)", t.opts.MaxSessions))
		return true
	}
	victim, ok := t.makeRoomLocked(peer)
	if !ok {
		n := len(t.unauthBy[peer])
		t.mu.Unlock()
		cancel()
		t.m.refused.WithLabelValues("unauthenticated_limit").Inc()
		t.logLimit.limited(t.log, peer).Warn("session refused: too many connections waiting to authenticate",
			zap.String("peer", req.RemoteAddr()), zap.Int("limit", t.opts.MaxUnauthenticated), zap.Int("from_peer", n))
		t.reject(req, fmt.Sprintf("too many connections waiting to authenticate (limit %d, %d from your address): retry later", t.opts.MaxUnauthenticated, n))
		return true
	}
	t.addUnauthLocked(pre)
	t.wg.Add(1)
	t.mu.Unlock()
	if victim != nil {
		t.m.refused.WithLabelValues("unauthenticated_evicted").Inc()
		t.logLimit.limited(t.log, victim.peer).Warn("closing a connection that has not authenticated: too many connections wait to authenticate, the most from its address",
			zap.String("peer", victim.peer), zap.Duration("waited", time.Since(victim.since)), zap.Int("limit", t.opts.MaxUnauthenticated))
		victim.cancel()
	}
	go func() {
		defer t.wg.Done()
		defer cancel()
		t.serveSession(ctx, req, pre)
		t.mu.Lock()
		t.removeUnauthLocked(pre)
		t.mu.Unlock()
	}()
	return true
}

// reject refuses req with a busy error that says why.
func (t *Target) reject(req transport.ConnRequest, why string) {
	em := protocol.ErrorMsg{Code: protocol.CodeBusy, Text: why}
	b, _ := protocol.Append(nil, 0, 0, &em)
	req.Reject(b)
}

// makeRoomLocked decides whether a new connection from peer may wait to
// authenticate: yes while fewer than MaxUnauthenticated wait; beyond,
// only if another address holds more of them than peer does, whose oldest
// is then the victim (no longer counted; the caller closes it). t.mu is
// held.
func (t *Target) makeRoomLocked(peer string) (victim *preauth, ok bool) {
	if t.unauth < t.opts.MaxUnauthenticated {
		return nil, true
	}
	var most []*preauth
	for _, q := range t.unauthBy {
		if len(q) > len(most) || (len(q) == len(most) && len(q) > 0 && q[0].since.Before(most[0].since)) {
			most = q
		}
	}
	if len(most) <= len(t.unauthBy[peer]) {
		return nil, false
	}
	victim = most[0]
	t.removeUnauthLocked(victim)
	return victim, true
}

// addUnauthLocked counts pre as waiting to authenticate. t.mu is held.
func (t *Target) addUnauthLocked(pre *preauth) {
	t.unauth++
	t.unauthBy[pre.peer] = append(t.unauthBy[pre.peer], pre)
	t.m.unauthSessions.Set(float64(t.unauth))
}

// removeUnauthLocked stops counting pre, once. t.mu is held.
func (t *Target) removeUnauthLocked(pre *preauth) {
	if pre.gone {
		return
	}
	pre.gone = true
	t.unauth--
	t.m.unauthSessions.Set(float64(t.unauth))
	q := t.unauthBy[pre.peer]
	for i, o := range q {
		if o == pre {
			q = append(q[:i], q[i+1:]...)
			break
		}
	}
	if len(q) == 0 {
		delete(t.unauthBy, pre.peer)
	} else {
		t.unauthBy[pre.peer] = q
	}
}

// droppedBeforeConnect counts and logs a stream the listener dropped
// before its connect request came (transport.HandshakeLimits.Dropped).
func (t *Target) droppedBeforeConnect(reason transport.DropReason, remote string) {
	peer := peerHost(remote)
	log := t.logLimit.limited(t.log, peer)
	switch reason {
	case transport.DropTimeout:
		t.m.authFailures.WithLabelValues("timeout").Inc()
		log.Warn("closing a connection that did not authenticate in time", zap.String("peer", remote),
			zap.Duration("timeout", t.opts.HandshakeTimeout), zap.String("stage", "connect request"))
	case transport.DropLimit:
		t.m.refused.WithLabelValues("unauthenticated_limit").Inc()
		log.Warn("session refused: too many connections waiting to authenticate", zap.String("peer", remote),
			zap.Int("limit", t.opts.MaxUnauthenticated), zap.String("stage", "connect request"))
	case transport.DropEvicted:
		t.m.refused.WithLabelValues("unauthenticated_evicted").Inc()
		log.Warn("closing a connection that has not authenticated: too many connections wait to authenticate, the most from its address",
			zap.String("peer", remote), zap.Int("limit", t.opts.MaxUnauthenticated), zap.String("stage", "connect request"))
	}
}

func (t *Target) serveSession(ctx context.Context, req transport.ConnRequest, pre *preauth) {
	t.mu.Lock()
	t.nextID++
	id := t.nextID
	t.mu.Unlock()
	s := &session{t: t, id: id, ready: make(chan struct{}), ended: make(chan struct{}), pre: pre,
		handles: make(map[uint32]*openVol), peer: peerHost(req.RemoteAddr())}
	s.log = t.log.With(zap.Uint64("session", id), zap.String("peer", req.RemoteAddr()))
	s.noisy = t.logLimit.limited(s.log, s.peer)
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.penaltyEnd.Store(t.penaltyOf(s.peer))
	// The handshake timeout runs from the connection's accept.
	deadline := pre.since.Add(t.opts.HandshakeTimeout)
	actx, acancel := context.WithDeadline(ctx, deadline)
	l, err := link.Accept(actx, req, link.Options{Handler: s.handle, Logger: s.log, KeepAlive: max(t.opts.KeepAlive, 0)})
	timedOut := actx.Err() == context.DeadlineExceeded
	acancel()
	if err != nil {
		close(s.ended)
		s.cancel()
		if timedOut {
			t.m.authFailures.WithLabelValues("timeout").Inc()
		}
		s.noisy.Warn("session refused", zap.Error(err))
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
	s.noisy.Info("session started", zap.String("local", l.Conn().LocalAddr()))
	// A connection that does not authenticate in time is closed.
	handshake := time.AfterFunc(time.Until(deadline), func() {
		s.mu.Lock()
		st := s.state
		if st != stateReady && st != stateRefused {
			s.state = stateRefused
		}
		s.mu.Unlock()
		if st != stateReady && st != stateRefused {
			t.m.authFailures.WithLabelValues("timeout").Inc()
			s.noisy.Warn("closing a connection that did not authenticate in time", zap.Duration("timeout", t.opts.HandshakeTimeout),
				zap.Duration("since_accept", time.Since(pre.since)))
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
	authenticated := s.counted
	if s.counted {
		t.authed--
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
	s.noisy.Info("session ended", zap.NamedError("reason", reason), zap.Bool("authenticated", authenticated))
}

// Close shuts the target down cleanly: it refuses new sessions, tells every
// initiator that it is shutting down (an Error message with tag 0 and
// CodeShutdown), gives them DrainTimeout to finish their IO, flush and
// disconnect, then ends the sessions left, writes every dirty chunk back,
// syncs and closes the backing files. An export operation in progress (a
// RemoveExport draining its sessions) is cut short first, and those
// waiting to start fail with ErrClosed. Safe to call twice.
func (t *Target) Close() error {
	t.closeOnce.Do(func() {
		// An export being added, removed, updated or grown is finished
		// first, at once: its waits (a drain, a revoke) end now, it
		// leaves the export served or gone, never half, and what comes
		// after it gives up (ErrClosed). What it cannot cut short is disk
		// IO, which the shutdown would wait for as well.
		t.admin.cancel()
		t.admin.sem <- struct{}{}
		defer func() { <-t.admin.sem }()
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
				if now := t.progress.Load(); now != last || serving(sessions) {
					// (An initiator whose request is being served,
					// such as its Flush writing back a slow disk,
					// waits for the target.)
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

// serving reports whether a request of one of sessions is being served.
func serving(sessions []*session) bool {
	for _, s := range sessions {
		if s.serving.Load() > 0 {
			return true
		}
	}
	return false
}

// reinstate gives ov its session generation and, if it is writable,
// makes s its identity's current session, after the checks of the
// export's access mode:
//   - an exclusive export (not Shared) has one writing host: another
//     host's writer makes the open fail with ErrBusy naming it, unless
//     takeover, which fences that writer first;
//   - the earlier session of the same host and export is fenced when it
//     is the same attach coming back (reinstatement: its own reconnect, or
//     the host back after the target lost the link): the same instance,
//     or an Open without one (an initiator of before instances);
//   - the live session of another attach of the same host (another
//     instance) keeps the export: the open fails with ErrBusy naming it,
//     unless takeover, which fences it. Unless its link is down, it is
//     probed first (see checkLive): one that does not answer in time is
//     dead, and is fenced as a reinstatement.
//
// Fencing marks the earlier handle stale (its Done and Flush are refused
// from now on), closes its connection and waits until the session
// released everything: its requests finished and its grants
// deregistered, so nothing still in flight on it can reach the cache or
// the file. A refused open leaves nothing behind.
func (t *Target) reinstate(ctx context.Context, s *session, ov *openVol, takeover bool) error {
	t.mu.Lock()
	t.nextGen++
	ov.gen = t.nextGen
	if !ov.writable {
		// Read-only: nothing of it can reach the file.
		t.mu.Unlock()
		return nil
	}
	var waited *probe       // the last probe this open waited for
	var others []identEntry // other hosts' writers
	for round := 0; ; round++ {
		others = others[:0]
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
		old, had := t.idents[ov.ident]
		if !had || old.s == s || takeover || sameAttach(old.ov, ov) {
			break
		}
		// Another attach of this host holds the export.
		p, dead := t.checkLive(old, waited)
		if p == nil && !dead {
			t.mu.Unlock()
			t.m.refused.WithLabelValues("attach_busy").Inc()
			return heldByAttach(ov, old)
		}
		if dead {
			break
		}
		if round+1 >= maxProbeRounds {
			t.mu.Unlock()
			t.m.refused.WithLabelValues("attach_busy").Inc()
			return heldByAttach(ov, old)
		}
		t.mu.Unlock()
		select {
		case <-p.done:
		case <-ctx.Done():
			return fmt.Errorf("open %q: waiting for the check of session %d: %w", ov.ident.export, old.s.id, ctx.Err())
		}
		waited = p
		t.mu.Lock()
	}
	// (Still under t.mu.) The queues of the sessions fenced here are
	// fenced with them (and join them no more).
	var othersQueues, queues []identEntry
	for _, o := range others {
		delete(t.idents, o.ov.ident)
		othersQueues = append(othersQueues, o.ov.endQueues()...)
	}
	old, had := t.idents[ov.ident]
	replaced := had && old.s != s
	if replaced {
		queues = old.ov.endQueues()
	}
	// Why the earlier session of this host ends: its attach came back, it
	// was taken over by another attach, or it was found dead.
	var why string
	switch {
	case !replaced:
	case sameAttach(old.ov, ov):
		why = fmt.Sprintf("fenced: host %q opened export %q again on session %d", ov.ident.host, ov.ident.export, s.id)
	case takeover:
		t.m.takeovers.Inc()
		why = fmt.Sprintf("fenced: another attach of host %q (instance %s) took export %q over on session %d (--takeover)",
			ov.ident.host, instanceString(ov.instance), ov.ident.export, s.id)
	case old.s.link.Err() != nil:
		why = fmt.Sprintf("fenced: its connection was down when another attach of host %q (instance %s) opened export %q on session %d",
			ov.ident.host, instanceString(ov.instance), ov.ident.export, s.id)
	default:
		why = fmt.Sprintf("fenced: it did not answer a liveness check in %v when another attach of host %q (instance %s) opened export %q on session %d",
			t.opts.LivenessProbe, ov.ident.host, instanceString(ov.instance), ov.ident.export, s.id)
	}
	delete(t.probes, ov.ident)
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
		errs = append(errs, t.fence(ctx, q, why))
	}
	if replaced {
		old.s.log.Warn("fencing this session", zap.String("why", why), zap.String("host_id", ov.ident.host),
			zap.String("export", ov.ident.export), zap.String("instance", instanceString(old.ov.instance)),
			zap.String("new_instance", instanceString(ov.instance)), zap.Uint64("new_session", s.id), zap.Uint64("new_generation", ov.gen))
		errs = append(errs, t.fence(ctx, old, why))
	}
	return errors.Join(errs...)
}

// sameAttach reports whether next, an Open of the identity of cur, is
// cur's attach coming back: the same instance, or an Open without one
// (an initiator of before instances, reinstated as it always was). An
// Open with an instance is not the attach of a session without one.
func sameAttach(cur, next *openVol) bool {
	return next.instance == 0 || cur.instance == next.instance
}

// instanceString formats an attach's instance as rblk-attach shows it.
func instanceString(i uint64) string {
	if i == 0 {
		return "none"
	}
	return fmt.Sprintf("%016x", i)
}

// heldByAttach is the refusal of ov's Open while cur, the session of
// another attach of the same host, lives.
func heldByAttach(ov *openVol, cur identEntry) error {
	return fmt.Errorf("export %q is held read-write by another attach of host %q: session %d, instance %s, from %s, since %s; "+
		"it answers, so it is alive: detach it first, attach read-only, or take the export over from it (rblk-attach --takeover): %w",
		ov.ident.export, ov.ident.host, cur.s.id, instanceString(cur.ov.instance), cur.s.link.Conn().RemoteAddr(),
		cur.ov.since.UTC().Format(time.RFC3339), protocol.ErrBusy)
}

// probe is a liveness check of the current session of an identity: a
// KeepAlive on its link, answered within Options.LivenessProbe or not.
type probe struct {
	s     *session
	done  chan struct{} // closed once answered or not
	ended bool          // done is closed (Target.mu)
	alive bool          // it answered in time (Target.mu, once ended)
	at    time.Time     // when it ended (Target.mu)
}

// checkLive decides about cur, the live session of another attach of the
// identity that an Open wants: dead (fence it, and open) or alive (p nil:
// refuse); or it returns the probe to wait for, in flight or started
// here, before deciding again. waited is the probe the Open last waited
// for: its answer stands for it however late the Open looks at it. One
// probe at a time per identity; an answer stands for probeFresh for the
// others. Target.mu is held.
func (t *Target) checkLive(cur identEntry, waited *probe) (p *probe, dead bool) {
	if cur.s.link.Err() != nil {
		return nil, true // its link is down: its end is on its way
	}
	id := cur.ov.ident
	p = t.probes[id]
	switch {
	case p != nil && !p.ended:
		return p, false
	case p != nil && p.s == cur.s && (p == waited || time.Since(p.at) < probeFresh):
		return nil, !p.alive
	}
	p = &probe{s: cur.s, done: make(chan struct{})}
	t.probes[id] = p
	t.wg.Add(1)
	go t.runProbe(p, cur)
	return p, false
}

// runProbe sends cur's session a KeepAlive and records whether it
// answered within Options.LivenessProbe. It does not fence: the Open
// that waits does, so that a probe whose Opens left changes nothing. A
// target shutting down takes no session for dead.
func (t *Target) runProbe(p *probe, cur identEntry) {
	defer t.wg.Done()
	start := time.Now()
	cur.s.log.Info("another attach of this session's host opens its export: checking that this session lives",
		zap.String("export", cur.ov.ident.export), zap.String("instance", instanceString(cur.ov.instance)), zap.Duration("bound", t.opts.LivenessProbe))
	ctx, cancel := context.WithTimeout(t.ctx, t.opts.LivenessProbe)
	err := cur.s.link.RequestWithin(ctx, 0, &protocol.KeepAlive{}, &protocol.OK{})
	cancel()
	alive := err == nil || t.ctx.Err() != nil
	if alive {
		cur.s.log.Info("this session answered the liveness check and keeps its export",
			zap.String("export", cur.ov.ident.export), zap.String("instance", instanceString(cur.ov.instance)),
			zap.Duration("answered_in", time.Since(start)))
	} else {
		cur.s.log.Warn("this session did not answer a liveness check: it is fenced for another attach of its host",
			zap.String("export", cur.ov.ident.export), zap.String("instance", instanceString(cur.ov.instance)),
			zap.Duration("bound", t.opts.LivenessProbe), zap.Error(err))
	}
	t.mu.Lock()
	p.ended, p.alive, p.at = true, alive, time.Now()
	close(p.done)
	id := cur.ov.ident
	if e, ok := t.idents[id]; t.probes[id] == p && (!ok || e.s != p.s) {
		delete(t.probes, id) // its session is gone: nothing to remember
	}
	t.mu.Unlock()
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
	if err := t.fenceSession(ctx, e.s, why); err != nil {
		return fmt.Errorf("fence session %d of %s: %w", e.s.id, e.ov.ident.describe(), err)
	}
	return nil
}

// fenceSession fences s as fence says: every handle of it stale, the
// notice sent, its grants invalidated, its connection closed; it returns
// once s released everything, or when ctx ends.
func (t *Target) fenceSession(ctx context.Context, s *session, why string) error {
	s.markFenced()
	t.m.fenced.Inc()
	nctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	notice := &protocol.ErrorMsg{Code: protocol.CodeStale, Text: why}
	err := s.link.Send(nctx, 0, notice)
	if err == nil {
		err = s.link.WaitSent(nctx)
	}
	if err != nil {
		s.log.Debug("fence notice not delivered", zap.Error(err))
	}
	cancel()
	s.dropFencedGrants()
	s.link.Close()
	select {
	case <-s.ended:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// describe names the identity in messages.
func (id ident) describe() string {
	if id.host == "" {
		return "an anonymous initiator"
	}
	return fmt.Sprintf("host %q", id.host)
}

// admitHost counts s as an authenticated session of host, within
// MaxSessions and MaxSessionsPerHost, once its proof was accepted (or, on
// a target without keys, once the host named itself); the session's end
// gives it back. It is no longer counted as waiting to authenticate.
func (t *Target) admitHost(s *session, host string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case s.counted:
		return fmt.Errorf("session %d counted twice (a bug): %w", s.id, protocol.ErrProtocol)
	case s.pre.gone:
		// Closed to make room for others (makeRoomLocked).
		return fmt.Errorf("too many connections wait to authenticate, the most from your address: %w", protocol.ErrBusy)
	case t.authed >= t.opts.MaxSessions:
		t.m.refused.WithLabelValues("session_limit").Inc()
		return fmt.Errorf("too many sessions on the target (limit %d): %w", t.opts.MaxSessions, protocol.ErrBusy)
	case t.perHost[host] >= t.opts.MaxSessionsPerHost:
		t.m.refused.WithLabelValues("host_session_limit").Inc()
		return fmt.Errorf("host %q has %d sessions, the most one host may have: %w", host, t.perHost[host], protocol.ErrBusy)
	}
	t.removeUnauthLocked(s.pre)
	t.authed++
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
			if p := t.probes[ov.ident]; p != nil && p.s == s && p.ended {
				delete(t.probes, ov.ident)
			}
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
