package initiator

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/rblk/rblk/initiator/blockdev"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// tryAcquire takes a reference on the grant of every chunk of idxs if all
// of them are held and usable, and reports whether it did.
func (s *session) tryAcquire(b *ioBuf, idxs []uint64, write bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ok bool
	b.grants, ok = s.grants.tryAcquire(idxs, write, b.grants)
	return ok
}

// acquire makes sure the chunks idxs are granted, then takes a reference on
// each, all at once: no reference is held while waiting for a grant, so a
// revoke never waits on an IO that waits on another grant. With a single
// chunk it always makes progress: a grant just fetched is referenced before
// a revoke of it can take effect.
func (s *session) acquire(ctx context.Context, b *ioBuf, idxs []uint64, write bool) error {
	v := s.v
	s.mu.Lock()
	for {
		var st acquireStep
		b.grants, st = s.grants.acquire(idxs, write, b.grants)
		switch st.kind {
		case acquired:
			s.mu.Unlock()
			return nil
		case waitFetch:
			s.mu.Unlock()
			select {
			case <-st.wait:
			case <-ctx.Done():
				return ctx.Err()
			case <-s.link.Done():
				return s.link.Err()
			}
			s.mu.Lock()
			continue
		}
		s.mu.Unlock()
		if st.replaced {
			v.m.grantsHeld.Dec() // replaced by a writable one
		}
		gr, err := s.fetch(ctx, st.idx)
		s.mu.Lock()
		if err != nil {
			s.grants.fetchFailed(st.grant)
			s.mu.Unlock()
			return err
		}
		if err := s.grants.fetched(st.grant, &gr); err != nil {
			s.mu.Unlock()
			s.protocolError(err)
			return protocol.ErrProtocol
		}
		v.m.grantsHeld.Inc()
		// Still holding the mutex: the next acquire references the grant
		// before a Revoke waiting for this fetch can take it.
	}
}

// fetch asks the target for a grant of chunk idx.
func (s *session) fetch(ctx context.Context, idx uint64) (protocol.Grant, error) {
	v := s.v
	start := time.Now()
	req := protocol.GrantRequest{Handle: s.info.Handle, Offset: idx * uint64(s.info.ChunkSize)}
	if !v.ReadOnly() {
		req.Flags = protocol.GrantWrite
	}
	var gr protocol.Grant
	v.m.grantRequests.Inc()
	if err := s.link.Request(ctx, &req, &gr); err != nil {
		v.m.errors.WithLabelValues("grant").Inc()
		return gr, fmt.Errorf("grant of chunk at %d: %w", req.Offset, err)
	}
	v.m.grantSeconds.Observe(time.Since(start).Seconds())
	return gr, nil
}

// releaseGrants gives back the references b holds.
func (s *session) releaseGrants(b *ioBuf) {
	s.mu.Lock()
	if s.grants.release(b.grants) {
		s.cond.Broadcast()
	}
	s.mu.Unlock()
	clear(b.grants)
	b.grants = b.grants[:0]
}

// ops fills b.ops with one operation per piece of the volume range
// [lo, hi), within one chunk and one buffer segment, of a request of b at
// off. b.grants holds the grants of the chunks of [lo, hi), in order.
func (s *session) ops(b *ioBuf, off, lo, hi uint64, write bool) {
	b.ops = b.ops[:0]
	cs := uint64(s.info.ChunkSize)
	first := lo / cs
	pos := off
	for si, seg := range b.Segs {
		end := pos + uint64(len(seg))
		if end <= lo {
			pos = end
			continue
		}
		if pos >= hi {
			break
		}
		for p := max(pos, lo); p < min(end, hi); {
			g := b.grants[p/cs-first]
			n := min(min(end, hi)-p, g.off+g.length-p)
			b.ops = append(b.ops, link.Op{Write: write, Addr: g.addr + (p - g.off), RKey: g.rkey,
				Local: transport.SGE{Region: s.region, Offset: b.offs[si] + int(p-pos), Length: int(n)}})
			p += n
		}
		pos = end
	}
}

func (v *Volume) check(off, n uint64) error {
	if n == 0 {
		return nil
	}
	size := v.Size()
	if off >= size || n > size-off {
		return fmt.Errorf("range %d+%d beyond the volume's %d bytes: %w", off, n, size, syscall.EINVAL)
	}
	return nil
}

// Alloc lends registered memory for a request of n bytes.
func (v *Volume) Alloc(ctx context.Context, n int) (*blockdev.Buffer, error) {
	b, err := v.pool.alloc(ctx, n, nil)
	if err != nil {
		return nil, err
	}
	return &b.Buffer, nil
}

// Free gives a buffer back.
func (v *Volume) Free(nb *blockdev.Buffer) { v.pool.release(nb.Priv.(*ioBuf)) }

func bufLen(b *ioBuf) uint64 {
	var n uint64
	for _, s := range b.Segs {
		n += uint64(len(s))
	}
	return n
}

// ReadAt reads into b from the volume at off with RDMA READs.
func (v *Volume) ReadAt(ctx context.Context, nb *blockdev.Buffer, off uint64) error {
	b := nb.Priv.(*ioBuf)
	b.q = byChunk
	return v.io(ctx, b, off, false, false)
}

// WriteAt writes b at off with RDMA WRITEs, then tells the target with a
// Done message; with fua it waits until the target made the range durable.
func (v *Volume) WriteAt(ctx context.Context, nb *blockdev.Buffer, off uint64, fua bool) error {
	if err := v.writable(); err != nil {
		return err
	}
	b := nb.Priv.(*ioBuf)
	b.q = byChunk
	return v.io(ctx, b, off, true, fua)
}

// writable is nil, or why the volume takes no writes.
func (v *Volume) writable() error {
	if v.ReadOnly() {
		return fmt.Errorf("write to read-only volume %q: %w", v.opts.Export, syscall.EPERM)
	}
	return nil
}

// retry runs op on the queue of off of the current session until it
// succeeds, fails for a reason other than a lost connection, or no session
// comes back.
func (v *Volume) retry(ctx context.Context, what string, q int, off uint64, op func(*session) error) error {
	for {
		s, err := v.current(ctx, q, off)
		if err != nil {
			v.m.errors.WithLabelValues(what).Inc()
			return v.mapErr(fmt.Errorf("%s: %w", what, err))
		}
		err = op(s)
		v.put(s)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, link.ErrDown) && v.opts.ReconnectTimeout >= 0 && ctx.Err() == nil:
			continue // done again once reconnected
		}
		v.m.errors.WithLabelValues(what).Inc()
		return v.mapErr(fmt.Errorf("%s: %w", what, err))
	}
}

func (v *Volume) io(ctx context.Context, b *ioBuf, off uint64, write, fua bool) error {
	n := bufLen(b)
	if n == 0 {
		return nil
	}
	if err := v.check(off, n); err != nil {
		return err
	}
	op := "read"
	if write {
		op = "write"
	}
	v.plan(b, off, n)
	err := v.retry(ctx, op, b.q, off, func(s *session) error {
		if err := s.move(ctx, b, off, n, write, fua); err != nil {
			return err
		}
		if write {
			// Counted while s is held: a volume whose link went down
			// waits for the operations holding its sessions before it
			// reads the count (supervise), so a write acknowledged on a
			// lost session is never taken for flushed.
			v.writes.Add(1)
		}
		return nil
	})
	if err == nil && write && testHookWriteAcked != nil {
		testHookWriteAcked()
	}
	return err
}

// move does the RDMA of the request of b at off, n bytes, on s: in one
// chain when every chunk is granted, else chunk by chunk.
func (s *session) move(ctx context.Context, b *ioBuf, off, n uint64, write, fua bool) error {
	if s.tryAcquire(b, b.idxs, write) {
		// The usual case: every chunk is granted; one chain of work
		// requests does the whole request.
		return s.rdma(ctx, b, off, off, off+n, write, fua)
	}
	// Chunk by chunk, holding one grant at a time, so that a request
	// larger than the target's cache, or many requests at once, always
	// make progress.
	cs := uint64(s.info.ChunkSize)
	for i := range b.idxs {
		lo, hi := max(off, b.idxs[i]*cs), min(off+n, (b.idxs[i]+1)*cs)
		if err := s.acquire(ctx, b, b.idxs[i:i+1], write); err != nil {
			return err
		}
		if err := s.rdma(ctx, b, off, lo, hi, write, fua); err != nil {
			return err
		}
	}
	return nil
}

// testHookWriteAcked, set by tests only, runs when a synchronous write is
// about to be acknowledged to its caller.
var testHookWriteAcked func()

// rdma moves the volume range [lo, hi) of the request of b at off, whose
// grants b.grants holds referenced, and releases them. A write is followed
// by its Done, sent before the grants are released so that the target sees
// it before any RevokeAck for those chunks.
func (s *session) rdma(ctx context.Context, b *ioBuf, off, lo, hi uint64, write, fua bool) error {
	v := s.v
	defer s.releaseGrants(b)
	s.ops(b, off, lo, hi, write)
	start := time.Now()
	if err := s.link.RDMA(ctx, b.ops...); err != nil {
		return err
	}
	v.m.observe(write, start, len(b.ops), hi-lo)
	if write {
		return s.done(ctx, b, lo, hi-lo, fua)
	}
	return nil
}

// plan fills b.idxs with the chunks of [off, off+n).
func (v *Volume) plan(b *ioBuf, off, n uint64) {
	cs := uint64(v.info.ChunkSize)
	b.idxs = b.idxs[:0]
	for idx := off / cs; idx*cs < off+n; idx++ {
		b.idxs = append(b.idxs, idx)
	}
}

// done reports a written range.
func (s *session) done(ctx context.Context, b *ioBuf, off, n uint64, fua bool) error {
	d := &b.done
	b.ranges[0] = protocol.Range{Offset: off, Length: n}
	*d = protocol.Done{Handle: s.info.Handle, Generation: s.info.Generation, Ranges: b.ranges[:]}
	if !fua {
		return s.link.Send(ctx, 0, d)
	}
	d.Flags = protocol.DoneFUA
	start := time.Now()
	err := s.link.RequestWithin(ctx, s.v.opts.FlushTimeout, d, &protocol.OK{})
	s.v.m.controlSeconds.WithLabelValues("fua").Observe(time.Since(start).Seconds())
	return err
}

// flushMsg is the Flush of the session's handle and generation.
func (s *session) flushMsg() protocol.Message {
	return &protocol.Flush{Handle: s.info.Handle, Generation: s.info.Generation}
}

// mapErr turns an error into one whose errno the NBD server can report.
func (v *Volume) mapErr(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return err
	}
	var code syscall.Errno
	switch protocol.CodeOf(err) {
	case protocol.CodePerm:
		code = syscall.EPERM
	case protocol.CodeInval, protocol.CodeRange:
		code = syscall.EINVAL
	case protocol.CodeNoSpc:
		code = syscall.ENOSPC
	default:
		code = syscall.EIO
	}
	if errors.Is(err, link.ErrDown) {
		code = syscall.EIO
	}
	return fmt.Errorf("%w: %w", code, err)
}

// control sends a request whose reply is OK on the queue of off, again
// after a reconnection, waiting at most timeout for each reply.
func (v *Volume) control(ctx context.Context, op string, q int, off uint64, timeout time.Duration, mk func(s *session) protocol.Message) error {
	start := time.Now()
	err := v.retry(ctx, op, q, off, func(s *session) error {
		return s.link.RequestWithin(ctx, timeout, mk(s), &protocol.OK{})
	})
	v.m.controlSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	return err
}

// Flush returns once every write completed before it is durable on the
// target: it flushes every queue, again after a reconnection. After a lost
// connection with writes not yet flushed it fails once with EIO
// (ErrLostWrites).
func (v *Volume) Flush(ctx context.Context) error {
	writes := v.writes.Load()
	start := time.Now()
	var err error
	for {
		var set *queueSet
		set, err = v.currentSet(ctx)
		if err != nil {
			break
		}
		err = set.flush(ctx, v)
		v.putSet(set)
		if err == nil || !errors.Is(err, link.ErrDown) || v.opts.ReconnectTimeout < 0 || ctx.Err() != nil {
			break
		}
		// done again once reconnected
	}
	v.m.controlSeconds.WithLabelValues("flush").Observe(time.Since(start).Seconds())
	if err != nil {
		v.m.errors.WithLabelValues("flush").Inc()
		return v.mapErr(fmt.Errorf("flush: %w", err))
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.lost {
		v.lost = false
		v.m.errors.WithLabelValues("lost_writes").Inc()
		return fmt.Errorf("flush: %w: %w", syscall.EIO, ErrLostWrites)
	}
	v.flushedAt = max(v.flushedAt, writes)
	return nil
}

// Trim discards a range; it then reads as zeroes.
func (v *Volume) Trim(ctx context.Context, off, n uint64, fua bool) error {
	return v.trim(ctx, byChunk, off, n, fua)
}

func (v *Volume) trim(ctx context.Context, q int, off, n uint64, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("trim on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	var flags uint32
	if fua {
		flags = protocol.FlagFUA
	}
	return v.control(ctx, "trim", q, off, v.opts.IOTimeout, func(s *session) protocol.Message {
		return &protocol.Trim{Handle: s.info.Handle, Flags: flags, Offset: off, Length: n}
	})
}

// WriteZeroes zeroes a range, keeping it allocated if noHole.
func (v *Volume) WriteZeroes(ctx context.Context, off, n uint64, noHole, fua bool) error {
	return v.writeZeroes(ctx, byChunk, off, n, noHole, fua)
}

func (v *Volume) writeZeroes(ctx context.Context, q int, off, n uint64, noHole, fua bool) error {
	if v.ReadOnly() {
		return fmt.Errorf("write zeroes on read-only volume: %w", syscall.EPERM)
	}
	if err := v.check(off, n); err != nil || n == 0 {
		return err
	}
	var flags uint32
	if fua {
		flags |= protocol.FlagFUA
	}
	if noHole {
		flags |= protocol.FlagNoHole
	}
	return v.control(ctx, "write_zeroes", q, off, v.opts.IOTimeout, func(s *session) protocol.Message {
		return &protocol.WriteZeroes{Handle: s.info.Handle, Flags: flags, Offset: off, Length: n}
	})
}
