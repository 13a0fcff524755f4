#!/usr/bin/env bash
# bench/bench.sh: `make bench`. The bare-machine harness (bench/run.sh),
# then the guest's fio table (rblk over verbs beside the kernel's NVMe-oF
# RDMA: the `bench` scenario of vm/rblk-e2e.sh through scripts/vm-test.sh,
# on bookworm-backports' 6.12 kernel only), both reported together by
# bench/report.py into one folder: table.md, results.json, bench.png,
# guest.png (gnuplot; installed with apt-get as gnuplot-nox if missing).
#
#   make bench                          # about 15 minutes on 2 cores
#   RBLK_BENCH_SKIP_VM=1 make bench     # the bare machine only
#   RBLK_BENCH_BASELINE=DIR RBLK_VM_BASELINE_BIN=DIR2 make bench
#                                       # with "rblk-before" columns (DIR2:
#                                       # built with -tags rdma, for the guest)
#
# Settings: those of bench/run.sh (RBLK_BENCH_*), RBLK_BENCH_OUT (default
# bench/out/DATE), RBLK_BENCH_SKIP_VM=1, RBLK_BENCH_VM_KERNEL (default
# 6.12), and those scripts/vm-test.sh passes to the guest
# (RBLK_VM_BASELINE_BIN, FIO_REPS, FIO_RUNTIME, FIO_RAMP, BENCH_MB,
# BENCH_QUEUES). On a shared machine, run it alone (flock LOCK make bench).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${RBLK_BENCH_OUT:-bench/out/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export RBLK_BENCH_OUT=$OUT
KERNEL=${RBLK_BENCH_VM_KERNEL:-6.12}

if ! command -v gnuplot >/dev/null; then
	echo "bench: installing gnuplot-nox (for the plots)"
	[ "$(id -u)" = 0 ] || { echo "bench: gnuplot is missing and this is not root: apt-get install gnuplot-nox" >&2; exit 1; }
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gnuplot-nox >/dev/null
fi

rc=0
t0=$SECONDS
bash bench/run.sh || rc=$?
t_bare=$((SECONDS - t0))

if [ "${RBLK_BENCH_SKIP_VM:-0}" != 1 ]; then
	t1=$SECONDS
	echo
	echo "bench: the guest's fio table on kernel $KERNEL (scripts/vm-test.sh, scenario bench)"
	RBLK_VM_KERNELS=$KERNEL RBLK_VM_SCENARIOS=bench RBLK_VM_RESULTS=$OUT/vm scripts/vm-test.sh || rc=$?
	share=$OUT/vm/kernel-$KERNEL
	mkdir -p "$OUT/guest"
	for f in fio-table.txt fio-table.csv fio-table.json fio-floors.json fio-floors.txt fio-info.txt scenarios.txt; do
		[ ! -e "$share/$f" ] || cp "$share/$f" "$OUT/guest/"
	done
	[ -s "$OUT/guest/fio-table.csv" ] || { echo "bench: no guest table in $share" >&2; rc=1; }
	echo "guest table on kernel $KERNEL: $((SECONDS - t1)) s (build and boot included)" >"$OUT/guest/time.txt"
	python3 bench/report.py "$OUT" || rc=$?
	(cd "$OUT" && gnuplot plot.gp) || rc=$?
	echo
	cat "$OUT/guest/fio-table.txt" 2>/dev/null || true
fi
echo
echo "bench: bare machine ${t_bare}s${t1:+, guest $((SECONDS - t1))s}; results in $OUT (table.md, results.json, bench.png${t1:+, guest.png})"
exit "$rc"
