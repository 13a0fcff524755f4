package nbd

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the server's Prometheus collectors. One Metrics may be shared
// by several servers.
type Metrics struct {
	requests    *prometheus.CounterVec
	bytes       *prometheus.CounterVec
	latency     *prometheus.HistogramVec
	inFlight    prometheus.Gauge
	connections prometheus.Gauge
	replyWrites prometheus.Counter

	// The children of each op, resolved once so that counting an IO neither
	// hashes label values nor allocates.
	ops [numOps]opMetrics
}

type opMetrics struct {
	ok, failed prometheus.Counter
	bytes      prometheus.Counter
	latency    prometheus.Observer
}

// Operations as counted; the index is what opIndex returns.
const (
	opRead = iota
	opWrite
	opFlush
	opTrim
	opWriteZeroes
	numOps
)

var opNames = [numOps]string{"read", "write", "flush", "trim", "write_zeroes"}

// opIndex maps a command to its metrics index, -1 for a command not counted.
func opIndex(cmd uint16) int {
	switch cmd {
	case cmdRead:
		return opRead
	case cmdWrite:
		return opWrite
	case cmdFlush:
		return opFlush
	case cmdTrim:
		return opTrim
	case cmdWriteZeroes:
		return opWriteZeroes
	}
	return -1
}

// NewMetrics makes the collectors and registers them with reg under the
// namespace "rblk_attach_nbd" (it panics, like prometheus.MustRegister, if
// one is registered already). With reg nil they are made but not registered.
//
//	rblk_attach_nbd_requests_total{op,result}        counter, result ok|error
//	rblk_attach_nbd_bytes_total{op}                  counter, bytes of successful requests
//	rblk_attach_nbd_request_duration_seconds{op}     histogram, 10µs … 10s, from the request header to the reply
//	rblk_attach_nbd_requests_in_flight               gauge
//	rblk_attach_nbd_connections                      gauge
//	rblk_attach_nbd_reply_writes_total               counter, writes to client sockets that carried replies
//
// op is one of read, write, flush, trim, write_zeroes.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	const ns = "rblk_attach_nbd"
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "requests_total",
			Help: "NBD requests handled, by operation and result.",
		}, []string{"op", "result"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: ns, Name: "bytes_total",
			Help: "Bytes covered by successful NBD requests, by operation.",
		}, []string{"op"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: "request_duration_seconds",
			Help:    "Time from reading an NBD request header to sending its reply, by operation.",
			Buckets: prometheus.ExponentialBucketsRange(10e-6, 10, 19),
		}, []string{"op"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "requests_in_flight",
			Help: "NBD requests read and not yet replied to.",
		}),
		connections: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: ns, Name: "connections",
			Help: "Open NBD connections (handshake or transmission).",
		}),
		replyWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: ns, Name: "reply_writes_total",
			Help: "Writes to NBD client sockets that carried replies: the replies of requests completed together share one.",
		}),
	}
	for i, name := range opNames {
		m.ops[i] = opMetrics{
			ok:      m.requests.WithLabelValues(name, "ok"),
			failed:  m.requests.WithLabelValues(name, "error"),
			bytes:   m.bytes.WithLabelValues(name),
			latency: m.latency.WithLabelValues(name),
		}
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.bytes, m.latency, m.inFlight, m.connections, m.replyWrites)
	}
	return m
}

// done counts one finished request.
func (m *Metrics) done(cmd uint16, ok bool, length uint32, start time.Time) {
	i := opIndex(cmd)
	if i < 0 {
		return
	}
	o := &m.ops[i]
	if ok {
		o.ok.Inc()
		if length > 0 {
			o.bytes.Add(float64(length))
		}
	} else {
		o.failed.Inc()
	}
	o.latency.Observe(time.Since(start).Seconds())
}
