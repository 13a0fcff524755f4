package target

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/rblk/rblk/protocol"
)

// volumeBlockSize is the logical block size every volume reports in
// VolumeInfo: a volume grows by whole blocks of it.
const volumeBlockSize = 4096

// Errors of Grow, to test with errors.Is.
var (
	// ErrShrink: the size asked for is smaller than the volume's. A volume
	// never shrinks online: initiators and the file systems on them keep
	// using what they were given.
	ErrShrink = errors.New("a volume cannot shrink")
	// ErrBadSize: the size asked for is not a positive multiple of the
	// volumes' logical block size (4096 bytes).
	ErrBadSize = errors.New("size must be a positive multiple of 4096 bytes")
	// ErrBackingTooSmall: the export is a block device (or a read-only
	// file) smaller than the size asked for. rblkd enlarges only the
	// regular files it may write; a block device is enlarged first (for
	// example with lvextend), then grown.
	ErrBackingTooSmall = errors.New("the backing device is smaller than the size asked for")
)

// resizeNoticeTimeout bounds the sending of one Resize notice: a session
// that takes no message for that long is going away anyway.
const resizeNoticeTimeout = 5 * time.Second

// Grow enlarges the export name to size bytes online. The backing file is
// extended (ftruncate, then fsync) first; a block device must already be
// at least that large. Then the new size is in effect: reads, writes,
// trims and grants up to it are served, new opens and the export list
// report it. A cached last chunk that was short is revoked from its
// holders first, so that they ask for it again with its new length. Last,
// every connection with the volume open (every queue of every session) is
// sent a Resize notice with the new size. The same size again is a no-op;
// a smaller one is refused (ErrShrink), as is a size that is not a
// multiple of 4096 (ErrBadSize) and an unknown export
// (protocol.ErrNoExport). Grows of one export run one at a time.
func (t *Target) Grow(ctx context.Context, name string, size int64) error {
	ctx, unlock, err := t.lockAdmin(ctx) // not while an export is added, removed or updated
	if err != nil {
		return fmt.Errorf("grow export %q: %w", name, err)
	}
	defer unlock()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("grow export %q: %w", name, err)
	}
	return t.grow(ctx, name, size)
}

// grow is Grow with the admin lock held.
func (t *Target) grow(ctx context.Context, name string, size int64) error {
	t.volMu.RLock()
	v := t.volumes[name]
	t.volMu.RUnlock()
	if v == nil {
		return fmt.Errorf("grow export %q: %w", name, protocol.ErrNoExport)
	}
	if size <= 0 || size%volumeBlockSize != 0 {
		return fmt.Errorf("grow export %q to %d bytes: %w", name, size, ErrBadSize)
	}
	v.growMu.Lock()
	defer v.growMu.Unlock()
	old := v.size.Load()
	switch {
	case uint64(size) < old:
		return fmt.Errorf("grow export %q to %d bytes: it has %d: %w", name, size, old, ErrShrink)
	case uint64(size) == old:
		return nil
	}
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return fmt.Errorf("grow export %q: the target is shutting down", name)
	}
	if err := v.extend(size); err != nil {
		return fmt.Errorf("grow export %q to %d bytes: %w", name, size, err)
	}

	c := t.cache
	c.mu.Lock() // chunk lengths computed under it see one size or the other
	v.size.Store(uint64(size))
	c.mu.Unlock()
	// The last chunk of the old size was short if the old size is not a
	// multiple of the chunk size: its holders hold grants of the short
	// length. It goes (revoked, written back) before they hear of the new
	// size; it is loaded again with its new length when next asked for.
	if cs := uint64(c.chunkSize); old%cs != 0 {
		if err := c.refit(ctx, v, old/cs); err != nil {
			return fmt.Errorf("grow export %q: revoke its last chunk: %w", name, err)
		}
	}
	notified := t.announceResize(ctx, v, uint64(size))
	t.m.grows.WithLabelValues(v.name).Inc()
	t.log.Info("export grown", zap.String("export", v.name), zap.String("path", v.path),
		zap.Uint64("old_size", old), zap.Int64("size", size), zap.Int("connections_notified", notified))
	return nil
}

// extend makes the backing store at least size bytes: a regular file is
// truncated up (sparse) and fsync'd, so that the new size survives a
// crash before the initiators use it; a block device (or a read-only
// export's file, which rblkd does not write) must be that large already.
// (The file's directory entry does not change: fsync of the file is
// enough.)
func (v *volume) extend(size int64) error {
	if v.blockDev {
		end, err := v.file.Seek(0, io.SeekEnd)
		if err != nil {
			return fmt.Errorf("size of %s: %w", v.path, err)
		}
		if end < size {
			return fmt.Errorf("block device %s has %d bytes: enlarge it first (lvextend, ...): %w", v.path, end, ErrBackingTooSmall)
		}
		return nil
	}
	st, err := v.file.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", v.path, err)
	}
	if st.Size() >= size {
		return nil // enlarged already (truncate -s)
	}
	if v.readOnly {
		return fmt.Errorf("read-only export: rblkd does not write %s, which has %d bytes: enlarge it first (truncate -s): %w",
			v.path, st.Size(), ErrBackingTooSmall)
	}
	if err := v.file.Truncate(size); err != nil {
		return fmt.Errorf("extend %s: %w", v.path, err)
	}
	if err := v.file.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", v.path, err)
	}
	return nil
}

// chunkLen is the length of chunk idx of v at v's current size.
func (c *cache) chunkLen(v *volume, idx uint64) uint64 {
	cs := uint64(c.chunkSize)
	return min(cs, v.size.Load()-idx*cs)
}

// refit waits until chunk idx of v is not cached with a stale length:
// evicted, or loaded again since the volume grew.
func (c *cache) refit(ctx context.Context, v *volume, idx uint64) error {
	key := chunkKey{v, idx}
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		ch := c.tbl.lookup(key)
		if ch == nil {
			return nil
		}
		switch ch.state {
		case chunkReady:
			if ch.length == c.chunkLen(v, idx) {
				return nil
			}
			// Evicted unless pinned (unpin wakes the waiters).
			if c.tbl.refit(ch) {
				c.startEvict(ch, "evicting a chunk the volume grew past failed")
			}
		case chunkLoading:
			c.waitLoaded(ctx, ch)
			if err := ctx.Err(); err != nil {
				return err
			}
			continue
		}
		if err := c.wait(ctx, 0); err != nil {
			return err
		}
	}
}

// announceResize sends a Resize notice with the volume's new size on
// every connection that has v open, under each handle of it, and returns
// how many it sent. A connection that cannot take it in time is logged
// and left: it is going away.
func (t *Target) announceResize(ctx context.Context, v *volume, size uint64) int {
	t.mu.Lock()
	sessions := make([]*session, 0, len(t.sessions))
	for s := range t.sessions {
		sessions = append(sessions, s)
	}
	t.mu.Unlock()
	var wg sync.WaitGroup
	var mu sync.Mutex
	sent := 0
	for _, s := range sessions {
		s.mu.Lock()
		var handles []uint32
		for h, ov := range s.handles {
			if ov.v == v {
				handles = append(handles, h)
			}
		}
		s.mu.Unlock()
		for _, h := range handles {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sctx, cancel := context.WithTimeout(ctx, resizeNoticeTimeout)
				defer cancel()
				if err := s.link.Send(sctx, 0, &protocol.Resize{Handle: h, VolumeSize: size}); err != nil {
					s.log.Info("resize notice not sent", zap.String("export", v.name), zap.Uint32("handle", h), zap.Error(err))
					return
				}
				mu.Lock()
				sent++
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	return sent
}

// registerGrow creates the grow counter and registers it with reg (if
// not nil).
func (m *Metrics) registerGrow(reg prometheus.Registerer) {
	m.grows = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "rblkd", Name: "volume_grows_total",
		Help: "Volumes grown online (rblkd export grow), by export."}, []string{"export"})
	if reg != nil {
		reg.MustRegister(m.grows)
	}
}
