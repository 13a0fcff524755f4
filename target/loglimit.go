package target

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// maxLogKeys bounds the kinds of lines by peer address the log limiter
// keeps count of.
const maxLogKeys = 4096

// logLimiter bounds the log lines that clients can make the target write
// as often as they like (a refused authentication, an Open, a failed
// request, a connection refused or timed out): by peer address and kind of
// line (its message), a burst goes through, then one line per interval;
// the others are counted, and the next line written of that kind says how
// many were left out ("suppressed_before"). One client's flood leaves the
// other clients' lines alone, and the first lines of a flood stay visible.
type logLimiter struct {
	mu         sync.Mutex
	b          *buckets
	suppressed prometheus.Counter
}

func newLogLimiter(limit RateLimit, suppressed prometheus.Counter) *logLimiter {
	return &logLimiter{b: newBuckets(limit, maxLogKeys), suppressed: suppressed}
}

// allow reports whether a line of key may be written now, and how many of
// key were left out before it.
func (ll *logLimiter) allow(key string, now time.Time) (ok bool, before uint64) {
	ll.mu.Lock()
	defer ll.mu.Unlock()
	b := ll.b.get(key, now)
	if b.tokens < 1 {
		b.suppressed++
		ll.suppressed.Inc()
		return false, 0
	}
	b.tokens--
	before, b.suppressed = b.suppressed, 0
	return true, before
}

// limited returns log with its lines limited as those of peer.
func (ll *logLimiter) limited(log *zap.Logger, peer string) *zap.Logger {
	return log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return &limitedCore{Core: c, lim: ll, peer: peer}
	}))
}

// limitedCore is a zapcore.Core that writes an entry only if its limiter
// allows one more of its message from its peer.
type limitedCore struct {
	zapcore.Core
	lim  *logLimiter
	peer string
}

func (c *limitedCore) With(fields []zapcore.Field) zapcore.Core {
	return &limitedCore{Core: c.Core.With(fields), lim: c.lim, peer: c.peer}
}

func (c *limitedCore) Check(ent zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if !c.Enabled(ent.Level) {
		return ce
	}
	ok, before := c.lim.allow(c.peer+"\x00"+ent.Message, ent.Time)
	if !ok {
		return ce
	}
	if before == 0 {
		return c.Core.Check(ent, ce)
	}
	return c.Core.With([]zapcore.Field{zap.Uint64("suppressed_before", before)}).Check(ent, ce)
}
