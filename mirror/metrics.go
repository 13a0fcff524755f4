package mirror

import (
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics exports the arrays' state, read from sysfs at each scrape, and
// counts the members Supervise put back. Register it with a registry; add
// each array with Track, and set Options.Added to its Added.
type Metrics struct {
	mu     sync.Mutex
	arrays map[string]Options

	degraded, members, inSync, resyncing, progress, remaining, mismatches *prometheus.Desc
	added                                                                 *prometheus.CounterVec
}

// NewMetrics makes the rblk_mirror_* metrics.
func NewMetrics() *Metrics {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("rblk_mirror_"+name, help, []string{"array"}, nil)
	}
	return &Metrics{arrays: map[string]Options{},
		degraded:   d("degraded", "Members the array lacks: missing or failed (0: both copies serve)."),
		members:    d("members", "Member devices in the array, failed ones included."),
		inSync:     d("members_in_sync", "Members that hold the whole array."),
		resyncing:  d("resyncing", "1 while md copies data onto a member (recover or resync), else 0."),
		progress:   d("sync_progress_ratio", "How far the running resync, recovery or check is (0 to 1); 1 when none runs."),
		remaining:  d("sync_remaining_bytes", "Bytes the running resync, recovery or check has still to go; 0 when none runs."),
		mismatches: d("mismatch_sectors", "Sectors the last check or repair found to differ between the copies (mismatch_cnt)."),
		added: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rblk_mirror_members_added_total",
			Help: "Members put back into the array: from the bitmap (what changed while it was away) or in full."}, []string{"array", "from"}),
	}
}

// Track exports o's array (by o.Name) until Untrack.
func (m *Metrics) Track(o Options) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.arrays[o.Name] = o
}

// Untrack stops exporting the array name.
func (m *Metrics) Untrack(name string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.arrays, name)
	m.added.DeletePartialMatch(prometheus.Labels{"array": name})
}

// Added counts a member put back into array name (full: copied in full).
// It fits Options.Added.
func (m *Metrics) Added(name string, full bool) {
	from := "bitmap"
	if full {
		from = "full"
	}
	m.added.WithLabelValues(name, from).Inc()
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.degraded, m.members, m.inSync, m.resyncing, m.progress, m.remaining, m.mismatches} {
		ch <- d
	}
	m.added.Describe(ch)
}

// Collect implements prometheus.Collector. An array not assembled is
// left out.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.mu.Lock()
	arrays := make([]Options, 0, len(m.arrays))
	for _, o := range m.arrays {
		arrays = append(arrays, o)
	}
	m.mu.Unlock()
	for _, o := range arrays {
		st, err := Stat(o)
		if err != nil {
			continue
		}
		g := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, o.Name)
		}
		in := 0
		for _, mb := range st.Members {
			if mb.InSync() {
				in++
			}
		}
		done, total, running := st.Progress()
		resync := 0.0
		if st.Resyncing() {
			resync = 1
		}
		ratio := 1.0
		if running && total > 0 {
			ratio = float64(done) / float64(total)
		}
		g(m.degraded, float64(st.Degraded))
		g(m.members, float64(len(st.Members)))
		g(m.inSync, float64(in))
		g(m.resyncing, resync)
		g(m.progress, ratio)
		g(m.remaining, float64((total-done)<<9))
		g(m.mismatches, float64(st.Mismatches))
	}
	m.added.Collect(ch)
}

// Progress parses SyncCompleted ("DONE / TOTAL" sectors): running is
// false when no resync, recovery or check runs.
func (s *Status) Progress() (done, total int64, running bool) {
	a, b, ok := strings.Cut(s.SyncCompleted, "/")
	if !ok {
		return 0, 0, false
	}
	done, err1 := strconv.ParseInt(strings.TrimSpace(a), 10, 64)
	total, err2 := strconv.ParseInt(strings.TrimSpace(b), 10, 64)
	if err1 != nil || err2 != nil || total <= 0 || done > total {
		return 0, 0, false
	}
	return done, total, true
}
