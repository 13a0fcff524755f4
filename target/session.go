package target

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// openVol is a volume opened by a session under a handle.
type openVol struct {
	v        *volume
	writable bool
	gen      uint64      // the session generation VolumeInfo gave
	ident    ident       // host ID and export; host "" is anonymous
	instance uint64      // the attach's, from Open; 0: none given
	since    time.Time   // when it was opened
	fenced   atomic.Bool // a later session of ident took over

	// Queues (Join): on the session's first openVol, the connections that
	// joined it, fenced with it; on a joined one, the first. ended: the
	// session ended or was fenced, no more joins. Guarded by Target.mu.
	queues  []identEntry
	primary *openVol
	ended   bool

	// grants indexes the chunks this handle holds grants of, by chunk
	// index: a Done names ranges, and finds their chunks here, without the
	// cache's lock. A chunk leaves it before its grant leaves the cache's
	// table, so a Done never marks a chunk dirty whose grant is gone.
	// Guarded by session.mu.
	grants map[uint64]*chunk
}

// ident is an initiator's identity for one export: reinstatement fences
// the earlier sessions of the same ident. An anonymous initiator (host "")
// is its session.
type ident struct {
	host, export string
	anon         uint64 // the session's id when host is ""
}

// session is one initiator's connection.
type session struct {
	t     *Target
	id    uint64
	log   *zap.Logger
	noisy *zap.Logger // log, limited for the lines the client can multiply (loglimit.go)
	pre   *preauth    // its count as a connection waiting to authenticate
	link  *link.Link
	ready chan struct{} // closed once link is set

	ctx    context.Context // ends when the session ends
	cancel context.CancelFunc
	wg     sync.WaitGroup // request goroutines
	// serving counts its requests being served: a drain waiting for the
	// session takes them as progress (the initiator waits for the target).
	serving atomic.Int64

	// mu guards the session's handles and their grants' index. Lock
	// order: Target.mu, then session.mu, then cache.mu.
	mu      sync.Mutex
	handles map[uint32]*openVol
	next    uint32
	opening int // handles being opened (reserveHandle)

	done protocol.Done // reused by the completion goroutine

	penaltyEnd atomic.Int64 // UnixNano until which its share is cut (see penalize)
	fenced     bool         // a later session of its identity took over: no more grants (mu)
	// dropped: a revoke of its went unanswered (or its link went down
	// while one waited) and the session is being closed: a Done of that
	// grant arriving meanwhile is dropped, not a protocol error (mu).
	dropped bool
	peer    string        // the peer's host, for penalties
	ended   chan struct{} // closed once the session released everything

	// Authentication (see auth.go), guarded by mu.
	state  int
	host   string // the host ID of AuthStart: proven if the target has keys
	ci, ct [protocol.ChallengeSize]byte
	// countedHost is the host this session counts against in
	// Target.perHost, if counted (Target.mu).
	countedHost string
	counted     bool

	// Memory windows (grantkey.go): the registrations of the cache on this
	// connection, whole or by slot (regMu), and whether the connection
	// lacks windows.
	regMu       sync.Mutex
	spanChecked bool
	cacheReg    transport.Region
	slotRegs    map[int]transport.Region
	noWindows   atomic.Bool
}

func (s *session) handle(h protocol.Header, payload []byte) {
	<-s.ready
	if !s.gate(h) {
		return
	}
	if h.Type == protocol.TypeDone {
		// Done is handled in order on the completion goroutine, so that a
		// later Flush or RevokeAck on this connection sees its ranges dirty.
		s.handleDone(h, payload)
		return
	}
	m, err := protocol.New(h.Type)
	if err == nil {
		err = m.Unmarshal(payload)
	}
	if err != nil {
		s.protocolError(fmt.Errorf("decode %v: %w", h.Type, err))
		return
	}
	s.serving.Add(1)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.serving.Add(-1)
		s.serve(h, m)
	}()
}

// protocolError ends the session: the peer sent something malformed.
func (s *session) protocolError(err error) {
	s.t.m.errProtocol.Inc()
	s.noisy.Warn("protocol error, closing session", zap.Error(err))
	go s.link.Close()
}

func (s *session) reply(tag uint64, m protocol.Message) {
	if err := s.link.Send(s.ctx, tag, m); err != nil && s.link.Err() == nil {
		s.log.Warn("send reply", zap.Stringer("type", m.Type()), zap.Error(err))
	}
}

func (s *session) replyErr(tag uint64, op *opMetrics, err error) {
	code := protocol.CodeOf(err)
	op.errors.Inc()
	// (Refused opens and stale requests are logged where they are refused,
	// with the host, or are the initiator's business.)
	if code != protocol.CodeStale && code != protocol.CodeInval && code != protocol.CodePerm && code != protocol.CodeAccess {
		s.noisy.Warn("request failed", zap.String("op", op.name), zap.Error(err))
	}
	s.reply(tag, protocol.ErrorFor(err))
}

func (s *session) lookup(handle uint32) (*openVol, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ov := s.handles[handle]
	if ov == nil {
		return nil, fmt.Errorf("handle %d: %w", handle, protocol.ErrInvalid)
	}
	return ov, nil
}

// checkRange validates [off, off+n) against v.
func checkRange(v *volume, off, n uint64) error {
	size := v.size.Load()
	if n == 0 || off >= size || n > size-off {
		return fmt.Errorf("range %d+%d outside volume %q of %d bytes: %w", off, n, v.name, size, protocol.ErrRange)
	}
	return nil
}

func (s *session) serve(h protocol.Header, m protocol.Message) {
	start := time.Now()
	op, err := s.dispatch(h.Tag, m)
	s.t.progress.Add(1)
	if op == nil {
		return
	}
	op.seconds.Observe(time.Since(start).Seconds())
	if err != nil {
		op.failed.Inc()
		s.replyErr(h.Tag, op, err)
		return
	}
	op.ok.Inc()
}

// dispatch serves one request. It sends the success reply itself and returns
// the operation's metrics (nil: no reply) and its error, which the caller
// replies with.
func (s *session) dispatch(tag uint64, m protocol.Message) (*opMetrics, error) {
	om := s.t.m
	switch m := m.(type) {
	case *protocol.AuthStart:
		return s.authStart(tag, m)
	case *protocol.AuthResponse:
		return s.authResponse(tag, m)
	case *protocol.ListExports:
		s.reply(tag, s.t.exportList(s.hostID()))
		return om.opList, nil
	case *protocol.Open:
		info, err := s.open(m)
		if err == nil {
			s.reply(tag, info)
		}
		return om.opOpen, err
	case *protocol.Join:
		info, err := s.join(m)
		if err == nil {
			s.reply(tag, info)
		}
		return om.opJoin, err
	case *protocol.GrantRequest:
		return om.opGrant, s.grant(tag, m)
	case *protocol.Flush:
		ov, err := s.lookup(m.Handle)
		if err == nil {
			err = ov.current(m.Generation)
		}
		if err == nil {
			err = s.t.cache.flush(ov.v)
		}
		if err == nil {
			s.reply(tag, &protocol.OK{})
		}
		return om.opFlush, err
	case *protocol.Trim:
		return om.opTrim, s.zero(tag, m.Handle, m.Offset, m.Length, false, m.Flags&protocol.FlagFUA != 0)
	case *protocol.WriteZeroes:
		return om.opWriteZeroes, s.zero(tag, m.Handle, m.Offset, m.Length, m.Flags&protocol.FlagNoHole != 0, m.Flags&protocol.FlagFUA != 0)
	case *protocol.Close:
		s.mu.Lock()
		ov, ok := s.handles[m.Handle]
		delete(s.handles, m.Handle)
		s.mu.Unlock()
		if !ok {
			return om.opClose, fmt.Errorf("handle %d: %w", m.Handle, protocol.ErrInvalid)
		}
		s.closeHandle(m.Handle, ov)
		s.t.forget(s, ov)
		s.reply(tag, &protocol.OK{})
		return om.opClose, nil
	default:
		s.protocolError(fmt.Errorf("unexpected %v from initiator: %w", m.Type(), protocol.ErrProtocol))
		return nil, nil
	}
}

// current checks that gen names this open volume's session generation and
// that no later session of its identity fenced it.
func (ov *openVol) current(gen uint64) error {
	if gen != ov.gen || ov.fenced.Load() {
		return fmt.Errorf("session generation %d of %q, current %d (fenced: %v): %w",
			gen, ov.v.name, ov.gen, ov.fenced.Load(), protocol.ErrStale)
	}
	return nil
}

// hostID is the host the session named in AuthStart.
func (s *session) hostID() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.host
}

// export returns the export name that the session's host may open, for
// a request (op) that names hostID (empty: the session's).
func (s *session) export(op, name, hostID string) (*volume, string, error) {
	host := s.hostID()
	if hostID != "" && hostID != host {
		return nil, "", fmt.Errorf("%s names host %q, but the session is host %q's: %w", op, hostID, host, protocol.ErrAccess)
	}
	v, allowed := s.t.volumeFor(name, host)
	if v == nil {
		return nil, "", fmt.Errorf("export %q: %w", name, protocol.ErrNoExport)
	}
	if !allowed {
		s.t.m.refused.WithLabelValues("not_allowed").Inc()
		s.noisy.Warn(op+" refused: host not allowed", zap.String("host_id", host), zap.String("export", v.name))
		return nil, "", fmt.Errorf("host %q is not allowed to open export %q: %w", host, v.name, protocol.ErrAccess)
	}
	return v, host, nil
}

func (s *session) open(m *protocol.Open) (*protocol.VolumeInfo, error) {
	release, err := s.reserveHandle("open")
	if err != nil {
		return nil, err
	}
	defer release()
	v, host, err := s.export("open", m.Name, m.HostID)
	if err != nil {
		return nil, err
	}
	writable := m.Mode == protocol.ModeReadWrite
	if writable && v.readOnly {
		return nil, fmt.Errorf("export %q is read-only: %w", m.Name, protocol.ErrPerm)
	}
	ov := &openVol{v: v, writable: writable, ident: ident{host: host, export: v.name}, instance: m.Instance, since: time.Now()}
	if host == "" {
		ov.ident.anon = s.id
	}
	// Reinstatement: the earlier session of this attach (this host and
	// instance) and export is fenced (its grants deregistered, its
	// connection closed, its requests finished) before this one gets a
	// handle; so is another host's writer of an exclusive export, or
	// another attach of this host, on a takeover. Another live attach of
	// this host makes the open fail (see Target.reinstate).
	if err := s.t.reinstate(s.ctx, s, ov, m.Flags&protocol.OpenTakeover != 0); err != nil {
		return nil, err
	}
	if testHookOpening != nil {
		testHookOpening(host)
	}
	return s.addHandle(ov, "volume opened")
}

// testHookOpening, set by tests only, runs in an Open between the checks
// of the export and the handle's addition.
var testHookOpening func(host string)

// reserveHandle takes a place for a handle being opened, within
// MaxHandlesPerSession, before anything of the open happens (fencing
// included); release gives it back once the handle is added or the open
// failed. Handles open and being opened never exceed the limit, however
// many Opens the session sends at once.
func (s *session) reserveHandle(op string) (release func(), err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.handles) + s.opening; n >= s.t.opts.MaxHandlesPerSession {
		s.t.m.refused.WithLabelValues("handle_limit").Inc()
		return nil, fmt.Errorf("%s: the session has %d handles open, the most one session may have (--max-handles-per-session): close one first: %w",
			op, n, protocol.ErrBusy)
	}
	s.opening++
	return func() {
		s.mu.Lock()
		s.opening--
		s.mu.Unlock()
	}, nil
}

// addHandle gives ov a handle of the session and returns the VolumeInfo
// that tells the initiator, logging event. An export removed meanwhile
// (RemoveExport), or one whose allow list no longer has the host
// (UpdateExport, FenceHost), gives no handle: the change either sees the
// handle or the handle sees the change, both under s.mu.
func (s *session) addHandle(ov *openVol, event string) (*protocol.VolumeInfo, error) {
	s.mu.Lock()
	if ov.v.removed.Load() {
		s.mu.Unlock()
		s.t.forget(s, ov)
		return nil, fmt.Errorf("export %q: removed: %w", ov.v.name, protocol.ErrNoExport)
	}
	if _, allowed := s.t.volumeFor(ov.v.name, ov.ident.host); !allowed {
		s.mu.Unlock()
		s.t.forget(s, ov)
		return nil, fmt.Errorf("host %q is no longer allowed to open export %q: %w", ov.ident.host, ov.v.name, protocol.ErrAccess)
	}
	// A free handle number: after 2^32 opens the numbers wrap around
	// the few still open.
	for s.next++; s.next == 0 || s.handles[s.next] != nil; s.next++ {
	}
	h := s.next
	s.handles[h] = ov
	s.t.cache.openHandle(s, h, ov.writable, ov.ident.host)
	s.mu.Unlock()
	v := ov.v
	s.noisy.Info(event, zap.String("export", v.name), zap.String("host_id", ov.ident.host), zap.String("instance", instanceString(ov.instance)),
		zap.Bool("writable", ov.writable), zap.Uint32("handle", h), zap.Uint64("generation", ov.gen))
	flags := volFlags(v)
	if !ov.writable {
		flags = protocol.VolReadOnly | protocol.VolCanFlush
	}
	return &protocol.VolumeInfo{Handle: h, Flags: flags, VolumeSize: v.size.Load(), BlockSize: volumeBlockSize,
		ChunkSize: uint32(s.t.cache.chunkSize), Generation: ov.gen, Instance: s.t.instance}, nil
}

// join adds the session to the current session of its host ID and the
// export as an IO queue (protocol.Join): it gets a handle of its own and
// the session's generation, and is fenced with the session.
func (s *session) join(m *protocol.Join) (*protocol.VolumeInfo, error) {
	release, err := s.reserveHandle("join")
	if err != nil {
		return nil, err
	}
	defer release()
	v, host, err := s.export("join", m.Name, m.HostID) // (a Join always names one)
	if err != nil {
		return nil, err
	}
	ov := &openVol{v: v, writable: m.Mode == protocol.ModeReadWrite, gen: m.Generation, ident: ident{host: host, export: v.name}}
	if err := s.t.join(s, ov); err != nil {
		return nil, err
	}
	return s.addHandle(ov, "queue joined")
}

func volFlags(v *volume) protocol.VolumeFlags {
	if v.readOnly {
		return protocol.VolReadOnly | protocol.VolCanFlush
	}
	return protocol.VolCanTrim | protocol.VolCanZero | protocol.VolCanFlush
}

// grant registers the chunk that holds m.Offset on this session's
// connection for handle m.Handle and replies with its description. The
// grant carries the handle's access: remote write only when the handle was
// opened for writing, whatever else the session holds. A handle that holds
// a grant of the chunk already gets it again. The reply is sent while the
// chunk is pinned, so that a Revoke of it cannot overtake the Grant.
func (s *session) grant(tag uint64, m *protocol.GrantRequest) error {
	ov, err := s.lookup(m.Handle)
	if err != nil {
		return err
	}
	if size := ov.v.size.Load(); m.Offset >= size {
		return fmt.Errorf("grant at %d of %q (%d bytes): %w", m.Offset, ov.v.name, size, protocol.ErrRange)
	}
	if m.Flags&protocol.GrantWrite != 0 && !ov.writable {
		return fmt.Errorf("write grant on %q opened read-only: %w", ov.v.name, protocol.ErrPerm)
	}
	c := s.t.cache
	idx := m.Offset / uint64(c.chunkSize)
	ch, hd, err := c.get(s.ctx, s, m.Handle, ov.v, idx)
	if err != nil {
		return err
	}
	defer c.unpin(ch)

	if hd == nil {
		if hd, err = s.newGrant(ch, m.Handle, ov); err != nil {
			return err
		}
	}
	g := &protocol.Grant{Handle: m.Handle, Offset: ch.off, Addr: hd.key.Addr(), RKey: hd.key.RKey(),
		Length: uint32(len(ch.buf)), Generation: ch.gen}
	if hd.writable {
		g.Flags = protocol.GrantWrite
	}
	s.reply(tag, g)
	return nil
}

// newGrant gives handle (ov) of the session a key to ch, pinned, with the
// handle's access, and returns its grant: a new one, or the one the handle
// got meanwhile.
func (s *session) newGrant(ch *chunk, handle uint32, ov *openVol) (*holder, error) {
	c := s.t.cache
	access := transport.AccessRemoteRead
	if ov.writable {
		access |= transport.AccessLocalWrite | transport.AccessRemoteWrite
	}
	key, err := s.grantKeyFor(s.ctx, ch, access)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	hd, added, err := c.tbl.grant(ch, s, handle, key)
	c.mu.Unlock()
	if !added {
		// Never handed out.
		c.releaseKey(ch, s, key, "deregister an unused grant failed: its cache slot is taken out of use")
	}
	if err != nil {
		return nil, fmt.Errorf("grant on %q, handle %d: %w: %w", ov.v.name, handle, err, protocol.ErrStale)
	}
	if !added {
		return hd, nil
	}
	s.mu.Lock()
	live := !s.fenced && s.handles[handle] == ov
	if live {
		if ov.grants == nil {
			ov.grants = make(map[uint64]*chunk)
		}
		ov.grants[ch.key.idx] = ch
	}
	s.mu.Unlock()
	if !live {
		// Fenced, or the handle closed, while registering: the grant
		// never leaves (if the fence or the Close did not take it).
		c.dropHolder(hd, false)
		return nil, fmt.Errorf("grant on %q, handle %d: the handle is closed or its session fenced: %w", ov.v.name, handle, protocol.ErrStale)
	}
	ov.v.m.grants.Inc()
	return hd, nil
}

// revoke asks the initiator to stop using the grant h (of its handle) and
// waits for its RevokeAck, at most ttl: the whole revoke timeout, for every
// holder, since a healthy initiator on a loaded machine may take long. An
// initiator that does not answer in time loses its session, and its host's
// share of the cache is cut for a while. Either way the grant's key is
// released before revoke returns (unless its handle's Close, or the
// session's fence or end, released it first).
func (s *session) revoke(ctx context.Context, h *holder, ttl time.Duration) {
	ch := h.ch
	ctx, cancel := context.WithTimeout(ctx, ttl)
	defer cancel()
	var ack protocol.RevokeAck
	err := s.link.Request(ctx, &protocol.Revoke{Handle: h.handle, Offset: ch.off, Generation: ch.gen}, &ack)
	ch.key.vol.m.revokes.Inc()
	if err != nil {
		// The session is going away; a Done of this grant still on its
		// way is no protocol error.
		s.mu.Lock()
		s.dropped = true
		s.mu.Unlock()
	}
	s.forgetGrant(h.handle, ch)
	if err != nil && s.link.Err() == nil && s.t.ctx.Err() == nil {
		s.log.Warn("initiator did not give a chunk back in time, closing its session",
			zap.Uint64("offset", ch.off), zap.Uint32("handle", h.handle), zap.Duration("waited", ttl), zap.Error(err))
		s.t.m.revokeTimeouts.Inc()
		s.t.penalize(s)
		s.t.cache.penalize(s, time.Unix(0, s.penaltyEnd.Load()))
		s.link.Close()
	}
	s.t.cache.dropHolder(h, err != nil)
}

// forgetGrant takes ch out of handle's index of grants.
func (s *session) forgetGrant(handle uint32, ch *chunk) {
	s.mu.Lock()
	if ov := s.handles[handle]; ov != nil && ov.grants[ch.key.idx] == ch {
		delete(ov.grants, ch.key.idx)
	}
	s.mu.Unlock()
}

// handleDone marks the ranges of a Done dirty. It runs on the completion
// goroutine; a Done with FUA is made durable and answered on another.
//
// It takes no lock but the session's (and the chunks' dirty bitmaps'): the
// handle and the chunks come from the session's own maps, and a chunk that
// is already queued for write-back is not queued again.
func (s *session) handleDone(h protocol.Header, payload []byte) {
	d := &s.done
	if err := d.Unmarshal(payload); err != nil {
		s.protocolError(fmt.Errorf("decode Done: %w", err))
		return
	}
	fua := d.Flags&protocol.DoneFUA != 0
	s.mu.Lock()
	ov, fuaChunks, err := s.doneLocked(d, fua)
	s.mu.Unlock()
	if err != nil {
		if !errors.Is(err, errFencedDone) {
			s.protocolError(err)
		}
		return
	}
	if fua {
		s.doneFUA(h.Tag, ov.v, fuaChunks)
	}
}

// doneFUA makes the chunks of a Done with FUA durable and replies, on a
// goroutine of its own.
func (s *session) doneFUA(tag uint64, v *volume, chunks []*chunk) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		start := time.Now()
		err := s.durable(v, chunks)
		s.t.m.opDoneFUA.seconds.Observe(time.Since(start).Seconds())
		if err != nil {
			s.replyErr(tag, s.t.m.opDoneFUA, err)
			return
		}
		s.reply(tag, &protocol.OK{})
	}()
}

// errFencedDone: a Done of a fenced handle, or of a session being dropped,
// dropped.
var errFencedDone = errors.New("done of a fenced handle")

// doneLocked checks d and marks its ranges dirty; with fua it returns their
// chunks. s.mu is held.
func (s *session) doneLocked(d *protocol.Done, fua bool) (ov *openVol, fuaChunks []*chunk, err error) {
	ov = s.handles[d.Handle]
	if ov == nil {
		return nil, nil, fmt.Errorf("handle %d: %w", d.Handle, protocol.ErrInvalid)
	}
	if !ov.writable {
		return nil, nil, fmt.Errorf("done on %q opened read-only: %w", ov.v.name, protocol.ErrPerm)
	}
	if ov.fenced.Load() || s.dropped {
		// Fenced (a reinstatement or a takeover) while this Done was on
		// its way, or a revoke it did not answer in time is closing the
		// session: its grants are gone and its session is being closed
		// (fenced: with a notice the initiator should get); not a
		// protocol error. The chunks it held writable are written back
		// whole.
		return nil, nil, errFencedDone
	}
	if err := ov.current(d.Generation); err != nil {
		return nil, nil, err
	}
	v := ov.v
	cs := uint64(s.t.cache.chunkSize)
	var bytes uint64
	for _, r := range d.Ranges {
		if err := checkRange(v, r.Offset, r.Length); err != nil {
			return nil, nil, fmt.Errorf("done: %w", err)
		}
		bytes += r.Length
		for idx := r.Offset / cs; idx*cs < r.Offset+r.Length; idx++ {
			ch := ov.grants[idx]
			if ch == nil {
				// The initiator wrote where this handle holds no grant:
				// its data is not in the cache any more (or it wrote
				// through another handle's). That is a broken initiator.
				return nil, nil, fmt.Errorf("done for chunk at %d of %q that handle %d holds no grant of: %w", idx*cs, v.name, d.Handle, protocol.ErrStale)
			}
			from := max(r.Offset, ch.off) - ch.off
			to := min(r.Offset+r.Length, ch.off+uint64(len(ch.buf))) - ch.off
			ch.markDirty(from, to)
			v.markDirty(ch)
			if fua {
				fuaChunks = append(fuaChunks, ch)
			}
		}
	}
	v.m.done.Add(float64(bytes))
	return ov, fuaChunks, nil
}

// durable writes back chunks (in one pass, see writeChunks) and syncs the
// file.
func (s *session) durable(v *volume, chunks []*chunk) error {
	var errs []error
	if err := s.t.cache.writeChunks(v, chunks, nil); err != nil {
		errs = append(errs, err)
	}
	if err := v.f.Sync(); err != nil {
		errs = append(errs, fmt.Errorf("fdatasync %q: %w", v.name, err))
	}
	return errors.Join(errs...)
}

func (s *session) zero(tag uint64, handle uint32, off, n uint64, noHole, fua bool) error {
	ov, err := s.lookup(handle)
	if err != nil {
		return err
	}
	if !ov.writable {
		return fmt.Errorf("export %q opened read-only: %w", ov.v.name, protocol.ErrPerm)
	}
	if err := checkRange(ov.v, off, n); err != nil {
		return err
	}
	if err := s.t.cache.zeroRange(ov.v, off, n, noHole); err != nil {
		return err
	}
	if fua {
		if err := ov.v.f.Sync(); err != nil {
			return fmt.Errorf("fdatasync %q: %w", ov.v.name, err)
		}
	}
	s.reply(tag, &protocol.OK{})
	return nil
}

// writerLike returns another read-write handle the session has open, of
// ov's identity and not fenced, or nil. Target.mu may be held (it is taken
// before s.mu).
func (s *session) writerLike(ov *openVol) *openVol {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, o := range s.handles {
		if o != ov && o.writable && o.ident == ov.ident && !o.fenced.Load() {
			return o
		}
	}
	return nil
}

// closeHandle takes back the grants of handle (ov), which the session
// just closed (it left s.handles), and only those: another handle of the
// session, of the same volume or not, keeps its own. The handle's Dones
// came before its Close on this connection, but an initiator may have
// written without one: a writable grant's chunk is written back whole, so
// that cache and file agree.
func (s *session) closeHandle(handle uint32, ov *openVol) {
	s.mu.Lock()
	ov.grants = nil
	s.mu.Unlock()
	c := s.t.cache
	c.mu.Lock()
	hs := c.tbl.closeHandle(s, handle)
	c.mu.Unlock()
	c.releaseAll(hs, true)
}

// markFenced is the first half of fencing the session (Target.fence): its
// handles are stale (Done and Flush refused) and it gets no new grant.
func (s *session) markFenced() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fenced = true
	for _, ov := range s.handles {
		ov.fenced.Store(true)
	}
}

// dropFencedGrants is the second half: every grant it holds, of every
// handle, is invalidated, so that an RDMA operation still in flight on its
// connection cannot reach the memory.
func (s *session) dropFencedGrants() {
	s.mu.Lock()
	for _, ov := range s.handles {
		ov.grants = nil
	}
	s.mu.Unlock()
	c := s.t.cache
	c.mu.Lock()
	hs := c.tbl.fence(s)
	c.mu.Unlock()
	c.releaseAll(hs, true)
}

// end releases what the session holds once its link is down: it waits
// for its requests, then deregisters every grant, and closes s.ended.
func (s *session) end() {
	s.cancel()
	s.wg.Wait()
	s.mu.Lock()
	handles := s.handles
	s.handles = map[uint32]*openVol{}
	for _, ov := range handles {
		ov.grants = nil
	}
	s.mu.Unlock()
	// The grants left belong to handles still open: the session did not
	// close cleanly (Flush, then Close), and their last Dones may be lost.
	c := s.t.cache
	c.mu.Lock()
	hs := c.tbl.endSession(s)
	c.mu.Unlock()
	c.releaseAll(hs, true)
	for _, ov := range handles {
		s.t.forget(s, ov)
	}
	s.releaseRegions()
	close(s.ended)
}
