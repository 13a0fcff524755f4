package initiator

import (
	"context"
	"time"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol/link"
)

var _ blockdev.Submitter = (*Volume)(nil)

// SubmitRead starts a read of b at off: see blockdev.Submitter.
func (v *Volume) SubmitRead(ctx context.Context, nb *blockdev.Buffer, off uint64, c blockdev.Completion) {
	v.submit(ctx, nb.Priv.(*ioBuf), byChunk, off, false, false, c)
}

// SubmitWrite starts a write of b at off: see blockdev.Submitter.
func (v *Volume) SubmitWrite(ctx context.Context, nb *blockdev.Buffer, off uint64, fua bool, c blockdev.Completion) {
	if err := v.writable(); err != nil {
		c.Complete(err)
		return
	}
	v.submit(ctx, nb.Priv.(*ioBuf), byChunk, off, true, fua, c)
}

// submit runs a request to completion when it can: on the caller's
// goroutine it takes references on the grants of every chunk (all held
// already, the usual case) and posts one chain of work requests, the RDMA
// operations and, for a write, its Done; the completion of the chain's
// last work request (OnComplete, on the link's completion goroutine) gives
// the references back and completes the request. No goroutine is started
// and nothing waits in between.
//
// Everything else goes the synchronous way in a goroutine of its own
// (slow): a chunk not granted yet, no session up (reconnecting, draining),
// a FUA write (which waits for the target's reply), a request too large
// for one chain, and a chain that failed (it is done again once
// reconnected, as any IO in flight on a lost session).
func (v *Volume) submit(ctx context.Context, b *ioBuf, q int, off uint64, write, fua bool, c blockdev.Completion) {
	b.q = q
	n := bufLen(b)
	if n == 0 {
		c.Complete(nil)
		return
	}
	if err := v.check(off, n); err != nil {
		c.Complete(err)
		return
	}
	b.v, b.comp, b.ctx, b.off, b.write, b.fua = v, c, ctx, off, write, fua
	if fua || !v.start(b, n) {
		v.slow(b)
	}
}

// start posts the request's chain if its session is up and every chunk it
// needs is granted, and reports whether it did. A write's Done goes in the
// same chain when the queue's window of Dones has room, else in the next
// Done batch (see doneWindow).
func (v *Volume) start(b *ioBuf, n uint64) bool {
	off, write := b.off, b.write
	v.plan(b, off, n)
	if v.dead.Load() {
		return false
	}
	s := v.queueFor(b.q, off)
	if s == nil {
		return false
	}
	// Only the queue's own lock: queues share nothing on this path.
	s.mu.Lock()
	if !s.usableLocked() {
		s.mu.Unlock()
		return false
	}
	var ok bool
	b.grants, ok = s.grants.tryAcquire(b.idxs, write, b.grants)
	if !ok {
		s.mu.Unlock()
		return false
	}
	s.inflight++
	var db *doneBatch
	if write && len(s.pend) == 0 && s.dones < doneWindow {
		// Room in the window: this write's own Done, chained after
		// its WRITEs.
		s.pend = append(s.pend, b)
		db = s.batchLocked()
	}
	s.mu.Unlock()
	s.ops(b, off, off, off+n, write)
	b.sess, b.start = s, time.Now()
	var err error
	switch {
	case len(b.ops) > s.link.MaxChain():
		err = link.ErrChainTooLong
	case !write:
		err = s.link.Start(b.ctx, b, nil, b.ops...)
	case db != nil:
		if err = s.link.Start(b.ctx, db, &db.msg, b.ops...); err == nil {
			s.sent(1)
		}
	default:
		// The window is full: the WRITEs go now, the Done with the
		// next batch.
		if err = s.link.PostOps(b.ctx, b.ops...); err == nil {
			s.mu.Lock()
			s.pend = append(s.pend, b)
			db = s.batchLocked() // the window may have room by now
			s.mu.Unlock()
			if db != nil {
				db.post(true)
			}
			return true
		}
	}
	if err != nil {
		// Nothing posted: the synchronous path sorts it out (a chain in
		// pieces, the link going down).
		if db != nil {
			// b's own batch, never posted: its slot in the window
			// goes to the writes that queued behind it meanwhile.
			s.mu.Lock()
			s.freeLocked(db)
			next := s.batchEndedLocked()
			s.mu.Unlock()
			if next != nil {
				next.post(true)
			}
		}
		b.sess = nil
		v.finish(s, b)
		return false
	}
	return true
}

// finish gives back the references of b's grants and its hold on s.
func (v *Volume) finish(s *session, b *ioBuf) {
	s.mu.Lock()
	if s.grants.release(b.grants) {
		s.cond.Broadcast()
	}
	s.releaseLocked()
	s.mu.Unlock()
	clear(b.grants)
	b.grants = b.grants[:0]
}

// OnComplete ends a request's chain (link.Callback): it runs on the link's
// completion goroutine and does not block.
func (b *ioBuf) OnComplete(err error) {
	v, s := b.v, b.sess
	b.sess = nil
	if err == nil && b.write {
		// Counted before s is released: see io.
		v.writes.Add(1)
	}
	v.finish(s, b)
	if err != nil {
		// The link went down under the chain: done again, the
		// synchronous way, once reconnected (or failed as it decides).
		v.slow(b)
		return
	}
	n := bufLen(b)
	v.m.observe(b.write, b.start, len(b.ops), n)
	c := b.comp
	b.comp = nil
	// b may be freed and reused from here on.
	if bc, ok := c.(blockdev.BatchCompletion); ok {
		// The front end's reply waits for the others of this batch of
		// completions, to go out with them.
		if f := bc.CompleteBatched(nil); f != nil && !s.link.Defer(f) {
			f.Flush()
		}
		return
	}
	c.Complete(nil)
}

// slow carries the request of b on the synchronous path, in a goroutine.
func (v *Volume) slow(b *ioBuf) {
	c := b.comp
	b.comp = nil
	go func() {
		c.Complete(v.io(b.ctx, b, b.off, b.write, b.fua))
	}()
}
