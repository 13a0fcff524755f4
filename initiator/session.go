package initiator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/rblk/rblk/auth"
	"github.com/rblk/rblk/protocol"
	"github.com/rblk/rblk/protocol/link"
	"github.com/rblk/rblk/transport"
)

// session is one connection to the target with the volume open on it.
// Grants belong to a session: a new session starts with none.
type session struct {
	v      *Volume
	link   *link.Link
	region transport.Region // the IO buffers, registered on this connection
	info   protocol.VolumeInfo
	wg     sync.WaitGroup // revoke and drain goroutines

	// mu guards the queue's IO state: its grants, the operations using
	// it, draining and down. It is the only lock IO takes on its way
	// (submit), so that queues share none. Lock order: the volume's mu
	// before a session's, and the sessions of a queueSet in their order.
	mu       sync.Mutex
	cond     sync.Cond  // on mu: a grant's references or inflight dropped to zero
	grants   grantTable // (mu)
	inflight int        // operations using the session (mu)
	draining bool       // the target is shutting down: no new operations (mu)
	down     bool       // lost: supervise waits for inflight to drop to 0 (mu)

	// The writes of the run-to-completion path and their Dones, see
	// doneWindow (mu).
	dones     int          // Done batches in flight
	pend      []*ioBuf     // writes whose WRITEs are posted, waiting for a Done batch
	freeDones []*doneBatch // for reuse, so that no IO allocates

	set atomic.Pointer[queueSet] // the queues of its session, itself among them
	// withInstance: its Open carried the volume's instance (the target
	// offered protocol.FeatureOpenInstance).
	withInstance bool
}

// usableLocked reports whether new IO may start on s. s.mu is held.
func (s *session) usableLocked() bool {
	return !s.draining && !s.down && s.link.Err() == nil
}

// hold takes a hold on s if new IO may start on it, and reports whether
// it did.
func (s *session) hold() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.usableLocked() {
		return false
	}
	s.inflight++
	return true
}

// releaseLocked ends a hold on s. s.mu is held.
func (s *session) releaseLocked() {
	s.inflight--
	if s.inflight == 0 && (s.draining || s.down) {
		s.cond.Broadcast()
	}
}

// dialTimeout bounds one connection attempt: a connect request lost on a
// link that is down (RDMA CM waits for its reply as long as it is let)
// must not use up the whole reconnect time when the link comes back.
const dialTimeout = 10 * time.Second

// connect dials the target, authenticates, opens the volume (taking it
// over from another host if takeover) and registers the IO buffers.
func (v *Volume) connect(ctx context.Context, takeover bool) (*session, error) {
	return v.dial(ctx, func(s *session) error {
		l := s.link
		mode := protocol.ModeReadWrite
		if v.opts.ReadOnly {
			mode = protocol.ModeReadOnly
		}
		// The instance goes to a target that knows it: an older one
		// refuses the flag, and reinstates by host ID alone.
		open := &protocol.Open{Mode: mode, Name: v.opts.Export, HostID: v.opts.HostID}
		if l.Features()&protocol.FeatureOpenInstance != 0 {
			open.Flags, open.Instance = protocol.OpenInstance, v.opts.Instance
			s.withInstance = true
		}
		if takeover && mode == protocol.ModeReadWrite {
			open.Flags |= protocol.OpenTakeover
		}
		err := l.Request(ctx, open, &s.info)
		if errors.Is(err, protocol.ErrPerm) && mode == protocol.ModeReadWrite {
			// A read-only export: attach it read-only, as a disk with its
			// write-protect switch on.
			v.log.Info("the export is read-only: opening it read-only", zap.String("export", v.opts.Export))
			open.Mode, open.Flags = protocol.ModeReadOnly, open.Flags&^protocol.OpenTakeover
			err = l.Request(ctx, open, &s.info)
		}
		if err != nil {
			err = fmt.Errorf("open volume %q on %s: %w", v.opts.Export, v.opts.Target, err)
			if errors.Is(err, protocol.ErrBusy) {
				err = errHeld{err}
			}
			return err
		}
		return nil
	})
}

// dial connects to the target, authenticates, has open open the volume on
// the connection (filling s.info), checks what the target reports and
// registers the IO buffers.
func (v *Volume) dial(ctx context.Context, open func(s *session) error) (*session, error) {
	s := &session{v: v}
	s.cond.L = &s.mu
	dctx, cancel := context.WithTimeout(ctx, min(dialTimeout, v.opts.IOTimeout))
	l, err := link.Dial(dctx, v.opts.Provider, v.opts.Target, link.Options{Handler: s.handle, Logger: v.log,
		KeepAlive: max(v.opts.KeepAlive, 0), RequestTimeout: v.opts.IOTimeout, Posts: v.m.sqPosts})
	cancel()
	if err != nil {
		return nil, err
	}
	s.link = l
	if _, err := auth.Initiate(ctx, l, v.opts.HostID, v.opts.Secret); err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q on %s: %w", v.opts.Export, v.opts.Target, err)
	}
	if err := open(s); err != nil {
		l.Close()
		return nil, err
	}
	if s.info.ChunkSize == 0 || s.info.VolumeSize == 0 {
		l.Close()
		return nil, fmt.Errorf("open volume %q: target reports size %d, chunk size %d: %w", v.opts.Export, s.info.VolumeSize, s.info.ChunkSize, protocol.ErrProtocol)
	}
	if v.info.ChunkSize != 0 && (s.info.VolumeSize < v.Size() || s.info.ChunkSize != v.info.ChunkSize) {
		l.Close()
		return nil, fmt.Errorf("volume %q changed on %s: size %d, chunk size %d, was %d and %d", v.opts.Export, v.opts.Target,
			s.info.VolumeSize, s.info.ChunkSize, v.Size(), v.info.ChunkSize)
	}
	if v.info.ChunkSize != 0 {
		v.grew(s.info.VolumeSize) // grown while the volume was away
	}
	s.grants = newGrantTable(s.info.ChunkSize)
	s.region, err = l.Conn().Register(v.mem.Bytes(), transport.AccessLocalWrite)
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("open volume %q: register IO buffers: %w", v.opts.Export, err)
	}
	return s, nil
}

// teardown closes the session's connection and waits for its goroutines.
func (s *session) teardown() {
	s.link.Close()
	s.wg.Wait()
	s.region.Deregister()
	s.mu.Lock()
	s.v.m.grantsHeld.Sub(float64(s.grants.teardown()))
	s.mu.Unlock()
}

// handle runs on the link's completion goroutine.
func (s *session) handle(h protocol.Header, payload []byte) {
	switch h.Type {
	case protocol.TypeRevoke:
		var r protocol.Revoke
		if err := r.Unmarshal(payload); err != nil {
			s.protocolError(fmt.Errorf("decode Revoke: %w", err))
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.revoke(h.Tag, &r)
		}()
	case protocol.TypeResize:
		var r protocol.Resize
		if err := r.Unmarshal(payload); err != nil {
			s.protocolError(fmt.Errorf("decode Resize: %w", err))
			return
		}
		// (A Volume has one handle per connection: the notice is its.)
		s.v.grew(r.VolumeSize)
	case protocol.TypeError:
		var em protocol.ErrorMsg
		if err := em.Unmarshal(payload); err != nil {
			s.protocolError(fmt.Errorf("decode Error: %w", err))
			return
		}
		if em.Code == protocol.CodeStale {
			// Fenced: another attach took the export over, or found this
			// session dead (this one reconnecting never sees the notice:
			// it has left that connection). Reconnecting would be
			// refused, or fence that one in turn.
			v := s.v
			v.fail(fmt.Errorf("%w: %s", ErrFenced, strings.TrimPrefix(em.Text, "fenced: ")))
			go s.link.Close()
			return
		}
		if em.Code != protocol.CodeShutdown {
			s.protocolError(fmt.Errorf("error notice from target: %w", em.Err()))
			return
		}
		// (every queue gets the notice: the first starts the drain of
		// them all, which teardown waits for)
		if set := s.set.Load(); set != nil {
			go set.drain(s.v)
		} else {
			go s.link.Close() // still connecting: tried again
		}
	default:
		s.protocolError(fmt.Errorf("unexpected %v from target: %w", h.Type, protocol.ErrProtocol))
	}
}

func (s *session) protocolError(err error) {
	s.v.m.errors.WithLabelValues("protocol").Inc()
	s.v.log.Error("protocol error, closing the connection", zap.Error(err))
	go s.link.Close()
}

// revoke stops new IO on the grant, waits for IO in flight on it (whose
// Done messages are sent before they release it), then acknowledges.
func (s *session) revoke(tag uint64, r *protocol.Revoke) {
	v := s.v
	v.m.revokes.Inc()
	s.mu.Lock()
	// The Revoke may overtake the reply of a grant being fetched: wait for
	// the fetch to finish before deciding whether this generation is held.
	st := s.grants.revoke(r.Offset, r.Generation, false)
	for st.wait != nil {
		s.mu.Unlock()
		select {
		case <-st.wait:
		case <-s.link.Done():
		}
		s.mu.Lock()
		st = s.grants.revoke(r.Offset, r.Generation, s.link.Err() != nil)
	}
	if st.drain != nil {
		v.m.grantsHeld.Dec()
		for !s.grants.drained(st.drain) {
			s.cond.Wait()
		}
	}
	s.mu.Unlock()
	ack := protocol.RevokeAck{Handle: r.Handle, Offset: r.Offset, Generation: r.Generation}
	if err := s.link.Send(context.Background(), tag, &ack); err != nil && s.link.Err() == nil {
		v.log.Warn("revoke ack", zap.Error(err))
	}
}
