package link

import (
	"context"
	"fmt"
	"time"

	"github.com/rblk/rblk/protocol"
)

// keepAliveLoop watches the time since the peer was last heard from: after
// a third of Options.KeepAlive it asks with a KeepAlive request, after
// KeepAlive it takes the link down.
func (l *Link) keepAliveLoop(ctx context.Context) {
	defer l.wg.Done()
	timeout := l.opts.KeepAlive
	quiet := timeout / 3
	tick := time.NewTicker(max(quiet/4, time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.downCh:
			return
		case now := <-tick.C:
			idle := now.Sub(time.Unix(0, l.lastRecv.Load()))
			if idle >= timeout {
				l.expire(fmt.Errorf("%w: nothing from the peer in %v (keepalive timeout %v)", ErrTimeout, idle.Round(time.Millisecond), timeout))
				return
			}
			if idle >= quiet && l.pinging.CompareAndSwap(false, true) {
				l.wg.Add(1)
				go func() {
					defer l.wg.Done()
					defer l.pinging.Store(false)
					// The loop above judges the silence; this request
					// waits no longer than the link lives.
					_ = l.RequestWithin(ctx, 0, &protocol.KeepAlive{}, &protocol.OK{})
				}()
			}
		}
	}
}
