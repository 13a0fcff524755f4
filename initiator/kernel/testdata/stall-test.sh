#!/bin/bash
# Guest stress test of the first reads on a freshly attached /dev/nbdN, for
# vm/run.sh: the cwd holds rblkd and rblk-attach, built on the host:
#
#   d=$(mktemp -d) && go build -o "$d/" ./cmd/rblkd ./cmd/rblk-attach &&
#     printf 'export STALL_KINDS=decoy STALL_CYCLES=4\n' >"$d/env.sh" &&
#     vm/run.sh initiator/kernel/testdata/stall-test.sh "$d"
#
# It was written for the 3-minute stall of the first attach after boot in
# vm/rblk-e2e.sh: the kernel never read one of the device's sockets, because
# its workqueue rescuer ran the receive works of all of them one after the
# other (see receiversWait in ../device.go). Kind "decoy" reproduces that.
#
# rblkd serves a 512 MiB sparse file over tcp on 192.0.2.1 (dummy0);
# rblk-attach attaches it as /dev/nbd0 with a short --request-timeout,
# STALL_CYCLES times (default 16), each cycle of a kind of STALL_KINDS in
# turn (default "e2e wait hog open"; the kinds are described at the loop).
# Then blockdev and O_DIRECT reads at offset 0, at the end and in the middle,
# pinned to each CPU in turn (one hardware queue, so one socket, per CPU),
# and the same on the decoy device if there is one. After each attach it
# prints the kernel threads running a receive work (recv_work) of each
# device.
#
# Any command that takes more than STALL_AFTER seconds (default 5) is a stall:
# the script saves the kernel stacks of the blocked command, of every
# rblk-attach thread and of the kernel threads in nbd code, the unix
# sockets' queues (ss), the nbd and blk-mq debugfs state, a sysrq-t dump
# (with the busy workqueues) and dmesg into stall-N.txt and sysrq-t-N.txt, a
# few seconds of strace of rblk-attach, then sends it SIGQUIT (its
# goroutines land in attachN.log) and goes on with the next cycle (on the
# next device if this one stays attached). Exit 1 if there was a stall or an
# error. Settings: STALL_CYCLES, STALL_KINDS, STALL_AFTER,
# STALL_REQUEST_TIMEOUT (default 20s), STALL_CONNECTIONS (default 0: one per
# CPU), from the environment or from env.sh in the artifact dir.
set -uo pipefail

BIN=$PWD
# Settings (STALL_*) may come from env.sh in the artifact dir.
[ -f "$BIN/env.sh" ] && . "$BIN/env.sh"
IP=${RBLK_VM_ADDR:-192.0.2.1}
ADDR=$IP:7480
SIZE=$((512 << 20))
CYCLES=${STALL_CYCLES:-16}
STALL_AFTER=${STALL_AFTER:-5}
RTIMEOUT=${STALL_REQUEST_TIMEOUT:-20s}
CONNS=${STALL_CONNECTIONS:-0}
LOGS=/tmp/stall-logs
mkdir -p "$LOGS"
mountpoint -q /sys/kernel/debug || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null

now() { cut -d' ' -f1 /proc/uptime; }
step() { echo "== $(now)s $*"; }
pids=()
stalls=0
errors=0
save_logs() { cp "$LOGS"/*.log "$BIN/" 2>/dev/null; }
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
	save_logs
}
trap cleanup EXIT

APID=
DEV=/dev/nbd0
DECOY=/dev/nbd15
cycle=0

# diag WHAT PID: everything about a stalled command, then SIGQUIT to rblk-attach.
diag() {
	local what=$1 pid=$2 name=${DEV#/dev/} out
	stalls=$((stalls + 1))
	out=$BIN/stall-$stalls.txt
	echo "  STALL: $what blocked for ${STALL_AFTER}s (cycle $cycle, $DEV): see $(basename "$out"), and $(basename "$(readlink /proc/"$APID"/fd/2)") for the goroutines"
	{
		echo "### stall $stalls: '$what' (pid $pid), cycle $cycle, device $DEV, at $(now)s"
		for p in $pid $(pgrep -P "$pid"); do
			echo "--- kernel stack of $p ($(cat /proc/"$p"/comm 2>/dev/null)), state $(awk '{print $3}' /proc/"$p"/stat 2>/dev/null)"
			cat /proc/"$p"/stack 2>&1
		done
		echo "### rblk-attach $APID threads"
		for t in /proc/"$APID"/task/*; do
			echo "--- ${t##*/} $(cat "$t"/comm) state $(awk '{print $3}' "$t"/stat) wchan $(cat "$t"/wchan)"
			cat "$t"/stack 2>&1
		done
		echo "### fds of rblk-attach"
		ls -l /proc/"$APID"/fd 2>&1
		echo "### unix sockets (ss -xapn)"
		ss -xapn 2>&1
		echo "### /proc/net/unix"
		cat /proc/net/unix
		echo "### debugfs nbd"
		for f in /sys/kernel/debug/nbd/"$name"/*; do
			echo "--- $f"
			cat "$f" 2>&1
		done
		echo "### debugfs block"
		for d in /sys/kernel/debug/block/"$name"/hctx*; do
			for f in state busy dispatch flags tags ctx_map dispatched queued run active; do
				[ -e "$d/$f" ] && { echo "--- $d/$f"; cat "$d/$f" 2>&1; }
			done
			for c in "$d"/cpu*; do
				for f in "$c"/*_rq_list; do
					[ -e "$f" ] && { echo "--- $f"; cat "$f" 2>&1; }
				done
			done
		done
		echo "### /sys/block/$name"
		for f in pid backend size; do echo "$f: $(cat /sys/block/"$name"/$f 2>&1)"; done
		grep -r . /sys/block/"$name"/mq/ 2>&1
		echo "### tasks in D state, and tasks with nbd or blk in their kernel stack"
		for p in /proc/[0-9]*/task/[0-9]*; do
			st=$(awk '{print $3}' "$p"/stat 2>/dev/null)
			stk=$(cat "$p"/stack 2>/dev/null)
			[ "$st" = D ] || echo "$stk" | grep -qE 'nbd|blk_|recv_work|sock_' || continue
			echo "--- ${p##*/} $(cat "$p"/comm) state $st"
			echo "$stk"
		done
		echo "### sysrq t (tasks and workqueues)"
		dmesg >"$BIN/dmesg-before-sysrq-$stalls.txt"
		echo t >/proc/sysrq-trigger
		sleep 1
		dmesg >"$BIN/sysrq-t-$stalls.txt"
		grep -A 120 -E 'Showing busy workqueues' "$BIN/sysrq-t-$stalls.txt" | tail -n 121
		echo "### ss again after 2 s"
		sleep 2
		ss -xapn 2>&1 | grep -E 'rblk-attach|Recv-Q' 
		echo "### strace of rblk-attach for 3 s"
		timeout 3 strace -f -tt -p "$APID" 2>&1 | tail -n 200
		echo "### dmesg"
		dmesg | tail -n 40
	} >"$out" 2>&1
	kill -QUIT "$APID" 2>/dev/null
}

# timed WHAT CMD...: runs CMD; a stall if it takes over STALL_AFTER seconds.
# Prints the time taken. Returns CMD's exit code.
timed() {
	local what=$1 t0 pid stalled=0 rc el
	shift
	t0=$EPOCHREALTIME
	"$@" >"$LOGS/op.out" 2>&1 &
	pid=$!
	while kill -0 "$pid" 2>/dev/null; do
		el=$(echo "$EPOCHREALTIME - $t0" | bc)
		if [ "$stalled" = 0 ] && [ "$(echo "$el > $STALL_AFTER" | bc)" = 1 ]; then
			stalled=1
			diag "$what" "$pid"
		fi
		if [ "$(echo "$el > 120" | bc)" = 1 ]; then
			echo "  $what: still blocked after 120 s"
			return 99
		fi
		sleep 0.05
	done
	wait "$pid"
	rc=$?
	el=$(echo "$EPOCHREALTIME - $t0" | bc)
	if [ -z "${QUIET:-}" ] || [ "$rc" != 0 ] || [ "$(echo "$el > 1" | bc)" = 1 ]; then
		printf '  %-34s rc %d  %6.2fs %s\n' "$what" "$rc" "$el" "$(head -c 60 "$LOGS/op.out" | tr '\n' ' ')"
	fi
	LAST_OUT=$(cat "$LOGS/op.out")
	[ "$stalled" = 0 ] || return 98
	return "$rc"
}

running() {
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
	[ -n "$st" ] && [ "$st" != Z ]
}

wait_exit() { # PID WHAT: the child must exit within 60 s
	local i
	for i in $(seq 600); do
		running "$1" || break
		sleep 0.1
	done
	if running "$1"; then
		echo "  $2 still running after 60 s: SIGQUIT"
		kill -QUIT "$1"
		errors=$((errors + 1))
	fi
	wait "$1"
	echo "  $2 exited $?"
}

# next_free: DEV is a device with no server.
next_free() {
	local i
	for i in $(seq 0 15); do
		if [ ! -e /sys/block/nbd$i/pid ]; then
			DEV=/dev/nbd$i
			return 0
		fi
	done
	echo "no free nbd device"
	exit 1
}

# start_rblkd N: a fresh rblkd on a fresh volume file (the first IO of a
# fresh attach then fetches its grants from an empty cache, as in
# vm/rblk-e2e.sh), with something to read back at its start and its end.
RBLKD=
start_rblkd() {
	if [ -n "$RBLKD" ]; then
		kill -TERM "$RBLKD"
		wait "$RBLKD"
	fi
	rm -f /tmp/vol.img
	truncate -s $SIZE /tmp/vol.img
	printf 'rblk-stall-test-start' | dd of=/tmp/vol.img conv=notrunc status=none
	printf 'rblk-stall-test-end' | dd of=/tmp/vol.img bs=1 seek=$((SIZE - 4096)) conv=notrunc status=none
	"$BIN/rblkd" serve --transport tcp --listen "$ADDR" --export "vol=/tmp/vol.img,size=512M" \
		--metrics-listen 127.0.0.1:9480 >>"$LOGS/rblkd.log" 2>&1 &
	RBLKD=$!
	pids+=("$RBLKD")
	for _ in $(seq 300); do
		"$BIN/rblk-attach" list --target "$ADDR" --transport tcp >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "rblkd does not answer"
	exit 1
}

step "rblkd serve --transport tcp --listen $ADDR"
start_rblkd
"$BIN/rblk-attach" list --target "$ADDR" --transport tcp

# release: ends the load of starve and decoy.
release() {
	for h in "${hogs[@]}"; do kill "$h" 2>/dev/null; wait "$h" 2>/dev/null; done
	hogs=()
	if [ -n "$starved" ]; then
		chrt --other -p 0 2
		starved=
	fi
}

# read_all: blockdev and O_DIRECT reads of DEV at its start, its end and
# in the middle, from each CPU in turn (ROUNDS times), then a check of the
# data at both ends. Returns 1 at the first command that fails or stalls.
read_all() {
	local round cpu pin
	for round in $(seq 1 "${ROUNDS:-2}"); do
		for cpu in $(seq 0 $((ncpu - 1))); do
			pin="taskset -c $cpu"
			timed "cpu$cpu getsize64" $pin blockdev --getsize64 "$DEV" || return 1
			timed "cpu$cpu read 4k @0" $pin dd if="$DEV" of=/dev/null bs=4096 count=1 iflag=direct status=none || return 1
			timed "cpu$cpu read 4k @end" $pin dd if="$DEV" of=/dev/null bs=4096 count=1 skip=$((SIZE / 4096 - 1)) iflag=direct status=none || return 1
			timed "cpu$cpu read 1M @$((round * 37 + cpu))M" $pin dd if="$DEV" of=/dev/null bs=1M count=1 skip=$((round * 37 + cpu)) iflag=direct status=none || return 1
		done
	done
	timed "check data @0" sh -c "dd if=$DEV bs=4096 count=1 iflag=direct status=none | head -c 21" || return 1
	[ "$LAST_OUT" = rblk-stall-test-start ] || { echo "  bad data at 0: '$LAST_OUT'"; errors=$((errors + 1)); }
	timed "check data @end" sh -c "dd if=$DEV bs=4096 count=1 skip=$((SIZE / 4096 - 1)) iflag=direct status=none | head -c 19" || return 1
	[ "$LAST_OUT" = rblk-stall-test-end ] || { echo "  bad data at the end: '$LAST_OUT'"; errors=$((errors + 1)); }
}

ncpu=$(nproc)
read -ra KINDS <<<"${STALL_KINDS:-e2e wait hog open}"
for cycle in $(seq 1 "$CYCLES"); do
	next_free
	name=${DEV#/dev/}
	# The kinds of cycle (STALL_KINDS, in turn):
	#  e2e:    as vm/rblk-e2e.sh: fresh rblkd and volume, blockdev polled
	#          from the start, --metrics-listen, no --debug;
	#  wait:   open once "nbd device attached" is logged, --debug;
	#  hog:    polled, with a busy loop on every CPU while attaching and
	#          reading;
	#  open:   polled, with blockdev opening the device in a loop on every
	#          CPU while attaching;
	#  starve: kthreadd at SCHED_IDLE and a busy loop on every CPU until the
	#          device is attached, so that the kernel is slow to start
	#          workqueue workers when NBD_CMD_CONNECT queues one receive
	#          work per socket;
	#  decoy:  starve, and first a read-only attach of another device
	#          (DECOY) with 4 sockets, whose receive works take the idle
	#          workers of the kernel's pool.
	kind=${KINDS[$(((cycle - 1) % ${#KINDS[@]}))]}
	mode=poll-open
	extra=(--debug)
	hogs=()
	starved=
	case $kind in
	e2e)
		start_rblkd
		extra=(--metrics-listen 127.0.0.1:9481)
		;;
	wait) mode=wait-log ;;
	hog)
		for cpu in $(seq 0 $((ncpu - 1))); do
			taskset -c "$cpu" sh -c 'while :; do :; done' &
			hogs+=($!)
		done
		;;
	open)
		for cpu in $(seq 0 $((ncpu - 1))); do
			taskset -c "$cpu" sh -c "for i in \$(seq 100); do blockdev --getsize64 $DEV >/dev/null 2>&1; done" &
			hogs+=($!)
		done
		;;
	starve | decoy)
		mode=wait-log
		chrt --idle -p 0 2 && starved=1
		for cpu in $(seq 0 $((ncpu - 1))); do
			taskset -c "$cpu" sh -c 'while :; do :; done' &
			hogs+=($!)
		done
		;;
	esac
	DPID=
	if [ "$kind" = decoy ]; then
		"$BIN/rblk-attach" attach --target "$ADDR" --export vol --transport tcp --device "$DECOY" \
			--connections 4 --read-only >"$LOGS/decoy$cycle.log" 2>&1 &
		DPID=$!
		pids+=("$DPID")
		for _ in $(seq 600); do
			# Its first NBD_CMD_CONNECT: its receive works took the idle
			# workers, or wait for new ones.
			grep -q "nbd device attached" "$LOGS/decoy$cycle.log" && break
			running "$DPID" || break
			sleep 0.1
		done
		echo "  decoy $DECOY: attached $(grep -c "nbd device attached" "$LOGS/decoy$cycle.log") time(s)"
	fi
	step "cycle $cycle: rblk-attach attach --device $DEV --request-timeout $RTIMEOUT ${extra[*]} ($kind: $mode)"
	log=$LOGS/attach$cycle.log
	"$BIN/rblk-attach" attach --target "$ADDR" --export vol --transport tcp --device "$DEV" \
		--connections "$CONNS" --request-timeout "$RTIMEOUT" "${extra[@]}" >"$log" 2>&1 &
	APID=$!
	pids+=("$APID")
	t0=$EPOCHREALTIME
	ok=0
	for _ in $(seq 600); do
		running "$APID" || break
		# The load of starve and decoy ends once NBD_CMD_CONNECT is done.
		if [ ${#hogs[@]} -gt 0 ] && { [ "$kind" = starve ] || [ "$kind" = decoy ]; } &&
			grep -q "nbd device attached" "$log"; then
			release
		fi
		if [ "$mode" = poll-open ]; then
			QUIET=1 timed "blockdev --getsize64 (polling)" blockdev --getsize64 "$DEV"
			[ $? -ge 98 ] && break
			[ "$LAST_OUT" = "$SIZE" ] && { ok=1; break; }
		elif grep -qE $'\tattached\t\\{"device"' "$log"; then
			# rblk-attach's "attached": kernel.Attach returned.
			ok=1
			break
		fi
		sleep 0.1
	done
	if [ "$ok" != 1 ]; then
		echo "  not attached ($mode); rblk-attach running: $(running "$APID" && echo yes || echo no)"
		if grep -qiE 'in use|busy' "$log"; then
			echo "  (the kernel refused the connect: the device was open; expected with blockdev in a loop)"
		else
			errors=$((errors + 1))
		fi
		for h in "${hogs[@]}"; do kill "$h" 2>/dev/null; wait "$h" 2>/dev/null; done
		running "$APID" && kill -TERM "$APID"
		wait_exit "$APID" rblk-attach
		save_logs
		continue
	fi
	if [ "$kind" = starve ] || [ "$kind" = decoy ]; then
		release
	fi
	echo "  attached after $(echo "$EPOCHREALTIME - $t0" | bc | cut -c1-5)s; hardware queues: $(ls /sys/block/"$name"/mq | wc -l)"
	sleep 1
	echo "  threads in recv_work: $(grep -l recv_work /proc/[0-9]*/task/[0-9]*/stack 2>/dev/null | while read -r f; do cat "${f%/stack}/comm"; done | sort | uniq -c | tr -s ' \n' ' ')"
	for d in /sys/block/nbd*; do
		[ -e "$d/pid" ] || continue
		echo "    ${d##*/}: $(ls "$d/mq" | wc -l) sockets, $(cat /proc/[0-9]*/comm 2>/dev/null | grep -c "+${d##*/}-recv\$") receive works running"
	done
	read_all || fine=0
	if [ -n "$DPID" ] && running "$DPID"; then
		echo "  the same reads on the decoy $DECOY"
		read -r tdev tpid <<<"$DEV $APID"
		DEV=$DECOY APID=$DPID
		ROUNDS=1 read_all
		DEV=$tdev APID=$tpid
	fi
	for h in "${hogs[@]}"; do kill "$h" 2>/dev/null; wait "$h" 2>/dev/null; done
	if running "$APID"; then
		timed "rblk-attach detach $DEV" "$BIN/rblk-attach" detach --force "$DEV" || errors=$((errors + 1))
	else
		echo "  rblk-attach is gone (SIGQUIT): detaching $DEV by hand"
		"$BIN/rblk-attach" detach --force --wait 0 "$DEV" 2>&1 | sed 's/^/  /'
	fi
	wait_exit "$APID" "rblk-attach (cycle $cycle)"
	if [ -n "$DPID" ]; then
		if running "$DPID"; then
			"$BIN/rblk-attach" detach --force "$DECOY"
		else
			echo "  the decoy rblk-attach is gone (SIGQUIT): detaching $DECOY by hand"
			"$BIN/rblk-attach" detach --force --wait 0 "$DECOY" 2>&1 | sed 's/^/  /'
		fi
		wait_exit "$DPID" "decoy rblk-attach (cycle $cycle)"
	fi
	grep -E "nbd: (connected|disconnected)|nbd device|detached|does not read" "$log" | sed 's/^/    /' | cut -c1-200
	save_logs
done

step "kernel log (nbd)"
dmesg | grep -iE 'nbd|blk' | tail -n 60
kill -TERM "$RBLKD"
wait "$RBLKD"
echo "rblkd exited $?"
echo "stalls: $stalls, errors: $errors"
[ "$stalls" = 0 ] && [ "$errors" = 0 ] && echo PASS || { echo FAIL; exit 1; }
