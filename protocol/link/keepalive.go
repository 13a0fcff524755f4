package link

import (
	"context"
	"fmt"
	"time"

	"github.com/rblk/rblk/protocol"
)

// watchPeriod is how often watchLoop looks: often enough to honour the
// link's timeouts within a small fraction of them.
func (l *Link) watchPeriod() time.Duration {
	p := time.Second
	if ka := l.opts.KeepAlive; ka > 0 {
		p = min(p, ka/12)
	}
	if rt := l.opts.RequestTimeout; rt > 0 {
		p = min(p, rt/8)
	}
	return max(p, 5*time.Millisecond)
}

// watchLoop enforces the link's timeouts without a timer per request: it
// takes the link down (ErrTimeout) when a request's reply or an RDMA
// batch's completions are overdue, or when the peer has been silent for
// Options.KeepAlive; after a third of that silence it asks with a
// KeepAlive request.
func (l *Link) watchLoop(ctx context.Context) {
	defer l.wg.Done()
	tick := time.NewTicker(l.watchPeriod())
	defer tick.Stop()
	ka := l.opts.KeepAlive
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.downCh:
			return
		case now := <-tick.C:
			if err := l.overdue(now); err != nil {
				l.expire(err)
				return
			}
			if ka <= 0 {
				continue
			}
			idle := now.Sub(time.Unix(0, l.lastRecv.Load()))
			if idle >= ka {
				l.expire(fmt.Errorf("%w: nothing from the peer in %v (keepalive timeout %v)", ErrTimeout, idle.Round(time.Millisecond), ka))
				return
			}
			if idle >= ka/3 && l.pinging.CompareAndSwap(false, true) {
				l.wg.Add(1)
				go func() {
					defer l.wg.Done()
					defer l.pinging.Store(false)
					// The silence is judged above; this request waits
					// no longer than the link lives.
					_ = l.RequestWithin(ctx, 0, &protocol.KeepAlive{}, &protocol.OK{})
				}()
			}
		}
	}
}

// overdue returns why the link must go down if a request or an RDMA batch
// is past its deadline at now, else nil.
func (l *Link) overdue(now time.Time) error {
	t := now.UnixNano()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, w := range l.waiters {
		if w.deadline != 0 && t > w.deadline {
			return fmt.Errorf("%w: no reply to %v in %v", ErrTimeout, w.typ, w.timeout)
		}
	}
	for _, b := range l.batches {
		if b.deadline != 0 && t > b.deadline {
			return fmt.Errorf("%w: RDMA operations not completed in %v", ErrTimeout, l.opts.RequestTimeout)
		}
	}
	return nil
}
