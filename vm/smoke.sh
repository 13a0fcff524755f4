#!/bin/bash
# vm/smoke.sh: guest script proving the VM's stack: Soft-RoCE verbs and
# rdma_cm (rping), RDMA WRITE/READ (perftest), /dev/nbd0, and the kernel's
# NVMe-oF RDMA target+host with a short fio run.
# Run from the host with: vm/run.sh vm/smoke.sh
set -u
ADDR=${RBLK_VM_ADDR:-192.0.2.1}
DEV=${RBLK_VM_RDMA_DEV:-rxe0}
LIB=${RBLK_VM_LIB:-$(dirname "$0")/harness}
. "$LIB/nvmeof.sh"
. "$LIB/fio-table.sh"

failed=0
now() { cut -d' ' -f1 /proc/uptime; }
# check NAME CMD...: run CMD, report PASS/FAIL with its duration.
check() {
	local name=$1 t0 rc
	shift
	echo "=== $name"
	t0=$(now)
	"$@"
	rc=$?
	local dt
	dt=$(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}')
	if [ $rc -eq 0 ]; then
		echo "--- PASS $name (${dt}s)"
	else
		echo "--- FAIL $name (exit $rc, ${dt}s)"
		failed=$((failed + 1))
	fi
}

# client_server NAME SERVER_CMD -- CLIENT_CMD: start the server in the
# background, run the client (retried while the server is still starting),
# then require both to succeed.
client_server() {
	local srv=() cli=() spid rc i
	while [ "$1" != -- ]; do srv+=("$1"); shift; done
	shift
	cli=("$@")
	timeout 60 "${srv[@]}" &
	spid=$!
	for i in 1 2 3 4 5 6 7 8 9 10; do
		sleep 1
		timeout 60 "${cli[@]}" && { rc=0; break; }
		rc=$?
		kill -0 $spid 2>/dev/null || break # server gave up
		echo "(client attempt $i failed: $rc; retrying)"
	done
	if [ "$rc" -ne 0 ]; then
		kill $spid 2>/dev/null
		wait $spid 2>/dev/null
		return "$rc"
	fi
	wait $spid
}

verbs_device() {
	ibv_devices
	ibv_devices | grep -qw "$DEV" || return 1
	ibv_devinfo -d "$DEV" | grep -E 'state|link_layer|active_mtu'
	ibv_devinfo -d "$DEV" | grep -q PORT_ACTIVE
}

nbd_device() {
	ls -l /dev/nbd0 && [ -b /dev/nbd0 ] && [ -e /sys/block/nbd0 ]
}

nvmeof() {
	local dev csv=$RBLK_VM_SHARE/smoke-fio.csv rc=0
	rm -f "$csv"
	dev=$(nvmet_setup /tmp/nvme-backing.img 256M) || return 1
	echo "connected: $dev ($(blockdev --getsize64 "$dev") bytes)"
	nvme list
	[ -b "$dev" ] || rc=1
	FIO_RUNTIME=5 FIO_RAMP=0 fio_run "nvme-of rdma" "$dev" randread-4k-qd32 "$csv" || rc=1
	FIO_RUNTIME=3 FIO_RAMP=0 fio_run "nvme-of rdma" "$dev" randrw-4k-qd32-verify "$csv" || rc=1
	[ -s "$csv" ] && fio_table "$csv"
	nvmet_teardown || rc=1
	if [ -e "$dev" ] || ls /sys/kernel/config/nvmet/subsystems/* >/dev/null 2>&1; then
		echo "teardown left $dev or a subsystem behind"
		rc=1
	fi
	return $rc
}

echo "smoke: kernel $(uname -r), ulimit -l $(ulimit -l)"
check "verbs device $DEV" verbs_device
check "rping over rdma_cm" client_server \
	rping -s -a "$ADDR" -C 3 -- rping -c -a "$ADDR" -C 3 -v
check "ib_write_bw (RDMA WRITE)" client_server \
	ib_write_bw -d "$DEV" -R -F -n 200 -s 65536 -- ib_write_bw -d "$DEV" -R -F -n 200 -s 65536 "$ADDR"
check "ib_read_lat (RDMA READ)" client_server \
	ib_read_lat -d "$DEV" -R -F -n 200 -- ib_read_lat -d "$DEV" -R -F -n 200 "$ADDR"
check "/dev/nbd0" nbd_device
check "NVMe-oF RDMA (nvmet-rdma + nvme-rdma + fio)" nvmeof

if [ $failed -ne 0 ]; then
	echo "smoke: $failed check(s) failed"
	exit 1
fi
echo "smoke: all checks passed"
