#!/bin/bash
# Guest test of rblk-attach attach --device (the kernel's /dev/nbdN), for
# vm/run.sh: the cwd holds rblkd and rblk-attach, built on the host:
#
#   d=$(mktemp -d) && go build -o "$d/" ./cmd/rblkd ./cmd/rblk-attach &&
#     vm/run.sh initiator/kernel/testdata/guest-test.sh "$d"
#
# rblkd serves a 512 MiB sparse file over tcp on 127.0.0.1; rblk-attach
# attaches it as /dev/nbdN (auto); the test checks the queue flags the kernel
# took (TRIM, FLUSH), makes an ext4 file system, writes files with their
# checksums, syncs, fstrims, unmounts, detaches with `rblk-attach detach`,
# checks that the attach process exits 0, that e2fsck finds the backing file
# clean, then attaches again and checks the checksums; the second attach is
# ended with SIGTERM.
set -uo pipefail

BIN=$PWD
VOL=/tmp/vol.img
ADDR=127.0.0.1:7480
MNT=/tmp/mnt
SIZE=$((512 << 20))
LOGS=/tmp/guest-test-logs
mkdir -p "$LOGS" "$MNT"

step() { echo "== $*"; }
pids=()
cleanup() {
	mountpoint -q "$MNT" && umount "$MNT"
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
	cp "$LOGS"/*.log "$BIN/" 2>/dev/null
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*"
	for f in "$LOGS"/*.log; do
		echo "----- $f (tail)"
		tail -n 25 "$f"
	done
	echo "----- dmesg (tail)"
	dmesg | tail -n 25
	exit 1
}

# wait_for SECONDS CMD...: poll until CMD succeeds.
wait_for() {
	local n=$(($1 * 10))
	shift
	for _ in $(seq "$n"); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	return 1
}

# attach LOG ARGS...: starts rblk-attach attach ARGS in the background; sets
# APID and DEV once the device has the volume's size.
attach() {
	local log=$1
	shift
	"$BIN/rblk-attach" attach --target "$ADDR" --export vol --transport tcp "$@" >"$LOGS/$log" 2>&1 &
	APID=$!
	pids+=("$APID")
	local i
	DEV=
	for i in $(seq 600); do
		running "$APID" || { wait "$APID"; fail "rblk-attach exited $? before attaching"; }
		DEV=$(sed -n 's/.*"device": *"\(\/dev\/nbd[0-9]*\)".*/\1/p' "$LOGS/$log" | head -n 1)
		if [ -n "$DEV" ] && [ "$(blockdev --getsize64 "$DEV" 2>/dev/null)" = "$SIZE" ]; then
			echo "attached as $DEV after $((i / 10)).$((i % 10))s, size $SIZE"
			return 0
		fi
		sleep 0.1
	done
	fail "no device of $SIZE bytes after 60s (device: '$DEV')"
}

# running PID: the process exists and is no zombie.
running() {
	local st
	st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
	[ -n "$st" ] && [ "$st" != Z ]
}

# wait_exit PID WHAT: the process (a child) must exit 0 within 60s.
wait_exit() {
	# (No output from the watchdog: its sleep would hold the log pipe open.)
	(sleep 60 && kill -KILL "$1") >/dev/null 2>&1 &
	local dog=$! rc
	wait "$1"
	rc=$?
	kill "$dog" 2>/dev/null
	[ "$rc" = 0 ] || fail "$2 exited $rc (137: killed after 60s)"
	echo "$2 exited 0"
}

step "rblkd serve --transport tcp --listen $ADDR --export vol=$VOL,size=512M"
"$BIN/rblkd" serve --transport tcp --listen "$ADDR" --export "vol=$VOL,size=512M" >"$LOGS/rblkd.log" 2>&1 &
RBLKD=$!
pids+=("$RBLKD")
wait_for 30 "$BIN/rblk-attach" list --target "$ADDR" --transport tcp || fail "rblkd does not answer on $ADDR"
"$BIN/rblk-attach" list --target "$ADDR" --transport tcp

# metric NAME: the sum of the series of NAME (with labels) at the metrics
# endpoint of the first rblk-attach.
metric() {
	curl -fsS "http://$METRICS/metrics" | awk -v m="$1" 'index($0, m) == 1 { s += $NF } END { print s + 0 }'
}

METRICS=127.0.0.1:9481
step "rblk-attach attach --device auto --metrics-listen $METRICS"
attach attach1.log --device auto --metrics-listen "$METRICS"
name=${DEV#/dev/}
Q=/sys/block/$name/queue
echo "pid $(cat /sys/block/"$name"/pid), backend '$(cat /sys/block/"$name"/backend 2>/dev/null)'"
for a in write_cache discard_max_bytes discard_granularity write_zeroes_max_bytes fua logical_block_size physical_block_size max_hw_sectors_kb nr_requests; do
	printf '  %-24s %s\n' "$a" "$(cat "$Q/$a" 2>/dev/null)"
done
echo "  hardware queues: $(ls /sys/block/"$name"/mq | wc -l)"
[ "$(cat "$Q/discard_max_bytes")" -gt 0 ] || fail "discard_max_bytes is 0: TRIM not enabled"
[ "$(cat "$Q/write_cache")" = "write back" ] || fail "write_cache is '$(cat "$Q/write_cache")': FLUSH not enabled"
[ "$(cat "$Q/logical_block_size")" = 4096 ] || fail "logical block size $(cat "$Q/logical_block_size"), want 4096"

step "a second attach of the same device is refused"
if out=$("$BIN/rblk-attach" attach --target "$ADDR" --export vol --transport tcp --device "$DEV" 2>&1); then
	fail "second attach of $DEV succeeded"
fi
echo "$out"
[ "$(echo "$out" | wc -l)" = 1 ] || fail "want one line of error"

step "mkfs.ext4 (discards the whole device), mount"
mkfs.ext4 -q -F "$DEV" || fail "mkfs.ext4"
mount "$DEV" "$MNT" || fail "mount"

step "write files, checksums, sync"
mkdir -p "$MNT/d"
for i in $(seq 1 40); do
	head -c $(((i * 7919) % 300000 + 1)) /dev/urandom >"$MNT/d/small$i"
done
head -c $((48 << 20)) /dev/urandom >"$MNT/big"
dd if=/dev/urandom of="$MNT/direct" bs=1M count=8 oflag=direct status=none || fail "O_DIRECT write"
rm "$MNT/d/small7" "$MNT/d/small8" # freed blocks for fstrim
(cd "$MNT" && find . -type f ! -name lost+found -print0 | sort -z | xargs -0 sha256sum) >/tmp/sums
echo "$(wc -l </tmp/sums) files, $(du -sh "$MNT" | cut -f1)"
sync || fail "sync"

step "fstrim"
fstrim -v "$MNT" || fail "fstrim"

step "requests seen by rblk-attach's NBD server"
for op in read write flush trim write_zeroes; do
	printf '  %-13s ok %-8s error %s\n' "$op" "$(metric "rblk_attach_nbd_requests_total{op=\"$op\",result=\"ok\"}")" \
		"$(metric "rblk_attach_nbd_requests_total{op=\"$op\",result=\"error\"}")"
done
echo "  connections   $(metric rblk_attach_nbd_connections)"
[ "$(metric 'rblk_attach_nbd_requests_total{op="flush",result="ok"}')" -gt 0 ] || fail "no FLUSH reached the server"
[ "$(metric 'rblk_attach_nbd_requests_total{op="trim",result="ok"}')" -gt 0 ] || fail "no TRIM reached the server"
[ "$(metric 'rblk_attach_nbd_requests_total{op="write",result="ok"}')" -gt 0 ] || fail "no WRITE reached the server"
[ "$(metric 'rblk_attach_nbd_requests_total{op="read",result="error"}')" = 0 ] || fail "READ errors"
[ "$(metric 'rblk_attach_nbd_requests_total{op="write",result="error"}')" = 0 ] || fail "WRITE errors"
[ "$(metric rblk_attach_nbd_connections)" = "$(ls /sys/block/"$name"/mq | wc -l)" ] || fail "connections and hardware queues differ"

step "detach refuses a mounted device"
if out=$("$BIN/rblk-attach" detach "$DEV" 2>&1); then
	fail "detach of a mounted device succeeded"
fi
echo "$out"

step "umount, rblk-attach detach $DEV"
umount "$MNT" || fail "umount"
"$BIN/rblk-attach" detach "$DEV" || fail "rblk-attach detach exited $?"
wait_exit "$APID" "rblk-attach attach (first)"
[ ! -e "/sys/block/$name/pid" ] || fail "$DEV still has a server (pid $(cat "/sys/block/$name/pid"))"
grep -E "disconnected by another process|nbd device detached|detached cleanly" "$LOGS/attach1.log" | sed 's/^/  /'

step "e2fsck -fn $VOL"
e2fsck -fn "$VOL" || fail "e2fsck found errors in $VOL"

step "attach again as $DEV with one connection, mount, compare checksums"
attach attach2.log --device "$DEV" --connections 1
[ "$(ls /sys/block/"${DEV#/dev/}"/mq | wc -l)" = 1 ] || fail "want one hardware queue"
mount "$DEV" "$MNT" || fail "mount (second attach)"
(cd "$MNT" && sha256sum --quiet -c /tmp/sums) || fail "checksums differ after re-attach"
echo "all $(wc -l </tmp/sums) checksums match"
umount "$MNT" || fail "umount (second attach)"

step "SIGTERM to the second rblk-attach"
kill -TERM "$APID"
wait_exit "$APID" "rblk-attach attach (second, SIGTERM)"
[ ! -e "/sys/block/${DEV#/dev/}/pid" ] || fail "$DEV still has a server after SIGTERM"

step "stop rblkd, e2fsck again"
kill -TERM "$RBLKD"
wait_exit "$RBLKD" "rblkd"
e2fsck -fn "$VOL" || fail "e2fsck found errors in $VOL after rblkd stopped"

echo "----- kernel log (nbd)"
dmesg | grep -i nbd | tail -n 20
echo "PASS"
