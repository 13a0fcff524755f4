package target

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
)

// grantKey is what a grant hands the initiator: a memory window bound to
// the session's connection over the session's one registration of the
// cache, or, where the connection has no memory windows, a registration of
// the chunk alone. Either way the rkey works only through that connection,
// and release makes it reach nothing.
type grantKey interface {
	Addr() uint64
	RKey() uint32
	Access() transport.Access
	// release invalidates the window or deregisters the region; an error
	// means the memory may still be reachable (see transport.Region).
	release() error
}

type regionKey struct{ transport.Region }

func (k regionKey) release() error { return k.Deregister() }

type windowKey struct{ transport.Window }

// invalidateTimeout bounds a window's invalidation, a work request on the
// session's send queue.
const invalidateTimeout = 10 * time.Second

func (k windowKey) release() error {
	ctx, cancel := context.WithTimeout(context.Background(), invalidateTimeout)
	defer cancel()
	return k.Invalidate(ctx)
}

// grantKeyFor gives s access to ch's memory with access: a memory window
// when the connection has them, else a registration of the chunk. The
// cache is registered on the connection once, at the first window,
// without remote access of its own (only windows give that).
func (s *session) grantKeyFor(ctx context.Context, ch *chunk, access transport.Access) (grantKey, error) {
	conn := s.link.Conn()
	if wb, ok := conn.(transport.WindowBinder); ok && !s.noWindows.Load() {
		r, err := s.cacheRegion()
		if err == nil {
			var w transport.Window
			w, err = wb.BindWindow(ctx, r, ch.slot*s.t.cache.chunkSize, len(ch.buf), access&^transport.AccessLocalWrite)
			if err == nil {
				return windowKey{w}, nil
			}
		}
		if !errors.Is(err, transport.ErrUnsupported) {
			return nil, fmt.Errorf("memory window for chunk at %d: %w", ch.off, err)
		}
		if !s.noWindows.Swap(true) {
			s.log.Info("the connection has no memory windows: registering each granted chunk", zap.Error(err))
		}
	}
	r, err := conn.Register(ch.buf, access)
	if err != nil {
		return nil, fmt.Errorf("register chunk at %d: %w", ch.off, err)
	}
	return regionKey{r}, nil
}

// cacheRegion registers the whole cache on the session's connection, once,
// for memory windows: local write (which a writable window needs) and
// window binding, no remote access.
func (s *session) cacheRegion() (transport.Region, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if s.cacheReg != nil {
		return s.cacheReg, nil
	}
	r, err := s.link.Conn().Register(s.t.cache.mem.Bytes(), transport.AccessLocalWrite|transport.AccessBindWindow)
	if err != nil {
		return nil, err
	}
	s.cacheReg = r
	return r, nil
}

// releaseCacheRegion deregisters the session's registration of the cache,
// once its windows are gone (session end).
func (s *session) releaseCacheRegion() {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if s.cacheReg == nil {
		return
	}
	if err := s.cacheReg.Deregister(); err != nil {
		// Without remote access of its own, the registration exposes
		// nothing; the connection's close releases it.
		s.log.Warn("deregister the cache's registration", zap.Error(err))
	}
	s.cacheReg = nil
}
