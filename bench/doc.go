// Package bench holds rblk's benchmarks.
//
// In Go: BenchmarkPath measures the data path in one process (initiator
// against target over the software RDMA provider on loopback), and
// cmd/rdmaread measures the floor under it: a raw RDMA READ or WRITE
// between two processes over a transport provider, with no grant, NBD or
// volume in the way.
//
//	go test -run='^$' -bench=. ./bench/
//	go run ./bench/cmd/rdmaread serve &   # prints "listening ADDR"
//	go run ./bench/cmd/rdmaread run -target ADDR -jobs read:4K:1,read:4K:32
//
// The harness of `make bench` (bench.sh) runs the whole product:
//
//   - run.sh, on the bare machine: the same fio jobs (fio's nbd engine) on
//     rblk (rblkd + rblk-attach over the software transport), rblk-before
//     (an older build, RBLK_BENCH_BASELINE=DIR), nbdkit's file plugin,
//     qemu-nbd and nbdkit's null plugin (the front end's floor), each job
//     several times, interleaved, with the CPU time per IO of every server
//     process, and rdmaread's floor of the fabric;
//   - the guest: the `bench` scenario of vm/rblk-e2e.sh, rblk over verbs
//     beside the kernel's NVMe-oF RDMA on the same kind of RAM disk with the
//     same number of queues (scripts/vm-test.sh, kernel 6.12);
//   - report.py: results.json, table.md and gnuplot's bench.png and
//     guest.png, in bench/out/DATE.
//
// Run it with:
//
//	make bench
//	RBLK_BENCH_SKIP_VM=1 RBLK_BENCH_REPS=3 bench/bench.sh
package bench
