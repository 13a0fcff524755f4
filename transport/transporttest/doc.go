// Package transporttest is a conformance suite for transport providers.
//
// Run checks the data path over pairs of connected Conns that the caller
// makes (one fresh pair per subtest, as yamux-style suites do): SEND/RECV,
// RDMA WRITE, READ and WRITE WITH IMMEDIATE, ordering, remote and local
// protection errors breaking the connection and flushing what is in flight,
// queue limits, concurrency (run it with -race) and Close. RunProvider adds
// the connection setup (private data, reject, cancellation, listener close)
// and runs Run over the provider's own conns:
//
//	func TestConformance(t *testing.T) {
//		transporttest.RunProvider(t, tcp.New("tcp"), func(*testing.T) string { return "127.0.0.1:0" })
//	}
//
// Every subtest checks that no goroutine it started outlives it; tests of
// their own can do the same with CheckGoroutines. Subpackage faultnet wraps
// a provider to pull the cable of a connection or delay its completions.
package transporttest
