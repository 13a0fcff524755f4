package cli

import (
	"context"

	"go.uber.org/zap"

	"github.com/rblk/rblk/internal/sdnotify"
)

// NotifyReady tells systemd (Type=notify) that the service serves, with
// status as its one-line STATUS=, and arranges for STOPPING=1 to be sent as
// soon as ctx (the signal context) ends. Call it once everything a client
// needs is up. The returned stop cancels the STOPPING=1 of a ctx that has
// not ended. Without $NOTIFY_SOCKET it does nothing. A failure to notify is
// logged, never fatal: systemd then times the start out and says so.
func NotifyReady(ctx context.Context, log *zap.Logger, status string) (stop func() bool) {
	if !sdnotify.Enabled() {
		return func() bool { return false }
	}
	if err := sdnotify.Send(ctx, "READY=1\nSTATUS="+status); err != nil {
		log.Warn("cannot tell systemd the service is ready", zap.Error(err))
	}
	return context.AfterFunc(ctx, func() {
		if err := sdnotify.Stopping(context.Background()); err != nil {
			log.Warn("cannot tell systemd the service is stopping", zap.Error(err))
		}
	})
}
