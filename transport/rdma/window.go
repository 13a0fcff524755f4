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

// mwOp is a bind or invalidate request, in its slot from startOpLocked
// until finishOpLocked. Its channel is closed and its slot given back by
// finishOpLocked only, once, whoever ends it first: its completion
// (completeMW), the refusal of its post (postMW), the device's removal
// (flushWindows) or the teardown (destroyWindows).
type mwOp struct {
	kind   mwOpKind
	id     uint64
	w      *window
	done   chan struct{}    // closed once it is finished
	status transport.Status // its completion's (flushed if it had none), once done
	// abandoned: the BindWindow that posted it gave up (ctx); its
	// completion invalidates the window at once.
	abandoned bool
	// posted: the QP has it (its completion will come, or a flush);
	// finished: finishOpLocked ran. (c.mwMu)
	posted, finished bool
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

// newOp is a request of kind on w, to be started.
func newOp(kind mwOpKind, w *window) *mwOp {
	return &mwOp{kind: kind, w: w, done: make(chan struct{})}
}

// startOpLocked puts op in a free slot (c.mwMu held, a slot taken) and
// gives it its wr_id.
func (c *conn) startOpLocked(op *mwOp) {
	for i := range c.mwOps {
		if c.mwOps[i] == nil {
			c.mwGen++
			op.id = mwBit | (c.mwGen&0xffffffff)<<8 | uint64(i)
			c.mwOps[i] = op
			op.w.op = op
			return
		}
	}
	// The semaphore has as many tokens as there are slots, and a token is
	// given back only with its slot: unreachable. Without a slot the
	// request is refused at post (postMW), which is better than a panic.
	c.log.Error("rdma: no free window slot though the semaphore gave one")
}

// finishOpLocked ends op (c.mwMu held): out of its slot and off its window,
// its status recorded, its waiter woken, and its slot token given back
// (unless keepSlot: the caller puts the next request of the window in
// it). It reports whether it did: false if op was finished already, in
// which case the caller must leave op and its window alone (whoever
// finished it decided their fate).
func (c *conn) finishOpLocked(op *mwOp, st transport.Status, keepSlot bool) bool {
	if op.finished {
		return false
	}
	op.finished = true
	if slot := op.id & 0xff; slot < windowSlots && c.mwOps[slot] == op {
		c.mwOps[slot] = nil
	}
	if op.w.op == op {
		op.w.op = nil
	}
	op.status = st
	close(op.done)
	if !keepSlot {
		c.putSlot()
	}
	return true
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
	if st := c.state(); st >= stateFailing {
		return nil, fmt.Errorf("bind window: the connection is %v: %w", st, transport.ErrClosed)
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
	c.hooks.afterStartOp(op)
	if err := c.postMW(op, func() error {
		return c.qp.PostBindMW(op.id, w.mw, r.mr, w.addr, uint64(length), flags, w.rkey)
	}); err != nil {
		return nil, fmt.Errorf("bind window: %w", err)
	}
	select {
	case <-op.done:
	case <-ctx.Done():
		c.mwMu.Lock()
		finished := op.finished
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
	if st := c.state(); st >= stateFailing {
		return nil, nil, fmt.Errorf("bind window: the connection is %v: %w", st, transport.ErrClosed)
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
	op := newOp(opBind, w)
	c.windows[w] = struct{}{}
	if r.windows == nil {
		r.windows = make(map[*window]struct{})
	}
	r.windows[w] = struct{}{}
	c.startOpLocked(op)
	return w, op, nil
}

// postMW posts op's request with post, under the send queue's lock, so
// that the teardown does not destroy the QP meanwhile, and the windows'
// (the completion of a request posted is not taken before it is marked
// posted). If it is not posted, op is ended as flushed (its slot given
// back, its window dead, its MW back in the pool or deallocated) unless
// something ended it before, and the error says why.
func (c *conn) postMW(op *mwOp, post func() error) error {
	c.sq.mu.Lock()
	c.mwMu.Lock()
	var err error
	switch st := c.state(); {
	case op.finished:
		// The device's removal ended it.
		err = fmt.Errorf("the connection is %v: %w", st, transport.ErrClosed)
	case st >= stateFailing:
		err = fmt.Errorf("the connection is %v: %w", st, transport.ErrClosed)
	case c.mwOps[op.id&0xff] != op:
		err = errors.New("no window slot")
	default:
		if err = post(); err == nil {
			op.posted = true
		}
	}
	c.sq.mu.Unlock()
	if err == nil {
		c.mwMu.Unlock()
		return nil
	}
	if c.finishOpLocked(op, transport.StatusFlushed, false) {
		w := op.w
		w.state = winDead
		// Refused at post, a bind left the window unbound: its MW is free.
		// A refused invalidation left it bound: deallocating its MW revokes
		// it as surely. Closed: what the QP thinks no longer matters.
		c.freeMWLocked(w, op.kind == opBind && !errors.Is(err, transport.ErrClosed))
	}
	c.mwMu.Unlock()
	if errors.Is(err, syscall.ENOMEM) {
		err = fmt.Errorf("%w (%v)", transport.ErrQueueFull, err)
	}
	return err
}

// freeMWLocked retires the window's MW (c.mwMu held): back to the pool if
// reuse (it is unbound) and the conn goes on, else deallocated (its state
// is unknown, or the conn is going). The window forgets it and its region
// forgets the window. After the teardown (destroyWindows) a window has no
// MW left.
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
	if reuse && c.state() < stateFailing {
		c.mwFree = append(c.mwFree, mw)
		return
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
	w := op.w
	var failure error
	if st != transport.StatusSuccess && st != transport.StatusFlushed {
		what := "bind"
		if op.kind == opInv {
			what = "invalidate"
		}
		failure = fmt.Errorf("memory window %s request failed: %v (vendor_err %#x)", what, st, vendor)
	}
	// An abandoned bind that succeeded is invalidated at once, in its slot,
	// if the QP still executes requests.
	chain := st == transport.StatusSuccess && op.kind == opBind && op.abandoned && c.state() < stateFailing
	c.finishOpLocked(op, st, chain)
	var next *mwOp
	switch {
	case st != transport.StatusSuccess:
		// The QP is in the error state: the window died with it.
		w.state = winDead
		c.freeMWLocked(w, false)
	case op.kind == opBind && !op.abandoned:
		w.state = winBound
	case op.kind == opBind && !chain:
		// Nobody has the window, and the QP executes nothing more.
		w.state = winDead
		c.freeMWLocked(w, false)
	case op.kind == opBind:
		w.state = winInvalidating
		next = newOp(opInv, w)
		c.startOpLocked(next)
	default: // an invalidation
		w.state = winDead
		c.freeMWLocked(w, true)
	}
	c.mwMu.Unlock()
	if next != nil {
		if err := c.postMW(next, func() error { return c.qp.PostLocalInv(next.id, w.rkey) }); err != nil {
			c.log.Debug("rdma: invalidating an abandoned window", zap.Error(err))
		}
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
				// (Not reached: a window binding or invalidating has its
				// request.)
				return fmt.Errorf("invalidate window: %w: no request in flight on a window %v", transport.ErrDeregisterFailed, w.state)
			}
			select {
			case <-op.done:
				continue
			case <-ctx.Done():
				return fmt.Errorf("invalidate window: %w: its invalidation did not complete: %w", transport.ErrDeregisterFailed, ctx.Err())
			}
		}
		// Bound.
		if c.state() >= stateFailing {
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
		op := newOp(opInv, w)
		c.startOpLocked(op)
		c.mwMu.Unlock()
		c.hooks.afterStartOp(op)
		if err := c.postMW(op, func() error { return c.qp.PostLocalInv(op.id, w.rkey) }); err != nil {
			// The window is dead: postMW (or the teardown, or the
			// device's removal) ended it and retired its MW, unless the
			// deallocation failed.
			c.mwMu.Lock()
			leaked := w.leaked
			c.mwMu.Unlock()
			if leaked {
				return fmt.Errorf("invalidate window: %w: %w", transport.ErrDeregisterFailed, err)
			}
			if !errors.Is(err, transport.ErrClosed) {
				c.log.Warn("rdma: posting an invalidation failed; the window's memory window was deallocated instead", zap.String("remote", c.remote), zap.Error(err))
			}
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
	n := 0
	for _, op := range c.mwOps {
		if op != nil && op.posted {
			n++
		}
	}
	return n
}

// flushWindows ends every window request as flushed and marks every
// window dead, for a QP that will complete nothing more (the device is
// gone, or the QP destroyed). The memory windows stay for the teardown
// to deallocate.
func (c *conn) flushWindows() {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	for _, op := range c.mwOps {
		if op != nil {
			c.finishOpLocked(op, transport.StatusFlushed, false)
		}
	}
	for w := range c.windows {
		w.state = winDead
	}
}

// destroyWindows runs in the teardown before the QP is destroyed (a
// bound type-2 window holds a reference on its QP), and in newConn's
// cleanup: every request still in flight is ended (woken as flushed),
// every memory window deallocated.
func (c *conn) destroyWindows() {
	c.mwMu.Lock()
	defer c.mwMu.Unlock()
	for _, op := range c.mwOps {
		if op != nil {
			c.finishOpLocked(op, transport.StatusFlushed, false)
		}
	}
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
