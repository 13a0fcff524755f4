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
// when the connection has them, else a registration of the chunk.
func (s *session) grantKeyFor(ctx context.Context, ch *chunk, access transport.Access) (grantKey, error) {
	conn := s.link.Conn()
	if wb, ok := conn.(transport.WindowBinder); ok && !s.noWindows.Load() {
		r, off, err := s.windowRegion(ch)
		if err == nil {
			var w transport.Window
			w, err = wb.BindWindow(ctx, r, off, len(ch.buf), access&^transport.AccessLocalWrite)
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

// windowRegion returns the session's registration to bind ch's window
// over, and the chunk's offset in it. The registrations have no remote
// access of their own (only windows give that): local write, which a
// writable window needs, and window binding. Where the device holds a
// window's operations to its span, the whole cache is registered once;
// where it does not (Soft-RoCE checks the region's bounds only), a window
// would reach its whole region, so each cache slot is registered once, on
// its first grant, and a window reaches one slot at most.
func (s *session) windowRegion(ch *chunk) (transport.Region, int, error) {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	c := s.t.cache
	const access = transport.AccessLocalWrite | transport.AccessBindWindow
	if s.slotRegs == nil {
		sc, ok := s.link.Conn().(transport.WindowSpanChecker)
		s.spanChecked = ok && sc.WindowSpanChecked()
		s.slotRegs = make(map[int]transport.Region)
	}
	if s.spanChecked {
		if s.cacheReg == nil {
			r, err := s.link.Conn().Register(c.mem.Bytes(), access)
			if err != nil {
				return nil, 0, fmt.Errorf("register the cache: %w", err)
			}
			s.cacheReg = r
		}
		return s.cacheReg, ch.slot * c.chunkSize, nil
	}
	r := s.slotRegs[ch.slot]
	if r == nil {
		var err error
		if r, err = s.link.Conn().Register(c.slotBytes(ch.slot), access); err != nil {
			return nil, 0, fmt.Errorf("register cache slot %d: %w", ch.slot, err)
		}
		s.slotRegs[ch.slot] = r
	}
	return r, 0, nil
}

// releaseRegions deregisters the session's registrations of the cache,
// once its windows are gone (session end).
func (s *session) releaseRegions() {
	s.regMu.Lock()
	defer s.regMu.Unlock()
	regs := make([]transport.Region, 0, len(s.slotRegs)+1)
	if s.cacheReg != nil {
		regs = append(regs, s.cacheReg)
	}
	for _, r := range s.slotRegs {
		regs = append(regs, r)
	}
	for _, r := range regs {
		if err := r.Deregister(); err != nil {
			// Without remote access of their own, the registrations
			// expose nothing; the connection's close releases them.
			s.log.Warn("deregister the cache's registration", zap.Error(err))
		}
	}
	s.cacheReg, s.slotRegs = nil, nil
}
