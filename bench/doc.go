// Package bench holds rblk's benchmarks: BenchmarkPath measures the data
// path in one process (initiator against target over the software RDMA
// provider on loopback), and fio-compare.sh runs the same fio jobs against
// the whole product (rblkd + rblk-attach) and nbdkit's file plugin side by side.
//
//	go test -run='^$' -bench=. ./bench/
//	bench/fio-compare.sh [RUNTIME_SECONDS] [CHUNK_SIZE]
package bench
