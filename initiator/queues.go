package initiator

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol/link"

	"github.com/rblk/rblk/protocol"
)

// A volume's session may have several connections to the target, its IO
// queues (Options.Queues): the first opens the volume, the others join its
// session (protocol.Join) and share its generation, so that the target
// fences them all together. Each queue has its own grants and its own
// completion path. A front end with several connections serves its i-th
// from Queue(i) (blockdev.Queuer), so that a request and its completion
// stay on one queue; through the Volume's own methods a request goes to
// the queue of its first chunk. A flush goes to every queue. The volume
// reconnects them all when any of them goes down.

// queueSet is the connections of one session, first the one that opened
// the volume.
type queueSet struct {
	qs []*session

	drainOnce sync.Once
	draining  chan struct{} // closed when a drain starts
	drained   chan struct{} // closed when it has ended
}

func newQueueSet(qs []*session) *queueSet {
	set := &queueSet{qs: qs, draining: make(chan struct{}), drained: make(chan struct{})}
	for _, s := range qs {
		s.set.Store(set)
	}
	return set
}

// join dials the queues after the first, s, and adds them to its session.
// A queue that cannot join is not fatal: the volume goes on with those it
// has (an older target refuses Join).
func (v *Volume) join(ctx context.Context, s *session) *queueSet {
	qs := []*session{s}
	want := v.opts.Queues
	if want > 1 && v.opts.HostID == "" {
		v.log.Warn("an anonymous volume has one queue: give a host ID for more", zap.Int("queues", want))
		want = 1
	}
	for len(qs) < want {
		q, err := v.dialQueue(ctx, s)
		if err != nil {
			v.log.Warn("the target took fewer queues than asked", zap.Int("queues", len(qs)), zap.Int("asked", want), zap.Error(err))
			break
		}
		qs = append(qs, q)
	}
	return newQueueSet(qs)
}

// dialQueue connects once more and joins the session of first.
func (v *Volume) dialQueue(ctx context.Context, first *session) (*session, error) {
	mode := protocol.ModeReadWrite
	if first.info.Flags&protocol.VolReadOnly != 0 {
		mode = protocol.ModeReadOnly
	}
	return v.dial(ctx, func(s *session) error {
		err := s.link.Request(ctx, &protocol.Join{Mode: mode, Name: v.opts.Export, HostID: v.opts.HostID,
			Generation: first.info.Generation}, &s.info)
		if err != nil {
			return fmt.Errorf("join queue to session generation %d of volume %q on %s: %w", first.info.Generation, v.opts.Export, v.opts.Target, err)
		}
		// (The size may have grown since the first queue opened: dial
		// took it.)
		if s.info.Generation != first.info.Generation || s.info.ChunkSize != first.info.ChunkSize {
			return fmt.Errorf("join queue to volume %q: target reports generation %d, chunk size %d, the session has %d, %d: %w",
				v.opts.Export, s.info.Generation, s.info.ChunkSize,
				first.info.Generation, first.info.ChunkSize, protocol.ErrProtocol)
		}
		return nil
	})
}

// down is closed when the link of any queue of the set goes down (or stop
// is closed).
func (set *queueSet) down(stop <-chan struct{}) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	for _, s := range set.qs {
		go func() {
			select {
			case <-s.link.Done():
				once.Do(func() { close(ch) })
			case <-stop:
			case <-ch:
			}
		}()
	}
	return ch
}

// drainStarted reports whether the target announced its shutdown.
func (set *queueSet) drainStarted() bool {
	select {
	case <-set.draining:
		return true
	default:
		return false
	}
}

// teardown closes every queue's connection and waits for their
// goroutines; once a drain has started, it waits for it first.
func (set *queueSet) teardown() {
	select {
	case <-set.draining:
		<-set.drained
	default:
	}
	for _, s := range set.qs {
		s.teardown()
	}
}

// byChunk routes a request to the queue of its first chunk.
const byChunk = -1

// queueFor returns queue q (modulo the queues), or with byChunk the queue
// of the chunk that holds off; nil while reconnecting. It takes no lock.
func (v *Volume) queueFor(q int, off uint64) *session {
	set := v.set.Load()
	if set == nil {
		return nil
	}
	qs := set.qs
	switch {
	case len(qs) == 1:
		return qs[0]
	case q >= 0:
		return qs[q%len(qs)]
	}
	return qs[(off/uint64(v.info.ChunkSize))%uint64(len(qs))]
}

var _ blockdev.Queuer = (*Volume)(nil)

// Queue returns the backend of queue i: see blockdev.Queuer. The NBD
// server serves its i-th connection (the kernel's i-th socket) from it.
func (v *Volume) Queue(i int) blockdev.Backend { return &queueView{v: v, q: i} }

// queueView is one queue of a volume, as a blockdev backend.
type queueView struct {
	v *Volume
	q int
	// plugged is the link Plug plugged, until Unplug: by the submitting
	// goroutine, or by one whose Alloc must wait (a front end's worker).
	plugged atomic.Pointer[link.Link]
}

var (
	_ blockdev.Backend   = (*queueView)(nil)
	_ blockdev.Submitter = (*queueView)(nil)
	_ blockdev.Plugger   = (*queueView)(nil)
)

// Plug holds back the work requests of the queue's link until Unplug
// (blockdev.Plugger, link.Plug): the requests submitted meanwhile go to
// the target with one doorbell. No session up: nothing to hold back.
func (qv *queueView) Plug() {
	if qv.plugged.Load() != nil {
		return
	}
	if s := qv.v.queueFor(qv.q, 0); s != nil {
		// Plugged, then recorded: whoever takes the record unplugs it.
		s.link.Plug()
		qv.plugged.Store(s.link)
	}
}

// Unplug posts what Plug held back (blockdev.Plugger). The link is the one
// plugged, even if the queue reconnected since.
func (qv *queueView) Unplug() {
	if l := qv.plugged.Swap(nil); l != nil {
		l.Unplug()
	}
}

// Alloc takes a buffer through the queue's cache (bufPool.allocQ); if it
// must wait for one, it unplugs first (see Plug): the requests that would
// free one may be held back.
func (qv *queueView) Alloc(ctx context.Context, n int) (*blockdev.Buffer, error) {
	var unplug unplugger
	if qv.plugged.Load() != nil {
		unplug = qv
	}
	b, err := qv.v.pool.allocQ(ctx, qv.q, n, unplug)
	if err != nil {
		return nil, err
	}
	return &b.Buffer, nil
}

// Free gives a buffer back through the queue's cache.
func (qv *queueView) Free(b *blockdev.Buffer) { qv.v.pool.releaseQ(qv.q, b.Priv.(*ioBuf)) }

func (qv *queueView) Flush(ctx context.Context) error { return qv.v.Flush(ctx) }

func (qv *queueView) ReadAt(ctx context.Context, nb *blockdev.Buffer, off uint64) error {
	b := nb.Priv.(*ioBuf)
	b.q = qv.q
	return qv.v.io(ctx, b, off, false, false)
}

func (qv *queueView) WriteAt(ctx context.Context, nb *blockdev.Buffer, off uint64, fua bool) error {
	if err := qv.v.writable(); err != nil {
		return err
	}
	b := nb.Priv.(*ioBuf)
	b.q = qv.q
	return qv.v.io(ctx, b, off, true, fua)
}

func (qv *queueView) Trim(ctx context.Context, off, n uint64, fua bool) error {
	return qv.v.trim(ctx, qv.q, off, n, fua)
}

func (qv *queueView) WriteZeroes(ctx context.Context, off, n uint64, noHole, fua bool) error {
	return qv.v.writeZeroes(ctx, qv.q, off, n, noHole, fua)
}

func (qv *queueView) SubmitRead(ctx context.Context, nb *blockdev.Buffer, off uint64, c blockdev.Completion) {
	qv.v.submit(ctx, nb.Priv.(*ioBuf), qv.q, off, false, false, c)
}

func (qv *queueView) SubmitWrite(ctx context.Context, nb *blockdev.Buffer, off uint64, fua bool, c blockdev.Completion) {
	if err := qv.v.writable(); err != nil {
		c.Complete(err)
		return
	}
	qv.v.submit(ctx, nb.Priv.(*ioBuf), qv.q, off, true, fua, c)
}

// drain answers the target's shutdown notice, which comes on every queue:
// no new IO starts on the session, IO in flight finishes (and sends its
// Done), then a flush on every queue makes every acknowledged write
// durable and the connections are closed. IO waits for the reconnection
// meanwhile, and nothing is reported lost.
func (set *queueSet) drain(v *Volume) {
	set.drainOnce.Do(func() {
		close(set.draining)
		defer close(set.drained)
		v.log.Info("target is shutting down: finishing IO in flight and flushing", zap.String("target", v.opts.Target))
		for _, s := range set.qs {
			s.mu.Lock()
			s.draining = true
			s.mu.Unlock()
		}
		for _, s := range set.qs {
			s.mu.Lock()
			for s.inflight > 0 && s.link.Err() == nil {
				s.cond.Wait()
			}
			s.mu.Unlock()
		}
		writes := v.writes.Load()
		if err := set.flush(context.Background(), v); err == nil {
			v.mu.Lock()
			v.flushedAt = max(v.flushedAt, writes)
			v.mu.Unlock()
		} else {
			v.log.Warn("flush before the target's shutdown failed", zap.Error(err))
		}
		for _, s := range set.qs {
			s.link.Close()
		}
	})
}

// flush sends Flush on every queue at once and waits for every reply: a
// Done is ordered only with the Flush of its own connection.
func (set *queueSet) flush(ctx context.Context, v *Volume) error {
	if len(set.qs) == 1 {
		s := set.qs[0]
		return s.link.RequestWithin(ctx, v.opts.FlushTimeout, s.flushMsg(), &protocol.OK{})
	}
	errs := make([]error, len(set.qs))
	var wg sync.WaitGroup
	for i, s := range set.qs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.link.RequestWithin(ctx, v.opts.FlushTimeout, s.flushMsg(), &protocol.OK{})
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// up reports whether every queue's link is up.
func (set *queueSet) up() bool {
	for _, s := range set.qs {
		if s.link.Err() != nil {
			return false
		}
	}
	return true
}

// holdAll takes a hold on every queue if IO may start on each (links up,
// no drain), and reports whether it did: all or none.
func (set *queueSet) holdAll() bool {
	for i, s := range set.qs {
		s.mu.Lock()
		if !s.usableLocked() {
			for _, o := range set.qs[:i+1] {
				o.mu.Unlock()
			}
			return false
		}
	}
	for _, s := range set.qs {
		s.inflight++
		s.mu.Unlock()
	}
	return true
}
