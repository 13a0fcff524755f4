#!/bin/bash
# vm/guest-init.sh: PID 1 inside the guest, started by the initramfs after
# switch_root (root = host's / read-only over 9p; tmpfs on /tmp /run /var/tmp;
# the writable share on /run/share).
#
# Common setup, then runs the guest script named by rblk_script= on the kernel
# command line with the share as cwd. Writes into the share:
#   guest.log   the script's stdout+stderr (also echoed to the console)
#   result.rc   its exit code (setup failure: 100)
#   timing      "BOOT_S SCRIPT_S" (guest uptime when the script started, its run time)
#   dmesg.log   the kernel log at power-off
# then powers off.
#
# Environment given to the guest script:
#   RBLK_VM_SHARE=/run/share  RBLK_VM_LIB=/run/share/harness
#   RBLK_VM_ADDR=192.0.2.1    RBLK_VM_NETDEV=dummy0  RBLK_VM_RDMA_DEV=rxe0
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/tmp TERM=dumb LANG=C.UTF-8
export RBLK_VM_SHARE=/run/share RBLK_VM_LIB=/run/share/harness
export RBLK_VM_ADDR=192.0.2.1 RBLK_VM_NETDEV=dummy0 RBLK_VM_RDMA_DEV=rxe0
SHARE=$RBLK_VM_SHARE

poweroff_now() {
	dmesg >"$SHARE/dmesg.log" 2>/dev/null
	sync
	echo o >/proc/sysrq-trigger
	sleep 60
}

setup_fail() {
	echo "guest-init: setup failed: $*"
	echo "guest-init: setup failed: $*" >>"$SHARE/guest.log"
	echo 100 >"$SHARE/result.rc"
	poweroff_now
}

step() { "$@" || setup_fail "$*"; }

# --- file systems (the host's /proc, /sys, /dev would show through 9p) ---
step mount -t proc proc /proc
step mount -t sysfs sysfs /sys
step mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
step mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
step mount -t tmpfs -o mode=1777 tmpfs /dev/shm
ln -sf /proc/self/fd /dev/fd 2>/dev/null
echo "guest-init: kernel $(uname -r), uptime $(cut -d' ' -f1 /proc/uptime)s"

# --- modules: Soft-RoCE, rdma_cm userspace, dummy netdev, NBD, loop, FUSE (nbdfuse) ---
step modprobe -a configfs rdma_rxe ib_uverbs rdma_ucm dummy nbd loop fuse
mountpoint -q /sys/kernel/config || step mount -t configfs configfs /sys/kernel/config

# --- network: lo, dummy0 with 192.0.2.1/24 (Soft-RoCE fails on lo / 127.x) ---
step ip link set lo up
step ip link add dummy0 type dummy
step ip addr add "$RBLK_VM_ADDR/24" dev dummy0
step ip link set dummy0 up
step rdma link add rxe0 type rxe netdev dummy0
for _ in $(seq 50); do [ -e /dev/infiniband/uverbs0 ] && break; sleep 0.1; done
[ -e /dev/infiniband/uverbs0 ] || setup_fail "/dev/infiniband/uverbs0 missing"
[ -e /dev/infiniband/rdma_cm ] || setup_fail "/dev/infiniband/rdma_cm missing"
ulimit -l unlimited || setup_fail "ulimit -l unlimited"
ulimit -n 65536 2>/dev/null

# --- the guest script ---
name=$(sed -n 's/.*rblk_script=\([^ ]*\).*/\1/p' /proc/cmdline)
[ -n "$name" ] && [ -f "$SHARE/$name" ] || setup_fail "guest script '$name' not in share"
cd "$SHARE" || setup_fail "cd $SHARE"
t0=$(cut -d' ' -f1 /proc/uptime)
echo "guest-init: setup done at ${t0}s; running $name"
echo "$t0 ?" >"$SHARE/timing" # (boot time known even if the run times out)
# stdin from /dev/null; output to guest.log and the console. Wait for the
# script itself only: daemons it left running (holding its stdout) must not
# keep the VM up.
"./$name" </dev/null > >(tee "$SHARE/guest.log") 2>&1 &
pid=$!
wait "$pid"
rc=$?
sleep 0.5 # let tee drain
t1=$(cut -d' ' -f1 /proc/uptime)
echo "$t0 $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')" >"$SHARE/timing"
echo "$rc" >"$SHARE/result.rc"
echo "guest-init: $name exited $rc after $(cut -d' ' -f2 "$SHARE/timing")s; powering off"
poweroff_now
