#!/bin/bash
# vm/rblk-e2e.sh: rblk's test on a real kernel RDMA stack, run in the guest
# by vm/run.sh with rblkd and rblk-attach (built with -tags rdma), their
# -race builds in race/ and the Go test binaries in the working directory:
#
#   scripts/vm-test.sh        # builds, then: vm/run.sh vm/rblk-e2e.sh DIR
#
# What the bare build machine can test runs in e2e/ (real processes, one
# suite for both transports and both devices); here the same suite runs over
# the verbs provider on Soft-RoCE, and beside it only what needs the guest's
# kernel. Scenarios, each with its own rblkd (port), volume and log dir; a
# failed one is reported and the next ones still run:
#
#  verbs       the verbs provider's own tests (rdma.test, if present), the
#              device's memory window caps, and the cost of a grant:
#              Register+Deregister vs BindWindow+Invalidate of 1 MiB
#              (logs/verbs/grant-cost.txt);
#  e2e         the e2e suite (e2e.test) over rdma on rxe0, on the NBD
#              socket and on the kernel's /dev/nbdN (RBLK_VM_E2E_DEVICES):
#              qemu-io, fio verify, ext4 with e2fsck, kill -9 and SIGTERM
#              restarts, a silent target past the keepalive under fio
#              verify (the link fault), 1 MiB writes over 64K chunks,
#              authentication, one writer and takeover, the doctors, rxe0's
#              port metrics, ...; RBLK_E2E_REQUIRE=1, and what cannot run
#              over rdma says why (logs/e2e/DEVICE/, e2e-summary.txt);
#  csi         csi-sanity against rblk-csi and rblkd over rdma, the node
#              staging on /dev/nbdN: every spec with ext4, the Node specs
#              with xfs and with block volumes (csi-summary.txt, logs/csi/);
#  ublk        rblk-attach --device ublk where the kernel has ublk_drv
#              (6.12): one hardware queue per CPU, FLUSH enabled; fio
#              verify at 4k QD1/32/128, 1M and randrw 64k; an fsync reaches
#              rblkd (its flush count moves); ext4 with a file, sync,
#              umount: the device reads back as rblkd's backing file, and
#              after detach the file's sha256 matches in that image;
#              write-zeroes reads back as zeroes, discard works; a
#              --read-only attach refuses writes and reads the file's bytes;
#              detach of a mounted device refused; detach and SIGTERM exit
#              0 and leave no /dev/ublk*; after a SIGKILL of rblk-attach,
#              detach removes the device the kernel kept. Without ublk_drv (6.1): attach
#              --device ublk is refused at once in one line. bench gets a
#              "rblk ublk" column where the kernel has it;
#  grow        an online grow of /dev/nbdN (kernel.test, if present):
#              a target in process grows the attached volume,
#              /sys/block/nbdN/size shows the new size (NBD_CMD_RECONFIGURE),
#              O_DIRECT IO at the new end works;
#  udev        systemd/99-rblk.rules under a systemd-udevd started here:
#              /dev/disk/by-rblk/TARGET/vol points at the /dev/nbdN (and,
#              with ublk_drv, /dev/ublkbN) attached, and goes with detach;
#  bench       the fio table: the kernel's NVMe-oF RDMA beside rblk;
#  small-cache a cache of a quarter of the volume on /dev/nbdN, with a CPU
#              hog beside it (RBLK_VM_HOG): fio verify randrw over the whole
#              volume passes, rblkd evicted chunks and revoked grants (its
#              /metrics), and rblk-attach never reconnected;
#  soak        RBLK_VM_SOAK_RUNS runs under a CPU hog of the target's and
#              the initiator's tests and the e2e fault tests over rxe0, all
#              built with -race (soak-summary.txt, logs/soak/run-N/);
#  panics      no rblkd or rblk-attach of any scenario panicked or raced;
#  dmesg       the guest's kernel log has no call trace, BUG, WARNING,
#              blocked task, nbd I/O error or rxe/nbd/RDMA error (patterns
#              below; the fault tests' own errors allowed where they run);
# and the rxe0 port counters after each scenario (rxe-counters.txt, .csv).
# RBLK_VM_SCENARIOS picks scenarios. RBLK_TRANSPORT=tcp runs the
# scenarios' rblkd and rblk-attach over the software provider instead (to
# tell a transport problem from the rest; the e2e and soak scenarios are
# over rdma by definition).
#
# What the e2e suite covers over rdma left this script: the basic ext4,
# fio and doctor checks and rxe0's metrics (TestExt4OverNbdfuse and
# TestFio on /dev/nbdN, TestDoctorRDMA), security (TestAuthentication,
# TestOneWriterAndTakeover, and the target's tests in the soak), chunk-64k
# (TestFaultBigWritesSmallChunks), kill-9 (TestFaultKill9,
# TestFaultSIGTERMRestart, TestStatus), link-fault (TestFaultLinkReset and
# TestFaultLinkStall: rblkd stopped past the keepalive; `ip link set dummy0
# down` is no fault to test with here: once dummy0 is up again no new RDMA
# CM connection gets through on this Soft-RoCE, not even between two rping
# processes).
# shellcheck disable=SC2030,SC2031
set -euo pipefail

BIN=$PWD
# shellcheck source=/dev/null
if [ -f "$BIN/env.sh" ]; then . "$BIN/env.sh"; fi
LIB=${RBLK_VM_LIB:-$(dirname "$0")}
. "$LIB/lib.sh"
. "$LIB/nvmeof.sh"
. "$LIB/fio-table.sh"
. "$LIB/nbdnull.sh"
TRANSPORT=${RBLK_TRANSPORT:-rdma}
IP=${RBLK_VM_ADDR:-192.0.2.1}
RXE=${RBLK_VM_RDMA_DEV:-rxe0}
PORT_SYS=/sys/class/infiniband/$RXE/ports/1
WORK=/tmp/rblk-e2e
mkdir -p "$WORK/logs"
export FIO_RUNTIME=${FIO_RUNTIME:-3} FIO_RAMP=${FIO_RAMP:-1} FIO_OUTDIR=$WORK/fio

# Every rblkd authenticates its initiators (it refuses a non-loopback
# address without): the host vm-host attaches with its secret. Secrets are
# random, in files of mode 0600, never on a command line.
AUTH_DIR=$WORK/auth
mkdir -p "$AUTH_DIR"
chmod 0700 "$AUTH_DIR"
newsecret() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }
(
	umask 077
	newsecret >"$AUTH_DIR/vm-host.secret"
	printf 'vm-host %s\n' "$(cat "$AUTH_DIR/vm-host.secret")" >"$AUTH_DIR/auth"
)
HOST_ID=vm-host SECRET=$AUTH_DIR/vm-host.secret

# ---------------------------------------------------------------------------
# Helpers (a scenario runs in a subshell: its variables and pids stay there)
# ---------------------------------------------------------------------------
pids=() SCEN='' LOGS=$WORK/logs

# serve LOG PORT SIZE_MB RBLKD_ARGS...: rblkd serves $WORK/$SCEN.img (the
# export "vol") on IP:PORT; sets RBLKD, TGT, VOL, TM (its metrics) and AM
# (the metrics address for rblk-attach). Again with the same PORT: the same
# volume, same address. SERVE_VOL=PATH serves PATH instead (a block device:
# SIZE_MB is then its size); RBLKD_BIN runs another rblkd (a baseline).
serve() {
	local log=$1 port=$2 size=$3 export
	shift 3
	TGT=$IP:$port TM=127.0.0.1:$((port + 2000)) AM=127.0.0.1:$((port + 2100))
	VOL=${SERVE_VOL:-$WORK/$SCEN.img}
	export="vol=$VOL,size=${size}M"
	[ ! -b "$VOL" ] || export="vol=$VOL"
	"${RBLKD_BIN:-$BIN/rblkd}" serve --transport "$TRANSPORT" --listen "$TGT" --export "$export" \
		--auth-file "$AUTH_DIR/auth" --target-id vm-target --metrics-listen "$TM" "$@" >"$LOGS/$log" 2>&1 &
	RBLKD=$!
	pids+=("$RBLKD")
	wait_for 30 "$BIN/rblk-attach" list --target "$TGT" --transport "$TRANSPORT" --host-id "$HOST_ID" --secret-file "$SECRET" ||
		fail "rblkd ($log) does not answer on $TGT"
	[ "$TRANSPORT" != rdma ] || grep -q '"transport": "rdma' "$LOGS/$log" || fail "rblkd is not on rdma"
	echo "rblkd pid $RBLKD on $TGT: $* (volume ${size} MiB)"
}

stop_rblkd() {
	kill -TERM "$RBLKD"
	wait_exit "$RBLKD" "rblkd"
}

# free_nbd: the first /dev/nbdN without a server.
# Devices are taken in turn (the next after the one taken last, in
# $WORK/nbd-next), so that an attach never takes the device the scenario
# before it just detached: the kernel may still hold that one's old
# configuration for a moment, and NBD_CMD_CONNECT then fails with EBUSY.
free_nbd() {
	local i n start
	start=$(cat "$WORK/nbd-next" 2>/dev/null || echo 0)
	for i in $(seq 0 15); do
		n=$(((start + i) % 16))
		if [ ! -e "/sys/block/nbd$n/pid" ]; then
			echo $(((n + 1) % 16)) >"$WORK/nbd-next"
			echo "/dev/nbd$n"
			return 0
		fi
	done
	return 1
}

# attach LOG SIZE_MB ARGS...: rblk-attach --device (first free /dev/nbdN) in
# the background, as host HOST_ID with its SECRET; sets APID and DEV once
# the device has the volume's size. ATTACH_BIN runs another rblk-attach.
attach() {
	local log=$1 size=$(($2 << 20)) deadline rc
	shift 2
	DEV=$(free_nbd) || fail "no free /dev/nbdN"
	"${ATTACH_BIN:-$BIN/rblk-attach}" attach --target "$TGT" --export vol --transport "$TRANSPORT" \
		--host-id "$HOST_ID" --secret-file "$SECRET" --device "$DEV" --metrics-listen "$AM" "$@" >"$LOGS/$log" 2>&1 &
	APID=$!
	pids+=("$APID")
	deadline=$(($(date +%s) + 60))
	# Not a look at the device before the kernel has it connected (its
	# pid in sysfs): on 6.1 an open of an unconfigured /dev/nbdN makes it
	# a configuration, and rblk-attach's NBD_CMD_CONNECT then fails with
	# EBUSY ("attached already").
	until [ -e "/sys/block/${DEV#/dev/}/pid" ] && [ "$(blockdev --getsize64 "$DEV" 2>/dev/null)" = "$size" ]; do
		if ! running "$APID"; then
			rc=0
			wait "$APID" || rc=$?
			fail "rblk-attach exited $rc before attaching"
		fi
		[ "$(date +%s)" -lt "$deadline" ] || fail "$DEV did not get the volume's size in 60 s"
		sleep 0.2
	done
	echo "attached as $DEV (rblk-attach pid $APID)"
}

detach() {
	"$BIN/rblk-attach" detach "$DEV" || fail "rblk-attach detach $DEV"
	wait_exit "$APID" "rblk-attach attach"
}

# has_ublk: the kernel has ublk_drv (loaded now).
has_ublk() { modprobe ublk_drv >/dev/null 2>&1 && [ -e /dev/ublk-control ]; }

# attach_ublk LOG SIZE_MB ARGS...: rblk-attach --device ublk in the
# background; sets APID and DEV (/dev/ublkbN, from its log) once the device
# has the volume's size.
attach_ublk() {
	local log=$1 size=$(($2 << 20)) deadline rc
	shift 2
	DEV=''
	"${ATTACH_BIN:-$BIN/rblk-attach}" attach --target "$TGT" --export vol --transport "$TRANSPORT" \
		--host-id "$HOST_ID" --secret-file "$SECRET" --device ublk --metrics-listen "$AM" "$@" >"$LOGS/$log" 2>&1 &
	APID=$!
	pids+=("$APID")
	deadline=$(($(date +%s) + 60))
	until [ -n "$DEV" ] && [ "$(blockdev --getsize64 "$DEV" 2>/dev/null)" = "$size" ]; do
		if ! running "$APID"; then
			rc=0
			wait "$APID" || rc=$?
			fail "rblk-attach --device ublk exited $rc before attaching: $(tail -n 3 "$LOGS/$log")"
		fi
		[ "$(date +%s)" -lt "$deadline" ] || fail "no ublk device with the volume's size in 60 s: $(tail -n 3 "$LOGS/$log")"
		DEV=$(grep -m1 -oE '"device": "/dev/ublkb[0-9]+"' "$LOGS/$log" | grep -oE '/dev/ublkb[0-9]+' || true)
		sleep 0.2
	done
	echo "attached as $DEV (rblk-attach pid $APID)"
}

# no_ublk_devices: no /dev/ublkb* and no /dev/ublkc* left.
no_ublk_devices() { ! compgen -G '/dev/ublk[bc][0-9]*' >/dev/null; }

# fio_verify NAME FIO_ARGS...: fio with crc32c verify on $DEV; fail on an
# error or a mismatch.
fio_verify() {
	local name=$1
	shift
	fio --name="$name" --filename="$DEV" --ioengine=libaio --direct=1 "$@" \
		--verify=crc32c --verify_fatal=1 --verify_state_save=0 --output="$LOGS/fio-$name.log" ||
		fail "fio $name ($*): $(tail -n 8 "$LOGS/fio-$name.log")"
	grep -E "IOPS|err=" "$LOGS/fio-$name.log" | head -n 3
}

# flush_dev: fsync $DEV (the kernel sends a FLUSH); fails on an error.
flush_dev() { dd if=/dev/null of="$DEV" conv=notrunc,fsync status=none; }

# m NAME: metric NAME of rblkd (TM); am NAME: of rblk-attach (AM).
m() { metric "$TM" "$1"; }
am() { metric "$AM" "$1"; }
# at_least ADDR NAME VALUE: the metric has reached VALUE.
at_least() { [ "$(metric "$1" "$2")" -ge "$3" ]; }

# rxe_snap PHASE: append the rxe0 port counters to $WORK/rxe-counters.csv.
rxe_snap() {
	local f
	for f in "$PORT_SYS"/hw_counters/* "$PORT_SYS"/counters/*; do
		[ -f "$f" ] || continue
		echo "$1,${f##*/},$(cat "$f" 2>/dev/null || echo n/a)"
	done >>"$WORK/rxe-counters.csv"
}

# udev: systemd/99-rblk.rules (copied beside the binaries by vm-test.sh)
# under a systemd-udevd started here (the guest has none; its rules dir
# /run/udev/rules.d is on tmpfs): an NBD device attached by rblk-attach
# gets /dev/disk/by-rblk/TARGET/EXPORT, gone after detach; likewise a
# ublk device where the kernel has ublk_drv.
scen_udev() {
	local udevd link
	udevd=$(command -v systemd-udevd || echo /lib/systemd/systemd-udevd)
	[ -x "$udevd" ] || fail "no systemd-udevd (Debian package udev)"
	[ -f "$BIN/99-rblk.rules" ] || fail "no 99-rblk.rules beside the binaries"
	mkdir -p /run/udev/rules.d
	sed "s|/usr/local/bin/rblk-attach|$BIN/rblk-attach|g" "$BIN/99-rblk.rules" >/run/udev/rules.d/99-rblk.rules
	"$udevd" --daemon >"$LOGS/udevd.log" 2>&1 || fail "systemd-udevd --daemon"
	wait_for 20 udevadm control --ping || fail "systemd-udevd does not answer"
	gone() { [ ! -e "$1" ] && [ ! -L "$1" ]; }
	serve udev-rblkd.log 7640 16
	link="/dev/disk/by-rblk/$TGT/vol"
	attach udev-attach.log 16
	udevadm settle -t 20 || true
	wait_for 20 test -L "$link" || { find /dev/disk/by-rblk -ls 2>&1 | head; udevadm info "$DEV"; fail "no $link for $DEV"; }
	[ "$(readlink -f "$link")" = "$DEV" ] || fail "$link points at $(readlink -f "$link"), want $DEV"
	echo "udev: $link -> $(readlink "$link")"
	"$BIN/rblk-attach" status | tee -a "$LOGS/status.log"
	detach
	udevadm settle -t 20 || true
	wait_for 20 gone "$link" || fail "$link left behind after detach"
	if has_ublk; then
		attach_ublk udev-ublk.log 16
		udevadm settle -t 20 || true
		wait_for 20 test -L "$link" || { udevadm info "$DEV"; fail "no $link for $DEV"; }
		[ "$(readlink -f "$link")" = "$DEV" ] || fail "$link points at $(readlink -f "$link"), want $DEV"
		echo "udev: $link -> $(readlink "$link")"
		"$BIN/rblk-attach" detach "$DEV" || fail "rblk-attach detach $DEV"
		wait_exit "$APID" "rblk-attach attach --device ublk"
		udevadm settle -t 20 || true
		wait_for 20 gone "$link" || fail "$link left behind after the ublk detach"
	else
		echo "no ublk_drv: the ublk half is left out"
	fi
	stop_rblkd
	udevadm control --exit || true
}

# scenario NAME FUNC: run FUNC in a subshell with its own LOGS, record
# PASS/FAIL and its duration, clean up what it left behind.
RESULTS=()
scenario() {
	local name=$1 fn=$2 t0 rc k0
	# RBLK_VM_SCENARIOS, if set, names the scenarios to run (a quick look
	# at one of them; the test command runs them all).
	if [ -n "${RBLK_VM_SCENARIOS:-}" ] && [[ " $RBLK_VM_SCENARIOS " != *" $name "* ]]; then
		return 0
	fi
	# RBLK_VM_SKIP_SCENARIOS names scenarios left out on this kernel
	# (scripts/vm-test.sh's RBLK_VM_BENCH_KERNELS); said, not hidden.
	if [[ " ${RBLK_VM_SKIP_SCENARIOS:-} " == *" $name "* ]]; then
		echo
		echo "######## SKIP $name (RBLK_VM_SKIP_SCENARIOS on this kernel)"
		RESULTS+=("SKIP 0 $name")
		return 0
	fi
	t0=$(cut -d' ' -f1 /proc/uptime)
	k0=$(dmesg | wc -l)
	echo
	echo "######## $name"
	set +e
	(
		set -e
		SCEN=$name LOGS=$WORK/logs/$name
		mkdir -p "$LOGS"
		trap scenario_cleanup EXIT
		"$fn"
	)
	rc=$?
	set -e
	mkdir -p "$WORK/logs/$name"
	dmesg | tail -n +$((k0 + 1)) >"$WORK/logs/$name/kernel.log" # (its part of the kernel log)
	rxe_snap "$name"
	local dt
	dt=$(awk -v a="$t0" -v b="$(cut -d' ' -f1 /proc/uptime)" 'BEGIN{printf "%.0f", b-a}')
	if [ "$rc" = 0 ]; then
		RESULTS+=("PASS $dt $name")
		echo "######## PASS $name (${dt}s)"
	else
		RESULTS+=("FAIL $dt $name")
		echo "######## FAIL $name (exit $rc, ${dt}s)"
	fi
}

# (runs in the scenario's subshell on exit)
scenario_cleanup() {
	local rc=$? p
	trap - EXIT
	set +e
	mountpoint -q "$WORK/mnt" && umount "$WORK/mnt"
	nvmet_teardown >/dev/null 2>&1
	if [ -n "${DEV:-}" ] && { [ -e "/sys/block/${DEV#/dev/}/pid" ] || [[ "$DEV" == /dev/ublkb* ]]; } && running "${APID:-0}"; then
		echo "cleanup: detach --force $DEV"
		"$BIN/rblk-attach" detach --force --wait 20s "$DEV" >/dev/null 2>&1
	fi
	for p in "${pids[@]}"; do running "$p" && kill -TERM "$p" 2>/dev/null; done
	wait_for 10 no_children "${pids[@]}"
	for p in "${pids[@]}"; do running "$p" && kill -KILL "$p" 2>/dev/null; done
	[ ! -e /sys/module/brd ] || rmmod brd 2>/dev/null
	rm -f "$WORK/$SCEN.img"
	exit "$rc"
}
no_children() {
	local p
	for p; do ! running "$p" || return 1; done
}

# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------
scen_grow() {
	step "TestGuestResize: the volume grows under /dev/nbdN"
	RBLK_KERNEL_GUEST_REQUIRE=1 "$BIN/kernel.test" -test.run '^TestGuestResize$' -test.v -test.count=1 -test.timeout=5m \
		>"$LOGS/kernel-test.log" 2>&1 || fail "TestGuestResize: $(grep -E -- '--- FAIL|grow_|guest_linux_test|panic' "$LOGS/kernel-test.log" | head -n 20)"
	grep -E -- 'sectors after the grow|--- PASS' "$LOGS/kernel-test.log"
}

scen_verbs() {
	step "the verbs provider's tests (transport/rdma: the conformance suite over $RXE)"
	RBLK_RDMA_ADDR=$IP "$BIN/rdma.test" -test.v -test.count=1 -test.timeout=10m >"$LOGS/rdma-test.log" 2>&1 ||
		fail "transport/rdma tests: $(grep -E -- '--- FAIL|panic' "$LOGS/rdma-test.log" | head -n 20)"
	local passed
	passed=$(grep -cE -- '--- PASS' "$LOGS/rdma-test.log" || true)
	echo "$passed tests and subtests passed"
	grep -- '--- SKIP' "$LOGS/rdma-test.log" || true
	# With a device, the conformance suite must have run, not skipped.
	[ "$passed" -ge 20 ] || fail "transport/rdma: only $passed tests passed: did the suite skip?"

	step "type-2 memory windows on $RXE"
	local caps wpassed
	ibv_devinfo -v -d "$RXE" >"$LOGS/ibv_devinfo.txt" 2>&1 || true
	caps=$(grep -oE 'MEM_WINDOW[A-Z0-9_]*' "$LOGS/ibv_devinfo.txt" | sort -u | tr '\n' ' ' || true)
	echo "device_cap_flags: ${caps:-no MEM_WINDOW flag}; $(grep -E '^\s*max_mw:' "$LOGS/ibv_devinfo.txt" | tr -s ' \t' ' ')"
	wpassed=$(grep -cE -- '--- PASS: .*/Window' "$LOGS/rdma-test.log" || true)
	echo "$wpassed memory window tests and subtests passed"
	if grep -q 'WINDOW SPANS NOT CHECKED' "$LOGS/rdma-test.log"; then
		echo "NOTE: $RXE does not hold the peer's requests through a window to the window's span (only to its MR's): $(grep -c 'WINDOW SPANS NOT CHECKED' "$LOGS/rdma-test.log") out-of-span cases not run"
	fi
	if grep -qE -- '--- SKIP: .*/Window' "$LOGS/rdma-test.log"; then
		grep -E 'MEMORY WINDOWS UNSUPPORTED|SKIP: ' "$LOGS/rdma-test.log" | sort | uniq -c | head -n 5
		[[ "$caps" != *TYPE_2* ]] || fail "$RXE has type-2 memory windows, yet the window tests skipped"
	fi

	# The cost of a grant: a registration per chunk and grant (before),
	# a memory window bound and invalidated over memory registered once.
	step "grant cost: Register+Deregister vs BindWindow+Invalidate of 1 MiB"
	RBLK_RDMA_ADDR=$IP "$BIN/rdma.test" -test.run '^$' -test.bench '^BenchmarkGrant(Register|Window)$' \
		-test.benchtime "${GRANT_BENCHTIME:-2s}" >"$LOGS/grant-bench.log" 2>&1 ||
		fail "grant benchmarks: $(tail -n 20 "$LOGS/grant-bench.log")"
	grep -E '^(Benchmark|goos|cpu)|SKIP' "$LOGS/grant-bench.log" || true
	# (the window's cost with the conn polled on completion events, as
	# the link does by default, and with busy polling)
	local reg win wbusy
	reg=$(awk '$1 ~ /^BenchmarkGrantRegister/ { print $3 }' "$LOGS/grant-bench.log")
	win=$(awk '$1 ~ /^BenchmarkGrantWindow\/event/ { print $3 }' "$LOGS/grant-bench.log")
	wbusy=$(awk '$1 ~ /^BenchmarkGrantWindow\/busypoll/ { print $3 }' "$LOGS/grant-bench.log")
	if [ -z "$reg" ] || [ -z "$win" ]; then
		[[ "$caps" != *TYPE_2* ]] || fail "grant benchmarks: no figures ($(grep -c . "$LOGS/grant-bench.log") lines)"
		echo "grant cost: register ${reg:-?} ns, window: none (no memory windows)" | tee "$LOGS/grant-cost.txt"
		return 0
	fi
	awk -v r="$reg" -v w="$win" -v wb="${wbusy:-0}" -v k="$(uname -r)" 'BEGIN {
		printf "grant cost (kernel %s, rxe, 1 MiB): register %.1f µs, window %.1f µs (%.1fx)", k, r / 1000, w / 1000, r / w
		if (wb > 0) printf "; window with busy polling %.1f µs (%.1fx)", wb / 1000, r / wb
		printf "\n"
	}' | tee "$LOGS/grant-cost.txt"
}

# The fio table: rblk over verbs beside the kernel's NVMe-oF RDMA, with a
# fair backend and the same number of queues. Both export the same kind of
# memory-backed block device, a brd RAM disk of BENCH_MB MiB (/dev/ram0 for
# nvmet's namespace, /dev/ram1 for rblkd's --export), filled with the same
# random bytes (reads hit data, not the zero pages of unwritten sectors);
# rblkd's cache holds the volume. nvme connect --nr-io-queues and
# rblk-attach --connections get the same BENCH_QUEUES. The fabric's floor
# first (perftest's ib_read_lat and ib_read_bw over rdma_cm on $RXE). The
# NBD front end's floor as the column "nbd null": a /dev/nbdN on nbdkit's
# null plugin over a unix socket, connected by nbd-client with
# BENCH_QUEUES connections (vm/nbdnull.sh; left out, with a line saying so,
# when nbdkit or nbd-client is missing); no ublk floor (no null ublk server
# at hand). Every job FIO_REPS times, interleaved (vm/fio-table.sh). With
# RBLK_VM_BASELINE_BIN=DIR (a host path: the guest sees the host's root),
# DIR/rblkd and DIR/rblk-attach on /dev/ram2 as the column "rblk-before".
# Writes fio-table.txt (floor, queues, table), fio-table.csv/.json,
# fio-floors.json, fio-info.txt into the share.
BENCH_MB=${BENCH_MB:-128}
BENCH_QUEUES=${BENCH_QUEUES:-2}
BENCH_PORT=7485 BENCH_BEFORE_PORT=7486 BENCH_UBLK_PORT=7488 BENCH_MIRROR_PORT=7489 # (and 7490)
# The jobs of the "nbd null" column (empty: all of FIO_JOBS); the test
# command (scripts/test.sh) runs the 4k QD1 and QD32 ones only, for time.
BENCH_NULL_JOBS=${BENCH_NULL_JOBS:-}
# The jobs of the "rblk mirror" column (md RAID1 over two rblk devices,
# each on an rblkd of its own; empty: all of FIO_JOBS), and its bitmap
# (BENCH_MIRROR_BITMAP: internal, as rblk-mirror and rblk-csi make it, or
# none, to see what the bitmap costs).
BENCH_MIRROR_JOBS=${BENCH_MIRROR_JOBS:-}
# The software transport beside its peer: rblk --transport tcp and the
# kernel's NVMe/TCP (nvmet-tcp, nvme-tcp), both over the guest's loopback,
# each on a RAM disk of its own (BENCH_TCP=0: left out); BENCH_TCP_JOBS:
# the jobs of both columns (empty: all of FIO_JOBS).
BENCH_TCP=${BENCH_TCP:-1}
BENCH_TCP_JOBS=${BENCH_TCP_JOBS:-}
BENCH_TCP_PORT=7491 BENCH_NVMET_TCP_PORT=4421
BENCH_NVMET_TCP_NQN=nqn.2024-01.io.rblk:vmtest-tcp

# The target of each device of the bench, by its column's name: rblkd's
# pids, or "kernel" for nvmet (scen_bench fills it in).
declare -A BENCH_TGT=()

# fio_target_us NAME: the CPU time so far of the target of the bench's
# device NAME, in microseconds (vm/fio-table.sh's hook): rblkd's
# processes; for NVMe-oF, every kernel thread (nvmet's work and
# Soft-RoCE's of both sides: an upper bound of nvmet's).
fio_target_us() {
	local t=${BENCH_TGT[$1]:-}
	case $t in
	'') ;;
	kernel) echo kernel ;;
	*)
		# shellcheck disable=SC2086 # pids
		_proc_us $t
		;;
	esac
}

# hw_queues DEV: the blk-mq hardware queues of DEV; for an NVMe multipath
# head (no queues of its own), its controller's I/O queues (queue_count
# less the admin queue).
hw_queues() {
	local d=${1#/dev/} n c
	n=$(find "/sys/block/$d/mq" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l)
	if [ "$n" = 0 ]; then
		for c in /sys/class/nvme/nvme*; do
			[ "$(cat "$c/subsysnqn" 2>/dev/null)" = "${NVMET_NQN:-nqn.2024-01.io.rblk:vmtest}" ] && [ -r "$c/queue_count" ] || continue
			n=$(($(cat "$c/queue_count") - 1))
			break
		done
	fi
	echo "$n"
}

# bench_batching NAME PORT: the NBD requests of the rblk-attach of the
# rblkd on PORT, and how many went per post to the target's send queues
# (one doorbell each on RDMA: rblk_attach_sq_posts_total) and per write of
# replies to the NBD socket (rblk_attach_nbd_reply_writes_total); "-"
# where its build has no such metric. Then what made the target write
# back: the NBD flushes and FUA writes rblk-attach got, the flushes rblkd
# did (each writes back the volume's dirty ranges and fdatasyncs) and
# their mean time, and the bytes rblkd wrote back per byte written to it.
bench_batching() {
	local am=127.0.0.1:$(($2 + 2100)) tm=127.0.0.1:$(($2 + 2000)) req posts writes flush fua tfl tfs wb wr
	req=$(metric "$am" rblk_attach_nbd_requests_total) || req=0
	posts=$(metric "$am" rblk_attach_sq_posts_total) || posts=0
	writes=$(metric "$am" rblk_attach_nbd_reply_writes_total) || writes=0
	flush=$(metric "$am" 'rblk_attach_nbd_requests_total{op="flush",result="ok"}') || flush=0
	fua=$(metric "$am" 'rblk_attach_control_duration_seconds_count{op="fua"}') || fua=0
	tfl=$(metric "$tm" rblkd_flush_duration_seconds_count) || tfl=0
	tfs=$(metric "$tm" rblkd_flush_duration_seconds_sum 1000000) || tfs=0 # (µs)
	wb=$(metric "$tm" rblkd_writeback_bytes_total) || wb=0
	wr=$(metric "$tm" rblkd_written_bytes_total) || wr=0
	awk -v n="$1" -v r="$req" -v p="$posts" -v w="$writes" -v f="$flush" -v u="$fua" -v tf="$tfl" -v ts="$tfs" -v wb="$wb" -v wr="$wr" 'BEGIN {
		printf "  %-12s %9d NBD requests, %5s per post to the target, %5s replies per socket write;", n, r,
			(p > 0 ? sprintf("%.2f", r / p) : "-"), (w > 0 ? sprintf("%.2f", r / w) : "-")
		printf " %d flushes, %d FUA writes; rblkd: %d flushes (%s ms each), %s bytes written back per byte written\n", f, u, tf,
			(tf > 0 ? sprintf("%.1f", ts / tf / 1000) : "-"), (wr > 0 ? sprintf("%.2f", wb / wr) : "-")
	}'
}

scen_bench() {
	local size=$BENCH_MB csv=$WORK/fio.csv before=${RBLK_VM_BASELINE_BIN:-} nram=2 i d rc=0
	local nvme rblk_dev rblk_apid rblk_rblkd bdev='' b_apid='' b_rblkd='' udev='' u_apid='' u_rblkd='' uram='' ndev=''
	local mram='' mdev='' m_devs=() m_apids=() m_rblkds=()
	local tram='' tnvme='' tdev='' t_apid='' t_rblkd=''
	BENCH_TGT=()
	if [ -n "$before" ]; then
		[ -x "$before/rblkd" ] && [ -x "$before/rblk-attach" ] || fail "RBLK_VM_BASELINE_BIN=$before: no rblkd and rblk-attach there"
		nram=3
	fi
	# On a kernel with ublk_drv, rblk-attach --device ublk gets a column too.
	if has_ublk; then
		uram=$nram
		nram=$((nram + 1))
	fi
	# With mdadm and raid1, a mirror of two rblk devices gets a column.
	if command -v mdadm >/dev/null && modprobe raid1 2>/dev/null; then
		mram=$nram
		nram=$((nram + 2))
	fi
	# rblk over tcp beside NVMe/TCP, both on the loopback.
	if [ "$BENCH_TCP" != 0 ]; then
		tram=$nram
		nram=$((nram + 2))
	fi
	step "brd: $nram RAM disks of $size MiB with the same random bytes"
	if [ -e /sys/module/brd ]; then rmmod brd || fail "brd is loaded and busy"; fi
	modprobe brd rd_nr="$nram" rd_size=$((size << 10)) || fail "modprobe brd"
	dd if=/dev/urandom of=/dev/ram0 bs=1M count="$size" oflag=direct status=none || fail "fill /dev/ram0"
	for i in $(seq 1 $((nram - 1))); do
		dd if=/dev/ram0 of="/dev/ram$i" bs=1M iflag=direct oflag=direct status=none || fail "fill /dev/ram$i"
	done

	step "the fabric's floor: perftest ib_read_lat and ib_read_bw, 4 KiB, on $RXE"
	fio_floors "$BIN/fio-floors.json" >"$LOGS/floors.txt" 2>&1 || fail "perftest: $(tail -n 5 "$LOGS/floors.txt")"
	cp "$LOGS/floors.txt" "$BIN/fio-floors.txt"
	cat "$BIN/fio-floors.txt"

	step "NVMe-oF RDMA: nvmet on /dev/ram0, nvme connect --nr-io-queues $BENCH_QUEUES"
	nvme=$(NVMET_NR_IO_QUEUES=$BENCH_QUEUES nvmet_setup /dev/ram0) || fail "nvmet setup"
	step "rblk: rblkd --export vol=/dev/ram1 --transport $TRANSPORT, rblk-attach --connections $BENCH_QUEUES"
	SERVE_VOL=/dev/ram1 serve rblkd.log "$BENCH_PORT" "$size" --cache-size $((size + 32))M
	attach attach.log "$size" --connections "$BENCH_QUEUES"
	rblk_dev=$DEV rblk_apid=$APID rblk_rblkd=$RBLKD
	BENCH_TGT["nvme-of rdma"]=kernel BENCH_TGT[rblk]=$RBLKD
	if [ -n "$before" ]; then
		step "rblk-before: $before/rblkd on /dev/ram2, $before/rblk-attach --connections $BENCH_QUEUES"
		RBLKD_BIN=$before/rblkd SERVE_VOL=/dev/ram2 serve rblkd-before.log "$BENCH_BEFORE_PORT" "$size" --cache-size $((size + 32))M
		ATTACH_BIN=$before/rblk-attach attach attach-before.log "$size" --connections "$BENCH_QUEUES"
		bdev=$DEV b_apid=$APID b_rblkd=$RBLKD
		BENCH_TGT[rblk-before]=$RBLKD
	fi
	if [ -n "$uram" ]; then
		step "rblk ublk: rblkd on /dev/ram$uram, rblk-attach --device ublk --connections $BENCH_QUEUES"
		SERVE_VOL=/dev/ram$uram serve rblkd-ublk.log "$BENCH_UBLK_PORT" "$size" --cache-size $((size + 32))M
		attach_ublk attach-ublk.log "$size" --connections "$BENCH_QUEUES"
		udev=$DEV u_apid=$APID u_rblkd=$RBLKD
		BENCH_TGT["rblk ublk"]=$RBLKD
	fi
	if [ -n "$mram" ]; then
		step "rblk mirror: rblkd on /dev/ram$mram and on /dev/ram$((mram + 1)), rblk-attach --connections $BENCH_QUEUES to each, md RAID1 over them"
		for i in 0 1; do
			SERVE_VOL=/dev/ram$((mram + i)) serve "rblkd-mirror$i.log" $((BENCH_MIRROR_PORT + i)) "$size" --cache-size $((size + 32))M
			attach "attach-mirror$i.log" "$size" --connections "$BENCH_QUEUES"
			m_devs+=("$DEV") m_apids+=("$APID") m_rblkds+=("$RBLKD")
		done
		BENCH_TGT["rblk mirror"]="${m_rblkds[*]}"
		# (as package mirror creates it over new copies; the two RAM disks
		# hold the same bytes, so the copies are in sync)
		mdadm --create /dev/md/rblk-bench --run --level=1 --raid-devices=2 --metadata=1.2 --bitmap="${BENCH_MIRROR_BITMAP:-internal}" \
			--name=rblk-bench --assume-clean --data-offset=4096K "${m_devs[@]}" >"$LOGS/mdadm-bench.log" 2>&1 ||
			fail "mdadm --create: $(tail -n 3 "$LOGS/mdadm-bench.log")"
		# The array is its members' holder: /dev/md/NAME may not be there
		# (after the udev scenario, udevd runs without mdadm's rules, and
		# mdadm leaves the link to it: "timeout waiting for /dev/md/...").
		mdev=/dev/$(ls "/sys/block/${m_devs[0]#/dev/}/holders/" 2>/dev/null | head -n 1)
		[ -b "$mdev" ] && [ -d "/sys/block/${mdev#/dev/}/md" ] || fail "the mirror's md device: none holds ${m_devs[0]}"
	fi
	if [ -n "$tram" ]; then
		step "NVMe/TCP: nvmet-tcp on /dev/ram$tram, nvme connect -t tcp 127.0.0.1 --nr-io-queues $BENCH_QUEUES"
		tnvme=$(NVMET_TRTYPE=tcp NVMET_ADDR=127.0.0.1 NVMET_PORT=$BENCH_NVMET_TCP_PORT NVMET_PORTID=2 NVMET_NQN=$BENCH_NVMET_TCP_NQN \
			NVMET_NR_IO_QUEUES=$BENCH_QUEUES nvmet_setup "/dev/ram$tram") || fail "nvmet-tcp setup"
		step "rblk tcp: rblkd --transport tcp on /dev/ram$((tram + 1)), rblk-attach --transport tcp --connections $BENCH_QUEUES, on 127.0.0.1"
		TRANSPORT=tcp IP=127.0.0.1 SERVE_VOL=/dev/ram$((tram + 1)) serve rblkd-tcp.log "$BENCH_TCP_PORT" "$size" --cache-size $((size + 32))M
		TRANSPORT=tcp attach attach-tcp.log "$size" --connections "$BENCH_QUEUES"
		tdev=$DEV t_apid=$APID t_rblkd=$RBLKD
		BENCH_TGT["nvme-of tcp"]=kernel BENCH_TGT["rblk tcp"]=$RBLKD
	fi
	# The NBD front end's floor: a /dev/nbdN like rblk's (as many
	# connections, 4 KiB blocks) on nbdkit's null plugin, nothing behind it.
	if nbd_null_available; then
		ndev=$(free_nbd) || fail "no free /dev/nbdN"
		step "nbd null: nbdkit null ${size}M on a unix socket, nbd-client -connections $BENCH_QUEUES on $ndev"
		nbd_null_setup "$ndev" "$size" "$BENCH_QUEUES" 2>>"$LOGS/nbd-null.log" ||
			fail "nbd null on $ndev: $(tail -n 3 "$LOGS/nbd-null.log")"
		# (a floor for rblk's device only with as many queues as it has)
		[ "$(hw_queues "$ndev")" = "$(hw_queues "$rblk_dev")" ] ||
			fail "nbd null: $ndev has $(hw_queues "$ndev") hardware queues, rblk's $rblk_dev $(hw_queues "$rblk_dev")"
	fi
	{
		echo "kernel $(uname -r), $(nproc) CPUs; each device a brd RAM disk of $size MiB; fio $FIO_RAMP s warm + $FIO_RUNTIME s measured, ${FIO_REPS:-2} reps interleaved"
		echo "nvme-of rdma: $nvme, $(hw_queues "$nvme") hardware queues (nvme connect --nr-io-queues $BENCH_QUEUES)"
		echo "rblk: $rblk_dev, $(hw_queues "$rblk_dev") hardware queues (rblk-attach --connections $BENCH_QUEUES)"
		[ -z "$bdev" ] || echo "rblk-before: $bdev, $(hw_queues "$bdev") hardware queues ($before)"
		[ -z "$udev" ] || echo "rblk ublk: $udev, $(hw_queues "$udev") hardware queues (rblk-attach --device ublk --connections $BENCH_QUEUES)"
		[ -z "$tnvme" ] || echo "nvme-of tcp: $tnvme, $(NVMET_NQN=$BENCH_NVMET_TCP_NQN hw_queues "$tnvme") hardware queues (nvme connect -t tcp 127.0.0.1 --nr-io-queues $BENCH_QUEUES)${BENCH_TCP_JOBS:+; only $BENCH_TCP_JOBS}"
		[ -z "$tdev" ] || echo "rblk tcp: $tdev, $(hw_queues "$tdev") hardware queues (rblkd and rblk-attach --transport tcp on 127.0.0.1, --connections $BENCH_QUEUES)${BENCH_TCP_JOBS:+; only $BENCH_TCP_JOBS}"
		[ -z "$mdev" ] || echo "rblk mirror: $mdev, md RAID1 (bitmap ${BENCH_MIRROR_BITMAP:-internal}, chunk $(cat "/sys/block/${mdev#/dev/}/md/bitmap/chunksize" 2>/dev/null || echo none)) over ${m_devs[*]} (rblk-attach --connections $BENCH_QUEUES each, on two rblkd)${BENCH_MIRROR_JOBS:+; only $BENCH_MIRROR_JOBS}"
		if [ -n "$ndev" ]; then
			echo "nbd null: $ndev, $(hw_queues "$ndev") hardware queues (nbdkit null on a unix socket, nbd-client -connections $BENCH_QUEUES): the NBD front end alone, no network, no data${BENCH_NULL_JOBS:+; only $BENCH_NULL_JOBS}"
		else
			echo "nbd null: no column (nbdkit or nbd-client missing on the host: apt-get install nbdkit nbd-client)"
		fi
	} | tee "$BIN/fio-info.txt"

	# (rblkd's cache loads each chunk on its first access; nvmet on brd has
	# no cache to warm)
	# Each queue of a device has its own grants, and blk-mq sends a request
	# to the queue of the CPU that submits it: one read from each CPU, so
	# that no measured run pays for the grants (the 4k QD1 read, first,
	# did: its rblkd CPU per IO was the grant requests').
	step "warm-up (not measured): a sequential read of each rblk device from each CPU"
	local cpu
	for d in "$rblk_dev" ${bdev:+"$bdev"} ${udev:+"$udev"} ${tdev:+"$tdev"} "${m_devs[@]}"; do
		for cpu in $(seq 0 $(($(nproc) - 1))); do
			taskset -c "$cpu" dd if="$d" of=/dev/null bs=1M iflag=direct status=none || fail "warm-up read of $d on CPU $cpu"
		done
	done

	step "fio: $FIO_JOBS; ${FIO_REPS:-2} reps, interleaved"
	rm -f "$csv"
	local devs=("nvme-of rdma=$nvme" "rblk=$rblk_dev")
	[ -z "$bdev" ] || devs+=("rblk-before=$bdev")
	[ -z "$udev" ] || devs+=("rblk ublk=$udev")
	if [ -n "$ndev" ]; then
		local nj='' j
		for j in $BENCH_NULL_JOBS; do
			case " $FIO_JOBS " in *" $j "*) nj+=$j, ;; *) fail "BENCH_NULL_JOBS: '$j' is none of FIO_JOBS ($FIO_JOBS)" ;; esac
		done
		devs+=("nbd null=$ndev${nj:+=$nj}")
	fi
	if [ -n "$mdev" ]; then
		local mj='' j
		for j in $BENCH_MIRROR_JOBS; do
			case " $FIO_JOBS " in *" $j "*) mj+=$j, ;; *) fail "BENCH_MIRROR_JOBS: '$j' is none of FIO_JOBS ($FIO_JOBS)" ;; esac
		done
		devs+=("rblk mirror=$mdev${mj:+=$mj}")
	fi
	local tj='' tcp_jobs=$FIO_JOBS
	if [ -n "$tdev" ]; then
		local j
		for j in $BENCH_TCP_JOBS; do
			case " $FIO_JOBS " in *" $j "*) tj+=$j, ;; *) fail "BENCH_TCP_JOBS: '$j' is none of FIO_JOBS ($FIO_JOBS)" ;; esac
		done
		[ -z "$BENCH_TCP_JOBS" ] || tcp_jobs=$BENCH_TCP_JOBS
		devs+=("nvme-of tcp=$tnvme${tj:+=$tj}" "rblk tcp=$tdev${tj:+=$tj}")
	fi
	fio_interleaved "$csv" "${devs[@]}" || rc=1
	# What rblk-attach batched over the whole run (every job, every rep).
	{
		bench_batching rblk "$BENCH_PORT"
		[ -z "$bdev" ] || bench_batching rblk-before "$BENCH_BEFORE_PORT"
		[ -z "$tdev" ] || bench_batching "rblk tcp" "$BENCH_TCP_PORT"
		if [ -n "$mdev" ]; then
			bench_batching "mirror leg 0" "$BENCH_MIRROR_PORT"
			bench_batching "mirror leg 1" $((BENCH_MIRROR_PORT + 1))
		fi
	} >"$BIN/fio-batching.txt"
	if [ -s "$csv" ]; then
		cp "$csv" "$BIN/fio-table.csv"
		fio_json "$csv" >"$BIN/fio-table.json"
		{
			grep '^fabric floor' "$BIN/fio-floors.txt"
			cat "$BIN/fio-info.txt"
			fio_table "$csv" "nvme-of rdma" rblk "${bdev:+rblk-before}" ${udev:+"rblk ublk"} ${ndev:+"nbd null"} ${mdev:+"rblk mirror"}
			[ -z "$ndev" ] || fio_share "$csv" "nbd null" rblk
			echo
			echo "what rblk-attach batched (the whole run, every job):"
			cat "$BIN/fio-batching.txt"
			if [ -n "$mdev" ]; then
				echo
				echo "the mirror beside one rblk device (each write goes to both copies):"
				fio_table "$csv" rblk "rblk mirror"
			fi
			if [ -n "$tdev" ]; then
				echo
				echo "the software transport beside the kernel's NVMe/TCP, both over the loopback:"
				fio_table "$csv" "nvme-of tcp" "rblk tcp"
			fi
			echo
			echo "targets (medians of this run):"
			fio_check "$csv" "4k writes at QD32 over NBD, 0.6x NVMe-oF RDMA" rblk "nvme-of rdma" 0.6 randwrite-4k-qd32
			if [ -n "$udev" ]; then
				fio_check "$csv" "4k writes at QD32 over ublk, 0.8x NVMe-oF RDMA" "rblk ublk" "nvme-of rdma" 0.8 randwrite-4k-qd32
				fio_check "$csv" "4k reads at depth over ublk, 1.0x NVMe-oF RDMA" "rblk ublk" "nvme-of rdma" 1.0 randread-4k-qd32 randread-4k-qd16x2
			fi
			# shellcheck disable=SC2086 # a list of jobs
			[ -z "$tdev" ] || fio_check "$csv" "rblk tcp, 1.0x NVMe/TCP" "rblk tcp" "nvme-of tcp" 1.0 $tcp_jobs
			fio_check "$csv" "rblkd's CPU per 4k read under a tenth of the NVMe-oF target's" rblk "nvme-of rdma" "tgt<0.1" randread-4k-qd1 randread-4k-qd32
			[ -z "$tdev" ] || fio_check "$csv" "rblkd's CPU per 4k read over tcp, beside NVMe/TCP's target" "rblk tcp" "nvme-of tcp" "tgt<1" randread-4k-qd1 randread-4k-qd32
		} | tee "$BIN/fio-table.txt"
	fi
	[ "$rc" = 0 ] || fail "a fio job failed"

	step "teardown"
	nvmet_teardown
	nbd_null_teardown 2>>"$LOGS/nbd-null.log" || fail "nbd null teardown: $(tail -n 3 "$LOGS/nbd-null.log")"
	curl -fsS "$TM/metrics" | grep -E '^rblkd_(grants|revokes|cache_loads|cache_evictions|written_bytes|writeback_bytes)_total' || true
	if [ -n "$bdev" ]; then
		DEV=$bdev APID=$b_apid detach
		RBLKD=$b_rblkd stop_rblkd
	fi
	if [ -n "$udev" ]; then
		DEV=$udev APID=$u_apid detach
		RBLKD=$u_rblkd stop_rblkd
	fi
	if [ -n "$tdev" ]; then
		DEV=$tdev APID=$t_apid detach
		RBLKD=$t_rblkd stop_rblkd
	fi
	if [ -n "$mdev" ]; then
		mdadm --stop "$mdev" >>"$LOGS/mdadm-bench.log" 2>&1 || fail "mdadm --stop: $(tail -n 3 "$LOGS/mdadm-bench.log")"
		for i in 0 1; do
			DEV=${m_devs[i]} APID=${m_apids[i]} detach
			RBLKD=${m_rblkds[i]} stop_rblkd
		done
	fi
	DEV=$rblk_dev APID=$rblk_apid detach
	RBLKD=$rblk_rblkd stop_rblkd
	rmmod brd || fail "rmmod brd"
}

# ublk: rblk-attach --device ublk (Linux >= 6.0 with ublk_drv, e.g. 6.12);
# on a kernel without the driver (Debian's 6.1), a fast refusal in one line.
scen_ublk() {
	local size=256 mnt=$WORK/mnt a f0 f1 sum
	mkdir -p "$mnt"
	if ! has_ublk; then
		step "no ublk_drv in $(uname -r): --device ublk is refused at once, in one line"
		# (a target nobody serves: the refusal comes before any contact)
		refused noublk.log 'ublk: the kernel has no ublk_drv \(Linux >= 6\.0 with CONFIG_BLK_DEV_UBLK; modprobe ublk_drv\)' \
			attach --target "$IP:9" --export vol --transport "$TRANSPORT" --host-id "$HOST_ID" --secret-file "$SECRET" --device ublk
		[ "$(grep -c . "$LOGS/noublk.log")" = 1 ] || fail "more than one line: $(cat "$LOGS/noublk.log")"
		return 0
	fi
	step "rblkd serve --transport $TRANSPORT; rblk-attach --device ublk"
	serve rblkd.log 7487 "$size" --cache-size 384M
	attach_ublk attach.log "$size"
	for a in write_cache fua discard_max_bytes write_zeroes_max_bytes max_sectors_kb logical_block_size; do
		printf '  %-24s %s\n' "$a" "$(cat "/sys/block/${DEV#/dev/}/queue/$a")"
	done
	echo "  hardware queues          $(hw_queues "$DEV") ($(nproc) CPUs)"
	[ "$(cat "/sys/block/${DEV#/dev/}/queue/write_cache")" = "write back" ] || fail "FLUSH not enabled on $DEV"
	[ "$(hw_queues "$DEV")" = "$(nproc)" ] || fail "$(hw_queues "$DEV") hardware queues, want one per CPU ($(nproc))"

	step "fio --verify=crc32c on $DEV: 4k at QD1, 32 and 128, 1M at QD8, randrw 64k"
	fio_verify ublk-4k-qd1 --rw=randwrite --bs=4k --iodepth=1 --size=4M
	fio_verify ublk-4k-qd32 --rw=randwrite --bs=4k --iodepth=32 --size=32M
	fio_verify ublk-4k-qd128 --rw=randwrite --bs=4k --iodepth=128 --numjobs=1 --size=32M
	fio_verify ublk-1m-qd8 --rw=write --bs=1M --iodepth=8 --size=128M
	fio_verify ublk-randrw-64k --rw=randrw --bs=64k --iodepth=16 --size=64M

	step "write-zeroes reads back as zeroes; discard succeeds"
	dd if=/dev/urandom of="$DEV" bs=1M count=2 oflag=direct status=none || fail "write 2 MiB"
	blkdiscard -z -o 0 -l $((1 << 20)) "$DEV" || fail "blkdiscard -z (WRITE_ZEROES) on $DEV"
	cmp -n $((1 << 20)) <(dd if="$DEV" bs=1M count=1 iflag=direct status=none) /dev/zero || fail "zeroed range does not read back as zeroes"
	blkdiscard -o $((1 << 20)) -l $((1 << 20)) "$DEV" || fail "blkdiscard (DISCARD) on $DEV"
	echo "write_zeroes ok: $(m 'rblkd_requests_total{op="write_zeroes",result="ok"}'), trims ok: $(m 'rblkd_requests_total{op="trim",result="ok"}')"

	step "a flush reaches the target"
	f0=$(m 'rblkd_requests_total{op="flush",result="ok"}')
	flush_dev || fail "fsync of $DEV"
	f1=$(m 'rblkd_requests_total{op="flush",result="ok"}')
	echo "rblkd flushes: $f0 -> $f1"
	[ "$f1" -gt "$f0" ] || fail "fsync of $DEV sent no flush to rblkd"

	step "mkfs.ext4, mount, a file, sync, umount: the backing file holds the device's bytes"
	mkfs.ext4 -q -F "$DEV" || fail "mkfs.ext4"
	mount "$DEV" "$mnt" || fail "mount"
	head -c $((24 << 20)) /dev/urandom >"$mnt/data" || fail "write a file"
	sum=$(sha256sum <"$mnt/data" | cut -d' ' -f1)
	f0=$(m 'rblkd_requests_total{op="flush",result="ok"}')
	sync || fail "sync"
	umount "$mnt" || fail "umount"
	f1=$(m 'rblkd_requests_total{op="flush",result="ok"}')
	[ "$f1" -gt "$f0" ] || fail "sync and umount sent no flush to rblkd ($f0 -> $f1)"
	cmp <(dd if="$DEV" bs=1M iflag=direct status=none) "$VOL" || fail "$DEV and rblkd's backing file differ after a flush"
	echo "$DEV reads back as rblkd's backing file ($size MiB); flushes $f0 -> $f1"

	step "rblk-attach detach $DEV: it exits 0, no /dev/ublk* is left"
	detach
	no_ublk_devices || fail "left behind: $(compgen -G '/dev/ublk[bc][0-9]*' | tr '\n' ' ')"
	[ "$(debugfs -R 'cat /data' "$VOL" 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$sum" ] ||
		fail "the file in the backing file's ext4 differs from what was written"
	e2fsck -fn "$VOL" >"$LOGS/e2fsck.log" 2>&1 || fail "e2fsck: $(tail -n 5 "$LOGS/e2fsck.log")"
	echo "the file in the backing file's ext4 has the sha256 written; e2fsck clean"

	step "attach again, mount, SIGTERM while mounted-then-unmounted: exits 0, no /dev/ublk* left"
	attach_ublk attach2.log "$size"
	mount "$DEV" "$mnt" || fail "mount again"
	[ "$(sha256sum <"$mnt/data" | cut -d' ' -f1)" = "$sum" ] || fail "the file differs after a re-attach"
	"$BIN/rblk-attach" detach "$DEV" >"$LOGS/detach-busy.log" 2>&1 && fail "detach of a mounted $DEV was not refused"
	grep -q 'in use' "$LOGS/detach-busy.log" || fail "detach of a mounted device: $(cat "$LOGS/detach-busy.log")"
	umount "$mnt" || fail "umount"
	kill -TERM "$APID"
	wait_exit "$APID" "rblk-attach attach (SIGTERM)"
	no_ublk_devices || fail "left behind after SIGTERM: $(compgen -G '/dev/ublk[bc][0-9]*' | tr '\n' ' ')"
	grep -q 'detached cleanly' "$LOGS/attach2.log" || fail "no clean detach in the log: $(tail -n 3 "$LOGS/attach2.log")"

	step "attach --read-only: the device is read-only, a write fails, reads work"
	attach_ublk attach-ro.log "$size" --read-only
	[ "$(blockdev --getro "$DEV")" = 1 ] || fail "$DEV is not read-only"
	if dd if=/dev/zero of="$DEV" bs=4k count=1 oflag=direct status=none 2>"$LOGS/ro-write.log"; then fail "a write to read-only $DEV succeeded"; fi
	cmp -n $((4 << 20)) <(dd if="$DEV" bs=1M count=4 iflag=direct status=none) "$VOL" || fail "read-only $DEV reads other bytes than the backing file"
	echo "read-only: write refused ($(head -n 1 "$LOGS/ro-write.log")), reads match"
	detach

	step "rblk-attach killed with SIGKILL: rblk-attach detach removes what the kernel kept"
	attach_ublk attach3.log "$size"
	kill -KILL "$APID"
	wait "$APID" 2>/dev/null || true
	sleep 1
	echo "after SIGKILL: $(compgen -G '/dev/ublk[bc][0-9]*' | tr '\n' ' ')"
	"$BIN/rblk-attach" detach "$DEV" >"$LOGS/detach-killed.log" 2>&1 || fail "detach after SIGKILL: $(cat "$LOGS/detach-killed.log")"
	cat "$LOGS/detach-killed.log"
	wait_for 10 no_ublk_devices || fail "left behind after SIGKILL and detach: $(compgen -G '/dev/ublk[bc][0-9]*' | tr '\n' ' ')"
	stop_rblkd
}

# small-cache: a healthy initiator (2 queues, one per CPU) under revokes,
# with a CPU hog beside it (RBLK_VM_HOG, default 1: a busy loop on every
# vCPU at normal priority, as other jobs on a loaded machine): rblkd must
# never take it for a hog and drop its sessions, so rblk-attach's
# reconnects stay 0.
scen_small_cache() {
	local size=256
	step "rblkd with --cache-size 64M for a $size MiB volume (1M chunks)"
	serve rblkd.log 7481 "$size" --cache-size 64M
	attach attach.log "$size"
	if [ "${RBLK_VM_HOG:-1}" = 1 ]; then
		hog_start
		pids+=("${HOG_PIDS[@]}")
	fi
	step "fio verify randrw 4k QD32 over the whole volume${HOG_PIDS[*]:+, beside a CPU hog}"
	fio_verify small-cache --rw=randrw --bs=4k --iodepth=32 --size="${size}M" --io_size=8M
	hog_stop
	local rev ev loads rc
	rev=$(m rblkd_revokes_total) ev=$(m rblkd_cache_evictions_total) loads=$(m rblkd_cache_loads_total)
	rc=$(am rblk_attach_reconnects_total)
	echo "rblkd: revokes $rev, evictions $ev, cache loads $loads; rblk-attach: revokes $(am rblk_attach_revokes_total), reconnects $rc"
	[ "$ev" -gt 0 ] || fail "no cache eviction with a cache smaller than the volume"
	[ "$rev" -gt 0 ] || fail "no grant revoked with a cache smaller than the volume"
	[ "$rc" = 0 ] || fail "rblk-attach reconnected $rc times under revokes"
	detach
	stop_rblkd
}

# The kernel log, scenario by scenario (logs/*/kernel.log): generic kernel
# failures, and errors of rxe, RDMA, nbd, NVMe. DMESG_ALLOW: lines known to
# be harmless anywhere; DMESG_ALLOW_VERBS: in the verbs scenario only (its
# BadRKey and Deregistered tests make rxe complete work requests with remote
# access and operation errors on purpose; 6.12's rxe logs each one).
DMESG_FATAL='Call Trace|BUG:|kernel BUG|WARNING:|blocked for more than|hung_task|Oops|general protection fault|soft lockup|hard LOCKUP|rcu: INFO:|rcu.*(self-detected stall|detected stalls)|UBSAN|KASAN|list_(add|del) corruption|refcount_t:|I/O error|EXT4-fs error'
DMESG_DRIVER='(rxe|rdma|infiniband|ib_|nbd|nvme|ublk).*(err|fail|warn|timeout|timed out|stuck|abort|reset)'
DMESG_ALLOW='^$'
DMESG_ALLOW_VERBS='rxe[0-9]+: qp#[0-9]+ (make_send_cqe|do_complete): non-flush error status = [0-9]+$'
# The bench's fabric floor: perftest's client or server has been seen to
# crash in librdmacm under a loaded host (a user-space fault, which
# fio_floors' _perftest tries again); nothing of the kernel's.
DMESG_ALLOW_BENCH='traps: ib_read_(bw|lat)\[[0-9]+\] general protection fault ip:[0-9a-f]+ sp:[0-9a-f]+ error:[0-9a-f]+ in librdmacm\.so[.0-9]*\[[0-9a-f]+,[0-9a-f]+\+[0-9a-f]+\]$'
# DMESG_ALLOW_FAULTS: in the e2e and soak scenarios only, whose tests inject
# faults on purpose: rblkd killed with SIGKILL or stopped with SIGSTOP while
# RDMA operations are in flight, stale rkeys after a revoke, a close, a
# takeover (rxe completes them with remote access and flush errors; 6.12
# logs each one), and with RBLK_E2E_DEVICE=nbd the kernel's device failing
# the IO that the tests expect to fail (a fenced holder's writes, a read on
# a dead link, the FLUSH that reports lost writes), or sending again after
# their request timeout the requests a killed rblk-attach had read (the
# node plugin's restart drill, whose new rblk-attach adopts the device),
# or its NBD_CMD_DISC on sockets an rblk-attach that lost its session for
# good (fenced, or --fail-on-lost-writes: the mirror drill) has closed;
# and md's lines on the failing member of the mirror drills (a copy's
# FLUSH or superblock write failing fast while its target is away); and a
# memory registration that ended with EINTR (-4) because the process
# registering was killed (the pinning of its pages gives up on a fatal
# signal: a test's cleanup SIGKILLs an rblkd or rblk-attach that is still
# starting; 6.12 logs it).
# The tests check the results; call traces, BUG, WARNING, hung tasks and the like stay fatal.
DMESG_ALLOW_FAULTS='rxe[0-9]+: qp#[0-9]+ [a-z_]+: non-flush error status = [0-9]+$|block nbd[0-9]+: (Other side returned error \([0-9]+\)|Receive control failed \(result -[0-9]+\)|shutting down sockets|Dead connection, failed to find a fallback|Connection timed out(, retrying \([0-9]+/[0-9]+ alive\))?|Device being setup by another task|Attempted send on invalid socket|Send control failed \(result -[0-9]+\)|Send data failed \(result -[0-9]+\)|Send disconnect failed -[0-9]+)$|I/O error, dev nbd[0-9]+, sector [0-9]+ op 0x[0-9a-f]+:\((READ|WRITE|FLUSH|DISCARD|WRITE_ZEROES)\) flags 0x[0-9a-f]+ phys_seg [0-9]+ prio class [0-9]+$|Buffer I/O error on dev nbd[0-9]+, logical block [0-9]+, (lost async page write|async page read)$|md: nbd[0-9]+ flush io error -[0-9]+$|md: super_written gets error=-[0-9]+$|rxe[0-9]+: pd#[0-9]+ rxe_reg_user_mr: returned err = -4$'
# refused LOG WANT ARGS...: rblk-attach ARGS must fail at once, its output
# naming WANT (grep -E).
refused() {
	local log=$1 want=$2 rc=0
	shift 2
	timeout 30 "$BIN/rblk-attach" "$@" >"$LOGS/$log" 2>&1 || rc=$?
	[ "$rc" != 0 ] && [ "$rc" != 124 ] || fail "rblk-attach $* exited $rc, want a refusal"
	grep -qE -- "$want" "$LOGS/$log" || fail "rblk-attach $*: no '$want' in: $(tail -n 3 "$LOGS/$log")"
	echo "refused as expected: $(grep -m1 '^rblk-attach:' "$LOGS/$log")"
}

# ---------------------------------------------------------------------------
# Go test binaries in the guest: the e2e suite over verbs, and the soak
# ---------------------------------------------------------------------------
# gotest LOG BIN ARGS...: the Go test binary BIN with -test.v, run from a
# fresh folder in /tmp, its output in LOG; returns its exit code.
gotest() {
	local log=$1 bin=$2 rc=0 dir
	shift 2
	dir=$(mktemp -d /tmp/gotest.XXXXXX)
	(cd "$dir" && "$bin" -test.v -test.count=1 "$@") >"$log" 2>&1 || rc=$?
	rm -rf "$dir"
	return "$rc"
}

# verdict NAME LOG RC [LOGDIR [STRICT]]: one line on what the run of NAME
# (output LOG, exit code RC) did: tests passed, failed (by name), skipped,
# not applicable; and every panic, fatal error and data race in LOG and in
# the process logs under LOGDIR (rblkd and rblk-attach, RBLK_E2E_LOG_DIR),
# wherever it happened, failed test or not. With STRICT (the e2e suite with
# RBLK_E2E_REQUIRE=1) a skip that is not a deliberate NOT APPLICABLE is a
# failure too. Sets FAILED_TESTS; returns 1 if anything failed.
verdict() {
	local name=$1 log=$2 rc=$3 dir=${4:-} strict=${5:-} pass fail skip na bad='' badskip='' f
	pass=$(grep -cE -- '^\s*--- PASS' "$log" || true)
	FAILED_TESTS=$(grep -oE -- '^\s*--- FAIL: [^ ]+' "$log" | awk '{ print $3 }' | sort -u | tr '\n' ' ' || true)
	fail=$(wc -w <<<"$FAILED_TESTS")
	skip=$(grep -cE -- '^\s*--- SKIP' "$log" || true)
	# (the tests that were not applicable: the list e2e's TestMain prints
	# last, "  TestName: reason")
	na=$(sed -n '/^e2e: [0-9]* tests not applicable/,$p' "$log" | sed -n 's/^  \(Test[^: ]*\): .*/\1/p' | sort -u)
	if [ -n "$strict" ]; then
		badskip=$(grep -oE -- '^\s*--- SKIP: [^ ]+' "$log" | awk '{ print $3 }' | sort -u | grep -vxF -f <(echo "${na:-^}") | tr '\n' ' ' || true)
	fi
	na=$(grep -c . <<<"$na" || true)
	# (anchored: the processes' own output; a test that prints such a
	# string in a log line is indented)
	bad=$(grep -lE '^(panic: |fatal error: |WARNING: DATA RACE)' "$log" ${dir:+$(find "$dir" -name '*.log' 2>/dev/null)} 2>/dev/null | tr '\n' ' ' || true)
	echo "$name: exit $rc; $pass passed, $fail failed${FAILED_TESTS:+ ($FAILED_TESTS)}, $skip skipped ($na not applicable)${badskip:+; skipped without being not applicable: $badskip}${bad:+; PANIC OR RACE in: $bad}"
	for f in $bad; do
		grep -m 3 -B2 -A12 -E '^(panic: |fatal error: |WARNING: DATA RACE)' "$f" | sed "s|^|  ${f##*/}: |" | head -n 40
	done
	[ "$rc" = 0 ] && [ "$fail" = 0 ] && [ -z "$bad" ] && [ -z "$badskip" ]
}

# The e2e suite's give-up bounds (how long it waits for a daemon, a metric,
# a command, fio) stretched RBLK_VM_TIME_SCALE times (default 4): under
# TCG, with -race and four tests at once on two vCPUs, a machine that
# emulates slowly takes that much longer (RBLK_E2E_TIME_SCALE, e2e/).
E2E_TIME_SCALE=${RBLK_VM_TIME_SCALE:-4}

# The kernel's hung-task report (a task in D state for
# hung_task_timeout_secs, 120 by default: fatal in the dmesg scenario)
# stretched the same way. Under TCG with the suite's tests at once, IO on
# a loop device over nbdfuse is slow: TestExt4OverNbdfuse's sync of 10 MB
# took 22 s to 109 s in four 6.1 runs, and once its ext4 journal thread
# stayed blocked past 120 s (the test passed; likely waiting behind the
# writes queued before its commit, not measured). An IO that never completes is still reported, 480 s in.
# (The scale may be a fraction, as the e2e suite takes it.)
if [ -w /proc/sys/kernel/hung_task_timeout_secs ]; then
	awk -v s="$E2E_TIME_SCALE" 'BEGIN { t = int(120 * s); print (t < 120 ? 120 : t) }' >/proc/sys/kernel/hung_task_timeout_secs
fi

# e2e: the e2e suite (e2e/, built with -race -tags rdma,failpoints, as are
# the rblkd and rblk-attach it drives, in race/) over the verbs provider on
# rxe0 (RBLK_E2E_TRANSPORT=rdma, RBLK_E2E_ADDR), once per device of
# RBLK_VM_E2E_DEVICES (default "socket nbd": rblk-attach's NBD socket with
# the userspace clients, then the kernel's /dev/nbdN), RBLK_E2E_REQUIRE=1:
# nothing skips for a missing tool, and tests that cannot run over rdma or
# on a device say why (NOT APPLICABLE). RBLK_VM_E2E_RUN (-test.run) picks
# tests, RBLK_VM_E2E_SKIP (-test.skip) leaves tests out, said in the
# summary (the test command leaves out there what the soak runs on the same
# kernel, for time), RBLK_VM_E2E_PARALLEL is -test.parallel (default 4:
# the tests mostly wait, on keepalives, slow disks and restarts).
# Output and every process's log in logs/e2e/DEVICE/.
scen_e2e() {
	local d out rc failed='' skip=()
	[ -z "${RBLK_VM_E2E_SKIP:-}" ] || skip=(-test.skip "$RBLK_VM_E2E_SKIP")
	[ -x "$BIN/e2e.test" ] || fail "no e2e.test beside the binaries"
	[[ " ${RBLK_VM_E2E_DEVICES:-socket nbd} " == *" nbd "* ]] ||
		echo "device nbd: not on this kernel (RBLK_VM_E2E_DEVICES=$RBLK_VM_E2E_DEVICES)" | tee -a "$BIN/e2e-summary.txt"
	for d in ${RBLK_VM_E2E_DEVICES:-socket nbd}; do
		out=$BIN/logs/e2e/$d
		mkdir -p "$out/procs"
		step "e2e suite over rdma ($IP), device $d: e2e.test -test.run '${RBLK_VM_E2E_RUN:-.}'${skip[*]:+ -test.skip '$RBLK_VM_E2E_SKIP'}"
		rc=0
		RBLK_E2E_TRANSPORT=rdma RBLK_E2E_ADDR=$IP RBLK_E2E_TIME_SCALE=$E2E_TIME_SCALE RBLK_E2E_DEVICE=$d RBLK_E2E_REQUIRE=1 RBLK_E2E_BIN_DIR=$BIN/race \
			RBLK_E2E_LOG_DIR=$out/procs gotest "$out/e2e-test.log" "$BIN/e2e.test" -test.timeout=30m \
			-test.parallel "${RBLK_VM_E2E_PARALLEL:-4}" -test.run "${RBLK_VM_E2E_RUN:-.}" "${skip[@]}" || rc=$?
		verdict "e2e over rdma, device $d${skip[*]:+ (left out: $RBLK_VM_E2E_SKIP)}" "$out/e2e-test.log" "$rc" "$out/procs" strict >"$out/verdict.txt" || failed+="$d "
		tee -a "$BIN/e2e-summary.txt" <"$out/verdict.txt"
		sed -n '/^e2e: [0-9]* tests not applicable/,$p' "$out/e2e-test.log" | grep -E '^(e2e: |  Test)' | cut -c1-220 || true
	done
	# RBLK_VM_E2E_ALSO_DEVICE and _RUN: some tests on another device too
	# (the mirror drills on /dev/nbdN, where the suite runs on the socket).
	if [ -n "${RBLK_VM_E2E_ALSO_DEVICE:-}" ]; then
		d=$RBLK_VM_E2E_ALSO_DEVICE
		out=$BIN/logs/e2e/$d-also
		mkdir -p "$out/procs"
		step "e2e tests over rdma ($IP), device $d: e2e.test -test.run '$RBLK_VM_E2E_ALSO_RUN'"
		rc=0
		RBLK_E2E_TRANSPORT=rdma RBLK_E2E_ADDR=$IP RBLK_E2E_TIME_SCALE=$E2E_TIME_SCALE RBLK_E2E_DEVICE=$d RBLK_E2E_REQUIRE=1 RBLK_E2E_BIN_DIR=$BIN/race \
			RBLK_E2E_LOG_DIR=$out/procs gotest "$out/e2e-test.log" "$BIN/e2e.test" -test.timeout=30m \
			-test.parallel "${RBLK_VM_E2E_PARALLEL:-4}" -test.run "$RBLK_VM_E2E_ALSO_RUN" || rc=$?
		verdict "e2e over rdma, device $d (only $RBLK_VM_E2E_ALSO_RUN)" "$out/e2e-test.log" "$rc" "$out/procs" strict >"$out/verdict.txt" || failed+="$d-also "
		tee -a "$BIN/e2e-summary.txt" <"$out/verdict.txt"
	fi
	[ -z "$failed" ] || fail "the e2e suite over rdma failed on device(s): $failed(logs/e2e/DEVICE/e2e-test.log)"
}

# csi: the CSI conformance suite (csi-sanity, scripts/csi-sanity.sh)
# against rblk-csi and rblkd over rdma, the node attaching each volume with
# rblk-attach on the kernel's /dev/nbdN, four runs: every spec with ext4,
# then the Node specs with xfs and with block volumes, then the Node specs
# of a StorageClass of replicas: 2 (two rblkd; each volume an md RAID1
# over two /dev/nbdN) with ext4 (and block volumes with
# RBLK_VM_CSI_MIRROR_BLOCK=1; RBLK_VM_CSI_RUNS=short: the first and the
# last run alone). Logs in logs/csi/,
# the summary lines in csi-summary.txt.
scen_csi() {
	local run fs access size focus replicas name rc failed=''
	[ -x "$BIN/rblk-csi" ] && [ -x "$BIN/csi-sanity" ] && [ -f "$BIN/csi-sanity.sh" ] || fail "no rblk-csi, csi-sanity or csi-sanity.sh beside the binaries"
	modprobe nbd nbds_max=16 2>/dev/null || true
	modprobe raid1 2>/dev/null || true
	: >"$BIN/csi-summary.txt"
	local runs=("ext4 mount $((64 << 20)) . 1" "xfs mount $((320 << 20)) Node.Service 1" "ext4 block $((64 << 20)) Node.Service 1"
		"ext4 mount $((64 << 20)) Node.Service 2")
	# (RBLK_VM_CSI_RUNS=short: the first and the last, ext4 alone; the test
	# command's, for time)
	[ "${RBLK_VM_CSI_RUNS:-all}" != short ] || runs=("${runs[0]}" "${runs[3]}")
	# (block volumes of replicas 2 too with RBLK_VM_CSI_MIRROR_BLOCK=1: the
	# test command leaves them out, for time)
	[ "${RBLK_VM_CSI_MIRROR_BLOCK:-0}" = 0 ] || runs+=("ext4 block $((64 << 20)) Node.Service 2")
	for run in "${runs[@]}"; do
		read -r fs access size focus replicas <<<"$run"
		name=$fs-$access
		[ "$replicas" = 1 ] || name+=-replicas$replicas
		step "csi-sanity: $fs, $access volumes, focus $focus, replicas $replicas"
		rc=0
		TMPDIR=$WORK RBLK_CSI_BIN=$BIN CSI_SANITY_BIN=$BIN/csi-sanity RBLK_CSI_TRANSPORT=rdma RBLK_CSI_LISTEN=$IP:7660 \
			RBLK_CSI_NODE=1 RBLK_CSI_FS=$fs RBLK_CSI_ACCESS=$access RBLK_CSI_VOLUME_SIZE=$size CSI_SANITY_FOCUS=$focus \
			RBLK_CSI_REPLICAS=$replicas timeout 900 bash "$BIN/csi-sanity.sh" >"$LOGS/csi-$name.log" 2>&1 || rc=$?
		{
			printf '%s, %s, replicas %s: exit %d: ' "$fs" "$access" "$replicas" "$rc"
			grep -E '^(SUCCESS|FAIL)! --' "$LOGS/csi-$name.log" | tail -1 || echo "no summary"
		} | tee -a "$BIN/csi-summary.txt"
		grep -E '^\s*\[FAIL\]' "$LOGS/csi-$name.log" | head -20 || true
		[ "$rc" = 0 ] || failed+="$name "
	done
	# (No array is left: each unstage stopped its own.)
	if [ -e /proc/mdstat ] && grep -q '^md' /proc/mdstat; then
		cat /proc/mdstat
		failed+="md-arrays-left "
	fi
	mkdir -p "$BIN/logs/csi"
	cp "$LOGS"/csi-*.log "$BIN/logs/csi/" 2>/dev/null || true
	[ -z "$failed" ] || fail "csi-sanity failed: $failed(logs/csi/)"
}

# soak: RBLK_VM_SOAK_RUNS (default 1) runs in a row, each under a CPU hog
# (RBLK_VM_HOG, default 1: a busy loop on every vCPU, at normal priority,
# started here and killed after), of the Go tests that exercise the verbs
# provider, built with -race (-tags rdma,failpoints; RBLK_RDMA_FAILPOINTS
# passes through when set): the target's tests (RBLK_TARGET_TRANSPORT=rdma),
# the initiator's (RBLK_INITIATOR_TRANSPORT=rdma) and the e2e suite's fault
# tests (RBLK_VM_SOAK_E2E_RUN, default ^TestFault) over rxe0; RBLK_VM_SOAK_RUN
# picks the target's and initiator's tests (-test.run, default all; the
# host leaves out their packages' in-package tests, which do not use the
# transport: RBLK_VM_SOAK_SKIP_TARGET, RBLK_VM_SOAK_SKIP_INITIATOR)
# (RBLK_VM_SOAK_SUITES picks among target initiator e2e). A failure names
# the run and the tests; a panic or a data race anywhere (a test's output or
# any rblkd or rblk-attach log) fails it too. Logs in logs/soak/run-N/
# (each suite's output, the e2e tests' process logs, the run's part of the
# kernel log); soak-summary.txt.
scen_soak() {
	local runs=${RBLK_VM_SOAK_RUNS:-1} r suite out rc failed='' bin t0 procs strict k0
	: >"$BIN/soak-summary.txt"
	for r in $(seq 1 "$runs"); do
		out=$BIN/logs/soak/run-$r
		mkdir -p "$out"
		k0=$(dmesg | wc -l)
		if [ "${RBLK_VM_HOG:-1}" = 1 ]; then
			hog_start
			pids+=("${HOG_PIDS[@]}")
		fi
		for suite in ${RBLK_VM_SOAK_SUITES:-target initiator e2e}; do
			bin=$BIN/$suite.test
			[ -x "$bin" ] || fail "no $suite.test beside the binaries"
			step "soak run $r/$runs${HOG_PIDS[*]:+ (CPU hog)}: $suite.test over rdma${RBLK_RDMA_FAILPOINTS:+, RBLK_RDMA_FAILPOINTS=$RBLK_RDMA_FAILPOINTS}"
			rc=0 t0=$(date +%s)
			case $suite in
			target) RBLK_TARGET_TRANSPORT=rdma RBLK_RDMA_ADDR=$IP gotest "$out/target-test.log" "$bin" -test.timeout=20m -test.run "${RBLK_VM_SOAK_RUN:-.}" -test.skip "${RBLK_VM_SOAK_SKIP_TARGET:-}" || rc=$? ;;
			initiator) RBLK_INITIATOR_TRANSPORT=rdma RBLK_RDMA_ADDR=$IP gotest "$out/initiator-test.log" "$bin" -test.timeout=20m -test.run "${RBLK_VM_SOAK_RUN:-.}" -test.skip "${RBLK_VM_SOAK_SKIP_INITIATOR:-}" || rc=$? ;;
			e2e)
				mkdir -p "$out/e2e-procs"
				RBLK_E2E_TRANSPORT=rdma RBLK_E2E_ADDR=$IP RBLK_E2E_TIME_SCALE=$E2E_TIME_SCALE RBLK_E2E_DEVICE=${RBLK_VM_SOAK_E2E_DEVICE:-socket} RBLK_E2E_REQUIRE=1 \
					RBLK_E2E_BIN_DIR=$BIN/race RBLK_E2E_LOG_DIR=$out/e2e-procs gotest "$out/e2e-test.log" "$bin" \
					-test.timeout=20m -test.run "${RBLK_VM_SOAK_E2E_RUN:-^TestFault}" || rc=$?
				;;
			*) fail "RBLK_VM_SOAK_SUITES: unknown suite $suite (target, initiator, e2e)" ;;
			esac
			procs='' strict=''
			[ "$suite" != e2e ] || procs=$out/e2e-procs strict=strict
			verdict "run $r, $suite.test ($(($(date +%s) - t0))s)" "$out/$suite-test.log" "$rc" "$procs" $strict >"$out/$suite-verdict.txt" ||
				failed+="run $r: $suite.test${FAILED_TESTS:+ ($FAILED_TESTS)}; "
			tee -a "$BIN/soak-summary.txt" <"$out/$suite-verdict.txt"
		done
		hog_stop
		dmesg | tail -n +$((k0 + 1)) >"$out/kernel.log" # (this run's part of the kernel log)
	done
	[ -z "$failed" ] || fail "soak: $failed(soak-summary.txt, logs/soak/run-N/)"
	echo "soak: $runs run(s) passed"
}

# panics: no rblkd or rblk-attach of any scenario panicked or raced (their
# logs, wherever they are), even where the scenario passed.
scen_panics() {
	local bad
	bad=$(grep -rlE '^(panic: |fatal error: |WARNING: DATA RACE)' "$WORK/logs" "$BIN/logs" 2>/dev/null | sort -u || true)
	[ -z "$bad" ] || fail "panic, fatal error or data race in: $(tr '\n' ' ' <<<"$bad")"
	echo "no panic, fatal error or data race in $(find "$WORK/logs" "$BIN/logs" -name '*.log' 2>/dev/null | wc -l) logs"
}

scen_dmesg() {
	local f name allow bad found=
	for f in "$WORK"/logs/*/kernel.log; do
		name=${f%/kernel.log}
		name=${name##*/}
		allow=$DMESG_ALLOW
		[ "$name" != verbs ] || allow="$allow|$DMESG_ALLOW_VERBS"
		[ "$name" != bench ] || allow="$allow|$DMESG_ALLOW_BENCH"
		case $name in e2e | soak) allow="$allow|$DMESG_ALLOW_FAULTS" ;; esac
		bad=$({
			grep -E "$DMESG_FATAL" "$f"
			grep -iE "$DMESG_DRIVER" "$f"
		} | grep -vE "$allow" | sort -u || true)
		# (lines a scenario expected, word for word: kernel-expected.log)
		if [ -n "$bad" ] && [ -s "${f%/*}/kernel-expected.log" ]; then
			bad=$(grep -vxFf "${f%/*}/kernel-expected.log" <<<"$bad" || true)
		fi
		[ -n "$bad" ] || continue
		echo "$bad" >"$LOGS/findings-$name.txt"
		# (counted, without timestamps and sector numbers)
		found+="
during $name: $(wc -l <<<"$bad") lines
$(sed -E 's/^\[ *[0-9.]+\] //; s/sector [0-9]+/sector N/' <<<"$bad" | sort | uniq -c | sort -rn | head -n 12)"
	done
	[ -z "$found" ] || fail "the kernel log has bad lines (logs/dmesg/findings-*.txt):$found"
	echo "no call trace, BUG, WARNING, blocked task, I/O error or rxe/rdma/nbd/nvme/ublk error in $(cat "$WORK"/logs/*/kernel.log | wc -l) lines"
}

# rxe_table: the counters that moved, one column a scenario.
rxe_table() {
	awk -F, '
		!($1 in seen) { seen[$1] = 1; phases[++np] = $1 }
		!($2 in cseen) { cseen[$2] = 1; ctrs[++nc] = $2 }
		{ v[$1, $2] = $3; if ($3 != 0 && $3 != "n/a") moved[$2] = 1 }
		END {
			printf "%-24s", "rxe0 counter"
			for (p = 1; p <= np; p++) printf " %12.12s", phases[p]
			print ""
			for (c = 1; c <= nc; c++) {
				if (!(ctrs[c] in moved) || ctrs[c] == "lifespan") continue
				printf "%-24s", ctrs[c]
				for (p = 1; p <= np; p++) printf " %12s", v[phases[p], ctrs[c]]
				print ""
			}
		}' "$WORK/rxe-counters.csv"
}

finish() {
	cp -a "$WORK/logs" "$BIN/" 2>/dev/null || true
	cp "$WORK/rxe-counters.csv" "$BIN/" 2>/dev/null || true
	echo
	echo "######## rxe0 counters (cumulative, after each scenario; rxe-counters.csv has all)"
	rxe_table | tee "$BIN/rxe-counters.txt"
	echo
	echo "######## scenarios"
	printf '%s\n' "${RESULTS[@]}" | awk '{ printf "%-4s %5ss  %s\n", $1, $2, $3 }' | tee "$BIN/scenarios.txt"
}

echo "kernel $(uname -r), transport $TRANSPORT"
rxe_snap boot
mkdir -p "$WORK/logs/boot"
dmesg >"$WORK/logs/boot/kernel.log"
if [ -x "$BIN/rdma.test" ]; then scenario verbs scen_verbs; fi
scenario e2e scen_e2e
scenario csi scen_csi
scenario ublk scen_ublk
if [ -x "$BIN/kernel.test" ]; then scenario grow scen_grow; fi
scenario udev scen_udev
scenario bench scen_bench
scenario small-cache scen_small_cache
scenario soak scen_soak
scenario panics scen_panics
scenario dmesg scen_dmesg
finish
if printf '%s\n' "${RESULTS[@]}" | grep -q '^FAIL'; then
	echo "FAIL: $(printf '%s\n' "${RESULTS[@]}" | awk '$1 == "FAIL" { printf "%s ", $3 }')"
	exit 1
fi
echo "PASS"
