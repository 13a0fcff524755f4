package csidriver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.uber.org/zap"

	"github.com/rblk/rblk/mirror"
)

// DefaultMirrorArgs are the rblk-attach flags a mirror's copies attach
// with, before RBLKAttacher.Args (which may override them): a copy's IO
// fails soon after its target goes away, so that md fails that member and
// the volume goes on with the other copy, while its rblk-attach goes on
// reconnecting (md re-adds the member from its bitmap once it serves
// again); after a planned restart of its target (SIGTERM) it waits
// longer, degrading nothing; a copy whose target came back without writes
// it had acknowledged fails for good, and is attached again and copied in
// full.
var DefaultMirrorArgs = []string{"--fast-fail-timeout=5s", "--keepalive-timeout=5s", "--restart-grace=30s",
	"--reconnect-timeout=24h", "--fail-on-lost-writes"}

// MirrorAttacher is the node's Attacher: a volume of one copy is A's; a
// mirror (a volume of replicas: 2, its ID naming two copies) is two
// copies attached through A with an md RAID1 over them, /dev/md/NAME,
// which it keeps whole while the volume is staged (mirror.Supervise).
//
// It is an Attacher, a Conditioner (a mirror that lacks a copy, or
// resyncs one, is DEGRADED) and a Grower (a mirror's array grows once
// both copies have).
type MirrorAttacher struct {
	// A attaches volumes, and each copy of a mirror.
	A *RBLKAttacher
	// MirrorArgs are the flags of a mirror's copies (nil:
	// DefaultMirrorArgs).
	MirrorArgs []string
	// Every is how often a staged mirror's members are looked at
	// (default 1 s).
	Every time.Duration
	// Logger: what was done. Default: none.
	Logger *zap.Logger
	// Metrics, if set, exports each staged mirror's state.
	Metrics *mirror.Metrics
	// MD is the template of each array's mirror.Options (Run, SysBlock,
	// DevDir: tests set them).
	MD mirror.Options

	mu      sync.Mutex
	running map[string]*supervision
}

// supervision is a staged mirror's mirror.Supervise.
type supervision struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// mirrorRecord is what MirrorAttacher keeps of a staged mirror: enough to
// supervise it again after a restart of the plugin.
type mirrorRecord struct {
	VolumeID string            `json:"volume_id"`
	VolCtx   map[string]string `json:"volume_context"`
}

func (m *MirrorAttacher) log() *zap.Logger {
	if m.Logger == nil {
		return zap.NewNop()
	}
	return m.Logger
}

// mirrorOf returns id's parsed ID when it names a mirror.
func mirrorOf(id string) (volumeID, bool) {
	vid, err := parseVolumeID(id)
	return vid, err == nil && vid.Mirror()
}

func (m *MirrorAttacher) recordPath(id string) string { return recordFile(m.A.StateDir, "mirror", id) }

// legs are the copies of mirror id: its context's first copy, then the
// second (CtxMirror*).
func (m *MirrorAttacher) legs(id string, volCtx map[string]string) []*Leg {
	a := *m.A
	args := m.MirrorArgs
	if args == nil {
		args = DefaultMirrorArgs
	}
	a.Args = append(append([]string{}, args...), m.A.Args...)
	ids := legIDs(id)
	return []*Leg{
		{A: &a, ID: ids[0], VolCtx: map[string]string{CtxAddress: volCtx[CtxAddress], CtxExport: volCtx[CtxExport], CtxTransport: volCtx[CtxTransport]}},
		{A: &a, ID: ids[1], VolCtx: map[string]string{CtxAddress: volCtx[CtxMirrorAddress], CtxExport: volCtx[CtxMirrorExport], CtxTransport: volCtx[CtxMirrorTransport]}},
	}
}

// legIDs are the IDs the copies of mirror id are attached by (A's
// records).
func legIDs(id string) [2]string { return [2]string{id + "#0", id + "#1"} }

// options are the mirror.Options of mirror vid over members.
func (m *MirrorAttacher) options(vid volumeID, members []string) mirror.Options {
	o := m.MD
	o.Name, o.Members, o.Logger = vid.arrayName(), members, m.log()
	if m.Metrics != nil {
		o.Added = m.Metrics.Added
	}
	return o
}

// Attach implements Attacher: a mirror's copies are attached (or found
// attached), its array assembled (created in sync over new copies), and
// supervised until Detach.
func (m *MirrorAttacher) Attach(ctx context.Context, id string, volCtx map[string]string) (string, error) {
	vid, ok := mirrorOf(id)
	if !ok {
		return m.A.Attach(ctx, id, volCtx)
	}
	for _, k := range []string{CtxAddress, CtxExport, CtxMirrorAddress, CtxMirrorExport} {
		if volCtx[k] == "" {
			return "", fmt.Errorf("mirror %s: the volume's context lacks %s", id, k)
		}
	}
	legs := m.legs(id, volCtx)
	var members []string
	for i, l := range legs {
		dev, err := l.A.Attach(ctx, l.ID, l.VolCtx)
		if err != nil {
			return "", fmt.Errorf("mirror %s: attach copy %d (%s at %s): %w", id, i, l.VolCtx[CtxExport], l.VolCtx[CtxAddress], err)
		}
		members = append(members, dev)
	}
	if err := writeJSON(m.recordPath(id), mirrorRecord{VolumeID: id, VolCtx: volCtx}); err != nil {
		return "", err
	}
	o := m.options(vid, members)
	o.Fresh = true // (copies that carry no array are new volumes: zeroes)
	dev, err := mirror.Up(ctx, o)
	if err != nil {
		return "", fmt.Errorf("mirror %s: %w", id, err)
	}
	m.supervise(id, o, legs)
	return dev, nil
}

// supervise starts mirror.Supervise of o unless it runs.
func (m *MirrorAttacher) supervise(id string, o mirror.Options, legs []*Leg) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.running == nil {
		m.running = map[string]*supervision{}
	}
	if m.running[id] != nil {
		return
	}
	every := m.Every
	if every <= 0 {
		every = time.Second
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &supervision{cancel: cancel, done: make(chan struct{})}
	m.running[id] = s
	if m.Metrics != nil {
		m.Metrics.Track(o)
	}
	ml := make([]mirror.Leg, len(legs))
	for i, l := range legs {
		ml[i] = l
	}
	go func() {
		defer close(s.done)
		mirror.Supervise(ctx, o, ml, every)
	}()
}

// stop ends the supervision of mirror id, if it runs, and waits for it.
func (m *MirrorAttacher) stop(id string) {
	m.mu.Lock()
	s := m.running[id]
	delete(m.running, id)
	m.mu.Unlock()
	if s != nil {
		s.cancel()
		<-s.done
	}
}

// Close ends every supervision (the arrays stay up: a restarted plugin
// supervises them again, Resume).
func (m *MirrorAttacher) Close() {
	m.mu.Lock()
	ids := make([]string, 0, len(m.running))
	for id := range m.running {
		ids = append(ids, id)
	}
	m.mu.Unlock()
	for _, id := range ids {
		m.stop(id)
	}
}

// Detach implements Attacher: a mirror's supervision ends, its array
// stops and both copies are detached.
func (m *MirrorAttacher) Detach(ctx context.Context, id string) error {
	vid, ok := mirrorOf(id)
	if !ok {
		return m.A.Detach(ctx, id)
	}
	m.stop(id)
	o := m.options(vid, nil)
	if err := mirror.Down(ctx, o); err != nil {
		return fmt.Errorf("mirror %s: %w", id, err)
	}
	if m.Metrics != nil {
		m.Metrics.Untrack(o.Name)
	}
	var errs []error
	for _, leg := range legIDs(id) {
		if err := m.A.Detach(ctx, leg); err != nil {
			errs = append(errs, fmt.Errorf("mirror %s: detach copy: %w", id, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if err := os.Remove(m.recordPath(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// Device implements Attacher: a mirror's device is its array, while it
// is assembled.
func (m *MirrorAttacher) Device(id string) (string, bool) {
	vid, ok := mirrorOf(id)
	if !ok {
		return m.A.Device(id)
	}
	st, err := mirror.Stat(m.options(vid, nil))
	if err != nil {
		return "", false
	}
	return st.Device, true
}

// Condition implements Conditioner: a mirror that lacks a copy is
// DEGRADED (Degraded; Resyncing while md copies onto it), one whose
// array is not assembled INACCESSIBLE.
func (m *MirrorAttacher) Condition(id string) (Condition, bool) {
	vid, ok := mirrorOf(id)
	if !ok {
		return m.A.Condition(id)
	}
	st, err := mirror.Stat(m.options(vid, nil))
	if err != nil {
		return Condition{Health: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "NotAssembled", Message: err.Error()}, true
	}
	if st.Degraded == 0 && !st.Resyncing() {
		return Condition{}, false
	}
	var members []string
	for _, mb := range st.Members {
		members = append(members, mb.Device+" "+mb.State)
	}
	var legs []string
	for _, leg := range legIDs(id) {
		if c, bad := m.A.Condition(leg); bad {
			legs = append(legs, c.Message)
		}
	}
	detail := fmt.Sprintf("%s: members %s", st.Device, strings.Join(members, ", "))
	if len(legs) > 0 {
		detail += "; " + strings.Join(legs, "; ")
	}
	if done, total, running := st.Progress(); running && st.Resyncing() {
		return Condition{Health: csi.VolumeHealthErrorType_DEGRADED, Reason: "Resyncing",
			Message: fmt.Sprintf("md copies onto a member (%s): %.0f%% done, %d MiB to go; %s", st.SyncAction, 100*float64(done)/float64(total), (total-done)>>11, detail)}, true
	}
	return Condition{Health: csi.VolumeHealthErrorType_DEGRADED, Reason: "Degraded",
		Message: fmt.Sprintf("%d of 2 copies serve: the other is re-added once its target is back; %s", 2-st.Degraded, detail)}, true
}

// Grow implements Grower: a mirror's array grows once both copies show
// the grown volume (and md's room).
func (m *MirrorAttacher) Grow(ctx context.Context, id string, want int64) (int64, error) {
	vid, ok := mirrorOf(id)
	if !ok {
		return m.A.Grow(ctx, id, want)
	}
	r, ok := m.readRecord(id)
	if !ok {
		return 0, fmt.Errorf("mirror %s: not staged on this node", id)
	}
	for i, l := range m.legs(id, r.VolCtx) {
		dev, _ := l.Device()
		if dev == "" {
			return 0, fmt.Errorf("mirror %s: copy %d is not attached: the array grows once both copies are back", id, i)
		}
		if _, err := waitDeviceSize(ctx, dev, want+mirror.DataOffset); err != nil {
			return 0, fmt.Errorf("mirror %s: copy %d: %w", id, i, err)
		}
	}
	n, err := mirror.Grow(ctx, m.options(vid, nil))
	if err != nil {
		return 0, fmt.Errorf("mirror %s: %w", id, err)
	}
	if n < want {
		return n, fmt.Errorf("mirror %s: the array has %d bytes after growing, the volume %d", id, n, want)
	}
	return n, nil
}

func (m *MirrorAttacher) readRecord(id string) (*mirrorRecord, bool) {
	var r mirrorRecord
	if !readJSON(m.recordPath(id), &r) || r.VolumeID != id {
		return nil, false
	}
	return &r, true
}

// Resume, at the plugin's start (after A.Recover adopted the copies),
// supervises again every staged mirror whose array is assembled. It
// returns how many.
func (m *MirrorAttacher) Resume() (int, error) {
	names, err := filepath.Glob(filepath.Join(m.A.StateDir, "mirror-*.json"))
	if err != nil {
		return 0, err
	}
	n := 0
	for _, name := range names {
		var r mirrorRecord
		if !readJSON(name, &r) || m.recordPath(r.VolumeID) != name {
			continue
		}
		vid, ok := mirrorOf(r.VolumeID)
		if !ok {
			continue
		}
		legs := m.legs(r.VolumeID, r.VolCtx)
		var members []string
		for _, l := range legs {
			dev, _ := l.Device()
			members = append(members, dev)
		}
		o := m.options(vid, members)
		if _, err := mirror.Stat(o); err != nil {
			continue // (NodeStage assembles it)
		}
		m.supervise(r.VolumeID, o, legs)
		n++
	}
	return n, nil
}
