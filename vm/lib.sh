# shellcheck shell=bash
# vm/lib.sh: shared helpers for guest scripts (bash). vm/run.sh puts it in
# the guest as $RBLK_VM_LIB/lib.sh:
#
#   LOGS=/tmp/my-logs; . "$RBLK_VM_LIB/lib.sh"
#
#   step TEXT...            a "== UPTIMEs TEXT" header
#   fail TEXT...            "FAIL: TEXT", the tails of $LOGS/*.log and of dmesg,
#                           exit 1
#   wait_for SECS CMD...    poll CMD (quietly) every 0.2 s until it succeeds;
#                           1 if it did not within SECS
#   running PID             PID exists and is no zombie
#   wait_exit PID WHAT [SECS [RC]]
#                           the child PID must exit with RC (default 0) within
#                           SECS (default 60; then it is killed: 137); fail if not
#   metric URL NAME         the sum of the series of NAME (any labels) at the
#                           Prometheus endpoint URL (HOST:PORT), 0 if absent;
#                           fails (returns 1) if the endpoint does not answer
#   hog_start [N]           a CPU hog: N (default: one per CPU) busy loops at
#                           normal priority, as other jobs of a loaded machine;
#                           their pids in HOG_PIDS
#   hog_stop                kills the hog's loops and waits for them
#
# Safe under set -e. LOGS (a dir) is read by fail only; FAIL_TAIL lines of each log (default 30).

step() { echo "== $(cut -d' ' -f1 /proc/uptime)s $*"; }

fail() {
	local f
	echo "FAIL: $*"
	for f in "${LOGS:-/nonexistent}"/*.log; do
		[ -f "$f" ] || continue
		echo "----- $f (tail)"
		tail -n "${FAIL_TAIL:-30}" "$f"
	done
	echo "----- dmesg (tail)"
	dmesg | tail -n "${FAIL_TAIL:-30}"
	exit 1
}

wait_for() {
	local deadline=$(($(date +%s) + $1))
	shift
	until "$@" >/dev/null 2>&1; do
		[ "$(date +%s)" -lt "$deadline" ] || return 1
		sleep 0.2
	done
}

running() {
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
	[ -n "$st" ] && [ "$st" != Z ]
}

wait_exit() {
	local pid=$1 what=$2 secs=${3:-60} want=${4:-0} dog rc
	# (No output from the watchdog: its sleep would hold the log pipe open.)
	(sleep "$secs" && kill -KILL "$pid") >/dev/null 2>&1 &
	dog=$!
	rc=0
	wait "$pid" || rc=$?
	kill "$dog" 2>/dev/null || true
	wait "$dog" 2>/dev/null || true
	[ "$rc" = "$want" ] || fail "$what exited $rc, want $want (137: killed after ${secs}s)"
	echo "$what exited $rc"
}

# metric ADDR NAME [SCALE]: the sum of NAME's series at ADDR's /metrics,
# times SCALE (default 1), as a whole number.
metric() {
	local out
	out=$(curl -fsS --max-time 10 "http://$1/metrics") || return 1
	awk -v m="$2" -v k="${3:-1}" '$1 == m || index($1, m "{") == 1 { s += $NF } END { printf "%.0f\n", s * k }' <<<"$out"
}

HOG_PIDS=()

hog_start() {
	local n=${1:-$(nproc)} i
	for ((i = 0; i < n; i++)); do
		# (no output: the loop must not hold the log pipe open)
		bash -c 'while :; do :; done' >/dev/null 2>&1 </dev/null &
		HOG_PIDS+=($!)
	done
	echo "CPU hog: $n busy loops at normal priority (pids ${HOG_PIDS[*]})"
}

hog_stop() {
	[ ${#HOG_PIDS[@]} -gt 0 ] || return 0
	kill -KILL "${HOG_PIDS[@]}" 2>/dev/null || true
	wait "${HOG_PIDS[@]}" 2>/dev/null || true
	echo "CPU hog stopped"
	HOG_PIDS=()
}
