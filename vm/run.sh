#!/usr/bin/env bash
# vm/run.sh GUEST_SCRIPT [ARTIFACT_DIR]
#
# Boots Debian's kernel under qemu (software emulation) with a real kernel
# RDMA stack (Soft-RoCE rxe0 on dummy0, 192.0.2.1), real /dev/nbd0 and the
# kernel's NVMe-oF RDMA target/host, runs GUEST_SCRIPT inside the guest and
# exits with its exit code.
#
# The guest's root file system is the host's / (read-only, 9p), so every
# binary and library installed on the host is usable inside. A second,
# writable 9p share (mounted at /run/share in the guest, the script's cwd)
# carries GUEST_SCRIPT, the contents of ARTIFACT_DIR, the harness helpers
# (harness/) and the results (result.rc, guest.log, timing).
#
# Environment:
#   RBLK_VM_TIMEOUT  hard limit for the whole qemu run, seconds (default 600)
#   RBLK_VM_VERBOSE  1: also stream the guest console to stdout
#   RBLK_VM_CACHE    cache/work dir (default /var/tmp/rblk-vm)
#   RBLK_VM_MEM      guest memory (default 2G)
#   RBLK_VM_SMP      guest CPUs (default 2)
#   RBLK_VM_LOCK     lock file serialising VM runs (default /var/tmp/rblk-vm.lock)
#   RBLK_VM_BOOT_TRIES  boots in all when the guest kernel panics before
#                    the guest's init ran (default 3; see step 5)
#   RBLK_VM_QEMU     the qemu binary (default qemu-system-x86_64; the
#                    harness's self-test gives it a stand-in)
#   RBLK_VM_OUT      use this (new or empty) dir as the share and keep it;
#                    default: a fresh $RBLK_VM_CACHE/runs/DATE-PID (the last
#                    5 are kept; $RBLK_VM_CACHE/last points at the newest)
#
# After the run the share holds: result.rc, guest.log, timing, dmesg.log,
# console.log (the serial console, written by qemu on the host side),
# boot-panics and console-bootN.log (boots that panicked, if any), and
# whatever the guest script wrote. Only one VM runs at a time on the machine
# (flock on $RBLK_VM_LOCK, whatever the cache dir).
set -euo pipefail

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TIMEOUT=${RBLK_VM_TIMEOUT:-600}
VERBOSE=${RBLK_VM_VERBOSE:-0}
CACHE=${RBLK_VM_CACHE:-/var/tmp/rblk-vm}
MEM=${RBLK_VM_MEM:-2G}
SMP=${RBLK_VM_SMP:-2}
LOCK=${RBLK_VM_LOCK:-/var/tmp/rblk-vm.lock}
BOOT_TRIES=${RBLK_VM_BOOT_TRIES:-3}

log() { echo "[vm] $*" >&2; }
die() { echo "[vm] error: $*" >&2; exit 2; }

usage() { echo "usage: $0 GUEST_SCRIPT [ARTIFACT_DIR]" >&2; exit 2; }
if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
GUEST_SCRIPT=$1
ARTIFACT_DIR=${2:-}
[ -f "$GUEST_SCRIPT" ] || die "guest script not found: $GUEST_SCRIPT"
[[ $BOOT_TRIES =~ ^[1-9][0-9]*$ ]] || die "RBLK_VM_BOOT_TRIES=$BOOT_TRIES: want a number of boots, 1 or more"
[ -z "$ARTIFACT_DIR" ] || [ -d "$ARTIFACT_DIR" ] || die "artifact dir not found: $ARTIFACT_DIR"

# ---------------------------------------------------------------------------
# 1. Host packages. Everything the guest runs comes from the host's / over 9p,
#    so the guest-side tools (rdma-core, perftest, nvme-cli, fio, jq) are
#    installed here too.
# ---------------------------------------------------------------------------
PACKAGES=(
	qemu-system-x86 linux-image-amd64 busybox-static
	rdma-core ibverbs-utils ibverbs-providers libibverbs-dev librdmacm-dev
	rdmacm-utils perftest nvme-cli fio jq kmod iproute2 util-linux coreutils
	e2fsprogs curl xz-utils mdadm
)
missing=()
for p in "${PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	log "installing: ${missing[*]}"
	[ "$(id -u)" = 0 ] || die "need root to install packages"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---------------------------------------------------------------------------
# 2. Kernel: the newest /boot/vmlinuz-* that has its modules installed. This
#    is the kernel of linux-image-amd64, not the host's running kernel. Or,
#    with RBLK_VM_KERNEL_DIR, a kernel package unpacked with dpkg -x (see
#    vm/kernel-backports.sh): its boot/vmlinuz-* and lib/modules/VERSION,
#    which the guest gets bind-mounted over its /lib/modules.
# ---------------------------------------------------------------------------
KDIR=${RBLK_VM_KERNEL_DIR:-}
if [ -n "$KDIR" ]; then
	KDIR=$(cd "$KDIR" && pwd) || die "RBLK_VM_KERNEL_DIR not found"
	case $KDIR in # (the guest mounts its own /proc, /sys and /dev over these)
	/proc/* | /sys/* | /dev/*) die "RBLK_VM_KERNEL_DIR=$KDIR: the guest cannot see it through its root" ;;
	esac
fi
KROOT=${KDIR:-}
KVER=
for k in $(printf '%s\n' "$KROOT"/boot/vmlinuz-* | sort -V -r); do
	v=${k##*/vmlinuz-}
	if [ -d "$KROOT/lib/modules/$v/kernel" ]; then KVER=$v; break; fi
done
[ -n "$KVER" ] || die "no $KROOT/boot/vmlinuz-* with matching $KROOT/lib/modules/VERSION"
KERNEL=$KROOT/boot/vmlinuz-$KVER
MODDIR=$KROOT/lib/modules/$KVER
[ -f "$MODDIR/modules.dep" ] || die "$MODDIR/modules.dep missing (run depmod -b '${KROOT:-/}' $KVER)"
MODULES_ARG=
[ -z "$KDIR" ] || MODULES_ARG=" rblk_modules=$KDIR/lib/modules"

mkdir -p "$CACHE"

# One VM at a time (2 cores): wait for another run to finish.
exec 9>"$LOCK"
if ! flock -n 9; then
	log "another VM run holds $LOCK; waiting (up to ${TIMEOUT}s)"
	flock -w "$TIMEOUT" 9 || die "timed out waiting for $LOCK"
fi

# ---------------------------------------------------------------------------
# 3. Initramfs: static busybox + the modules needed to mount the 9p root,
#    whose /init mounts it read-only, mounts tmpfs on /tmp /run /var/tmp,
#    mounts the writable share on /run/share and switch_roots into
#    /run/share/harness/guest-init.sh. Rebuilt when the kernel version or
#    this recipe changes.
# ---------------------------------------------------------------------------
# The modules to mount the 9p root over virtio-pci, and what they need, in
# load order (from modules.dep): 6.1 has virtio and fscache as modules,
# 6.12 has virtio built in and fscache inside netfs.
INITRAMFS_WANT=(virtio_pci 9pnet_virtio 9p)
declare -A MODPATH=() MODDEPS=() MODSEEN=()
while IFS= read -r line; do
	f=${line%%:*}
	n=${f##*/}
	n=${n%%.ko*}
	MODPATH[$n]=$f
	deps=
	for d in ${line#*:}; do
		d=${d##*/}
		deps+=" ${d%%.ko*}"
	done
	MODDEPS[$n]=$deps
done <"$MODDIR/modules.dep"
INITRAMFS_MODULES=()
# add_module NAME: NAME's dependencies first, then NAME (built-in: nothing).
add_module() {
	local d
	[ -z "${MODSEEN[$1]:-}" ] || return 0
	MODSEEN[$1]=1
	if [ -z "${MODPATH[$1]:-}" ]; then
		grep -q "/$1.ko" "$MODDIR/modules.builtin" || die "module $1 not found for $KVER"
		return 0
	fi
	for d in ${MODDEPS[$1]}; do add_module "$d"; done
	INITRAMFS_MODULES+=("${MODPATH[$1]}")
}
for m in "${INITRAMFS_WANT[@]}"; do add_module "$m"; done

# shellcheck disable=SC2016 # (expanded by the guest)
INIT_SCRIPT='#!/bin/busybox sh
# initramfs /init, generated by vm/run.sh
/bin/busybox --install -s /bin
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
fail() { echo "initramfs: $*"; echo o >/proc/sysrq-trigger; sleep 60; }
for m in $(cat /modules.order); do
	insmod "/modules/$m.ko" || fail "insmod $m"
done
# cache=loose: the root is read-only and nothing changes it during a run, so
# let the guest cache it (uncached 9p makes every exec and modprobe crawl).
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=512000,cache=loose hostroot /newroot || fail "mount 9p root"
# rblk_modules=DIR (a kernel unpacked on the host): its modules replace the
# /lib/modules of the host, so that modprobe finds them.
for a in $(cat /proc/cmdline); do
	case $a in rblk_modules=*) mount -o bind "/newroot${a#rblk_modules=}" /newroot/lib/modules || fail "bind $a" ;; esac
done
for d in tmp run var/tmp; do mount -t tmpfs -o mode=1777 tmpfs /newroot/$d || fail "tmpfs $d"; done
mkdir -p /newroot/run/share
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 share /newroot/run/share || fail "mount share"
umount /proc
exec switch_root /newroot /bin/bash /run/share/harness/guest-init.sh
fail "switch_root"
'

recipe_id=$( { echo "$KVER"; printf '%s\n' "${INITRAMFS_MODULES[@]}"; echo "$INIT_SCRIPT"; } | sha256sum | cut -c1-16)
INITRAMFS=$CACHE/initramfs-$KVER-$recipe_id.cpio.gz
if [ ! -s "$INITRAMFS" ]; then
	log "building initramfs for $KVER"
	rm -f "$CACHE"/initramfs-*.cpio.gz
	stage=$(mktemp -d "$CACHE/stage.XXXXXX")
	mkdir -p "$stage"/{bin,dev,proc,sys,newroot,modules}
	cp /bin/busybox "$stage/bin/busybox"
	file "$stage/bin/busybox" 2>/dev/null | grep -q 'dynamically' && die "/bin/busybox is not static"
	: >"$stage/modules.order"
	for m in "${INITRAMFS_MODULES[@]}"; do
		name=${m##*/}
		name=${name%%.ko*}
		src=$MODDIR/$m
		case $src in # busybox insmod wants plain .ko
		*.xz) xz -dc "$src" >"$stage/modules/$name.ko" ;;
		*.zst) zstd -qdc "$src" >"$stage/modules/$name.ko" ;;
		*.gz) gzip -dc "$src" >"$stage/modules/$name.ko" ;;
		*) cp "$src" "$stage/modules/$name.ko" ;;
		esac
		echo "$name" >>"$stage/modules.order"
	done
	printf '%s' "$INIT_SCRIPT" >"$stage/init"
	chmod 755 "$stage/init"
	(cd "$stage" && find . | LC_ALL=C sort | /bin/busybox cpio -o -H newc 2>/dev/null | gzip -1) >"$INITRAMFS.tmp"
	mv "$INITRAMFS.tmp" "$INITRAMFS"
	rm -rf "$stage"
fi

# ---------------------------------------------------------------------------
# 4. Writable share: harness helpers + guest script + artifacts.
# ---------------------------------------------------------------------------
if [ -n "${RBLK_VM_OUT:-}" ]; then
	SHARE=$RBLK_VM_OUT
	if [ -d "$SHARE" ] && [ -n "$(ls -A "$SHARE")" ]; then
		die "RBLK_VM_OUT=$SHARE exists and is not empty"
	fi
else
	# Keep the newest few runs; a new run never reuses a dir, so results of a
	# run are not wiped by the next one queued behind the lock.
	mkdir -p "$CACHE/runs"
	{ ls -1dt "$CACHE"/runs/*/ 2>/dev/null || true; } | tail -n +5 | xargs -r rm -rf
	SHARE=$CACHE/runs/$(date +%Y%m%d-%H%M%S)-$$
	rm -rf "$CACHE/share" "$CACHE/console.log" # (older layout)
	ln -sfn "$SHARE" "$CACHE/last"
fi
CONSOLE=$SHARE/console.log
mkdir -p "$SHARE/harness"
SHARE=$(cd "$SHARE" && pwd)
[ -n "$ARTIFACT_DIR" ] && cp -a "$ARTIFACT_DIR/." "$SHARE/"
cp "$VM_DIR/guest-init.sh" "$VM_DIR/lib.sh" "$VM_DIR/nvmeof.sh" "$VM_DIR/fio-table.sh" "$VM_DIR/nbdnull.sh" "$SHARE/harness/"
SCRIPT_NAME=$(basename "$GUEST_SCRIPT")
cp "$GUEST_SCRIPT" "$SHARE/$SCRIPT_NAME"
chmod +x "$SHARE/$SCRIPT_NAME" "$SHARE/harness/"*.sh
: >"$CONSOLE"

# ---------------------------------------------------------------------------
# 5. Boot. KVM hangs on these machines: TCG only. No NIC: all traffic stays
#    inside the guest. The guest powers itself off (sysrq o); -no-reboot makes
#    a kernel panic (panic=-1) end qemu too.
#    The stall detectors get the timeouts syzkaller gives its emulated
#    guests (their defaults assume a CPU of its own): on these 2-core hosts a
#    vCPU thread can go without the host's CPU for tens of seconds, which the
#    guest sees as a CPU stuck where it happened to stop (CI once had a 24 s
#    "soft lockup" in clear_page of an rblkd page fault, nothing spinning).
#    A real lockup still shows: after 110 s (watchdog_thresh=55, doubled)
#    and 100 s for RCU, inside the tests' own timeouts, and the dmesg
#    scenario fails on each. (Debian's kernels have no workqueue watchdog.)
# ---------------------------------------------------------------------------
if [ "$VERBOSE" = 1 ]; then
	serial=(-chardev "stdio,id=con0,signal=off,logfile=$CONSOLE")
else
	serial=(-chardev "file,id=con0,path=$CONSOLE")
fi
# shellcheck disable=SC2054 # (commas are qemu option syntax)
QEMU=(
	"${RBLK_VM_QEMU:-qemu-system-x86_64}"
	-accel tcg,thread=multi -cpu max -smp "$SMP" -m "$MEM"
	-nodefaults -no-user-config -display none -nic none -no-reboot
	"${serial[@]}" -serial chardev:con0
	-kernel "$KERNEL" -initrd "$INITRAMFS"
	-append "console=ttyS0 rdinit=/init panic=-1 loglevel=4 mitigations=off watchdog_thresh=55 rcupdate.rcu_cpu_stall_timeout=100 rblk_script=$SCRIPT_NAME$MODULES_ARG"
	-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
	-virtfs "local,path=$SHARE,mount_tag=share,security_model=none,multidevs=remap"
)

# boot_panicked: whether the guest kernel panicked before the guest's init
# ran (no "guest-init:" line on the console, nothing written to the share).
boot_panicked() {
	[ ! -e "$SHARE/result.rc" ] && [ ! -e "$SHARE/timing" ] && [ ! -e "$SHARE/guest.log" ] &&
		! grep -q 'guest-init:' "$CONSOLE" && grep -q 'Kernel panic' "$CONSOLE"
}
# A kernel that panics while it boots, before the guest's init ran, is
# booted again, up to RBLK_VM_BOOT_TRIES times in all (default 3): nothing
# of the run had started. (6.12 under multi-threaded TCG once died 1.6 s
# into its boot on a stray int3 of its own text patching, "Oops: int3" in
# hrtimer_start_range_ns: the emulator's fault, not the run's.) Each
# failed boot's console is kept (console-bootN.log) and listed in
# boot-panics. A panic after init started is the run's result, as is a
# qemu that dies without a panic.
log "kernel $KVER, script $SCRIPT_NAME, timeout ${TIMEOUT}s, share $SHARE"
start=$(date +%s.%N)
t_start=$SECONDS try=1 left=$TIMEOUT
while :; do
	set +e
	timeout -k 10 "$left" "${QEMU[@]}" </dev/null
	qrc=$?
	set -e
	left=$((TIMEOUT - (SECONDS - t_start)))
	if [ "$try" -lt "$BOOT_TRIES" ] && [ "$left" -gt 0 ] && boot_panicked; then
		what=$(grep -m 1 -E 'Oops|BUG:|general protection|Kernel panic' "$CONSOLE" | tr -d '\r')
		mv "$CONSOLE" "$SHARE/console-boot$try.log"
		: >"$CONSOLE"
		echo "boot $try: $what (console-boot$try.log)" >>"$SHARE/boot-panics"
		log "the guest kernel panicked while it booted, before the guest's init ran: $what"
		log "its console is $SHARE/console-boot$try.log; booting again (try $((try + 1)) of $BOOT_TRIES)"
		try=$((try + 1))
		continue
	fi
	break
done
wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')

# ---------------------------------------------------------------------------
# 6. Result.
# ---------------------------------------------------------------------------
boot="?" script="?"
if [ -f "$SHARE/timing" ]; then
	read -r boot script <"$SHARE/timing" || true
	boot=${boot:-?} script=${script:-?}
fi
if [ -f "$SHARE/result.rc" ]; then
	rc=$(tr -dc 0-9 <"$SHARE/result.rc")
	rc=${rc:-1}
	why="guest script exited $rc"
elif [ $qrc -eq 124 ] || [ $qrc -eq 137 ]; then
	rc=124
	why="TIMEOUT after ${TIMEOUT}s"
elif boot_panicked; then
	rc=1
	why="the guest kernel panicked while it booted, before the guest's init ran, $try time(s)"
else
	rc=1
	why="guest died without a result (qemu exit $qrc)"
fi
log "timing: boot ${boot}s, script ${script}s, total wall ${wall}s"
if [ "$rc" -ne 0 ]; then
	log "FAIL: $why"
	if [ "$VERBOSE" != 1 ]; then # (verbose: the console was streamed already)
		echo "----- guest console (tail, $CONSOLE) -----" >&2
		tail -n 60 "$CONSOLE" | tr -d '\r' >&2
	fi
	if [ -f "$SHARE/guest.log" ]; then
		echo "----- guest log (tail, $SHARE/guest.log) -----" >&2
		tail -n 60 "$SHARE/guest.log" >&2
	fi
	echo "-----" >&2
else
	log "PASS: $SCRIPT_NAME (results in $SHARE)"
fi
exit "$rc"
