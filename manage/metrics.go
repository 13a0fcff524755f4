package manage

import (
	"github.com/prometheus/client_golang/prometheus"
)

// poolCollector reports each pool's capacity at every scrape.
type poolCollector struct {
	s                                                 *Service
	capacity, provisioned, allocated, available, vols *prometheus.Desc
	damaged                                           *prometheus.Desc
}

// Collector returns the collector of the pools' metrics:
// rblkd_pool_capacity_bytes, _provisioned_bytes, _allocated_bytes,
// _available_bytes, rblkd_pool_volumes and rblkd_pool_volumes_damaged,
// each by pool.
func (s *Service) Collector() prometheus.Collector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("rblkd_pool_"+name, help, []string{"pool"}, nil)
	}
	return &poolCollector{s: s,
		capacity:    d("capacity_bytes", "A pool's capacity: its configured limit, or its file system's size."),
		provisioned: d("provisioned_bytes", "The sum of the sizes of a pool's volumes."),
		allocated:   d("allocated_bytes", "What a pool's volumes take on disk."),
		available:   d("available_bytes", "The largest volume (or growth) a pool takes now."),
		vols:        d("volumes", "A pool's volumes."),
		damaged:     d("volumes_damaged", "A pool's volumes not served: their record or data file is not what the pool wrote (see rblkd's log)."),
	}
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.capacity, c.provisioned, c.allocated, c.available, c.vols, c.damaged} {
		ch <- d
	}
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	ps, err := c.s.Pools("")
	if err != nil {
		return
	}
	for _, p := range ps {
		g := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, p.Name)
		}
		g(c.capacity, float64(p.Limit))
		g(c.provisioned, float64(p.Provisioned))
		g(c.allocated, float64(p.Allocated))
		g(c.available, float64(p.Available))
		g(c.vols, float64(p.Volumes))
		g(c.damaged, float64(p.Damaged))
	}
}
