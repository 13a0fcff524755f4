package rdmacounters_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/rblk/rblk/internal/rdmacounters"
)

// tree writes files (path relative to root: content) under root.
func tree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for p, content := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCollector(t *testing.T) {
	const ib = "class/infiniband/"
	for _, c := range []struct {
		name  string
		files map[string]string
		// unreadable are made symbolic links to nowhere: reading them
		// fails, as a counter's read fails when the port does not answer,
		// even for root.
		unreadable []string
		want       string
	}{
		{name: "no sysfs", want: ""},
		{name: "no devices", files: map[string]string{"class/net/lo/mtu": "65536\n"}, want: ""},
		{
			name: "rxe on eth0",
			files: map[string]string{
				ib + "rxe0/ports/1/counters/port_xmit_data":    "1234\n",
				ib + "rxe0/ports/1/counters/port_rcv_packets":  "99\n",
				ib + "rxe0/ports/1/hw_counters/sent_pkts":      "42\n",
				ib + "rxe0/ports/1/hw_counters/rcvd_pkts":      "41\n",
				ib + "rxe0/ports/1/hw_counters/lifespan":       "10\n",
				ib + "rxe0/ports/1/hw_counters/garbage":        "n/a\n",
				ib + "rxe0/ports/1/state":                      "4: ACTIVE\n",
				ib + "rxe0/ports/1/phys_state":                 "5: LinkUp\n",
				ib + "rxe0/ports/1/link_layer":                 "Ethernet\n",
				ib + "rxe0/ports/1/rate":                       "10 Gb/sec (1X QDR)\n",
				ib + "rxe0/ports/1/gid_attrs/ndevs/0":          "eth0\n",
				"class/net/eth0/mtu":                           "1500\n",
				ib + "mlx5_0/hw_counters/out_of_sequence":      "7\n",
				ib + "mlx5_0/ports/1/state":                    "1: DOWN\n",
				ib + "mlx5_0/ports/1/counters/symbol_error":    "18446744073709551615\n",
				ib + "mlx5_0/ports/1/counters/port_rcv_errors": "3\n",
				ib + "mlx5_0/ports/1/counters/VL15_dropped":    "0\n",
			},
			want: `
# HELP rblk_rdma_device_hw_counters_total An RDMA device's provider-specific counter (hw_counters).
# TYPE rblk_rdma_device_hw_counters_total counter
rblk_rdma_device_hw_counters_total{counter="out_of_sequence",device="mlx5_0"} 7
# HELP rblk_rdma_port_counters_total An RDMA port's standard counter (ports/N/counters; the *_data ones count 4-byte units).
# TYPE rblk_rdma_port_counters_total counter
rblk_rdma_port_counters_total{counter="VL15_dropped",device="mlx5_0",port="1"} 0
rblk_rdma_port_counters_total{counter="port_rcv_errors",device="mlx5_0",port="1"} 3
rblk_rdma_port_counters_total{counter="port_rcv_packets",device="rxe0",port="1"} 99
rblk_rdma_port_counters_total{counter="port_xmit_data",device="rxe0",port="1"} 1234
rblk_rdma_port_counters_total{counter="symbol_error",device="mlx5_0",port="1"} 1.8446744073709552e+19
# HELP rblk_rdma_port_hw_counters_total An RDMA port's provider-specific counter (ports/N/hw_counters).
# TYPE rblk_rdma_port_hw_counters_total counter
rblk_rdma_port_hw_counters_total{counter="rcvd_pkts",device="rxe0",port="1"} 41
rblk_rdma_port_hw_counters_total{counter="sent_pkts",device="rxe0",port="1"} 42
# HELP rblk_rdma_port_info An RDMA port's link layer (InfiniBand, Ethernet) and rate, as labels; the value is 1.
# TYPE rblk_rdma_port_info gauge
rblk_rdma_port_info{device="rxe0",link_layer="Ethernet",port="1",rate="10 Gb/sec (1X QDR)"} 1
# HELP rblk_rdma_port_netdev_mtu_bytes The MTU of the network device of a RoCE port (its GID 0's), which bounds the port's active RDMA MTU.
# TYPE rblk_rdma_port_netdev_mtu_bytes gauge
rblk_rdma_port_netdev_mtu_bytes{device="rxe0",netdev="eth0",port="1"} 1500
# HELP rblk_rdma_port_phys_state An RDMA port's physical state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, 5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test.
# TYPE rblk_rdma_port_phys_state gauge
rblk_rdma_port_phys_state{device="rxe0",port="1"} 5
# HELP rblk_rdma_port_state An RDMA port's logical state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.
# TYPE rblk_rdma_port_state gauge
rblk_rdma_port_state{device="mlx5_0",port="1"} 1
rblk_rdma_port_state{device="rxe0",port="1"} 4
`,
		},
		{
			name: "unreadable and odd files",
			files: map[string]string{
				ib + "d0/ports/1/counters/port_xmit_wait": "5\n",
				ib + "d0/ports/1/counters/negative":       "-1\n",
				ib + "d0/ports/1/counters/empty":          "",
				ib + "d0/ports/1/counters/subdir/x":       "1\n",
				ib + "d0/ports/1/state":                   "garbage\n",
				ib + "d0/ports/1/gid_attrs/ndevs/0":       "gone0\n",
				ib + "d0/hw_counters/lifespan":            "12\n",
				ib + "notadevice":                         "",
			},
			unreadable: []string{ib + "d0/ports/1/counters/secret"},
			want: `
# HELP rblk_rdma_port_counters_total An RDMA port's standard counter (ports/N/counters; the *_data ones count 4-byte units).
# TYPE rblk_rdma_port_counters_total counter
rblk_rdma_port_counters_total{counter="port_xmit_wait",device="d0",port="1"} 5
`,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "sys")
			tree(t, root, c.files)
			for _, p := range c.unreadable {
				if err := os.Symlink(filepath.Join(root, "nowhere"), filepath.Join(root, p)); err != nil {
					t.Fatal(err)
				}
			}
			reg := prometheus.NewPedanticRegistry()
			reg.MustRegister(rdmacounters.New(root))
			if err := testutil.GatherAndCompare(reg, strings.NewReader(c.want)); err != nil {
				t.Fatal(err)
			}
		})
	}
}
