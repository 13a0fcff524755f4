package initiator

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// resizer tells Options.OnResize of the volume's growth, one call at a
// time and in order.
type resizer struct {
	wg       sync.WaitGroup // the calls running; Close waits for them
	mu       sync.Mutex     // one call at a time
	notified uint64         // the size the last call announced (mu)
}

// grew makes size the volume's size if it is larger than the one it has
// (a volume never shrinks: a smaller one is ignored) and, but for the
// first size the volume learns, tells Options.OnResize on a goroutine of
// its own.
func (v *Volume) grew(size uint64) {
	for {
		old := v.size.Load()
		if size <= old {
			return
		}
		if !v.size.CompareAndSwap(old, size) {
			continue
		}
		if old == 0 {
			v.resize.mu.Lock()
			v.resize.notified = max(v.resize.notified, size)
			v.resize.mu.Unlock()
			return // opening: nothing to tell
		}
		v.log.Info("volume grew on the target", zap.String("export", v.opts.Export), zap.Uint64("old_size", old), zap.Uint64("size", size))
		v.m.resizes.Inc()
		v.resize.wg.Add(1)
		go func() {
			defer v.resize.wg.Done()
			v.notifyResize()
		}()
		return
	}
}

// notifyResize calls Options.OnResize with the size last announced and the
// size now, if that grew; several grows in a row may make one call.
func (v *Volume) notifyResize() {
	r := &v.resize
	r.mu.Lock()
	defer r.mu.Unlock()
	now := v.size.Load()
	if now <= r.notified {
		return
	}
	old := r.notified
	r.notified = now
	if v.opts.OnResize != nil {
		v.opts.OnResize(old, now)
	}
}

// registerResize creates the resize counter and registers it with reg (if
// not nil).
func (m *Metrics) registerResize(reg prometheus.Registerer) {
	m.resizes = prometheus.NewCounter(prometheus.CounterOpts{Namespace: "rblk_attach", Name: "volume_resizes_total",
		Help: "Times the volume grew on the target while attached."})
	if reg != nil {
		reg.MustRegister(m.resizes)
	}
}
