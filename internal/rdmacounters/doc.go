// Package rdmacounters is a Prometheus collector of the RDMA devices'
// counters as the kernel publishes them in sysfs, read at each scrape (pure
// Go, no verbs):
//
//	rblk_rdma_port_counters_total{device,port,counter}     <dev>/ports/<n>/counters/*
//	rblk_rdma_port_hw_counters_total{device,port,counter}  <dev>/ports/<n>/hw_counters/*
//	rblk_rdma_device_hw_counters_total{device,counter}     <dev>/hw_counters/*
//	rblk_rdma_port_state{device,port}                      <dev>/ports/<n>/state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER
//	rblk_rdma_port_phys_state{device,port}                 <dev>/ports/<n>/phys_state: 5 LinkUp, 3 Disabled, ...
//	rblk_rdma_port_info{device,port,link_layer,rate} 1     <dev>/ports/<n>/link_layer and rate
//	rblk_rdma_port_netdev_mtu_bytes{device,port,netdev}    the MTU of a RoCE port's network device
//
// where <dev> is each entry of ROOT/class/infiniband (ROOT is /sys on a
// normal system; a test points it at a fixture tree). The standard port
// counters (port_xmit_data, port_rcv_data, port_xmit_packets, ...,
// symbol_error, link_downed, port_rcv_errors, ...) are the InfiniBand
// PortCounters: the *_data ones count units of 4 bytes. hw_counters are the
// provider's own: mlx5's out_of_sequence, rnr_nak_retry_err, ...; rxe's
// sent_pkts, rcvd_pkts, retry_exceeded_err, .... A counters or hw_counters
// file that is not a number (the "lifespan" setting of hw_counters) or
// cannot be read (some need root, some query the port and fail) is left
// out of that scrape, not reported as an error: one bad file never hides
// the others. A machine without RDMA devices has none of these series.
package rdmacounters
