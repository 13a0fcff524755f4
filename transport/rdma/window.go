//go:build linux

package rdma

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"go.uber.org/zap"

	"github.com/rblk/rblk/transport"
	"github.com/rblk/rblk/transport/rdma/internal/verbs"
)

// Memory windows.
//
// A window is a type-2 memory window (ibv_alloc_mw) bound to the conn's QP
// by an IBV_WR_BIND_MW work request and invalidated by an IBV_WR_LOCAL_INV,
// as the kernel's storage targets do with their fast registrations. Both
// are send-queue work requests, so:
//
//   - The QP has windowSlots more send work requests than SendQueueDepth,
//     which the link above counts on alone; a bind or invalidate takes one
//     of those slots (mwSem) from its post until its completion is polled.
//   - Their wr_id carries mwBit (and the slot and a generation): complete
//     hands their completions to completeMW, never to the rings, so Poll
//     never returns them. The goroutine waiting in BindWindow or
//     Invalidate is woken instead.
//   - Their failure breaks the connection like any failed work request.
//
// Memory windows are pooled per conn: an invalidated window is free again
// (its MW goes back to mwFree); one whose state is unknown (a request on
// it failed, or the conn broke) is deallocated.
const (
	// windowSlots is the send-queue room kept for bind and invalidate
	// requests, so as many of them may be in flight at once.
	windowSlots = 8
	// mwBit marks the wr_id of bind and invalidate requests: mwBit |
	// generation<<8 | slot.
	mwBit = 1 << 62
)

// rxeVendorID is the vendor_id of Soft-RoCE (rxe) devices.
const rxeVendorID = 0xffffff

// WindowSpanChecked reports whether the device checks the peer's requests
// through a window against the window's span. Soft-RoCE does not: its
// responder checks them against the window's MR, so a window reaches the
// whole region it was bound over (checked on 6.1, and the code is the same
// in later kernels).
func (c *conn) WindowSpanChecked() bool { return c.mwSpanChecked }

// winState is where a window is in its life (c.mwMu).
type winState uint8

const (
	winBinding      winState = iota // its bind is posted
	winBound                        // the peer may use it
	winInvalidating                 // its LOCAL_INV is posted
	winDead                         // invalidated, or died with the QP
)

// mwOpKind says what a slot's request does.
type mwOpKind uint8

const (
	opBind mwOpKind = iota + 1
	opInv
)

// mwOp is a bind or invalidate request in flight, in its slot.
type mwOp struct {
	kind   mwOpKind
	id     uint64
	w      *window
	done   chan struct{}    // closed once it completed (or the conn was torn down)
	status transport.Status // its completion's, once done
	// abandoned: the BindWindow that posted it gave up (ctx); its
	// completion invalidates the window at once.
	abandoned bool
}

// window is a type-2 memory window of a conn.
type window struct {
	c      *conn
	r      *region
	mw     verbs.MW // nil once deallocated or back in the pool
	addr   uint64
	length int
	rkey   uint32
	access transport.Access

	state winState // c.mwMu
	op    *mwOp    // the request in flight on it (c.mwMu)
	// leaked: its MW could not be deallocated, and so may still be bound
	// (c.mwMu).
	leaked bool
}

var (
	_ transport.WindowBinder = (*conn)(nil)
	_ transport.Window       = (*window)(nil)
)

func (w *window) Addr() uint64             { return w.addr }
func (w *window) RKey() uint32             { return w.rkey }
func (w *window) Access() transport.Access { return w.access }

// initWindows sets the window bookkeeping of a conn up; supported says the
// device has type-2 windows.
func (c *conn) initWindows(supported bool) {
	c.mwSupported.Store(supported)
	c.mwSem = make(chan struct{}, windowSlots)
	c.windows = make(map[*window]struct{})
}

// errNoWindows is the error of BindWindow on a device without type-2
// memory windows.
func (c *conn) errNoWindows(cause error) error {
	if cause != nil {
		return fmt.Errorf("bind window: %w: the device has no type-2 memory windows (%v)", transport.ErrUnsupported, cause)
	}
	return fmt.Errorf("bind window: %w: the device has no type-2 memory windows", transport.ErrUnsupported)
}

// takeSlot takes a slot of the send-queue room kept for window requests.
func (c *conn) takeSlot(ctx context.Context) error {
	select {
	case c.mwSem <- struct{}{}:
		return nil
	default:
	}
	select {
	case c.mwSem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-c.closed:
		return transport.ErrClosed
	}
}

func (c *conn) putSlot() { <-c.mwSem }

// startOpLocked puts op in a free slot (c.mwMu held, a slot taken) and
// gives it its wr_id.
func (c *conn) startOpLocked(op *mwOp) {
	for i := range c.mwOps {
		if c.mwOps[i] == nil {
			c.mwGen++
			op.id = mwBit | (c.mwGen&0xffffffff)<<8 | uint64(i)
			op.done = make(chan struct{})
			c.mwOps[i] = op
			op.w.op = op
			return
		}
	}
	panic("rdma: no free window slot though the semaphore gave one")
}

// BindWindow binds a type-2 memory window over a span of r to the QP and
// waits for the bind's completion, which Poll reaps.
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
	if !c.mwSupported.Load() {
		return nil, c.errNoWindows(nil)
	}
	if c.broken.Load() {
		return nil, fmt.Errorf("bind window: %w", transport.ErrClosed)
	}
	if err := c.takeSlot(ctx); err != nil {
		return nil, fmt.Errorf("bind window: %w", err)
	}
	w, op, err := c.newWindow(r, off, length, access)
	if err != nil {
		c.putSlot()
		return nil, err
	}
	flags := 0
	if access&transport.AccessRemoteRead != 0 {
		flags |= verbs.AccessRemoteRead
	}
	if access&transport.AccessRemoteWrite != 0 {
		flags |= verbs.AccessRemoteWrite
	}
	if err := c.postMW(op, func() error {
		return c.qp.PostBindMW(op.id, w.mw, r.mr, w.addr, uint64(length), flags, w.rkey)
	}); err != nil {
		return nil, fmt.Errorf("bind window: %w", err)
	}
	select {
	case <-op.done:
	case <-ctx.Done():
		c.mwMu.Lock()
		finished := w.op != op
		if !finished {
			op.abandoned = true
		}
		c.mwMu.Unlock()
		if !finished {
			return nil, ctx.Err()
		}
	}
	// (c.mwMu orders the completion's writes before these reads)
	c.mwMu.Lock()
	st, state := op.status, w.state
	c.mwMu.Unlock()
	if state != winBound {
		if st == transport.StatusFlushed || st == transport.StatusSuccess {
			return nil, fmt.Errorf("bind window: %w", transport.ErrClosed)
		}
		return nil, fmt.Errorf("bind window: the bind request failed: %v; the connection is broken", st)
	}
	return w, nil
}

// newWindow takes a memory window from the pool, or allocates one, for a
// window over r (a slot taken), and puts its bind in a slot.
func (c *conn) newWindow(r *region, off, length int, access transport.Access) (*window, *mwOp, error) {
	// c.regMu first: Deregister, which holds it, sees the window binding.
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if r.mr == nil || r.dead.Load() {
		return nil, nil, errors.New("bind window: the region is deregistered")
	}
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	if c.mwClosed || c.broken.Load() {
		return nil, nil, fmt.Errorf("bind window: %w", transport.ErrClosed)
	}
	var mw verbs.MW
	if n := len(c.mwFree); n > 0 {
		mw = c.mwFree[n-1]
		c.mwFree[n-1] = nil
		c.mwFree = c.mwFree[:n-1]
	} else {
		var err error
		if mw, err = c.pd.AllocMW(); err != nil {
			if errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.ENOSYS) {
				c.mwSupported.Store(false)
				return nil, nil, c.errNoWindows(err)
			}
			return nil, nil, fmt.Errorf("bind window: %w", memlockHint(err))
		}
		c.mwAllocated++
	}
	w := &window{
		c:      c,
		r:      r,
		mw:     mw,
		addr:   r.addr + uint64(off),
		length: length,
		rkey:   verbs.IncRKey(mw.RKey()),
		access: access,
		state:  winBinding,
	}
	op := &mwOp{kind: opBind, w: w}
	c.startOpLocked(op)
	c.windows[w] = struct{}{}
	if r.windows == nil {
		r.windows = make(map[*window]struct{})
	}
	r.windows[w] = struct{}{}
	return w, op, nil
}

// postMW posts op's request with post, under the send queue's lock so
// that Close does not destroy the QP meanwhile. If it is not posted, op
// is undone (its slot freed, its window dead) and the error says why.
func (c *conn) postMW(op *mwOp, post func() error) error {
	c.sq.mu.Lock()
	var err error
	if c.sq.closed || c.broken.Load() {
		err = transport.ErrClosed
	} else {
		err = post()
	}
	if err == nil {
		c.mwMu.Lock()
		c.mwOut++
		c.mwMu.Unlock()
	}
	c.sq.mu.Unlock()
	if err == nil {
		return nil
	}
	c.mwMu.Lock()
	c.endOpLocked(op)
	w := op.w
	w.state = winDead
	// Refused at post, a bind left the window unbound: its MW is free.
	// A refused invalidation left it bound: deallocating its MW revokes
	// it as surely. Closed: what the QP thinks no longer matters.
	c.freeMWLocked(w, op.kind == opBind && !errors.Is(err, transport.ErrClosed))
	op.status = transport.StatusFlushed
	close(op.done)
	c.mwMu.Unlock()
	c.putSlot()
	if errors.Is(err, syscall.ENOMEM) {
		err = fmt.Errorf("%w (%v)", transport.ErrQueueFull, err)
	}
	return err
}

// endOpLocked takes op out of its slot (c.mwMu held).
func (c *conn) endOpLocked(op *mwOp) {
	c.mwOps[op.id&0xff] = nil
	if op.w.op == op {
		op.w.op = nil
	}
}

// freeMWLocked retires the window's MW (c.mwMu held): back to the pool if
// reuse (it is unbound), else deallocated (its state is unknown, or the
// conn is going). The window forgets it and its region forgets the window.
func (c *conn) freeMWLocked(w *window, reuse bool) {
	delete(c.windows, w)
	if w.r.windows != nil {
		delete(w.r.windows, w)
	}
	mw := w.mw
	w.mw = nil
	if mw == nil {
		return
	}
	if reuse && !c.mwClosed && !c.broken.Load() {
		c.mwFree = append(c.mwFree, mw)
		return
	}
	if c.mwClosed {
		return // teardown deallocates what it finds; this one is gone with it
	}
	if err := mw.Dealloc(); err != nil {
		c.log.Warn("rdma: ibv_dealloc_mw", zap.String("remote", c.remote), zap.Error(err))
		c.mwLeaked = append(c.mwLeaked, mw)
		w.leaked = true
		return
	}
	c.mwAllocated--
}

// completeMW takes the completion of a bind or invalidate request (pollSem
// held, the queues' locks not). It reports a failure that breaks the
// connection.
func (c *conn) completeMW(id uint64, st transport.Status, vendor uint32) error {
	c.mwMu.Lock()
	op := c.mwOps[id&0xff]
	if op == nil || op.id != id {
		c.mwMu.Unlock()
		c.log.Error("rdma: completion of an unknown window request", zap.Uint64("wr_id", id))
		return nil
	}
	c.mwOut--
	c.endOpLocked(op)
	op.status = st
	w := op.w
	var failure error
	if st != transport.StatusSuccess && st != transport.StatusFlushed {
		what := "bind"
		if op.kind == opInv {
			what = "invalidate"
		}
		failure = fmt.Errorf("memory window %s request failed: %v (vendor_err %#x)", what, st, vendor)
	}
	var next *mwOp
	switch {
	case st != transport.StatusSuccess:
		// The QP is in the error state: the window died with it.
		w.state = winDead
		c.freeMWLocked(w, false)
	case op.kind == opBind && !op.abandoned:
		w.state = winBound
	case op.kind == opBind:
		// Nobody has the window: invalidate it at once, in the same slot.
		if c.broken.Load() || c.mwClosed {
			w.state = winDead
			c.freeMWLocked(w, false)
			break
		}
		w.state = winInvalidating
		next = &mwOp{kind: opInv, w: w}
		c.startOpLocked(next)
	default: // an invalidation
		w.state = winDead
		c.freeMWLocked(w, true)
	}
	close(op.done)
	c.mwMu.Unlock()
	if next != nil {
		if err := c.postMW(next, func() error { return c.qp.PostLocalInv(next.id, w.rkey) }); err != nil {
			c.log.Debug("rdma: invalidating an abandoned window", zap.Error(err))
		}
	} else {
		c.putSlot()
	}
	return failure
}

// Invalidate posts a LOCAL_INV of the window on its QP and waits for its
// completion, which Poll reaps.
func (w *window) Invalidate(ctx context.Context) error {
	c := w.c
	for {
		c.mwMu.Lock()
		switch w.state {
		case winDead:
			c.mwMu.Unlock()
			return nil
		case winInvalidating, winBinding:
			op := w.op
			c.mwMu.Unlock()
			if op == nil {
				continue
			}
			select {
			case <-op.done:
				continue
			case <-ctx.Done():
				return fmt.Errorf("invalidate window: %w: its invalidation did not complete: %w", transport.ErrDeregisterFailed, ctx.Err())
			}
		}
		// Bound.
		if c.broken.Load() || c.mwClosed {
			// The QP executes nothing more: the window died with it.
			w.state = winDead
			c.freeMWLocked(w, false)
			c.mwMu.Unlock()
			return nil
		}
		c.mwMu.Unlock()
		if err := c.takeSlot(ctx); err != nil {
			if errors.Is(err, transport.ErrClosed) {
				continue
			}
			return fmt.Errorf("invalidate window: %w: no room to post the invalidation: %w", transport.ErrDeregisterFailed, err)
		}
		c.mwMu.Lock()
		if w.state != winBound {
			c.mwMu.Unlock()
			c.putSlot()
			continue
		}
		w.state = winInvalidating
		op := &mwOp{kind: opInv, w: w}
		c.startOpLocked(op)
		c.mwMu.Unlock()
		if err := c.postMW(op, func() error { return c.qp.PostLocalInv(op.id, w.rkey) }); err != nil {
			// The window is dead (postMW deallocated its MW) unless the
			// deallocation failed too.
			c.mwMu.Lock()
			leaked := w.leaked
			c.mwMu.Unlock()
			if leaked {
				return fmt.Errorf("invalidate window: %w: %w", transport.ErrDeregisterFailed, err)
			}
			c.log.Warn("rdma: posting an invalidation failed; the window's memory window was deallocated instead", zap.String("remote", c.remote), zap.Error(err))
			return nil
		}
	}
}

// killWindowsLocked deallocates the windows of r before its MR is
// deregistered (c.regMu held): a device refuses to deregister an MR with
// windows bound (rxe does). A window with a request in flight cannot be
// deallocated: the error says so, and r stays registered.
func (c *conn) killWindowsLocked(r *region) error {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	busy := 0
	for w := range r.windows {
		if w.op != nil {
			busy++
			continue
		}
		w.state = winDead
		c.freeMWLocked(w, false)
	}
	if busy > 0 {
		return fmt.Errorf("%d memory windows over the region have a bind or invalidation in flight", busy)
	}
	return nil
}

// mwInFlight is the number of window requests posted whose completion was
// not polled.
func (c *conn) mwInFlight() int {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	return c.mwOut
}

// destroyWindows runs in teardown once the QP is destroyed, before the
// regions go: every request in flight is over (woken as flushed), every
// memory window deallocated.
func (c *conn) destroyWindows() {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	c.mwClosed = true
	for i, op := range c.mwOps {
		if op == nil {
			continue
		}
		c.mwOps[i] = nil
		op.status = transport.StatusFlushed
		op.w.op = nil
		close(op.done)
	}
	c.mwOut = 0
	var all []verbs.MW
	for w := range c.windows {
		w.state = winDead
		if w.mw != nil {
			all = append(all, w.mw)
			w.mw = nil
		}
		if w.r.windows != nil {
			delete(w.r.windows, w)
		}
	}
	clear(c.windows)
	all = append(all, c.mwFree...)
	all = append(all, c.mwLeaked...)
	c.mwFree, c.mwLeaked = nil, nil
	for _, mw := range all {
		if err := mw.Dealloc(); err != nil {
			c.log.Warn("rdma close: ibv_dealloc_mw", zap.Error(err))
			continue
		}
		c.mwAllocated--
	}
}

// WindowStats reports the windows bound or being bound or invalidated,
// and the memory windows the conn holds (those and its pool).
func (c *conn) WindowStats() (live, allocated int) {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	return len(c.windows), c.mwAllocated
}
