package initiator

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the initiator's Prometheus collectors, namespace "rblk_attach".
type Metrics struct {
	rdmaOps        *prometheus.CounterVec
	rdmaBytes      *prometheus.CounterVec
	rdmaSeconds    *prometheus.HistogramVec
	grantRequests  prometheus.Counter
	grantSeconds   prometheus.Histogram
	revokes        prometheus.Counter
	grantsHeld     prometheus.Gauge
	controlSeconds *prometheus.HistogramVec
	errors         *prometheus.CounterVec
	sessions       prometheus.Gauge
	reconnects     prometheus.Counter
	fastFailing    prometheus.Gauge
	fastFailed     prometheus.Counter // errors{op="fast_fail"}
	resizes        prometheus.Counter // see resize.go
	doneMessages   prometheus.Counter // see doneWindow
	doneWrites     prometheus.Counter
	sqPosts        prometheus.Counter // link.Options.Posts

	// The children of the IO path's vectors, resolved once: index 0 for
	// reads, 1 for writes.
	ioOps     [2]prometheus.Counter
	ioBytes   [2]prometheus.Counter
	ioSeconds [2]prometheus.Observer
}

// observe accounts for the RDMA of one request (or piece of one).
func (m *Metrics) observe(write bool, start time.Time, ops int, bytes uint64) {
	d := dir(write)
	m.ioSeconds[d].Observe(time.Since(start).Seconds())
	m.ioOps[d].Add(float64(ops))
	m.ioBytes[d].Add(float64(bytes))
}

// dir indexes the resolved children by direction.
func dir(write bool) int {
	if write {
		return 1
	}
	return 0
}

// NewMetrics creates the collectors and registers them with reg (if not nil).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns = "rblk_attach"
	buckets := prometheus.ExponentialBuckets(5e-6, 4, 12)
	m := &Metrics{
		rdmaOps: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "rdma_ops_total",
			Help: "One-sided RDMA operations, by kind (read, write)."}, []string{"op"}),
		rdmaBytes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "rdma_bytes_total",
			Help: "Bytes moved with one-sided RDMA, by kind."}, []string{"op"}),
		rdmaSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "rdma_duration_seconds",
			Help: "Time from posting a request's RDMA operations to their completion.", Buckets: buckets}, []string{"op"}),
		grantRequests: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "grant_requests_total", Help: "Chunk grants asked of the target."}),
		grantSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Name: "grant_duration_seconds",
			Help: "Time to get a chunk grant (target load included).", Buckets: buckets}),
		revokes:    prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "revokes_total", Help: "Grants the target took back."}),
		grantsHeld: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "grants_held", Help: "Chunk grants held now."}),
		controlSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "control_duration_seconds",
			Help: "Time of control requests to the target (flush, trim, write_zeroes, fua), by kind.", Buckets: buckets}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "errors_total",
			Help: "Failed operations, by kind."}, []string{"op"}),
		sessions:   prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "target_sessions", Help: "Sessions with the target that are up (0 or 1)."}),
		reconnects: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "reconnects_total", Help: "Connections to the target made again after one was lost."}),
		doneMessages: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "done_messages_total",
			Help: "Done messages that reported writes of the run-to-completion path (writes of granted chunks); several writes share one at depth."}),
		doneWrites: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "done_writes_total",
			Help: "Writes reported by done_messages_total's messages."}),
		sqPosts: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "sq_posts_total",
			Help: "Calls that posted work requests to the target's connections (on RDMA one doorbell each; the requests read from the socket together share one)."}),
		fastFailing: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "fast_failing",
			Help: "1 while IO fails at once because the target has been unreachable for longer than --fast-fail-timeout (reconnecting goes on), else 0."}),
	}
	for i, op := range [2]string{"read", "write"} {
		m.ioOps[i] = m.rdmaOps.WithLabelValues(op)
		m.ioBytes[i] = m.rdmaBytes.WithLabelValues(op)
		m.ioSeconds[i] = m.rdmaSeconds.WithLabelValues(op)
	}
	// The series of every kind exist from the start, at 0, so that rates
	// and alerts over them work before the first error.
	for _, op := range []string{"read", "write", "grant", "flush", "trim", "write_zeroes", "lost_writes", "protocol", "fast_fail"} {
		m.errors.WithLabelValues(op)
	}
	m.fastFailed = m.errors.WithLabelValues("fast_fail")
	for _, op := range []string{"flush", "fua", "trim", "write_zeroes"} {
		m.controlSeconds.WithLabelValues(op)
	}
	if reg != nil {
		reg.MustRegister(m.rdmaOps, m.rdmaBytes, m.rdmaSeconds, m.grantRequests, m.grantSeconds, m.revokes,
			m.grantsHeld, m.controlSeconds, m.errors, m.sessions, m.reconnects, m.fastFailing, m.doneMessages, m.doneWrites, m.sqPosts)
	}
	m.registerResize(reg)
	return m
}
