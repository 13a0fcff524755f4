#!/usr/bin/env bash
# bench/bundle/run.sh: rblk against two nbdkit peers on one machine, from a self-contained bundle
# (make bench-bundle builds it: bench/out/rblk-bench.tar.xz, with this script beside it as run.sh).
#
#   OUT=/some/empty/dir bash run.sh            # full run, about 4 minutes on 16 cores
#   OUT=/tmp/o QUICK=1 bash run.sh             # short check: 1 s runs, numjobs 1 and 2
#
# Needs on the machine: bash (>= 5), coreutils, tar, and one xz decoder among xz/xzcat/unxz,
# apt's /usr/lib/apt/apt-helper, busybox or a python3 with lzma (tried in that order) to unpack
# $BUNDLE (default: rblk-bench.tar.xz or bundle.tar.xz beside this script). Everything else comes from the bundle: static rblkd and rblk-attach
# (CGO_ENABLED=0), Debian 12's fio 3.33 (nbd engine, libnbd linked), nbdkit 1.32 with its file
# and nbd plugins and jq 1.6, all run through the bundled glibc loader
# ($B/lib/ld-linux-x86-64.so.2 --library-path $B/lib ...) with an empty environment.
#
# Servers, all up at once, each on its own unix socket, each on its own 1 GiB file in /dev/shm:
#   rblk    fio -> rblk-attach --nbd-listen unix --queues 16 -> software RDMA (tcp) on 127.0.0.1
#           -> rblkd --transport tcp --cache-size 1280M (the whole volume), chunk size default (1M)
#   direct  fio -> nbdkit file plugin (unix socket; nbdkit's default 16 threads per connection)
#   chain   fio -> nbdkit nbd plugin (unix) -> TCP 127.0.0.1 -> nbdkit file plugin (rblk's two hops)
# Each file is filled once by a sequential 1M write (QD8) through its server.
# Jobs: fio --ioengine=nbd, time_based, ramp 1 s, runtime 4 s, group_reporting, json; each job runs
# on the three servers back to back, the order rotating from job to job; one repetition.
# CPU per IO: utime+stime (/proc/PID/stat) of the server's processes (rblk: rblkd + rblk-attach;
# chain: both nbdkits), sampled inside the measured period (from 0.5 s after the ramp until 0.25 s
# before its end), divided by the IOs of that window (fio's IOPS x the window's length).
#
# Then, if the bundle has it, the Go benchmark of the data path by queue count (bench.test, BenchmarkQueues:
# the initiator and the target in one process over the software transport on loopback, 4k random IO,
# 8 in flight per queue; IOPS and the time blocked on mutexes per IO against 1, 2, 4, 8 and 16 queues).
# The table ends with the issue's targets for this machine (rblk at 16 jobs against 8, against the
# two-hop chain, and rblk-attach's CPU per IO against nbdkit file's), each "met" or "MISSED".
#
# Results in $OUT (at most 6 files): table.txt, results.csv, console.log, logs.tar.gz
# (server logs, fio json, meta), fill.csv and queues.txt.
# Settings (env): QUICK=1, RUNTIME (s), RAMP (s), SIZE_MIB (1024), QUEUES (16), NJ_LIST ("1 4 8 16": numjobs
# of the 4k QD32 jobs), NJ_BIG (4: numjobs of the 1M jobs), BUDGET (400 s: the
# hard wall-time limit; runs that would not end before it are skipped), KEEP=1 (keep /dev/shm/b),
# QB_IOS (IOs of each BenchmarkQueues run: 400000, 20000 with QUICK=1; 0: no queue benchmark).
set -u -o pipefail
export LC_ALL=C
SECONDS=0
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${OUT:?set OUT to an empty folder for the results}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "run.sh: cannot use OUT=$OUT" >&2; exit 2; }
exec > >(tee "$OUT/console.log") 2>&1
TEE_PID=$!

QUICK=${QUICK:-0}
BUDGET=${BUDGET:-400}
if [ "$QUICK" = 1 ]; then RUNTIME=${RUNTIME:-1}; NJ=(${NJ_LIST:-1 2}); NJ_BIG=${NJ_BIG:-2}; else RUNTIME=${RUNTIME:-4}; NJ=(${NJ_LIST:-1 4 8 16}); NJ_BIG=${NJ_BIG:-4}; fi
RAMP=${RAMP:-1}
SIZE_MIB=${SIZE_MIB:-1024}
CACHE_MIB=$((SIZE_MIB + 256))
QUEUES=${QUEUES:-16}
B0=${BENCH_DIR:-/dev/shm/b}   # the bundle is unpacked here; backing files and sockets go to $B0/work
B=$B0                          # where the programs run from ($B0, unless its file system is noexec)
W=$B0/work
BUNDLE=${BUNDLE:-$([ -f "$HERE/rblk-bench.tar.xz" ] && echo "$HERE/rblk-bench.tar.xz" || echo "$HERE/bundle.tar.xz")}
FIO_TO=$((RAMP + RUNTIME + 10))   # timeout of one fio run
WIN_LEAD_US=$([ "$RUNTIME" -ge 3 ] && echo 500000 || echo 250000)
FPID=
DEADLINE=$((BUDGET - 12))          # no fio run is started that could end after this (cleanup and report after)

log() { printf '[%4ds] %s\n' "$SECONDS" "$*"; }
die() { log "FATAL: $*"; exit 1; }

# ---------------------------------------------------------------------------
# Processes: only those started here, stopped by PID on exit.
# ---------------------------------------------------------------------------
FRONT_PIDS=() # stopped first (rblk-attach flushes while rblkd is still there)
BACK_PIDS=()
WD_PID=
alive() { local s=; { read -r s <"/proc/$1/stat"; } 2>/dev/null || return 1; s=${s##*) }; [ -n "$s" ] && [ "${s:0:1}" != Z ]; }
stop_pids() { # stop_pids SECS PID...: TERM, wait up to SECS, then KILL; reap
	local secs=$1 p i any; shift
	[ $# -gt 0 ] || return 0
	for p; do kill -TERM "$p" 2>/dev/null; done
	for ((i = 0; i < secs * 10; i++)); do
		any=0; for p; do alive "$p" && any=1; done
		[ $any = 1 ] || break
		sleep 0.1
	done
	for p; do alive "$p" && { log "pid $p still there after ${secs}s: KILL"; kill -KILL "$p" 2>/dev/null; }; done
	for p; do wait "$p" 2>/dev/null; done
	return 0
}
CLEANED=0
cleanup() {
	local rc=$?
	[ $CLEANED = 1 ] && return; CLEANED=1
	trap - EXIT; trap '' INT TERM
	set +e
	[ -n "$WD_PID" ] && kill "$WD_PID" 2>/dev/null
	[ -n "$FPID" ] && alive "$FPID" && stop_pids 3 "$FPID"   # a fio run in flight (timeout passes TERM on to fio)
	stop_pids 4 "${FRONT_PIDS[@]}"
	stop_pids 4 "${BACK_PIDS[@]}"
	if [ -d "$W" ]; then
		cp "$B/MANIFEST" "$W/logs/" 2>/dev/null
		(cd "$W" && tar -czf "$OUT/logs.tar.gz" logs fio 2>/dev/null || tar -cf "$OUT/logs.tar" logs fio)
		rm -f "$W"/*.img "$W"/*.sock
	fi
	[ "${KEEP:-0}" = 1 ] || rm -rf "$B0" "$W"
	[ "${KEEP:-0}" = 1 ] || [ "$B" = "$B0" ] || rm -rf "$B"
	log "done in ${SECONDS}s (exit $rc); results in $OUT"
	exec >/dev/null 2>&1
	wait "$TEE_PID" 2>/dev/null
	exit $rc
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated (budget watchdog or signal)"; exit 143' TERM
# Watchdog: the whole run ends at BUDGET seconds whatever happens (the trap cleans up).
MAIN=$$
( while [ $SECONDS -lt "$BUDGET" ]; do kill -0 $MAIN 2>/dev/null || exit 0; sleep 1; done; kill -TERM $MAIN ) &
WD_PID=$!

# ---------------------------------------------------------------------------
# Unpack the bundle into /dev/shm/b.
# ---------------------------------------------------------------------------
log "rblk bundle bench: nproc $(nproc), kernel $(uname -r), QUICK=$QUICK runtime ${RUNTIME}s ramp ${RAMP}s, volume ${SIZE_MIB}M"
[ -f "$BUNDLE" ] || die "no bundle at $BUNDLE"
DEC=()
if command -v xz >/dev/null; then DEC=(xz -dc)
elif command -v xzcat >/dev/null; then DEC=(xzcat)
elif command -v unxz >/dev/null; then DEC=(unxz -c)
elif [ -x /usr/lib/apt/apt-helper ]; then DEC=(/usr/lib/apt/apt-helper cat-file)
elif command -v busybox >/dev/null; then DEC=(busybox xzcat)
else
	for py in python3 /opt/torch/.venv/bin/python3; do
		if command -v "$py" >/dev/null && "$py" -c 'import lzma' 2>/dev/null; then
			DEC=("$py" -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1<<20)'); break
		fi
	done
fi
[ ${#DEC[@]} -gt 0 ] || die "no xz decoder here (xz, xzcat, unxz, apt-helper, busybox, python3+lzma)"
rm -rf "$B0" && mkdir -p "$B0" || die "cannot make $B0"
timeout 120 "${DEC[@]}" "$BUNDLE" | timeout 120 tar -C "$B0" --strip-components=1 -xf - || die "unpacking $BUNDLE with ${DEC[0]} failed"
mkdir -p "$B0/locale"
log "unpacked the bundle with '${DEC[0]}' into $B0 ($(du -sm "$B0" | cut -f1) MB): $(head -n1 "$B0/MANIFEST")"
# A file system mounted noexec (some /dev/shm are) cannot run the programs: copy them elsewhere.
if ! env -i "$B0/bin/rblkd" --help >/dev/null 2>&1; then
	B=
	for alt in /tmp/rblkbench-b /var/tmp/rblkbench-b "$HERE/.rblkbench-b"; do
		rm -rf "$alt" && mkdir -p "$alt" && cp -a "$B0/." "$alt/" && env -i "$alt/bin/rblkd" --help >/dev/null 2>&1 && { B=$alt; break; }
		rm -rf "$alt"
	done
	[ -n "$B" ] || die "cannot run programs from $B0 (noexec?) nor from /tmp, /var/tmp or $HERE"
	log "WARNING: $B0 cannot run programs (noexec?): they run from $B (backing files stay in $W)"
fi
# Room for the three backing files (tmpfs): else put them on /tmp, with a warning.
free_mib() { local fs blocks used avail rest; { read -r _; read -r fs blocks used avail rest; } < <(df -Pm "$1" 2>/dev/null); echo "${avail:-0}"; }
if [ "$(free_mib "$B0")" -lt $((3 * SIZE_MIB + 256)) ]; then
	W=/tmp/rblkbench-work
	log "WARNING: only $(free_mib "$B0") MiB free in $B0: the backing files go to $W ($(free_mib /tmp) MiB free)"
fi
mkdir -p "$W/logs" "$W/fio" || die "cannot make $W"
# Every dynamic program runs through the bundled loader, with an empty environment (no LD_*,
# locale from nowhere: LOCPATH is an empty folder of the bundle).
RUNB=(env -i PATH=/usr/bin:/bin LC_ALL=C LOCPATH="$B/locale" "$B/lib/ld-linux-x86-64.so.2" --library-path "$B/lib")
FIO=("${RUNB[@]}" "$B/bin/fio")
JQ=("${RUNB[@]}" "$B/bin/jq")
NBDKIT=("${RUNB[@]}" "$B/bin/nbdkit")
V_FIO=$("${FIO[@]}" --version) || die "the bundled fio does not run"
V_NBDKIT=$("${NBDKIT[@]}" --version | head -n1) || die "the bundled nbdkit does not run"
"${JQ[@]}" -n 1 >/dev/null || die "the bundled jq does not run"
env -i "$B/bin/rblkd" --help >/dev/null 2>&1 || die "the bundled rblkd does not run"
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)
[ -n "$CLK_TCK" ] || CLK_TCK=100
log "$V_FIO, $V_NBDKIT, CLK_TCK $CLK_TCK"

# ---------------------------------------------------------------------------
# Servers.
# ---------------------------------------------------------------------------
port_used() { # port_used PORT [LISTEN-ONLY]: a TCP socket has this local port (in LISTEN state with 2nd arg)
	local hex f sl loc rem st rest
	printf -v hex ':%04X' "$1"
	for f in /proc/net/tcp /proc/net/tcp6; do
		[ -r $f ] || continue
		while read -r sl loc rem st rest; do
			[[ $loc == *"$hex" ]] || continue
			[ -z "${2:-}" ] || [ "$st" = 0A ] && return 0
		done <$f
	done
	return 1
}
free_port() { local p=$((20000 + RANDOM % 20000)); while port_used $p; do p=$((p + 1)); done; echo $p; }
wait_for() { # wait_for SECS PID CMD...: CMD succeeds while PID lives
	local n=$(($1 * 10)) pid=$2 i; shift 2
	for ((i = 0; i < n; i++)); do
		"$@" && return 0
		alive "$pid" || return 1
		sleep 0.1
	done
	return 1
}
has_text() { [ -f "$1" ] && [[ $(<"$1") == *"$2"* ]]; }
tailf() { [ -f "$1" ] && tail -n "${2:-5}" "$1"; }

SERVERS=(rblk direct chain)
declare -A PIDS_OF URI SOCK FRONT_NAME BACK_NAME
for s in "${SERVERS[@]}"; do rm -f "$W/$s.sock"; truncate -s "${SIZE_MIB}M" "$W/$s.img" || die "truncate $W/$s.img"; done

# (a) rblk: rblkd on 127.0.0.1 (loopback: no --auth-file needed), no admin socket (it would go to
# /run/rblk); rblk-attach with a host ID given (no /etc/rblk/hostid; more than one queue needs one),
# no status file (--state-dir ""), QUEUES connections to the target: NBD connection i is served by
# queue i mod QUEUES, so each fio job (its own NBD connection) has a queue of its own up to 16 jobs.
for try in 1 2 3; do
	RPORT=$(free_port)
	env -i "$B/bin/rblkd" serve --listen "127.0.0.1:$RPORT" --transport tcp --cache-size "${CACHE_MIB}M" \
		--admin-socket "" --export "vol=$W/rblk.img" >"$W/logs/rblkd.log" 2>&1 &
	RBLKD_PID=$!
	if wait_for 15 $RBLKD_PID port_used $RPORT listen; then break; fi
	log "rblkd did not listen on $RPORT (try $try): $(tailf "$W/logs/rblkd.log" 3)"
	stop_pids 2 $RBLKD_PID; RBLKD_PID=
done
[ -n "$RBLKD_PID" ] || die "rblkd did not start"
BACK_PIDS+=($RBLKD_PID)
env -i "$B/bin/rblk-attach" attach --target "127.0.0.1:$RPORT" --export vol --transport tcp \
	--host-id rblkbench --state-dir "" --queues "$QUEUES" --nbd-listen "unix:$W/rblk.sock" >"$W/logs/rblk-attach.log" 2>&1 &
ATTACH_PID=$!
FRONT_PIDS+=($ATTACH_PID)
wait_for 30 $ATTACH_PID has_text "$W/logs/rblk-attach.log" attached ||
	die "rblk-attach did not attach: $(tailf "$W/logs/rblk-attach.log")"
wait_for 5 $ATTACH_PID test -S "$W/rblk.sock" || die "rblk-attach: no socket"
has_text "$W/logs/rblk-attach.log" "fewer queues" && log "WARNING: rblk-attach took fewer queues than $QUEUES: see logs/rblk-attach.log"
PIDS_OF[rblk]="$ATTACH_PID $RBLKD_PID"; FRONT_NAME[rblk]=rblk-attach; BACK_NAME[rblk]=rblkd
URI[rblk]="nbd+unix:///vol?socket=$W/rblk.sock"
log "rblk: rblkd pid $RBLKD_PID on 127.0.0.1:$RPORT (cache ${CACHE_MIB}M, chunk 1M), rblk-attach pid $ATTACH_PID ($QUEUES queues) on $W/rblk.sock"

# (b) direct: nbdkit file plugin on a unix socket (default threads: 16 per connection).
"${NBDKIT[@]}" -f --exit-with-parent -U "$W/direct.sock" "$B/plugins/nbdkit-file-plugin.so" file="$W/direct.img" \
	>"$W/logs/nbdkit-direct.log" 2>&1 &
DIRECT_PID=$!
BACK_PIDS+=($DIRECT_PID)
wait_for 15 $DIRECT_PID test -S "$W/direct.sock" || die "nbdkit (direct) did not start: $(tailf "$W/logs/nbdkit-direct.log")"
PIDS_OF[direct]="$DIRECT_PID"; FRONT_NAME[direct]=nbdkit-file; BACK_NAME[direct]=-
URI[direct]="nbd+unix:///?socket=$W/direct.sock"
log "direct: nbdkit file pid $DIRECT_PID on $W/direct.sock"

# (c) chain: nbdkit nbd plugin (unix) -> TCP 127.0.0.1 -> nbdkit file plugin.
for try in 1 2 3; do
	KPORT=$(free_port)
	"${NBDKIT[@]}" -f --exit-with-parent -i 127.0.0.1 -p "$KPORT" "$B/plugins/nbdkit-file-plugin.so" file="$W/chain.img" \
		>"$W/logs/nbdkit-chain-file.log" 2>&1 &
	CFILE_PID=$!
	if wait_for 15 $CFILE_PID port_used $KPORT listen; then break; fi
	log "nbdkit (chain, file) did not listen on $KPORT (try $try): $(tailf "$W/logs/nbdkit-chain-file.log" 3)"
	stop_pids 2 $CFILE_PID; CFILE_PID=
done
[ -n "$CFILE_PID" ] || die "nbdkit (chain, file) did not start"
BACK_PIDS+=($CFILE_PID)
"${NBDKIT[@]}" -f --exit-with-parent -U "$W/chain.sock" "$B/plugins/nbdkit-nbd-plugin.so" hostname=127.0.0.1 port="$KPORT" \
	>"$W/logs/nbdkit-chain-nbd.log" 2>&1 &
CNBD_PID=$!
FRONT_PIDS+=($CNBD_PID)
wait_for 15 $CNBD_PID test -S "$W/chain.sock" || die "nbdkit (chain, nbd) did not start: $(tailf "$W/logs/nbdkit-chain-nbd.log")"
PIDS_OF[chain]="$CNBD_PID $CFILE_PID"; FRONT_NAME[chain]=nbdkit-nbd; BACK_NAME[chain]=nbdkit-file
URI[chain]="nbd+unix:///?socket=$W/chain.sock"
log "chain: nbdkit nbd pid $CNBD_PID on $W/chain.sock -> 127.0.0.1:$KPORT nbdkit file pid $CFILE_PID"

# ---------------------------------------------------------------------------
# Measurement helpers.
# ---------------------------------------------------------------------------
now_us() { printf -v "$1" '%s' "${EPOCHREALTIME/./}"; } # now_us VAR: wall clock in microseconds (bash >= 5)
sleep_until() { # sleep_until US
	local now d; now_us now; d=$(($1 - now))
	[ $d -gt 0 ] || return 0
	printf -v d '%d.%06d' $((d / 1000000)) $((d % 1000000)); sleep "$d"
}
us2s() { printf -v "$1" '%d.%06d' $(($2 / 1000000)) $(($2 % 1000000)); } # us2s VAR US: seconds
snap() { # snap VAR SERVER: VAR="US TICKS_FRONT TICKS_BACK", ticks = utime+stime (fields 14, 15 of
	# /proc/PID/stat: the whole process, all its threads); no fork, so that it is quick under load.
	local p l t i=0 a=0 b=0 v; local -a f
	now_us t
	for p in ${PIDS_OF[$2]}; do
		l=; { read -r l <"/proc/$p/stat"; } 2>/dev/null
		l=${l##*) }; f=($l); v=$((${f[11]:-0} + ${f[12]:-0}))
		if [ $i = 0 ]; then a=$v; else b=$v; fi
		i=$((i + 1))
	done
	printf -v "$1" '%s %s %s' "$t" "$a" "$b"
}
servers_alive() { local p; for p in ${PIDS_OF[$1]}; do alive "$p" || return 1; done; }

CSV=$OUT/results.csv
echo "job,server,order,rc,rw,bs,iodepth,numjobs,iops,bw_mib_s,lat_mean_us,clat_p99_us,cpu_us_per_io,front,front_cpu_us_per_io,back,back_cpu_us_per_io,window_s,window_ticks_front,window_ticks_back,run_wall_s,run_ticks_front,run_ticks_back,clk_tck,fio_runtime_ms,ios" >"$CSV"
declare -A R_IOPS R_LAT R_CPU R_FCPU FILL

# fio_json FILE ...: one CSV tail (from iops on) out of a fio json and the CPU samples, via jq.
fio_csv() { # fio_csv JSON WIN_DT WF WB TCK RUN_DT RF RB
	"${JQ[@]}" -r --argjson wdt "$2" --argjson wf "$3" --argjson wb "$4" --argjson tck "$5" \
		--argjson rdt "$6" --argjson rf "$7" --argjson rb "$8" '
	def r(n): (. * pow(10; n) + 0.5 | floor) / pow(10; n);
	.jobs[0] as $j
	| ($j.read.total_ios + $j.write.total_ios) as $n
	| ($j.read.iops + $j.write.iops) as $iops
	| (if $n > 0 then ($j.read.lat_ns.mean * $j.read.total_ios + $j.write.lat_ns.mean * $j.write.total_ios) / $n / 1000 else 0 end) as $lat
	| (if $j.read.total_ios > 0 then $j.read else $j.write end) as $d
	| ((($d.clat_ns.percentile // {})["99.000000"] // 0) / 1000) as $p99
	| (if $iops > 0 and $wdt > 0 then 1e6 / $tck / ($iops * $wdt) else null end) as $k
	| def c(x): if $k == null then "" else (x * $k | r(2)) end;
	[($iops | r(1)), (($j.read.bw + $j.write.bw) / 1024 | r(1)), ($lat | r(1)), ($p99 | r(1)),
	   c($wf + $wb), c($wf), c($wb),
	   ($wdt | r(3)), $wf, $wb, ($rdt | r(3)), $rf, $rb, $tck, ([$j.read.runtime, $j.write.runtime] | max), $n]
	| map(tostring) | join(",")' "$1" 2>/dev/null
}

# run_one ORDER JOB SERVER ARGS...: one fio run on SERVER, a line of results.csv.
run_one() {
	local order=$1 job=$2 s=$3; shift 3
	local rw=$1 bs=$2 qd=$3 nj=$4
	local js="$W/fio/$job.$s.json" rc s0 s1 s2 s3 fpid res line t0 t1 t2 t3 a0 a1 a2 a3 b0 b1 b2 b3 wdt=0 wf=0 wb=0 rdt rf rb
	if ! servers_alive "$s"; then
		log "SKIP $job on $s: a server process is gone"
		echo "$job,$s,$order,dead,$rw,$bs,$qd,$nj,,,,,,,,,,,,,,,,,," >>"$CSV"; return
	fi
	if [ $((SECONDS + FIO_TO)) -gt $DEADLINE ]; then
		log "SKIP $job on $s: not enough time left in the ${BUDGET}s budget"
		echo "$job,$s,$order,skipped,$rw,$bs,$qd,$nj,,,,,,,,,,,,,,,,,," >>"$CSV"; return
	fi
	snap s0 "$s"
	read -r t0 _ <<<"$s0"
	timeout -k 2 $FIO_TO "${FIO[@]}" --name="$job" --ioengine=nbd --uri="${URI[$s]}" --size="${SIZE_MIB}M" \
		--rw="$rw" --bs="$bs" --iodepth="$qd" --numjobs="$nj" --group_reporting \
		--time_based --ramp_time="$RAMP" --runtime="$RUNTIME" \
		--output-format=json --output="$js" >"$W/fio/$job.$s.txt" 2>&1 &
	fpid=$!; FPID=$fpid
	# CPU window: from WIN_LEAD_US (0.5 s; 0.25 s for runs under 3 s) after the ramp to 0.25 s before
	# the end, by the clock of this launch (fio's own clock starts later, after its start-up: a few
	# ms to 0.2 s; the window lies inside the measured period while that takes under WIN_LEAD_US).
	sleep_until $((t0 + RAMP * 1000000 + WIN_LEAD_US)); snap s1 "$s"
	sleep_until $((t0 + (RAMP + RUNTIME) * 1000000 - 250000)); snap s2 "$s"
	local fio_alive_at_s2=1; alive $fpid || fio_alive_at_s2=0
	wait $fpid; rc=$?
	snap s3 "$s"
	read -r t0 a0 b0 <<<"$s0"; read -r t1 a1 b1 <<<"$s1"; read -r t2 a2 b2 <<<"$s2"; read -r t3 a3 b3 <<<"$s3"
	if [ $fio_alive_at_s2 = 1 ]; then us2s wdt $((t2 - t1)); wf=$((a2 - a1)); wb=$((b2 - b1)); fi
	us2s rdt $((t3 - t0)); rf=$((a3 - a0)); rb=$((b3 - b0))
	res=$(fio_csv "$js" "$wdt" "$wf" "$wb" "$CLK_TCK" "$rdt" "$rf" "$rb")
	if [ -z "$res" ]; then
		log "FAIL $job on $s: fio rc $rc, no json: $(tailf "$W/fio/$job.$s.txt" 3)"
		echo "$job,$s,$order,$rc,$rw,$bs,$qd,$nj,,,,,,,,,,,,,,,,,," >>"$CSV"; return
	fi
	[ "$rc" = 0 ] || log "WARNING $job on $s: fio rc $rc: $(tailf "$W/fio/$job.$s.txt" 3)"
	IFS=, read -r iops bw lat p99 cpu cf cb _ <<<"$res"
	line="$job,$s,$order,$rc,$rw,$bs,$qd,$nj,$iops,$bw,$lat,$p99,$cpu,${FRONT_NAME[$s]},$cf,${BACK_NAME[$s]},$cb,${res#*,*,*,*,*,*,*,}"
	echo "$line" >>"$CSV"
	R_IOPS[$job,$s]=${iops%.*}; R_LAT[$job,$s]=$lat; R_CPU[$job,$s]=${cpu:--}; R_FCPU[$job,$s]=${cf:--}
	log "$(printf '%2d %-22s %-6s %9s IOPS %9s us mean %8s CPU us/IO (%s %s + %s %s)%s' "$order" "$job" "$s" "${iops%.*}" "$lat" "$cpu" \
		"${FRONT_NAME[$s]}" "$cf" "${BACK_NAME[$s]}" "$cb" "$([ $fio_alive_at_s2 = 1 ] || echo ' [no CPU window]')")"
}

# ---------------------------------------------------------------------------
# Fill: one sequential 1M write (QD8) of the whole volume through each server.
# ---------------------------------------------------------------------------
echo "server,rc,seconds,bw_mib_s" >"$OUT/fill.csv"
for s in "${SERVERS[@]}"; do
	t0=$SECONDS
	timeout -k 2 45 "${FIO[@]}" --name=fill --ioengine=nbd --uri="${URI[$s]}" --size="${SIZE_MIB}M" --rw=write --bs=1M \
		--iodepth=8 --output-format=json --output="$W/fio/fill.$s.json" >"$W/fio/fill.$s.txt" 2>&1 &
	FPID=$!; wait $FPID; rc=$?
	bw=$("${JQ[@]}" -r '.jobs[0].write.bw / 1024 | floor' "$W/fio/fill.$s.json" 2>/dev/null)
	echo "$s,$rc,$((SECONDS - t0)),$bw" >>"$OUT/fill.csv"
	FILL[$s]="$bw MiB/s"
	[ "$rc" = 0 ] || log "WARNING: fill of $s: fio rc $rc: $(tailf "$W/fio/fill.$s.txt" 3)"
	log "fill $s: ${bw:-?} MiB/s (rc $rc, $((SECONDS - t0))s)"
done

# ---------------------------------------------------------------------------
# Jobs: NAME RW BS IODEPTH NUMJOBS
# ---------------------------------------------------------------------------
JOBS=()
for n in "${NJ[@]}"; do JOBS+=("randread-4k-qd32-j$n randread 4k 32 $n"); done
for n in "${NJ[@]}"; do JOBS+=("randwrite-4k-qd32-j$n randwrite 4k 32 $n"); done
JOBS+=("randread-4k-qd1-j1 randread 4k 1 1")
JOBS+=("read-1m-qd8-j$NJ_BIG read 1M 8 $NJ_BIG")
JOBS+=("write-1m-qd8-j$NJ_BIG write 1M 8 $NJ_BIG")
NRUNS=$((${#JOBS[@]} * ${#SERVERS[@]}))
log "jobs: $(for j in "${JOBS[@]}"; do printf '%s ' "${j%% *}"; done)"
log "${#JOBS[@]} jobs x ${#SERVERS[@]} servers = $NRUNS fio runs of ${RAMP}+${RUNTIME}s: about $((NRUNS * (RAMP + RUNTIME) * 11 / 10))s; budget ends at ${BUDGET}s"
order=0
for ((k = 0; k < ${#JOBS[@]}; k++)); do
	read -r name rw bs qd nj <<<"${JOBS[$k]}"
	for ((i = 0; i < ${#SERVERS[@]}; i++)); do
		s=${SERVERS[$(((i + k) % ${#SERVERS[@]}))]}
		order=$((order + 1))
		run_one $order "$name" "$s" "$rw" "$bs" "$qd" "$nj"
	done
done

# ---------------------------------------------------------------------------
# The data path by queue count, in one process (bench.test, BenchmarkQueues).
# ---------------------------------------------------------------------------
QB_IOS=${QB_IOS:-$([ "$QUICK" = 1 ] && echo 20000 || echo 400000)}
: >"$OUT/queues.txt"
if [ "$QB_IOS" != 0 ] && [ -x "$B/bin/bench.test" ]; then
	if [ $((SECONDS + 90)) -lt "$DEADLINE" ]; then
		log "BenchmarkQueues: $QB_IOS IOs per run, 1 to 16 queues"
		mkdir -p "$W/qb"
		(cd "$W/qb" && timeout -k 2 $((DEADLINE - SECONDS)) env -i TMPDIR="$W/qb" "$B/bin/bench.test" -test.run '^$' \
			-test.bench '^BenchmarkQueues$' -test.benchtime "${QB_IOS}x" -test.count 1 >"$OUT/queues.txt" 2>&1) ||
			log "WARNING: BenchmarkQueues failed: $(tailf "$OUT/queues.txt" 3)"
		grep '^Benchmark' "$OUT/queues.txt" | while read -r l; do log "$l"; done
	else
		log "BenchmarkQueues skipped: under 90 s of the budget left"
	fi
fi

# ---------------------------------------------------------------------------
# Table.
# ---------------------------------------------------------------------------
ratio() { # ratio A B: A/B with 2 decimals, from integers
	local a=${1:-} b=${2:-}
	[[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ && $b -gt 0 ]] || { echo -; return; }
	local x=$(((a * 1000 / b + 5) / 10))
	printf '%d.%02d' $((x / 100)) $((x % 100))
}
CPU_MODEL=$(while IFS=: read -r k v; do [[ $k == "model name"* ]] && { echo "${v# }"; break; }; done </proc/cpuinfo)
{
	echo "rblk vs nbdkit, one machine: $(date -u +%FT%TZ), nproc $(nproc), kernel $(uname -r), $CPU_MODEL"
	echo "bundle: $(head -n1 "$B/MANIFEST"); $V_FIO; $V_NBDKIT; programs run from $B"
	echo "fio --ioengine=nbd over unix sockets, ramp ${RAMP}s + runtime ${RUNTIME}s, group_reporting, 1 rep; a ${SIZE_MIB} MiB file each in $W"
	echo "rblk = rblk-attach (--queues $QUEUES, unix socket) -> tcp 127.0.0.1 -> rblkd (--transport tcp, cache ${CACHE_MIB}M, chunk 1M)"
	echo "direct = nbdkit file (unix, 16 threads/conn); chain = nbdkit nbd (unix) -> tcp 127.0.0.1 -> nbdkit file"
	echo "fill (seq 1M QD8 write of the volume): rblk ${FILL[rblk]:-?}, direct ${FILL[direct]:-?}, chain ${FILL[chain]:-?}"
	echo "CPU us/IO: utime+stime of rblkd+rblk-attach (rblk), nbdkit (direct), both nbdkits (chain), over a window inside the run / its IOs"
	echo
	printf '%-22s | %9s %9s %9s | %7s %7s | %8s %8s %8s | %7s %7s %7s\n' "job" "IOPS rblk" "direct" "chain" \
		"r/dir" "r/chain" "lat rblk" "direct" "chain" "CPU rblk" "direct" "chain"
	printf '%-22s | %9s %9s %9s | %7s %7s | %8s %8s %8s | %7s %7s %7s\n' "" "" "" "" "IOPS" "IOPS" "mean us" "" "" "us/IO" "" ""
	printf -- '-%.0s' {1..132}; echo
	for j in "${JOBS[@]}"; do
		read -r name _ <<<"$j"
		printf '%-22s | %9s %9s %9s | %7s %7s | %8s %8s %8s | %7s %7s %7s\n' "$name" \
			"${R_IOPS[$name,rblk]:--}" "${R_IOPS[$name,direct]:--}" "${R_IOPS[$name,chain]:--}" \
			"$(ratio "${R_IOPS[$name,rblk]:-}" "${R_IOPS[$name,direct]:-}")" "$(ratio "${R_IOPS[$name,rblk]:-}" "${R_IOPS[$name,chain]:-}")" \
			"${R_LAT[$name,rblk]:--}" "${R_LAT[$name,direct]:--}" "${R_LAT[$name,chain]:--}" \
			"${R_CPU[$name,rblk]:--}" "${R_CPU[$name,direct]:--}" "${R_CPU[$name,chain]:--}"
	done
	if grep -q '^Benchmark' "$OUT/queues.txt" 2>/dev/null; then
		echo
		echo "the data path by queue count (bench.test -test.bench BenchmarkQueues, ${QB_IOS} IOs a run; initiator and target in one process, software transport on loopback; 8 in flight per queue):"
		printf '%-22s | %9s | %12s\n' "job" "IOPS" "mutex ns/IO"
		grep '^Benchmark' "$OUT/queues.txt" | awk '{ n = $1; sub(/^BenchmarkQueues\//, "", n); sub(/-[0-9]+$/, "", n)
			for (i = 2; i < NF; i++) { if ($(i + 1) == "iops") io = $i; if ($(i + 1) == "mutex-ns/op") mx = $i }
			printf "%-22s | %9.0f | %12.1f\n", n, io, mx }'
	fi
	echo
	echo "targets (issue 19; this run's figures):"
	target() { # target WHAT VALUE OP LIMIT
		awk -v w="$1" -v v="$2" -v op="$3" -v l="$4" 'BEGIN {
			if (v == "" || v == "-") { printf "  %-64s not measured\n", w; exit }
			ok = (op == ">=") ? (v + 0 >= l + 0) : (v + 0 <= l + 0)
			printf "  %-64s %8s, want %s %s: %s\n", w, v, op, l, ok ? "met" : "MISSED" }'
	}
	nmax=${NJ[${#NJ[@]} - 1]} nhalf=
	for n in "${NJ[@]}"; do [ $((n * 2)) = "$nmax" ] && nhalf=$n; done
	for rw in randread randwrite; do
		[ -z "$nhalf" ] || target "rblk $rw 4k QD32, $nmax jobs / $nhalf jobs (IOPS)" \
			"$(ratio "${R_IOPS[$rw-4k-qd32-j$nmax,rblk]:-}" "${R_IOPS[$rw-4k-qd32-j$nhalf,rblk]:-}")" ">=" 1.6
		for n in "${NJ[@]}"; do
			target "rblk / chain, $rw 4k QD32 x $n (IOPS)" "$(ratio "${R_IOPS[$rw-4k-qd32-j$n,rblk]:-}" "${R_IOPS[$rw-4k-qd32-j$n,chain]:-}")" ">=" 2
		done
		for n in "${NJ[@]}"; do
			target "rblk-attach CPU us/IO, $rw 4k QD32 x $n (<= direct's ${R_CPU[$rw-4k-qd32-j$n,direct]:--})" \
				"${R_FCPU[$rw-4k-qd32-j$n,rblk]:--}" "<=" "${R_CPU[$rw-4k-qd32-j$n,direct]:-}"
		done
	done
	echo
	echo "nproc $(nproc); kernel $(uname -r); ${SECONDS}s so far (of the ${BUDGET}s budget)"
} >"$OUT/table.txt"
{
	echo "date=$(date -u +%FT%TZ) nproc=$(nproc) kernel=$(uname -r) cpu=$CPU_MODEL"
	echo "quick=$QUICK runtime=$RUNTIME ramp=$RAMP size_mib=$SIZE_MIB cache_mib=$CACHE_MIB queues=$QUEUES clk_tck=$CLK_TCK budget=$BUDGET"
	echo "rblkd=$RBLKD_PID rblk-attach=$ATTACH_PID nbdkit-direct=$DIRECT_PID nbdkit-chain-nbd=$CNBD_PID nbdkit-chain-file=$CFILE_PID"
	echo "decoder=${DEC[*]}"
} >"$W/logs/meta.txt"
echo
cat "$OUT/table.txt"
