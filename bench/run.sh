#!/usr/bin/env bash
# bench/run.sh: rblk's benchmark harness on the bare machine (`make bench`).
#
# The same fio jobs (fio's nbd engine, NBD over unix sockets) against:
#   rblk          fio -> rblk-attach --nbd-listen -> software RDMA (tcp
#                 provider) on loopback -> rblkd serve --transport tcp
#   rblk-before   the same with RBLK_BENCH_BASELINE/rblkd and
#                 RBLK_BENCH_BASELINE/rblk-attach (a build of an older
#                 commit), when RBLK_BENCH_BASELINE=DIR is set
#   nbdkit-file   nbdkit's file plugin
#   qemu-nbd      qemu-nbd -f raw --cache=writeback
#   nbdkit-null   nbdkit's null plugin: one NBD hop and no data work, the
#                 front end's floor (the "null NBD round trip")
# and the floor of the fabric: a raw RDMA READ/WRITE of the job's size and
# depth between two processes over the same software transport on loopback
# (bench/cmd/rdmaread), in the rotation of each job like one more server.
#
# Jobs: 4k randread/randwrite QD1 and QD32, 4k randrw QD32, 4k randread
# QD16 x 2 connections (numjobs=2: each fio job its own NBD connection,
# group_reporting), 1M read/write QD8. Every job runs RBLK_BENCH_REPS times
# on every server, interleaved: for each rep, for each job, every server
# (and the raw RDMA floor) in turn; the order rotates from rep to rep.
#
# CPU time per IO: utime+stime of each server process (/proc/PID/stat
# covers all its threads), read just before and just after each fio run,
# divided by every IO fio did in that run. A fio run is two job groups on
# the same server: "warm" (RBLK_BENCH_RAMP seconds, in place of fio's
# ramp_time, whose IOs fio does not count) and then "measure"
# (RBLK_BENCH_RUNTIME seconds, a new connection each job). IOPS, bandwidth
# and latency are those of "measure"; the CPU per IO is the CPU of the
# whole fio run over the IOs of both groups, so that both sides of the
# division cover the same time (connection set-up included; it is
# negligible beside seconds of IO).
#
# Results in RBLK_BENCH_OUT (default bench/out/DATE): fio/*.json (each
# run), runs.jsonl (each run's CPU counters), floors.jsonl, meta.json, and
# from bench/report.py: results.json, table.md, bench.png (gnuplot).
#
#   bench/run.sh                                    # about 10 minutes
#   RBLK_BENCH_BASELINE=/path/to/old/bin bench/run.sh
#
# Settings: RBLK_BENCH_RUNTIME (s, default 5), RBLK_BENCH_RAMP (s, default
# 1), RBLK_BENCH_REPS (default 2), RBLK_BENCH_SIZE (default 1G),
# RBLK_BENCH_CHUNK (rblkd --chunk-size, default 1M), RBLK_BENCH_FLOOR_TIME
# (s per raw RDMA floor job, default 3), RBLK_BENCH_SERVERS and RBLK_BENCH_JOBS
# (subsets, space separated), RBLK_BENCH_KEEP=1 (keep the work dir).
# Needs: go, fio, nbdkit, qemu-utils (qemu-nbd), python3; gnuplot for the
# plot (apt-get install fio nbdkit qemu-utils gnuplot-nox).
# Exits non-zero if any fio run or floor measurement failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin
RUNTIME=${RBLK_BENCH_RUNTIME:-5}
RAMP=${RBLK_BENCH_RAMP:-1}
REPS=${RBLK_BENCH_REPS:-2}
SIZE=${RBLK_BENCH_SIZE:-1G}
CHUNK=${RBLK_BENCH_CHUNK:-1M}
FLOOR_TIME=${RBLK_BENCH_FLOOR_TIME:-3}
BASELINE=${RBLK_BENCH_BASELINE:-}
OUT=${RBLK_BENCH_OUT:-bench/out/$(date +%Y%m%d-%H%M%S)}
T_START=$SECONDS

for tool in go fio nbdkit qemu-nbd python3; do
	command -v "$tool" >/dev/null || {
		echo "bench: $tool is missing (apt-get install fio nbdkit qemu-utils python3)" >&2
		exit 1
	}
done
if [ -n "$BASELINE" ]; then
	BASELINE=$(cd "$BASELINE" && pwd)
	for b in rblkd rblk-attach; do
		[ -x "$BASELINE/$b" ] || { echo "bench: RBLK_BENCH_BASELINE=$BASELINE has no executable $b" >&2; exit 1; }
	done
fi
mkdir -p "$OUT/fio" "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d /var/tmp/rblk-bench.XXXXXX)
CLK_TCK=$(getconf CLK_TCK)

# ---------------------------------------------------------------------------
# Processes: every one this script starts, stopped on exit (also on failure).
# ---------------------------------------------------------------------------
PIDS=()
# running PID: it exists and is no zombie.
running() {
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
	[ -n "$st" ] && [ "$st" != Z ]
}
# stop SECS PID...: SIGTERM, then SIGKILL to those still there after SECS.
stop() {
	local secs=$1 p i alive
	shift
	for p; do kill -TERM "$p" 2>/dev/null; done
	for i in $(seq $((secs * 10))); do
		alive=0
		for p; do running "$p" && alive=1; done
		[ "$alive" = 1 ] || return 0
		sleep 0.1
	done
	for p; do running "$p" && log "pid $p did not stop on SIGTERM in ${secs}s: SIGKILL" && kill -KILL "$p" 2>/dev/null; done
}
ATTACH_PIDS=() # stopped first: an initiator detaches (flushes) while its target is still there
cleanup() {
	local rc=$?
	trap - EXIT INT TERM
	set +e
	[ ${#ATTACH_PIDS[@]} = 0 ] || stop 30 "${ATTACH_PIDS[@]}"
	[ ${#PIDS[@]} = 0 ] || stop 30 "${PIDS[@]}"
	wait 2>/dev/null
	if [ "${RBLK_BENCH_KEEP:-0}" = 1 ]; then echo "bench: work dir kept: $WORK"; else rm -rf "$WORK"; fi
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log() { echo "bench: $*" >&2; }
die() { log "$*"; exit 1; }

# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------
tags=
if [ -e /usr/include/infiniband/verbs.h ] && [ -e /usr/include/rdma/rdma_cma.h ]; then tags=rdma; fi
log "building bin/rblkd, bin/rblk-attach (tags '${tags}') and rdmaread"
go build -tags "$tags" -o bin/ ./cmd/rblkd ./cmd/rblk-attach
go build -o "$WORK/rdmaread" ./bench/cmd/rdmaread
BIN=$PWD/bin

# ---------------------------------------------------------------------------
# Backing files. Each file server gets its own file of SIZE on /var/tmp
# (WORK), all made the same way: created sparse with truncate, then filled
# completely with the same pseudo-random bytes (no holes, nothing
# compressible), so reads hit data; then synced, so that no writeback of
# the fill runs during the measurements. Every server reads it through the
# host's page cache (all fit in memory); rblkd's cache holds the whole
# volume (--cache-size above SIZE), as in the guest test.
# ---------------------------------------------------------------------------
size_bytes=$(numfmt --from=iec "$SIZE")
log "backing files: $SIZE of random bytes each"
truncate -s "$SIZE" "$WORK/base.img"
head -c "$size_bytes" /dev/urandom | dd of="$WORK/base.img" bs=1M conv=notrunc iflag=fullblock status=none

# name | start function; SERVERS in the order of the first rep.
SERVERS=(rblk)
[ -z "$BASELINE" ] || SERVERS+=(rblk-before)
SERVERS+=(nbdkit-file qemu-nbd nbdkit-null)
if [ -n "${RBLK_BENCH_SERVERS:-}" ]; then
	want=" $RBLK_BENCH_SERVERS "
	sel=()
	for s in "${SERVERS[@]}"; do [[ $want != *" $s "* ]] || sel+=("$s"); done
	SERVERS=("${sel[@]}")
fi
for s in "${SERVERS[@]}"; do
	[ "$s" = nbdkit-null ] || cp --sparse=never "$WORK/base.img" "$WORK/$s.img"
done
rm -f "$WORK/base.img"
sync

declare -A PROCS=() # server -> "name=pid name=pid" (the processes whose CPU counts)

# wait_sock PATH PID...: the unix socket exists (and the processes live).
wait_sock() {
	local sock=$1 i p
	shift
	for i in $(seq 300); do
		[ -S "$sock" ] && return 0
		for p; do running "$p" || return 1; done
		sleep 0.1
	done
	return 1
}

# start_rblk NAME BINDIR: rblkd (tcp, loopback, no auth) and rblk-attach
# with NBD on a unix socket.
start_rblk() {
	local name=$1 bin=$2 port tpid apid i
	port=$((20000 + RANDOM % 20000))
	"$bin/rblkd" serve --listen "127.0.0.1:$port" --transport tcp --chunk-size "$CHUNK" \
		--cache-size $(((size_bytes >> 20) + 256))M --export "vol=$WORK/$name.img" \
		>"$OUT/logs/$name-rblkd.log" 2>&1 &
	tpid=$!
	PIDS+=("$tpid")
	for i in $(seq 100); do
		"$bin/rblk-attach" list --target "127.0.0.1:$port" --transport tcp --host-id bench >/dev/null 2>&1 && break
		running "$tpid" || die "$name: rblkd exited: $(tail -n 3 "$OUT/logs/$name-rblkd.log")"
		sleep 0.1
	done
	# Two queues, one per NBD connection of the QD16 x 2 job (a build
	# without --queues has one).
	local queues=()
	if "$bin/rblk-attach" attach --help 2>&1 | grep -q -- --queues; then
		queues=(--queues 2)
	fi
	"$bin/rblk-attach" attach --target "127.0.0.1:$port" --export vol --transport tcp --host-id bench \
		--nbd-listen "unix:$WORK/$name.sock" "${queues[@]}" >"$OUT/logs/$name-attach.log" 2>&1 &
	apid=$!
	ATTACH_PIDS+=("$apid")
	wait_sock "$WORK/$name.sock" "$tpid" "$apid" || die "$name: no NBD socket: $(tail -n 3 "$OUT/logs/$name-attach.log")"
	PROCS[$name]="rblkd=$tpid rblk-attach=$apid"
}

start_server() {
	local s=$1 pid
	case $s in
	rblk) start_rblk rblk "$BIN" ;;
	rblk-before) start_rblk rblk-before "$BASELINE" ;;
	nbdkit-file | nbdkit-null)
		local plugin=(file "$WORK/$s.img")
		[ "$s" = nbdkit-file ] || plugin=(null "$SIZE")
		nbdkit --foreground --exit-with-parent --unix "$WORK/$s.sock" "${plugin[@]}" >"$OUT/logs/$s.log" 2>&1 &
		pid=$!
		PIDS+=("$pid")
		wait_sock "$WORK/$s.sock" "$pid" || die "$s did not start: $(tail -n 3 "$OUT/logs/$s.log")"
		PROCS[$s]="nbdkit=$pid"
		;;
	qemu-nbd)
		# --persistent: stay after the last client; --shared: the QD16x2
		# job's two connections at once.
		qemu-nbd --persistent --shared=8 --format=raw --cache=writeback \
			--socket="$WORK/$s.sock" "$WORK/$s.img" >"$OUT/logs/$s.log" 2>&1 &
		pid=$!
		PIDS+=("$pid")
		wait_sock "$WORK/$s.sock" "$pid" || die "$s did not start: $(tail -n 3 "$OUT/logs/$s.log")"
		PROCS[$s]="qemu-nbd=$pid"
		;;
	*) die "unknown server $s" ;;
	esac
}

# cpu_ticks PID: utime + stime of the whole process (all threads), in
# clock ticks (fields 14 and 15 of /proc/PID/stat, after the command name).
cpu_ticks() {
	local s
	s=$(cat "/proc/$1/stat") || return 1
	s=${s##*) }
	# shellcheck disable=SC2086 # split into fields
	set -- $s
	echo $((${12} + ${13}))
}

# cpu_snapshot SERVER: "name=ticks ..." of its processes.
cpu_snapshot() {
	local kv out=
	for kv in ${PROCS[$1]}; do
		out+="${kv%%=*}=$(cpu_ticks "${kv#*=}") "
	done
	echo "$out"
}

# ---------------------------------------------------------------------------
# Jobs: name|fio options (the same names as the guest's vm/fio-table.sh).
# ---------------------------------------------------------------------------
JOBS=(
	"randread-4k-qd1|--rw=randread --bs=4k --iodepth=1"
	"randwrite-4k-qd1|--rw=randwrite --bs=4k --iodepth=1"
	"randread-4k-qd32|--rw=randread --bs=4k --iodepth=32"
	"randwrite-4k-qd32|--rw=randwrite --bs=4k --iodepth=32"
	"randrw-4k-qd32|--rw=randrw --bs=4k --iodepth=32"
	"randread-4k-qd16x2|--rw=randread --bs=4k --iodepth=16 --numjobs=2"
	"read-1m-qd8|--rw=read --bs=1M --iodepth=8"
	"write-1m-qd8|--rw=write --bs=1M --iodepth=8"
)
if [ -n "${RBLK_BENCH_JOBS:-}" ]; then
	want=" $RBLK_BENCH_JOBS "
	sel=()
	for j in "${JOBS[@]}"; do [[ $want != *" ${j%%|*} "* ]] || sel+=("$j"); done
	JOBS=("${sel[@]}")
fi
[ ${#JOBS[@]} -gt 0 ] && [ ${#SERVERS[@]} -gt 0 ] || die "no job or no server selected"

FAILED=0

# fio_one SERVER JOB ARGS REP ORDER: one fio run, its CPU counters to runs.jsonl.
fio_one() {
	local s=$1 job=$2 args=$3 rep=$4 order=$5 out c0 c1 t0 t1 rc=0 kv pid
	out=$OUT/fio/$job.$s.rep$rep.json
	local groups=()
	if [ "$RAMP" != 0 ]; then groups+=(--name=warm --time_based --runtime="$RAMP"); fi
	groups+=(--name=measure --stonewall --time_based --runtime="$RUNTIME")
	for kv in ${PROCS[$s]}; do
		pid=${kv#*=}
		running "$pid" || { log "$s: ${kv%%=*} (pid $pid) is gone"; FAILED=$((FAILED + 1)); return 1; }
	done
	c0=$(cpu_snapshot "$s")
	t0=$(date +%s.%N)
	# shellcheck disable=SC2086 # args is a list of options
	fio --ioengine=nbd --uri="nbd+unix:///?socket=$WORK/$s.sock" --size="$SIZE" \
		--group_reporting --lat_percentiles=1 $args "${groups[@]}" \
		--output-format=json --output="$out" >"$OUT/logs/fio-last.txt" 2>&1 || rc=$?
	t1=$(date +%s.%N)
	c1=$(cpu_snapshot "$s")
	if [ "$rc" != 0 ]; then
		log "FAIL: fio $job on $s (rep $rep) exited $rc: $(tail -n 5 "$OUT/logs/fio-last.txt")"
		cp "$OUT/logs/fio-last.txt" "$OUT/logs/fio-$job.$s.rep$rep.err"
		FAILED=$((FAILED + 1))
	fi
	python3 - "$s" "$job" "$rep" "$order" "$rc" "$t0" "$t1" "$CLK_TCK" "$out" "$c0" "$c1" >>"$OUT/runs.jsonl" <<'PY'
import json, sys
s, job, rep, order, rc, t0, t1, tck, out, c0, c1 = sys.argv[1:]
kv = lambda t: {k: int(v) for k, v in (x.split("=") for x in t.split())}
b, a = kv(c0), kv(c1)
print(json.dumps({"server": s, "job": job, "rep": int(rep), "order": int(order), "fio_rc": int(rc),
                  "wall_s": round(float(t1) - float(t0), 3), "clk_tck": int(tck), "fio_json": out.rsplit("/", 2)[-2] + "/" + out.rsplit("/", 1)[-1],
                  "cpu_ticks": {k: a[k] - b[k] for k in a}}))
PY
	python3 - "$out" "$s" "$job" "$rep" <<'PY' >&2 || true
import json, sys
f, s, job, rep = sys.argv[1:]
m = [j for j in json.load(open(f))["jobs"] if j["jobname"] == "measure"][0]
iops = m["read"]["iops"] + m["write"]["iops"]
n = m["read"]["total_ios"] + m["write"]["total_ios"]
lat = (m["read"]["lat_ns"]["mean"] * m["read"]["total_ios"] + m["write"]["lat_ns"]["mean"] * m["write"]["total_ios"]) / max(n, 1) / 1e3
print(f"  rep {rep} {job:20s} {s:12s} {iops:10.0f} IOPS {lat:9.1f} us")
PY
}

# The fabric's floor of each job: the raw one-sided operations of the same
# size and depth over the software transport between two processes
# (bench/cmd/rdmaread), OP:BLOCKSIZE:DEPTH. It runs as one more "server" in
# each job's rotation ("raw-rdma"), so that it is measured beside the job's
# runs on the same machine state.
floor_jobs() {
	case $1 in
	randread-4k-qd1) echo read:4K:1 ;;
	randwrite-4k-qd1) echo write:4K:1 ;;
	randread-4k-qd32 | randread-4k-qd16x2) echo read:4K:32 ;;
	randwrite-4k-qd32) echo write:4K:32 ;;
	randrw-4k-qd32) echo read:4K:32,write:4K:32 ;;
	read-1m-qd8) echo read:1M:8 ;;
	write-1m-qd8) echo write:1M:8 ;;
	esac
}

# floor_one JOB REP ORDER: rdmaread's floor of JOB, to floors.jsonl.
floor_one() {
	local job=$1 rep=$2 order=$3 fj
	fj=$(floor_jobs "$job")
	[ -n "$fj" ] || return 0
	if ! "$WORK/rdmaread" run -target "$RDMAREAD_ADDR" -transport tcp -time "${FLOOR_TIME}s" -jobs "$fj" \
		>"$WORK/floor.json" 2>"$OUT/logs/rdmaread-run.log"; then
		log "FAIL: rdmaread run -jobs $fj: $(tail -n 3 "$OUT/logs/rdmaread-run.log")"
		FAILED=$((FAILED + 1))
		return 1
	fi
	jq -c --argjson rep "$rep" --argjson order "$order" --arg job "$job" '. + {rep: $rep, order: $order, job: $job}' \
		"$WORK/floor.json" >>"$OUT/floors.jsonl"
	jq -r --arg job "$job" --arg rep "$rep" '"  rep \($rep) \($job | . + " " * (20 - length)) raw-rdma     \(.op) \(.bs) QD\(.qd) (\(.mode)): \(.iops | floor) IOPS \(.lat_mean_us * 10 | round / 10) us"' \
		"$WORK/floor.json" >&2
}

# ---------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------
command -v jq >/dev/null || die "jq is missing (apt-get install jq)"
for s in "${SERVERS[@]}"; do start_server "$s"; done
"$WORK/rdmaread" serve -listen 127.0.0.1:0 -transport tcp -size 64M >"$WORK/rdmaread.addr" 2>"$OUT/logs/rdmaread-serve.log" &
PIDS+=($!)
for _ in $(seq 100); do grep -q '^listening ' "$WORK/rdmaread.addr" && break; sleep 0.1; done
RDMAREAD_ADDR=$(awk '/^listening /{ print $2 }' "$WORK/rdmaread.addr")
[ -n "$RDMAREAD_ADDR" ] || die "rdmaread serve did not start: $(cat "$OUT/logs/rdmaread-serve.log")"

{
	printf '{"date":"%s","host":"%s","kernel":"%s","cpus":%s,"cpu_model":"%s",' \
		"$(date -Is)" "$(hostname)" "$(uname -r)" "$(nproc)" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
	printf '"commit":"%s","baseline":"%s","runtime_s":%s,"ramp_s":%s,"reps":%s,"size":"%s","chunk":"%s","floor_time_s":%s,' \
		"$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)" "$BASELINE" "$RUNTIME" "$RAMP" "$REPS" "$SIZE" "$CHUNK" "$FLOOR_TIME"
	printf '"fio":"%s","nbdkit":"%s","qemu_nbd":"%s",' "$(fio --version)" "$(nbdkit --version | head -n1)" "$(qemu-nbd --version | head -n1)"
	printf '"servers":[%s],"jobs":[%s]}\n' "$(printf '"%s",' "${SERVERS[@]}" | sed 's/,$//')" \
		"$(for j in "${JOBS[@]}"; do printf '{"name":"%s","fio":"%s"},' "${j%%|*}" "${j#*|}"; done | sed 's/,$//')"
} >"$OUT/meta.json"

# Warm-up (not measured): one sequential read of the whole volume through
# each server, so that every server starts from the same warm state (the
# page cache; rblk's chunk cache and grants).
log "warm-up: one sequential 1M read of the whole volume through each server"
for s in "${SERVERS[@]}"; do
	fio --name=warmup --ioengine=nbd --uri="nbd+unix:///?socket=$WORK/$s.sock" --size="$SIZE" \
		--rw=read --bs=1M --iodepth=8 --output="$OUT/logs/warmup-$s.txt" >/dev/null 2>&1 ||
		die "warm-up read on $s failed: $(tail -n 5 "$OUT/logs/warmup-$s.txt")"
done

: >"$OUT/runs.jsonl"
: >"$OUT/floors.jsonl"
ROTATION=("${SERVERS[@]}" raw-rdma)
nrot=${#ROTATION[@]}
order=0
for rep in $(seq 1 "$REPS"); do
	log "rep $rep/$REPS: ${#JOBS[@]} jobs x ${#SERVERS[@]} servers (${RAMP}s + ${RUNTIME}s each) and the raw RDMA floor (${FLOOR_TIME}s)"
	for j in "${JOBS[@]}"; do
		for i in $(seq 0 $((nrot - 1))); do
			s=${ROTATION[$(((i + rep - 1) % nrot))]}
			order=$((order + 1))
			if [ "$s" = raw-rdma ]; then
				floor_one "${j%%|*}" "$rep" "$order" || true
			else
				fio_one "$s" "${j%%|*}" "${j#*|}" "$rep" "$order" || true
			fi
		done
	done
done
T_RUN=$((SECONDS - T_START))

log "report: $OUT"
python3 bench/report.py "$OUT" --elapsed "$T_RUN" || { log "FAIL: bench/report.py"; FAILED=$((FAILED + 1)); }
if command -v gnuplot >/dev/null; then
	(cd "$OUT" && gnuplot plot.gp) || { log "FAIL: gnuplot"; FAILED=$((FAILED + 1)); }
else
	log "gnuplot is missing (apt-get install gnuplot-nox): no plot"
fi
cat "$OUT/table.md"
log "results: $OUT (table.md, results.json, bench.png); ${T_RUN}s of runs"
[ "$FAILED" = 0 ] || die "$FAILED failures"
