package target

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the target's Prometheus collectors, namespace "rblkd".
type Metrics struct {
	sessions       prometheus.Gauge
	sessionsTotal  prometheus.Counter
	requests       *prometheus.CounterVec
	requestSeconds *prometheus.HistogramVec
	errors         *prometheus.CounterVec
	grants         *prometheus.CounterVec
	revokes        *prometheus.CounterVec
	fenced         prometheus.Counter
	revokeTimeouts prometheus.Counter
	authFailures   *prometheus.CounterVec
	refused        *prometheus.CounterVec
	takeovers      prometheus.Counter
	hostSessions   *prometheus.GaugeVec
	unauthSessions prometheus.Gauge
	authLimited    *prometheus.CounterVec
	logSuppressed  prometheus.Counter
	evictions      *prometheus.CounterVec
	loads          *prometheus.CounterVec
	loadBytes      *prometheus.CounterVec
	loadSeconds    *prometheus.HistogramVec
	writebackOps   *prometheus.CounterVec
	writebackBytes *prometheus.CounterVec
	doneBytes      *prometheus.CounterVec
	flushSeconds   *prometheus.HistogramVec
	cacheUsed      prometheus.Gauge
	cacheBudget    prometheus.Gauge
	grows          *prometheus.CounterVec // see grow.go

	// The children of the labelled collectors that requests and write-back
	// use, resolved once: no label lookup per request.
	opAuth, opList, opOpen, opJoin, opGrant, opFlush, opTrim, opWriteZeroes, opClose, opDoneFUA *opMetrics
	errWriteback, errLoad, errDeregister, errProtocol                                           prometheus.Counter
}

// opMetrics are the children of the per-operation collectors for one
// operation.
type opMetrics struct {
	name    string
	seconds prometheus.Observer // request_duration_seconds{op}
	ok      prometheus.Counter  // requests_total{op, result="ok"}
	failed  prometheus.Counter  // requests_total{op, result="error"}
	errors  prometheus.Counter  // errors_total{op}
}

// newOp resolves the children of op. They are created (at 0) with the
// target, as the other collectors are.
func (m *Metrics) newOp(op string) *opMetrics {
	return &opMetrics{name: op, seconds: m.requestSeconds.WithLabelValues(op),
		ok: m.requests.WithLabelValues(op, "ok"), failed: m.requests.WithLabelValues(op, "error"),
		errors: m.errors.WithLabelValues(op)}
}

// NewMetrics creates the collectors and registers them with reg (if not nil).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns = "rblkd"
	buckets := prometheus.ExponentialBuckets(10e-6, 4, 12) // 10µs .. ~42s
	exp := []string{"export"}
	m := &Metrics{
		sessions:      prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "sessions", Help: "Initiator sessions connected now."}),
		sessionsTotal: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "sessions_total", Help: "Initiator sessions accepted."}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "requests_total",
			Help: "Control requests served, by operation and result."}, []string{"op", "result"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "request_duration_seconds",
			Help: "Time to serve a control request, by operation.", Buckets: buckets}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "errors_total",
			Help: "Errors, by where they happened."}, []string{"op"}),
		grants:  prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "grants_total", Help: "Chunk grants registered for initiators, by export."}, exp),
		revokes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "revokes_total", Help: "Chunk grants revoked from initiators, by export."}, exp),
		fenced: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "sessions_fenced_total",
			Help: "Earlier sessions of a host ID and export fenced: the same attach opened the export again (reinstatement), or another attach of the host found it dead (no answer to a liveness check) or took it over."}),
		revokeTimeouts: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "revoke_timeouts_total",
			Help: "Sessions closed because they did not answer a revoke in time."}),
		authFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "auth_failures_total",
			Help: "Sessions refused by authentication, by reason: unknown_host, no_secret, wrong_secret, unauthenticated_request, " +
				"rate_limited (too many failures from the peer's address), timeout (no authentication within --handshake-timeout of the connection's accept)."}, []string{"reason"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "refused_total",
			Help: "Sessions and opens refused, by reason: session_limit, host_session_limit, unauthenticated_limit (a connection refused: " +
				"--max-unauthenticated connections wait to authenticate, the most of them from its address), unauthenticated_evicted (a waiting " +
				"connection closed to make room for one from another address), handle_limit (an Open or Join beyond --max-handles-per-session), " +
				"not_allowed, writer_busy, attach_busy (another live attach of the host holds the export)."}, []string{"reason"}),
		hostSessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Name: "host_sessions",
			Help: "Sessions now, by the host ID they authenticated (or, without an auth file, named) as."}, []string{"host_id"}),
		unauthSessions: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "sessions_unauthenticated",
			Help: "Connections accepted that have not authenticated yet (at most --max-unauthenticated; streams of the software transport that sent nothing yet are not counted)."}),
		authLimited: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "auth_rate_limited_total",
			Help: "Authentications held back by the limits on failures: by=peer, refused at once (too many failures from the address); " +
				"by=host, a wrong proof answered late (too many wrong proofs for the host ID; right proofs never wait)."}, []string{"by"}),
		logSuppressed: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "log_lines_suppressed_total",
			Help: "Log lines a client caused that were not written: beyond the burst of their kind from one peer address (the next one written says how many)."}),
		takeovers: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Name: "takeovers_total",
			Help: "Exclusive exports taken over from another host, or from another attach of the same host (its session fenced)."}),
		evictions:      prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cache_evictions_total", Help: "Chunks evicted from the cache, by export."}, exp),
		loads:          prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cache_loads_total", Help: "Chunks loaded from backing files, by export."}, exp),
		loadBytes:      prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "cache_load_bytes_total", Help: "Bytes loaded from backing files, by export."}, exp),
		loadSeconds:    prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "cache_load_duration_seconds", Help: "Time to load a chunk, by export.", Buckets: buckets}, exp),
		writebackOps:   prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "writeback_ops_total", Help: "Writes of dirty ranges to backing files, by export."}, exp),
		writebackBytes: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "writeback_bytes_total", Help: "Bytes written back to backing files, by export."}, exp),
		doneBytes:      prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Name: "written_bytes_total", Help: "Bytes initiators reported written with RDMA WRITE (MSG_DONE), by export."}, exp),
		flushSeconds:   prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: ns, Name: "flush_duration_seconds", Help: "Time to write back and fdatasync a volume, by export.", Buckets: buckets}, exp),
		cacheUsed:      prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cache_used_bytes", Help: "Registered cache memory holding chunks."}),
		cacheBudget:    prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Name: "cache_budget_bytes", Help: "Registered cache memory in all."}),
	}
	m.opAuth, m.opList, m.opOpen, m.opJoin, m.opGrant = m.newOp("auth"), m.newOp("list"), m.newOp("open"), m.newOp("join"), m.newOp("grant")
	m.opFlush, m.opTrim, m.opWriteZeroes, m.opClose = m.newOp("flush"), m.newOp("trim"), m.newOp("write_zeroes"), m.newOp("close")
	m.opDoneFUA = m.newOp("done_fua")
	m.errWriteback, m.errLoad = m.errors.WithLabelValues("writeback"), m.errors.WithLabelValues("load")
	m.errDeregister, m.errProtocol = m.errors.WithLabelValues("deregister"), m.errors.WithLabelValues("protocol")
	// The documented reasons exist from the start, at 0, so that rates and
	// alerts over them work before the first refusal.
	for _, r := range []string{"unknown_host", "no_secret", "wrong_secret", "unauthenticated_request", "rate_limited", "timeout"} {
		m.authFailures.WithLabelValues(r)
	}
	for _, r := range []string{"session_limit", "host_session_limit", "unauthenticated_limit", "unauthenticated_evicted", "handle_limit", "not_allowed", "writer_busy", "attach_busy"} {
		m.refused.WithLabelValues(r)
	}
	for _, by := range []string{"peer", "host"} {
		m.authLimited.WithLabelValues(by)
	}
	if reg != nil {
		reg.MustRegister(m.sessions, m.sessionsTotal, m.requests, m.requestSeconds, m.errors, m.grants, m.revokes, m.fenced, m.revokeTimeouts,
			m.authFailures, m.refused, m.takeovers, m.hostSessions, m.unauthSessions, m.authLimited, m.logSuppressed,
			m.evictions, m.loads, m.loadBytes, m.loadSeconds, m.writebackOps, m.writebackBytes, m.doneBytes,
			m.flushSeconds, m.cacheUsed, m.cacheBudget)
	}
	m.registerGrow(reg)
	return m
}

// volMetrics are the children of the per-export collectors for one export,
// resolved once when the export is opened: the request path does no label
// lookup.
type volMetrics struct {
	grants, revokes, evictions         prometheus.Counter
	loads, loadBytes                   prometheus.Counter
	writebackOps, writebackBytes, done prometheus.Counter
	loadSeconds, flushSeconds          prometheus.Observer
}

// forExport resolves (and so creates, at 0) the series of export name.
func (m *Metrics) forExport(name string) *volMetrics {
	m.grows.WithLabelValues(name) // 0 from the start, like the others
	return &volMetrics{grants: m.grants.WithLabelValues(name), revokes: m.revokes.WithLabelValues(name),
		evictions: m.evictions.WithLabelValues(name), loads: m.loads.WithLabelValues(name),
		loadBytes: m.loadBytes.WithLabelValues(name), writebackOps: m.writebackOps.WithLabelValues(name),
		writebackBytes: m.writebackBytes.WithLabelValues(name), done: m.doneBytes.WithLabelValues(name),
		loadSeconds: m.loadSeconds.WithLabelValues(name), flushSeconds: m.flushSeconds.WithLabelValues(name)}
}

// deleteExport removes the series of export name. Removing an export while
// the target runs must call it once the volume is closed, so that a later
// export of that name starts at 0 and a removed one leaves no stale series.
// (The gauges of exportCollector need nothing: they follow Target.vols.)
func (m *Metrics) deleteExport(name string) {
	l := prometheus.Labels{"export": name}
	for _, v := range []*prometheus.MetricVec{m.grants.MetricVec, m.revokes.MetricVec, m.evictions.MetricVec,
		m.loads.MetricVec, m.loadBytes.MetricVec, m.writebackOps.MetricVec, m.writebackBytes.MetricVec,
		m.doneBytes.MetricVec, m.loadSeconds.MetricVec, m.flushSeconds.MetricVec, m.grows.MetricVec} {
		v.DeletePartialMatch(l)
	}
}
