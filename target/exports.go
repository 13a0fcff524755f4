package target

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/internal/safeopen"
	"github.com/rblk/rblk/protocol"
)

// Runtime export management: exports added, removed and changed while the
// target serves, without touching the sessions of the other exports.

// Sentinel errors of the runtime export API, matched with errors.Is.
var (
	// ErrExportExists: AddExport of a name already exported.
	ErrExportExists = errors.New("export exists")
	// ErrNoExport: RemoveExport or UpdateExport of a name not exported
	// (the protocol's sentinel: an Open of it fails with the same).
	ErrNoExport = protocol.ErrNoExport
	// ErrNotLive: UpdateExport of a field that cannot change while the
	// export is served (path, read_only): remove and add the export.
	ErrNotLive = errors.New("cannot change while served")
	// ErrClosed: the target is closed.
	ErrClosed = errors.New("target closed")
	// ErrNotPrivate: FenceHost on an export that is not Private (taking
	// the last host off its allow list would admit every host).
	ErrNotPrivate = errors.New("export is not private")
	// ErrSameFile: an export of a file that another export serves already
	// (under another name or path: a symbolic or hard link, a bind mount,
	// "d/../", a second node of a block device). Its text reads in
	// context: "/srv/b.img is the same file as export "a" (/srv/a.img)".
	ErrSameFile = errors.New("the same file as export")
)

// FileID is a backing file's identity: its device and inode (a block
// device: its device number). Two exports never have one FileID.
type FileID = safeopen.ID

// adminLock serializes the operations that change exports (AddExport,
// AddPrepared, RemoveExport, UpdateExport, Grow) with each other and with
// Close. Unlike a mutex, waiting for it ends with the caller's context,
// and Close cancels ctx, which every such operation's waits (a drain, a
// revoke) also end with: an operation in progress yields to a shutdown,
// and those waiting behind it give up.
type adminLock struct {
	sem    chan struct{}
	ctx    context.Context
	cancel context.CancelFunc
}

func newAdminLock() adminLock {
	ctx, cancel := context.WithCancel(context.Background())
	return adminLock{sem: make(chan struct{}, 1), ctx: ctx, cancel: cancel}
}

// lockAdmin takes the admin lock for an operation of ctx, and returns the
// context it runs with: ctx, ended also by Close, and the function that
// releases the lock. Waiting for the lock ends, without it, when ctx ends
// or the target closes. (A free lock is taken even if ctx has ended: an
// operation that must not start then checks ctx itself.)
func (t *Target) lockAdmin(ctx context.Context) (context.Context, context.CancelFunc, error) {
	select {
	case t.admin.sem <- struct{}{}:
	default:
		select {
		case t.admin.sem <- struct{}{}:
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-t.admin.ctx.Done():
			return nil, nil, ErrClosed
		}
	}
	if t.admin.ctx.Err() != nil { // Close is waiting for the lock
		<-t.admin.sem
		return nil, nil, ErrClosed
	}
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(t.admin.ctx, cancel)
	return ctx, func() {
		stop()
		cancel()
		<-t.admin.sem
	}, nil
}

// ExportStatus is one export as Exports reports it.
type ExportStatus struct {
	// Config is the export's configuration as it applies now (Size is
	// the one it was added with).
	Config ExportConfig
	// Size is the volume's size in bytes now.
	Size uint64
	// BlockDevice: the backing store is a block device.
	BlockDevice bool
	// Sessions counts the sessions that have the export open.
	Sessions int
	// Writers counts those of them that have it open read-write.
	Writers int
	// File is the identity of its backing file.
	File FileID
	// Removing: RemoveExport is draining it (it is no longer opened by
	// name, and its file still counts as served).
	Removing bool
}

// startVolume starts v's write-back loop.
func (t *Target) startVolume(v *volume) {
	ctx, cancel := context.WithCancel(t.ctx)
	v.stopLoop, v.loopDone = cancel, make(chan struct{})
	v.dirtyMu.Lock()
	v.wbDelay = t.opts.WritebackDelay
	v.dirtyMu.Unlock()
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer close(v.loopDone)
		t.cache.writebackLoop(ctx, v)
	}()
}

// sizeNow is v's size in bytes now.
func (v *volume) sizeNow() uint64 { return v.size.Load() }

// volumeFor returns the export name (nil if there is none) and whether
// host may open it.
func (t *Target) volumeFor(name, host string) (*volume, bool) {
	t.volMu.RLock()
	defer t.volMu.RUnlock()
	v := t.volumes[name]
	if v == nil {
		return nil, false
	}
	return v, v.cfg.allows(host)
}

// shared reports whether v lets several hosts write at once.
func (t *Target) shared(v *volume) bool {
	t.volMu.RLock()
	defer t.volMu.RUnlock()
	return v.cfg.Shared
}

// Exports returns the status of every export, by name.
func (t *Target) Exports() []ExportStatus {
	t.volMu.RLock()
	out := make([]ExportStatus, 0, len(t.vols))
	byVol := make(map[*volume]int, len(t.vols))
	for _, v := range t.vols {
		cfg := v.cfg
		cfg.Allow = slices.Clone(cfg.Allow)
		byVol[v] = len(out)
		out = append(out, ExportStatus{Config: cfg, Size: v.sizeNow(), BlockDevice: v.blockDev, File: v.fileID, Removing: v.removed.Load()})
	}
	t.volMu.RUnlock()
	for _, s := range t.sessionList() {
		s.mu.Lock()
		seen := map[*volume]bool{}
		writer := map[*volume]bool{}
		for _, ov := range s.handles {
			seen[ov.v] = true
			writer[ov.v] = writer[ov.v] || ov.writable
		}
		s.mu.Unlock()
		for v := range seen {
			if i, ok := byVol[v]; ok {
				out[i].Sessions++
				if writer[v] {
					out[i].Writers++
				}
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Config.Name < out[j].Config.Name })
	return out
}

// sessionList is a snapshot of the sessions.
func (t *Target) sessionList() []*session {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*session, 0, len(t.sessions))
	for s := range t.sessions {
		out = append(out, s)
	}
	return out
}

// sessionsOf returns the sessions that have v open, and of those, if keep
// is not nil, only the ones whose host keep refuses.
func (t *Target) sessionsOf(v *volume, keep func(host string) bool) []*session {
	var out []*session
	for _, s := range t.sessionList() {
		s.mu.Lock()
		has := false
		for _, ov := range s.handles {
			if ov.v == v && (keep == nil || !keep(ov.ident.host)) {
				has = true
			}
		}
		s.mu.Unlock()
		if has {
			out = append(out, s)
		}
	}
	return out
}

// PreparedExport is an export whose backing file is opened and checked
// but not served yet: the first half of AddExport, for a caller that opens
// every file of a change before it changes anything (a reload). Hand it to
// AddPrepared, or Discard it.
type PreparedExport struct {
	v       *volume
	created bool
	done    bool
}

// Config is the export's configuration.
func (p *PreparedExport) Config() ExportConfig { return p.v.cfg }

// File is the identity of the export's backing file.
func (p *PreparedExport) File() FileID { return p.v.fileID }

// Size is the volume's size in bytes.
func (p *PreparedExport) Size() uint64 { return p.v.sizeNow() }

// Created reports whether opening it created its backing file (a sparse
// file of the configured size).
func (p *PreparedExport) Created() bool { return p.created }

// Discard closes the export's file, and removes it if the open created it.
// Safe after AddPrepared (then it does nothing) and twice.
func (p *PreparedExport) Discard() {
	if p == nil || p.done {
		return
	}
	p.done = true
	p.v.file.Close()
	if p.created {
		// Only if the path still names the file created (nothing else
		// was put there meanwhile).
		if st, err := os.Stat(p.v.path); err == nil && safeopen.IDOf(st) == p.v.fileID {
			os.Remove(p.v.path)
		}
	}
}

// PrepareExport opens e's backing file (creating its sparse file if e
// gives a size and the path does not exist) and checks it, without
// changing what the target serves. The open never blocks: anything but a
// regular file or a block device is refused at once, the error naming the
// path and what it is ("is a FIFO"). An export of a file that the target
// serves already is refused by AddPrepared; SameFile tells beforehand.
func (t *Target) PrepareExport(ctx context.Context, e ExportConfig) (*PreparedExport, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("open export %q: %w", e.Name, err)
	}
	if err := checkExport(e); err != nil {
		return nil, fmt.Errorf("export %q: %w", e.Name, err)
	}
	e.Allow = slices.Clone(e.Allow)
	v, created, err := openVolume(e)
	if err != nil {
		return nil, err // err names the export and the path
	}
	return &PreparedExport{v: v, created: created}, nil
}

// AddExport opens e (creating its sparse file if it gives a size) and
// serves it at once: PrepareExport, then AddPrepared.
func (t *Target) AddExport(ctx context.Context, e ExportConfig) error {
	p, err := t.PrepareExport(ctx, e)
	if err != nil {
		return fmt.Errorf("add export: %w", err) // err names the export
	}
	return t.AddPrepared(ctx, p)
}

// AddPrepared serves p at once. It is refused (and p discarded) if the
// name is exported (ErrExportExists), if another export serves the same
// file, even one being removed (ErrSameFile, naming it), or if the target
// is closed or ctx ended.
func (t *Target) AddPrepared(ctx context.Context, p *PreparedExport) error {
	e := p.v.cfg
	if p.done {
		return fmt.Errorf("add export %q: prepared export used or discarded already", e.Name)
	}
	_, unlock, err := t.lockAdmin(ctx)
	if err != nil {
		p.Discard()
		return fmt.Errorf("add export %q: %w", e.Name, err)
	}
	defer unlock()
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		p.Discard()
		return fmt.Errorf("add export %q: %w", e.Name, ErrClosed)
	}
	v := p.v
	t.volMu.Lock()
	if t.volumes[e.Name] != nil {
		t.volMu.Unlock()
		p.Discard()
		return fmt.Errorf("add export %q: %w", e.Name, ErrExportExists)
	}
	if o := t.sameFileLocked(v.fileID); o != nil {
		t.volMu.Unlock()
		p.Discard()
		return fmt.Errorf("add export %q: %w", e.Name, sameFileError(v.path, o.name, o.cfg.Path))
	}
	t.nextVol++
	v.id = t.nextVol
	if t.opts.WrapStore != nil {
		v.f = t.opts.WrapStore(e.Name, v.file)
	}
	v.m = t.m.forExport(e.Name)
	t.vols = append(t.vols, v)
	t.volumes[e.Name] = v
	t.volMu.Unlock()
	p.done = true
	t.startVolume(v)
	t.log.Info("export added", zap.String("name", v.name), zap.String("path", v.path),
		zap.Uint64("size", v.sizeNow()), zap.Bool("read_only", v.readOnly), zap.Bool("shared", e.Shared), zap.Strings("allow", e.Allow))
	return nil
}

// SameFile returns the name of the export (one being removed included)
// whose backing file is id, and whether there is one.
func (t *Target) SameFile(id FileID) (string, bool) {
	t.volMu.RLock()
	defer t.volMu.RUnlock()
	if v := t.sameFileLocked(id); v != nil {
		return v.name, true
	}
	return "", false
}

// sameFileLocked returns the volume of t.vols whose file is id, or nil.
// t.volMu is held.
func (t *Target) sameFileLocked(id FileID) *volume {
	for _, v := range t.vols {
		if v.fileID == id {
			return v
		}
	}
	return nil
}

// sameFileAt reports whether path names the file id now.
func sameFileAt(path string, id FileID) bool {
	st, err := os.Stat(path)
	return err == nil && safeopen.IDOf(st) == id
}

// sameFileError says that path is the file export name (at its path)
// serves.
func sameFileError(path, name, firstPath string) error {
	return fmt.Errorf("%s is %w %q (%s)", path, ErrSameFile, name, firstPath)
}

// checkExport checks what ParseExport checks of an ExportConfig built
// otherwise (a config file, the admin socket).
func checkExport(e ExportConfig) error {
	switch {
	case e.Name == "" || len(e.Name) > 255:
		return errors.New("name must be 1-255 bytes")
	case e.Path == "":
		return errors.New("empty path")
	case e.Size < 0:
		return fmt.Errorf("negative size %d", e.Size)
	}
	for _, r := range e.Name {
		if r == '/' || r == 0 {
			return errors.New("name must not contain '/' or NUL")
		}
	}
	for _, h := range e.Allow {
		if h == "" || len(h) > 255 {
			return fmt.Errorf("bad host ID %q in allow", h)
		}
	}
	return nil
}

// RemoveExport takes export name away: new opens of it fail at once with
// ErrNoExport; the sessions that have it open are drained as Close drains
// them all (told the export is going with a shutdown notice, so that
// their initiators finish their IO, flush and disconnect, bounded by
// DrainTimeout without progress and DrainLimit in all, and ctx); then
// every dirty chunk of it is written back, the file synced, its cache
// freed and its file closed. Sessions of other exports are not touched
// (a session that has other exports open too is closed with it:
// initiators open one export per session). If the write-back fails the
// export stays (its sessions gone) and the error says why. Close ends the
// drain and the waits of the write-back at once (as ctx does): the export
// then stays, and Close writes it back with the others.
func (t *Target) RemoveExport(ctx context.Context, name string) error {
	ctx, unlock, err := t.lockAdmin(ctx)
	if err != nil {
		return fmt.Errorf("remove export %q: %w", name, err)
	}
	defer unlock()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("remove export %q: %w", name, err)
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return fmt.Errorf("remove export %q: %w", name, ErrClosed)
	}
	t.volMu.Lock()
	v := t.volumes[name]
	if v != nil {
		delete(t.volumes, name)
		v.removed.Store(true)
	}
	t.volMu.Unlock()
	if v == nil {
		return fmt.Errorf("remove export %q: %w", name, ErrNoExport)
	}
	start := time.Now()
	n := t.endSessions(ctx, v, nil, fmt.Sprintf("export %q removed from the target", name))
	err = t.cache.flush(v)
	if err == nil {
		err = t.cache.dropVolume(ctx, v)
	}
	if err == nil {
		if serr := v.f.Sync(); serr != nil {
			err = fmt.Errorf("fdatasync %q: %w", name, serr)
		}
	}
	if err != nil {
		// Nothing is lost: the chunks that failed stay cached and the
		// export is served again.
		t.volMu.Lock()
		v.removed.Store(false)
		t.volumes[name] = v
		t.volMu.Unlock()
		return fmt.Errorf("remove export %q: write back: %w (the export stays)", name, err)
	}
	v.stopLoop()
	<-v.loopDone
	t.volMu.Lock()
	t.vols = slices.DeleteFunc(t.vols, func(o *volume) bool { return o == v })
	t.volMu.Unlock()
	if cerr := v.file.Close(); cerr != nil {
		t.log.Warn("close the backing file of a removed export", zap.String("name", name), zap.Error(cerr))
	}
	t.m.deleteExport(name)
	t.log.Info("export removed", zap.String("name", name), zap.String("path", v.path),
		zap.Int("sessions_drained", n), zap.Duration("took", time.Since(start)))
	return nil
}

// endSessions drains the sessions that have v open (of those, the ones
// whose host keep refuses, if keep is not nil) with the notice why, then
// closes those left and waits until they released everything. It goes
// on until no such session is left: one that opened v meanwhile is ended
// too. It returns how many sessions it ended.
func (t *Target) endSessions(ctx context.Context, v *volume, keep func(host string) bool, why string) int {
	n := 0
	for {
		sessions := t.sessionsOf(v, keep)
		if len(sessions) == 0 {
			return n
		}
		n += len(sessions)
		for _, s := range sessions {
			s.log.Info("draining this session", zap.String("export", v.name), zap.String("why", why))
		}
		t.drainWith(ctx, sessions, why)
		for _, s := range sessions {
			s.link.Close()
		}
		for _, s := range sessions {
			<-s.ended // closing the link ends it: its requests finish
		}
	}
}

// UpdateExport applies e to the export of its name, for what can change
// while it is served:
//   - Allow: hosts no longer allowed have their sessions of it drained;
//   - Shared: applies to the next opens (writers of an exclusive export
//     that became so stay until they reconnect);
//   - Size, if it changed: larger than the volume grows it (Grow);
//     smaller is refused with ErrShrink; zero or the volume's size
//     leaves it.
//
// Path can change only to another name of the export's file (a symbolic
// link, "d/../"); another file, or ReadOnly, cannot change live:
// ErrNotLive names the field (remove the export and add it again).
func (t *Target) UpdateExport(ctx context.Context, e ExportConfig) error {
	if err := checkExport(e); err != nil {
		return fmt.Errorf("update export %q: %w", e.Name, err)
	}
	ctx, unlock, err := t.lockAdmin(ctx)
	if err != nil {
		return fmt.Errorf("update export %q: %w", e.Name, err)
	}
	defer unlock()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("update export %q: %w", e.Name, err)
	}
	t.volMu.RLock()
	v := t.volumes[e.Name]
	var old ExportConfig
	if v != nil {
		old = v.cfg
	}
	t.volMu.RUnlock()
	if v == nil {
		return fmt.Errorf("update export %q: %w", e.Name, ErrNoExport)
	}
	switch {
	case e.Path != old.Path && !sameFileAt(e.Path, v.fileID):
		return fmt.Errorf("update export %q: path %s -> %s: %w (remove the export and add it again)", e.Name, old.Path, e.Path, ErrNotLive)
	case e.ReadOnly != old.ReadOnly:
		return fmt.Errorf("update export %q: read_only %v -> %v: %w (remove the export and add it again)", e.Name, old.ReadOnly, e.ReadOnly, ErrNotLive)
	case e.Size != old.Size && e.Size > 0 && uint64(e.Size) < v.sizeNow():
		return fmt.Errorf("update export %q: size %d, smaller than the volume's %d bytes: %w", e.Name, e.Size, v.sizeNow(), ErrShrink)
	}
	// (A size that did not change is left alone: the volume may have
	// grown past it since, by Grow.)
	grow := e.Size != old.Size && e.Size > 0 && uint64(e.Size) > v.sizeNow()
	if grow && v.readOnly {
		return fmt.Errorf("update export %q: size %d: a read-only export cannot grow", e.Name, e.Size)
	}
	allowChanged := !slices.Equal(old.Allow, e.Allow) || old.Private != e.Private
	t.volMu.Lock()
	v.cfg.Path, v.path = e.Path, e.Path // another name of the same file, if it changed
	v.cfg.Allow = slices.Clone(e.Allow)
	v.cfg.Private = e.Private
	v.cfg.Shared = e.Shared
	if !grow {
		v.cfg.Size = e.Size
	}
	t.volMu.Unlock()
	if allowChanged {
		allowed := ExportConfig{Allow: e.Allow, Private: e.Private}
		n := t.endSessions(ctx, v, allowed.allows, fmt.Sprintf("host no longer allowed on export %q", e.Name))
		t.log.Info("export's allow list changed", zap.String("name", e.Name), zap.Strings("allow", e.Allow), zap.Int("sessions_drained", n))
	}
	if old.Path != e.Path {
		t.log.Info("export's path changed: another name of the same file", zap.String("name", e.Name),
			zap.String("old_path", old.Path), zap.String("path", e.Path))
	}
	if old.Shared != e.Shared {
		t.log.Info("export's sharing changed", zap.String("name", e.Name), zap.Bool("shared", e.Shared))
	}
	if grow {
		if err := t.grow(ctx, e.Name, e.Size); err != nil {
			return fmt.Errorf("update export %q: %w", e.Name, err)
		}
		t.volMu.Lock()
		v.cfg.Size = e.Size
		t.volMu.Unlock()
	}
	return nil
}

// dropVolume takes every chunk of v out of the cache once no session has
// v open: each is written back (as an eviction does) and its slot freed.
// A chunk being loaded or evicted is waited for. A write-back error ends
// it: the chunk stays cached.
func (c *cache) dropVolume(ctx context.Context, v *volume) error {
	for {
		c.mu.Lock()
		victim, busy := c.tbl.volumeVictim(v)
		if victim == nil {
			if !busy {
				c.mu.Unlock()
				return nil
			}
			err := c.wait(ctx, c.patience)
			c.mu.Unlock()
			if err != nil {
				return err
			}
			continue
		}
		c.mu.Unlock()
		if err := c.evict(victim); err != nil {
			return err
		}
	}
}

// FenceHost takes host off the allow list of export name and fences its
// sessions of the export at once, without a drain: each is marked stale
// (its Done and Flush refused from then on), its grants are invalidated,
// its connection closed, and FenceHost returns once each released
// everything, so that nothing the host still has in flight reaches the
// cache or the file after it returns. New opens by host are refused from
// the start (an open being served either gets its handle before and is
// fenced, or sees the change and is refused). It returns how many
// sessions it fenced. The export must be Private (ErrNotPrivate): taking
// the last host off an export open to every host would open it to all.
// A host not on the list is fenced all the same (a session it opened
// before would still be there).
func (t *Target) FenceHost(ctx context.Context, name, host string) (int, error) {
	ctx, unlock, err := t.lockAdmin(ctx)
	if err != nil {
		return 0, fmt.Errorf("fence host %q on export %q: %w", host, name, err)
	}
	defer unlock()
	t.volMu.Lock()
	v := t.volumes[name]
	switch {
	case v == nil:
		t.volMu.Unlock()
		return 0, fmt.Errorf("fence host %q on export %q: %w", host, name, ErrNoExport)
	case !v.cfg.Private:
		t.volMu.Unlock()
		return 0, fmt.Errorf("fence host %q on export %q: %w", host, name, ErrNotPrivate)
	}
	v.cfg.Allow = slices.DeleteFunc(slices.Clone(v.cfg.Allow), func(h string) bool { return h == host })
	t.volMu.Unlock()
	why := fmt.Sprintf("host %q fenced off export %q", host, name)
	n := 0
	for {
		sessions := t.sessionsOf(v, func(h string) bool { return h != host })
		if len(sessions) == 0 {
			break
		}
		for _, s := range sessions {
			if err := t.fenceSession(ctx, s, why); err != nil {
				return n, fmt.Errorf("fence host %q on export %q: %w", host, name, err)
			}
			n++
		}
	}
	t.log.Info("host fenced off export", zap.String("name", name), zap.String("host_id", host), zap.Int("sessions_fenced", n))
	return n, nil
}
