package initiator

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
)

// supervise waits for the session to go down (any of its queues) and
// reconnects them all.
func (v *Volume) supervise(set *queueSet) {
	defer close(v.superDone)
	reconnects := 0
	onLink := func(up bool) {
		if v.opts.OnLink != nil {
			v.opts.OnLink(up, reconnects)
		}
	}
	for {
		select {
		case <-v.stop:
			return
		case <-set.down(v.stop):
		}
		select {
		case <-v.stop:
			return
		default:
		}
		s := set.qs[0]
		v.mu.Lock()
		v.set.Store(nil)
		v.mu.Unlock()
		v.m.sessions.Set(0)
		if err := v.Err(); err != nil {
			set.teardown()
			return // failed (fenced): no reconnection
		}
		linkErr := s.link.Err()
		for _, q := range set.qs {
			if err := q.link.Err(); err != nil {
				linkErr = err
				break
			}
		}
		v.log.Warn("connection to the target lost", zap.String("target", v.opts.Target), zap.Error(linkErr))
		v.mu.Lock()
		v.downs++
		gen := v.downs
		v.mu.Unlock()
		var fastFail *time.Timer
		if v.opts.FastFailTimeout > 0 && v.opts.ReconnectTimeout >= 0 {
			wait := v.opts.FastFailTimeout
			if set.drainStarted() && v.opts.RestartGrace > wait {
				wait = v.opts.RestartGrace // (a planned restart)
			}
			fastFail = time.AfterFunc(wait, func() { v.startFastFail(gen, wait) })
		}
		onLink(false)
		set.teardown()
		// Writes are counted while their operation holds its session:
		// once none holds one of set, every write acknowledged on it is
		// counted, however late its goroutine runs.
		settled := v.settle(set)
		v.mu.Lock()
		unflushed := !settled || v.writes.Load() > v.flushedAt
		v.mu.Unlock()
		if v.opts.ReconnectTimeout < 0 {
			v.fail(fmt.Errorf("connection to %s lost: %w", v.opts.Target, linkErr))
			return
		}
		ns, err := v.reconnect()
		if fastFail != nil {
			fastFail.Stop()
		}
		if err != nil {
			v.fail(err)
			return
		}
		// The same target process kept its cache, and wrote back every
		// chunk the lost session held writable (its last Dones may be
		// lost): nothing acknowledged is lost. Another process (a
		// restart) may have lost what was not flushed. Without a host ID
		// the old session may outlive the reconnect, so no such promise.
		sameTarget := ns.qs[0].info.Instance == s.info.Instance && v.opts.HostID != ""
		if unflushed && !sameTarget && v.opts.FailOnLostWrites {
			ns.teardown()
			v.m.errors.WithLabelValues("lost_writes").Inc()
			v.fail(fmt.Errorf("%w: %w: %s is another instance of the target now", syscall.EIO, ErrLostWrites, v.opts.Target))
			return
		}
		v.mu.Lock()
		v.fastFailing = false
		v.m.fastFailing.Set(0)
		if unflushed && !sameTarget {
			v.lost = true
		}
		v.set.Store(ns)
		close(v.changed)
		v.changed = make(chan struct{})
		v.mu.Unlock()
		v.m.sessions.Set(1)
		v.m.reconnects.Inc()
		reconnects++
		onLink(true)
		if unflushed && !sameTarget {
			v.log.Warn("reconnected to another target instance: writes since the last flush may be lost; the next flush reports it",
				zap.String("target", v.opts.Target), zap.String("export", v.opts.Export), zap.Int("queues", len(ns.qs)))
		} else {
			v.log.Info("reconnected", zap.String("target", v.opts.Target), zap.String("export", v.opts.Export),
				zap.Bool("same_target_instance", sameTarget), zap.Int("queues", len(ns.qs)))
		}
		set = ns
	}
}

// settle waits until no operation holds a session of set, whose links are
// down (and closed: what is in flight on them ends), at most IOTimeout,
// and reports whether none does.
func (v *Volume) settle(set *queueSet) bool {
	var expired atomic.Bool
	timer := time.AfterFunc(v.opts.IOTimeout, func() {
		expired.Store(true)
		for _, s := range set.qs {
			s.mu.Lock()
			s.cond.Broadcast()
			s.mu.Unlock()
		}
	})
	defer timer.Stop()
	for _, s := range set.qs {
		s.mu.Lock()
		s.down = true
		s.mu.Unlock()
	}
	held := 0
	for _, s := range set.qs {
		s.mu.Lock()
		for s.inflight > 0 && !expired.Load() {
			s.cond.Wait()
		}
		held += s.inflight
		s.mu.Unlock()
	}
	if held > 0 {
		v.log.Warn("operations still hold the lost connection: writes since the last flush are taken as unflushed",
			zap.Int("operations", held), zap.Duration("waited", v.opts.IOTimeout))
		return false
	}
	return true
}

// reconnect dials until it succeeds, the timeout passes or the volume closes.
func (v *Volume) reconnect() (*queueSet, error) {
	deadline := time.Now().Add(v.opts.ReconnectTimeout)
	wait := 50 * time.Millisecond
	var lastErr error
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		go func() {
			select {
			case <-v.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		s, err := v.connect(ctx, false)
		if err == nil {
			set := v.join(ctx, s)
			cancel()
			return set, nil
		}
		// An attempt cut short by the deadline says nothing of the target:
		// the answer of an earlier one (the volume changed, the export is
		// held, ...) is what the failure reports.
		cut := errors.Is(ctx.Err(), context.DeadlineExceeded) && lastErr != nil
		cancel()
		if errors.Is(err, auth.ErrFailed) || errors.Is(err, protocol.ErrAccess) || errors.Is(err, protocol.ErrNoExport) {
			// Trying again would not change the answer (an export
			// gone: rblkd export remove, or a reload without it).
			return nil, fmt.Errorf("reconnect to %s: %w", v.opts.Target, err)
		}
		if errors.As(err, new(errHeld)) && v.opts.HostID != "" {
			// Another host holds the export: it took it over while this
			// session was down (its fence notice was lost with the link).
			// (An anonymous volume may see its own old session, which the
			// target has not yet found dead: it tries again.)
			return nil, fmt.Errorf("%w: while reconnecting: %w", ErrFenced, err)
		}
		if !cut {
			lastErr = err
		}
		if attempt <= 5 || attempt%10 == 0 {
			v.log.Info("reconnecting", zap.String("target", v.opts.Target), zap.Int("attempt", attempt), zap.Error(err))
		}
		select {
		case <-v.stop:
			return nil, ErrClosed
		case <-time.After(wait):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("target %s did not come back within %v: %w", v.opts.Target, v.opts.ReconnectTimeout, lastErr)
		}
		wait = min(wait*2, 2*time.Second)
	}
}

// startFastFail makes IO fail at once (waitUp), if the volume is still
// reconnecting after the connection loss gen.
func (v *Volume) startFastFail(gen uint64, waited time.Duration) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if gen != v.downs || v.set.Load() != nil || v.failed != nil {
		return // back already, or lost again since (another timer), or ended
	}
	v.fastFailing = true
	v.m.fastFailing.Set(1)
	close(v.changed) // (what waits in waitUp fails now)
	v.changed = make(chan struct{})
	v.fastFailAfter = waited
	v.log.Warn("the target is still unreachable: IO fails until it is back (reconnecting goes on)",
		zap.String("target", v.opts.Target), zap.Duration("waited", waited))
}

// fail ends the volume: IO fails from now on.
func (v *Volume) fail(err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.failed != nil {
		return
	}
	v.failed = err
	v.dead.Store(true)
	close(v.done)
	close(v.changed)
	v.changed = make(chan struct{})
	if !errors.Is(err, ErrClosed) {
		v.log.Error("volume failed", zap.String("export", v.opts.Export), zap.Error(err))
	}
}

// current returns the queue q, or that of the chunk of off, to do IO on,
// waiting while reconnecting. The caller calls put when it no longer uses
// it.
func (v *Volume) current(ctx context.Context, q int, off uint64) (*session, error) {
	// The usual case, without the volume's lock: up, and not failed.
	if s := v.queueFor(q, off); s != nil && !v.dead.Load() && s.hold() {
		return s, nil
	}
	var s *session
	err := v.waitUp(ctx, func() bool {
		s = v.queueFor(q, off)
		return s != nil && s.hold()
	})
	return s, err
}

// currentSet returns every queue of the session, waiting while
// reconnecting; the caller calls putSet when it no longer uses them.
func (v *Volume) currentSet(ctx context.Context) (*queueSet, error) {
	var set *queueSet
	err := v.waitUp(ctx, func() bool {
		set = v.set.Load()
		return set != nil && set.holdAll()
	})
	return set, err
}

// waitUp calls take, with v.mu held, until it reports that it took what
// it needs of the session, the volume fails or ctx ends. take fails while
// reconnecting, draining, or when a link just went down and supervise has
// not noticed yet: changed is closed when the next session is in place or
// the volume fails.
func (v *Volume) waitUp(ctx context.Context, take func() bool) error {
	v.mu.Lock()
	defer v.mu.Unlock()
	for {
		if v.failed != nil {
			return v.failed
		}
		if take() {
			return nil
		}
		if v.fastFailing {
			v.m.fastFailed.Inc()
			return fmt.Errorf("%w: %w: %s, for more than %v", syscall.EIO, ErrUnavailable, v.opts.Target, v.fastFailAfter)
		}
		ch := v.changed
		v.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			v.mu.Lock()
			return ctx.Err()
		}
		v.mu.Lock()
	}
}

func (v *Volume) put(s *session) {
	s.mu.Lock()
	s.releaseLocked()
	s.mu.Unlock()
}

func (v *Volume) putSet(set *queueSet) {
	for _, s := range set.qs {
		v.put(s)
	}
}
