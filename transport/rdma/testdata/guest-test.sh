#!/bin/bash
# Guest script of transport/rdma: runs the package's test binaries inside the
# VM of vm/run.sh (Soft-RoCE rxe0 on dummy0, 192.0.2.1), with the share as cwd.
#
#   go test -c -tags rdma -o DIR/rdma.test ./transport/rdma/
#   go test -c -race -tags rdma -o DIR/rdma-race.test ./transport/rdma/   # optional
#   vm/run.sh transport/rdma/testdata/guest-test.sh DIR
#
# Environment (set in DIR/guest-test.env, sourced if present):
#   RDMA_TEST_RUN    -test.run pattern (default: all tests)
#   RDMA_TEST_BENCH  -test.bench pattern (default: all benchmarks; "none" skips them)
#   RDMA_BENCHTIME   -test.benchtime (default 2s)
#   RDMA_TEST_RACE   0 to skip the race binary even if present
#   RDMA_PERFTEST    1: also run perftest (ib_*_lat/bw over the RDMA CM) as
#                    the C baseline of the benchmarks, into perftest.log
#   RDMA_STRACE      a -test.bench pattern to run once under strace -f -c
#                    (syscall counts per benchmark), into strace.log
#   RDMA_HUGEPAGES   reserve that many huge pages of the hugetlb pool
#                    (vm.nr_hugepages) first, so that AllocMemory(n, true)
#                    gets hugetlb pages rather than transparent ones
# Results: rdma-test.log, rdma-race.log, rdma-bench.log in the share.
set -u
[ -f ./guest-test.env ] && . ./guest-test.env
export RBLK_RDMA_ADDR=${RBLK_VM_ADDR:-192.0.2.1}
RUN=${RDMA_TEST_RUN:-.}
BENCH=${RDMA_TEST_BENCH:-.}
BENCHTIME=${RDMA_BENCHTIME:-2s}

if [ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
	echo "guest-test: no RDMA device; setting up Soft-RoCE"
	modprobe -a rdma_rxe ib_uverbs rdma_ucm dummy || exit 100
	ip link add dummy0 type dummy && ip addr add "$RBLK_RDMA_ADDR/24" dev dummy0 && ip link set dummy0 up || exit 100
	rdma link add rxe0 type rxe netdev dummy0 || exit 100
	sleep 1
fi
ulimit -l unlimited 2>/dev/null
if [ -n "${RDMA_HUGEPAGES:-}" ]; then
	echo "$RDMA_HUGEPAGES" >/proc/sys/vm/nr_hugepages
	echo "guest-test: hugetlb pool $(grep -E 'HugePages_(Total|Free)' /proc/meminfo | tr -s ' \n' ' ')"
fi
echo "guest-test: transparent huge pages $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
echo "guest-test: devices $(ls /sys/class/infiniband), address $RBLK_RDMA_ADDR, memlock $(ulimit -l), $(nproc) cpus"
[ -x ./rdma.test ] || { echo "guest-test: ./rdma.test missing"; exit 2; }

rc=0
echo "=== tests"
./rdma.test -test.v -test.count=1 -test.timeout=20m -test.run "$RUN" >rdma-test.log 2>&1
r=$?
grep -E '^(=== RUN|\s*--- (PASS|FAIL|SKIP)|PASS|FAIL|ok|panic)' rdma-test.log | grep -v '^=== RUN' | tail -n 200
echo "guest-test: tests exit $r"
[ $r -eq 0 ] || rc=1

if [ -x ./rdma-race.test ] && [ "${RDMA_TEST_RACE:-1}" != 0 ]; then
	echo "=== tests with -race"
	./rdma-race.test -test.count=1 -test.timeout=30m -test.run "$RUN" -test.short >rdma-race.log 2>&1
	r=$?
	grep -E -- '--- FAIL|WARNING: DATA RACE|^(PASS|FAIL|ok)|panic' rdma-race.log | head -n 50
	echo "guest-test: race tests exit $r"
	[ $r -eq 0 ] || rc=1
fi

if [ "$BENCH" != none ]; then
	echo "=== benchmarks"
	./rdma.test -test.run '^$' -test.bench "$BENCH" -test.benchtime "$BENCHTIME" -test.benchmem >rdma-bench.log 2>&1
	r=$?
	cat rdma-bench.log
	echo "guest-test: benchmarks exit $r"
	[ $r -eq 0 ] || rc=1
fi
if [ "${RDMA_PERFTEST:-0}" = 1 ]; then
	echo "=== perftest baseline (C, same guest)"
	: >perftest.log
	perf_pair() { # NAME ARGS...: server and client of one perftest tool
		local tool=$1
		shift
		"$tool" -R "$@" >>perftest.log.srv 2>&1 &
		local spid=$!
		sleep 1
		echo "--- $tool $*" >>perftest.log
		timeout 120 "$tool" -R "$@" "$RBLK_RDMA_ADDR" >>perftest.log 2>&1 || echo "($tool failed)" >>perftest.log
		wait $spid
	}
	perf_pair ib_read_lat -s 4096 -n 2000
	perf_pair ib_write_lat -s 4096 -n 2000
	perf_pair ib_send_lat -s 64 -n 2000
	perf_pair ib_read_bw -s 4096 -n 2000 -t 16
	perf_pair ib_read_bw -s 1048576 -n 100 -t 8
	perf_pair ib_write_bw -s 1048576 -n 100 -t 8
	grep -E '^ *(#bytes|[0-9]+ +[0-9]+)|^---|failed' perftest.log
fi

if [ -n "${RDMA_STRACE:-}" ]; then
	echo "=== strace -c of $RDMA_STRACE"
	strace -f -c -o strace.log ./rdma.test -test.run '^$' -test.bench "$RDMA_STRACE" -test.benchtime 2000x >strace-bench.log 2>&1
	cat strace-bench.log strace.log | head -n 60
fi
exit $rc
