package tcp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/rblk/rblk/transport"
)

// window is a span of a region that the peer reaches under a key of its
// own, as a type-2 memory window bound to this connection: the key lives
// in this conn's table only, so no other connection knows it.
//
// The reader executes the peer's requests on the span without locks: a
// request that found the window holds it in use (users) until it no
// longer touches the memory (a WRITE's payload is placed, a READ's
// response is written to the stream), and Invalidate, once the key is out
// of the table, waits for those.
type window struct {
	c      *conn
	r      *region
	buf    []byte
	addr   uint64
	key    uint32
	access transport.Access

	mu    sync.Mutex
	dead  bool          // invalidated: acquire fails
	users int           // requests of the peer using the span now
	idle  chan struct{} // closed when users drops to 0 once dead (made by Invalidate)
}

var (
	_ transport.WindowBinder = (*conn)(nil)
	_ transport.Window       = (*window)(nil)
)

func (w *window) Addr() uint64             { return w.addr }
func (w *window) RKey() uint32             { return w.key }
func (w *window) Access() transport.Access { return w.access }

// acquire takes the window for a request of the peer, unless it is dead.
func (w *window) acquire() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.dead {
		return false
	}
	w.users++
	return true
}

// release ends a use of acquire; nil is no window.
func (w *window) release() {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.users--
	if w.users == 0 && w.idle != nil {
		close(w.idle)
		w.idle = nil
	}
	w.mu.Unlock()
}

// BindWindow gives the peer access to a span of r under a fresh key.
func (c *conn) BindWindow(ctx context.Context, reg transport.Region, off, length int, access transport.Access) (transport.Window, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r, ok := reg.(*region)
	if !ok || r == nil || r.c != c {
		return nil, errors.New("bind window: the region is not one of this connection")
	}
	if err := transport.CheckBind(r, off, length, access); err != nil {
		return nil, err
	}
	select {
	case <-c.dying:
		return nil, fmt.Errorf("bind window: %w", transport.ErrClosed)
	default:
	}
	buf := r.buf[off : off+length : off+length]
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if c.regClosed {
		return nil, fmt.Errorf("bind window: %w", transport.ErrClosed)
	}
	if r.revoked.Load() {
		return nil, errors.New("bind window: the region is deregistered")
	}
	w := &window{
		c:      c,
		r:      r,
		buf:    buf,
		addr:   uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))),
		key:    c.newKeyLocked(),
		access: access,
	}
	c.windows[w.key] = w
	if r.windows == nil {
		r.windows = make(map[*window]struct{})
	}
	r.windows[w] = struct{}{}
	return w, nil
}

// Invalidate takes the key out of the table, then waits for the peer's
// requests that use the span to be done with it. If ctx ends first (a
// peer stalled in the middle of a WRITE's payload, say), it closes the
// connection, which ends them, and waits for that. Called from the
// completion handler while the reader is placing a WRITE through the
// window, it waits for ctx, since the reader waits for the handler.
func (w *window) Invalidate(ctx context.Context) error {
	c := w.c
	c.regMu.Lock()
	if c.windows[w.key] == w {
		delete(c.windows, w.key)
	}
	delete(w.r.windows, w)
	c.regMu.Unlock()
	w.mu.Lock()
	w.dead = true
	if w.users == 0 {
		w.mu.Unlock()
		return nil
	}
	if w.idle == nil {
		w.idle = make(chan struct{})
	}
	idle := w.idle
	w.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-c.quietCh:
		// Closed, and nothing of the conn touches the memory any more
		// (the reader may still hold the window, inside the completion
		// handler: it lets go of it without touching it).
		return nil
	case <-ctx.Done():
	}
	// The reader and the writer leave once the stream is closed, and the
	// READ responses they did not send are dropped; shut waits for that
	// (or for the reader to be inside the handler, bound to leave).
	c.shut(fmt.Errorf("a request of the peer held an invalidated window past the invalidation's deadline: %w", ctx.Err()))
	return nil
}

// WindowStats reports the windows bound and not invalidated; the software
// provider allocates nothing else for them.
func (c *conn) WindowStats() (live, allocated int) {
	c.regMu.RLock()
	defer c.regMu.RUnlock()
	return len(c.windows), len(c.windows)
}

// WindowSpanChecked is true: a window's key reaches its span only.
func (c *conn) WindowSpanChecked() bool { return true }
