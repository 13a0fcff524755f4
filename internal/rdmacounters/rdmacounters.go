package rdmacounters

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector reads the counters of every RDMA device under a sysfs root at
// each scrape. It is unchecked (its series depend on the devices present):
// Describe sends nothing.
type Collector struct {
	root string

	portCounter, portHW, devHW, state, phys, info, mtu *prometheus.Desc
}

// New returns a Collector of the devices under sysfsRoot/class/infiniband
// (sysfsRoot "" means /sys).
func New(sysfsRoot string) *Collector {
	if sysfsRoot == "" {
		sysfsRoot = "/sys"
	}
	const ns = "rblk_rdma"
	dp := []string{"device", "port"}
	return &Collector{root: sysfsRoot,
		portCounter: prometheus.NewDesc(ns+"_port_counters_total",
			"An RDMA port's standard counter (ports/N/counters; the *_data ones count 4-byte units).", append(dp, "counter"), nil),
		portHW: prometheus.NewDesc(ns+"_port_hw_counters_total",
			"An RDMA port's provider-specific counter (ports/N/hw_counters).", append(dp, "counter"), nil),
		devHW: prometheus.NewDesc(ns+"_device_hw_counters_total",
			"An RDMA device's provider-specific counter (hw_counters).", []string{"device", "counter"}, nil),
		state: prometheus.NewDesc(ns+"_port_state",
			"An RDMA port's logical state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.", dp, nil),
		phys: prometheus.NewDesc(ns+"_port_phys_state",
			"An RDMA port's physical state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, 5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test.", dp, nil),
		info: prometheus.NewDesc(ns+"_port_info",
			"An RDMA port's link layer (InfiniBand, Ethernet) and rate, as labels; the value is 1.", append(dp, "link_layer", "rate"), nil),
		mtu: prometheus.NewDesc(ns+"_port_netdev_mtu_bytes",
			"The MTU of the network device of a RoCE port (its GID 0's), which bounds the port's active RDMA MTU.", append(dp, "netdev"), nil),
	}
}

// Describe implements prometheus.Collector: nothing, the collector is
// unchecked.
func (c *Collector) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	base := filepath.Join(c.root, "class", "infiniband")
	devs, err := os.ReadDir(base)
	if err != nil {
		return // no RDMA devices, or no sysfs
	}
	for _, d := range devs {
		dev := d.Name()
		dir := filepath.Join(base, dev)
		counters(filepath.Join(dir, "hw_counters"), func(name string, v float64) {
			ch <- prometheus.MustNewConstMetric(c.devHW, prometheus.CounterValue, v, dev, name)
		})
		ports, err := os.ReadDir(filepath.Join(dir, "ports"))
		if err != nil {
			continue
		}
		for _, p := range ports {
			port := p.Name()
			pdir := filepath.Join(dir, "ports", port)
			counters(filepath.Join(pdir, "counters"), func(name string, v float64) {
				ch <- prometheus.MustNewConstMetric(c.portCounter, prometheus.CounterValue, v, dev, port, name)
			})
			counters(filepath.Join(pdir, "hw_counters"), func(name string, v float64) {
				ch <- prometheus.MustNewConstMetric(c.portHW, prometheus.CounterValue, v, dev, port, name)
			})
			if n, ok := leadingNumber(filepath.Join(pdir, "state")); ok {
				ch <- prometheus.MustNewConstMetric(c.state, prometheus.GaugeValue, n, dev, port)
			}
			if n, ok := leadingNumber(filepath.Join(pdir, "phys_state")); ok {
				ch <- prometheus.MustNewConstMetric(c.phys, prometheus.GaugeValue, n, dev, port)
			}
			ll, okl := readLine(filepath.Join(pdir, "link_layer"))
			rate, okr := readLine(filepath.Join(pdir, "rate"))
			if okl || okr {
				ch <- prometheus.MustNewConstMetric(c.info, prometheus.GaugeValue, 1, dev, port, ll, rate)
			}
			if nd, ok := readLine(filepath.Join(pdir, "gid_attrs", "ndevs", "0")); ok && nd != "" {
				if s, ok := readLine(filepath.Join(c.root, "class", "net", nd, "mtu")); ok {
					if m, err := strconv.ParseFloat(s, 64); err == nil {
						ch <- prometheus.MustNewConstMetric(c.mtu, prometheus.GaugeValue, m, dev, port, nd)
					}
				}
			}
		}
	}
}

// counters calls emit for each file of dir that holds a number.
func counters(dir string, emit func(name string, v float64)) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.IsDir() || e.Name() == "lifespan" {
			continue
		}
		s, ok := readLine(filepath.Join(dir, e.Name()))
		if !ok {
			continue
		}
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			continue
		}
		emit(e.Name(), float64(v))
	}
}

// leadingNumber parses files like state ("4: ACTIVE").
func leadingNumber(path string) (float64, bool) {
	s, ok := readLine(path)
	if !ok {
		return 0, false
	}
	num, _, _ := strings.Cut(s, ":")
	v, err := strconv.ParseUint(strings.TrimSpace(num), 10, 8)
	return float64(v), err == nil
}

// readLine reads a small sysfs file, trimmed.
func readLine(path string) (string, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", false
	}
	return strings.TrimSpace(string(b)), true
}
