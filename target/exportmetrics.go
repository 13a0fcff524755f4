package target

import (
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// exportCollector reports, at each scrape, the per-export state that is
// not counted on the request path: the export's size, its share of the
// cache, its write-back backlog and lag, and the initiators that have it
// open. It reads the target's exports when scraped, so exports added or
// removed while the target runs appear and disappear with no bookkeeping.
type exportCollector struct {
	t *Target

	size, cache, queued, lag, opens *prometheus.Desc
}

func newExportCollector(t *Target) *exportCollector {
	const ns = "rblkd"
	exp := []string{"export"}
	return &exportCollector{t: t,
		size: prometheus.NewDesc(ns+"_export_size_bytes", "Size of the export's volume.", exp, nil),
		cache: prometheus.NewDesc(ns+"_export_cache_bytes",
			"Cache memory holding chunks of the export (rblkd_cache_used_bytes is the sum over exports).", exp, nil),
		queued: prometheus.NewDesc(ns+"_writeback_queued_chunks",
			"Chunks of the export queued for write-back.", exp, nil),
		lag: prometheus.NewDesc(ns+"_writeback_lag_seconds",
			"Age of the oldest range of the export that initiators wrote and write-back has not yet written to the backing file (0: none).", exp, nil),
		opens: prometheus.NewDesc(ns+"_export_sessions",
			"Initiator sessions that have the export open (additional queues of a session not counted).", exp, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *exportCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.size
	ch <- c.cache
	ch <- c.queued
	ch <- c.lag
	ch <- c.opens
}

// Collect implements prometheus.Collector.
func (c *exportCollector) Collect(ch chan<- prometheus.Metric) {
	t := c.t
	// (volMu guards vols; it is never held while taking mu.)
	t.volMu.RLock()
	vols := slices.Clone(t.vols)
	t.volMu.RUnlock()
	t.mu.Lock()
	opens := make(map[string]int, len(vols))
	for id := range t.idents {
		opens[id.export]++
	}
	t.mu.Unlock()
	now := time.Now()
	cs := float64(t.opts.ChunkSize)
	for _, v := range vols {
		queued, lag := v.writebackState(now)
		ch <- prometheus.MustNewConstMetric(c.size, prometheus.GaugeValue, float64(v.size.Load()), v.name)
		ch <- prometheus.MustNewConstMetric(c.cache, prometheus.GaugeValue, float64(v.cached.Load())*cs, v.name)
		ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(queued), v.name)
		ch <- prometheus.MustNewConstMetric(c.lag, prometheus.GaugeValue, lag.Seconds(), v.name)
		ch <- prometheus.MustNewConstMetric(c.opens, prometheus.GaugeValue, float64(opens[v.name]), v.name)
	}
}
