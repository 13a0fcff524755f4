#!/bin/bash
# vm/rblk-e2e.sh: rblk's end-to-end test on a real kernel RDMA stack, run in
# the guest by vm/run.sh with rblkd and rblk-attach (built with -tags rdma)
# in the working directory:
#
#   scripts/vm-test.sh        # builds, then: vm/run.sh vm/rblk-e2e.sh DIR
#
# 0. the verbs provider's own tests (rdma.test, if present);
# 1. rblkd --transport rdma on Soft-RoCE (rxe0, 192.0.2.1), rblk-attach
#    --transport rdma --device /dev/nbd0 (the kernel's NBD driver);
# 2. mkfs.ext4, mount, a few hundred files of random sizes with their
#    checksums, sync, umount, detach; e2fsck -fn on the backing file is
#    clean; a fresh attach and mount: every checksum matches;
# 3. fio with --verify=crc32c on /dev/nbd0, random 4k and sequential 1M;
# 4. the same fio jobs on the kernel's NVMe-oF RDMA (nvmet over rxe0) over
#    the same kind of backing file, and on /dev/nbd0: a table of both.
# Any failed step fails the script. RBLK_TRANSPORT=tcp runs it over the
# software provider instead (to tell a transport problem from the rest).
set -uo pipefail

BIN=$PWD
[ -f "$BIN/env.sh" ] && . "$BIN/env.sh"
LIB=${RBLK_VM_LIB:-$(dirname "$0")}
. "$LIB/nvmeof.sh"
. "$LIB/fio-table.sh"
TRANSPORT=${RBLK_TRANSPORT:-rdma}
IP=${RBLK_VM_ADDR:-192.0.2.1}
ADDR=$IP:7480
SIZE_MB=256
CACHE=384M # holds the whole volume: the table compares data paths, not cache misses
WORK=/tmp/rblk-e2e
VOL=$WORK/rblk.img
MNT=$WORK/mnt
LOGS=$WORK/logs
mkdir -p "$MNT" "$LOGS"
export FIO_RUNTIME=${FIO_RUNTIME:-5} FIO_OUTDIR=$WORK/fio

pids=()
step() { echo "== $(cut -d' ' -f1 /proc/uptime)s $*"; }
cleanup() {
	mountpoint -q "$MNT" && umount "$MNT"
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
	nvmet_teardown >/dev/null 2>&1
	cp "$LOGS"/*.log "$BIN/" 2>/dev/null
}
trap cleanup EXIT
fail() {
	echo "FAIL: $*"
	for f in "$LOGS"/*.log; do
		echo "----- $f (tail)"
		tail -n 30 "$f"
	done
	echo "----- dmesg (tail)"
	dmesg | tail -n 30
	exit 1
}
wait_for() { # SECONDS CMD...: poll until CMD succeeds
	local n=$(($1 * 10))
	shift
	for _ in $(seq "$n"); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	return 1
}
wait_exit() { # PID WHAT: the child must exit 0 within 60 s
	(sleep 60 && kill -KILL "$1") >/dev/null 2>&1 &
	local dog=$! rc
	wait "$1"
	rc=$?
	kill "$dog" 2>/dev/null
	[ "$rc" = 0 ] || fail "$2 exited $rc"
	echo "$2 exited 0"
}

# attach LOG: rblk-attach --device /dev/nbd0 in the background; sets APID.
attach() {
	"$BIN/rblk-attach" attach --target "$ADDR" --export vol --transport "$TRANSPORT" \
		--device /dev/nbd0 --metrics-listen 127.0.0.1:9481 >"$LOGS/$1" 2>&1 &
	APID=$!
	pids+=("$APID")
	for _ in $(seq 600); do
		kill -0 "$APID" 2>/dev/null || { wait "$APID"; fail "rblk-attach exited $? before attaching"; }
		[ "$(blockdev --getsize64 /dev/nbd0 2>/dev/null)" = $((SIZE_MB << 20)) ] && return 0
		sleep 0.1
	done
	fail "/dev/nbd0 did not get the volume's size in 60 s"
}
detach() {
	"$BIN/rblk-attach" detach /dev/nbd0 || fail "rblk-attach detach"
	wait_exit "$APID" "rblk-attach attach"
}

if [ -x "$BIN/rdma.test" ]; then
	step "the verbs provider's tests (transport/rdma: the conformance suite over rxe0)"
	RBLK_RDMA_ADDR=$IP "$BIN/rdma.test" -test.v -test.count=1 -test.timeout=10m >"$LOGS/rdma-test.log" 2>&1 ||
		fail "transport/rdma tests: $(grep -E -- '--- FAIL|panic' "$LOGS/rdma-test.log" | head -n 20)"
	passed=$(grep -cE -- '--- PASS' "$LOGS/rdma-test.log")
	echo "$passed tests and subtests passed"
	grep -- '--- SKIP' "$LOGS/rdma-test.log" || true
	# With a device, the conformance suite must have run, not skipped.
	[ "$passed" -ge 20 ] || fail "transport/rdma: only $passed tests passed: did the suite skip?"
fi

step "rblkd serve --transport $TRANSPORT --listen $ADDR"
"$BIN/rblkd" serve --transport "$TRANSPORT" --listen "$ADDR" --export "vol=$VOL,size=${SIZE_MB}M" \
	--cache-size "$CACHE" --metrics-listen 127.0.0.1:9480 >"$LOGS/rblkd.log" 2>&1 &
RBLKD=$!
pids+=("$RBLKD")
wait_for 30 "$BIN/rblk-attach" list --target "$ADDR" --transport "$TRANSPORT" || fail "rblkd does not answer on $ADDR"
grep -m1 "rblkd serving" "$LOGS/rblkd.log"
[ "$TRANSPORT" != rdma ] || grep -q '"transport": "rdma' "$LOGS/rblkd.log" || fail "rblkd is not on rdma"

step "rblk-attach attach --transport $TRANSPORT --device /dev/nbd0"
attach attach1.log
grep -m1 -E "attached|device" "$LOGS/attach1.log"
for a in write_cache discard_max_bytes fua logical_block_size; do
	printf '  %-20s %s\n' "$a" "$(cat /sys/block/nbd0/queue/$a)"
done
[ "$(cat /sys/block/nbd0/queue/write_cache)" = "write back" ] || fail "FLUSH not enabled on /dev/nbd0"

step "mkfs.ext4, mount, write files of random sizes, checksums"
mkfs.ext4 -q -F /dev/nbd0 || fail "mkfs.ext4"
mount /dev/nbd0 "$MNT" || fail "mount"
mkdir -p "$MNT/files"
RANDOM=42
for i in $(seq 1 300); do
	# sizes from 1 byte to ~1 MiB, most of them small
	n=$(((RANDOM * RANDOM) % (1 << (RANDOM % 21)) + 1))
	head -c "$n" /dev/urandom >"$MNT/files/f$i" || fail "write f$i"
done
(cd "$MNT" && find files -type f -print0 | sort -z | xargs -0 sha256sum) >"$WORK/sums"
echo "$(wc -l <"$WORK/sums") files, $(du -sh "$MNT/files" | cut -f1)"
sync || fail "sync"
umount "$MNT" || fail "umount"
step "detach"
detach

step "e2fsck -fn on the target's backing file"
e2fsck -fn "$VOL" || fail "e2fsck found problems"

step "fresh attach and mount: every checksum matches"
attach attach2.log
mount /dev/nbd0 "$MNT" || fail "mount again"
(cd "$MNT" && sha256sum --quiet -c "$WORK/sums") || fail "checksums differ after re-attach"
echo "all $(wc -l <"$WORK/sums") checksums match"
umount "$MNT" || fail "umount"

step "fio with --verify=crc32c on /dev/nbd0: randrw 4k QD32 and sequential 1M"
# (sizes keep each job near a minute under software emulation)
for args in "--rw=randrw --bs=4k --iodepth=32 --size=48M" "--rw=write --bs=1M --iodepth=8 --size=256M"; do
	# shellcheck disable=SC2086
	fio --name=verify --filename=/dev/nbd0 --ioengine=libaio --direct=1 $args \
		--verify=crc32c --verify_fatal=1 --verify_state_save=0 --output="$LOGS/fio-verify.log" ||
		fail "fio verify ($args): $(tail -n 5 "$LOGS/fio-verify.log")"
	grep -E "IOPS|err=" "$LOGS/fio-verify.log" | head -n 3
done

step "the same fio jobs on the kernel's NVMe-oF RDMA and on rblk"
CSV=$WORK/fio.csv
rm -f "$CSV"
truncate -s "${SIZE_MB}M" "$WORK/nvme.img"
NVME=$(nvmet_setup "$WORK/nvme.img") || fail "nvmet setup"
echo "nvme-of rdma device: $NVME"
fio_all "nvme-of rdma" "$NVME" "$CSV" || fail "fio on $NVME"
nvmet_teardown
fio_all rblk /dev/nbd0 "$CSV" || fail "fio on /dev/nbd0"
fio_table "$CSV" "nvme-of rdma" rblk | tee "$BIN/fio-table.txt"

step "target metrics"
curl -fsS 127.0.0.1:9480/metrics | grep -E '^rblkd_(grants|revokes|cache_loads|written_bytes|writeback_bytes)_total' || true
curl -fsS 127.0.0.1:9481/metrics | grep -E '^rblk_attach_rdma_(ops|bytes)_total' || true

step "detach, stop rblkd"
detach
kill -TERM "$RBLKD"
wait_exit "$RBLKD" rblkd
echo "PASS"
