package initiator

import (
	"context"
	"errors"

	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
)

// doneWindow is how many Dones of the run-to-completion path (submit) a
// queue keeps in flight. A write that finds them all in flight posts its
// RDMA WRITEs at once and waits for the next Done, which reports every
// write that waited for it: at depth, one Done (one SEND, one completion
// on each side, one pass through the target's Done handling) carries many
// writes, while a queue with fewer writes in flight than the window sends
// each its own Done at once, chained after its WRITEs, as before.
//
// The price is latency under load: a write waits for one Done of the
// window to complete before its own is sent. With a window of w and d
// writes in flight on a queue that only waits (the link's round trip, not
// the CPU, bounds it), d*w/(w+1) complete per round trip instead of d.
// Where the CPU bounds it, as at depth, fewer messages is the gain.
const doneWindow = 4

// doneBatch is one Done of the run-to-completion path and the writes it
// reports, whose RDMA WRITEs were posted before it: the completion of its
// SEND completes them all (link.Callback).
type doneBatch struct {
	s      *session
	ctx    context.Context // of its first write: bounds the wait to post it
	bufs   []*ioBuf
	ranges []protocol.Range
	msg    protocol.Done
}

// batchLocked takes a Done batch for the writes of s.pend (up to
// protocol.MaxDoneRanges of them), or returns nil when there are none or
// the window is full. It counts the batch in flight. s.mu is held.
func (s *session) batchLocked() *doneBatch {
	if len(s.pend) == 0 || s.dones >= doneWindow {
		return nil
	}
	var db *doneBatch
	if n := len(s.freeDones); n > 0 {
		db = s.freeDones[n-1]
		s.freeDones = s.freeDones[:n-1]
	} else {
		db = &doneBatch{s: s}
	}
	n := min(len(s.pend), protocol.MaxDoneRanges)
	db.bufs = append(db.bufs[:0], s.pend[:n]...)
	k := copy(s.pend, s.pend[n:])
	clear(s.pend[k:])
	s.pend = s.pend[:k]
	db.ranges = db.ranges[:0]
	for _, b := range db.bufs {
		r := protocol.Range{Offset: b.off, Length: bufLen(b)}
		if k := len(db.ranges) - 1; k >= 0 && db.ranges[k].Offset+db.ranges[k].Length == r.Offset {
			db.ranges[k].Length += r.Length // contiguous writes: one range
			continue
		}
		db.ranges = append(db.ranges, r)
	}
	db.ctx = db.bufs[0].ctx
	db.msg = protocol.Done{Handle: s.info.Handle, Generation: s.info.Generation, Ranges: db.ranges}
	s.dones++
	return db
}

// batchEndedLocked counts a Done batch out of the window and takes the
// next one, if writes wait for it. s.mu is held.
func (s *session) batchEndedLocked() *doneBatch {
	s.dones--
	return s.batchLocked()
}

// freeLocked keeps db for reuse. s.mu is held.
func (s *session) freeLocked(db *doneBatch) {
	clear(db.bufs)
	db.bufs = db.bufs[:0]
	db.ctx = nil
	s.freeDones = append(s.freeDones, db)
}

// sent counts a Done posted that reports n writes.
func (s *session) sent(n int) {
	s.v.m.doneMessages.Inc()
	s.v.m.doneWrites.Add(float64(n))
}

// post sends db's Done, after the RDMA WRITEs its writes posted (with
// PostOps). From a link callback (wait false) it does not wait: where the
// link has no send slot or credit free, a goroutine posts it. A Done that
// cannot be posted completes its writes with the error (done again the
// synchronous way, see ioBuf.OnComplete).
func (db *doneBatch) post(wait bool) {
	s, n := db.s, len(db.bufs) // (db may be done and reused once posted)
	var err error
	if wait {
		err = s.link.Start(db.ctx, db, &db.msg)
	} else {
		if testHookWouldWait != nil && testHookWouldWait() {
			err = link.ErrWouldWait
		} else {
			err = s.link.TryStart(db, &db.msg)
		}
		if errors.Is(err, link.ErrWouldWait) {
			go db.post(true)
			return
		}
	}
	if err != nil {
		db.OnComplete(err)
		return
	}
	s.sent(n)
}

// testHookWouldWait, set by tests only, makes post from a callback act as
// if the link had no send slot or credit free when it returns true.
var testHookWouldWait func() bool

// OnComplete ends a Done batch (link.Callback): the window has room for
// the next one, which goes out first; then each write completes.
func (db *doneBatch) OnComplete(err error) {
	s := db.s
	s.mu.Lock()
	next := s.batchEndedLocked()
	s.mu.Unlock()
	if next != nil {
		next.post(false)
	}
	for i, b := range db.bufs {
		db.bufs[i] = nil
		b.OnComplete(err)
	}
	s.mu.Lock()
	s.freeLocked(db)
	s.mu.Unlock()
}
