#!/usr/bin/env bash
# scripts/vm-run-selftest.sh: tests vm/run.sh's handling of a guest kernel
# that panics while it boots, with a stand-in for qemu (RBLK_VM_QEMU) that
# plays a given outcome per boot and counts the boots:
#   panic      the kernel panics before the guest's init ran (what 6.12
#              under TCG once did, 1.6 s into its boot)
#   late       the guest's init ran, then the kernel panicked
#   die        qemu exits 1 with nothing on the console
#   ok         the guest script ran and exited 0
# Each case asserts vm/run.sh's exit code, the number of boots, and what it
# left in the share (boot-panics, console-bootN.log). Needs what vm/run.sh
# needs before it boots (its packages, a kernel in /boot: it installs them);
# its own cache and lock, so that it neither waits for a VM that runs nor
# touches that VM's initramfs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

unset RBLK_VM_BOOT_TRIES # (the default is under test)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/qemu" <<'EOF'
#!/usr/bin/env bash
# A stand-in for qemu-system-x86_64: the outcome of this boot is word N of
# $FAKE_QEMU_PLAN, N counted in $FAKE_QEMU_COUNT.
set -eu
console= share=
while [ $# -gt 0 ]; do
	case $1 in
	-chardev) case $2 in file,*) console=${2##*path=} ;; esac; shift ;;
	-virtfs) case $2 in *mount_tag=share*) share=${2#local,path=}; share=${share%%,*} ;; esac; shift ;;
	esac
	shift
done
[ -n "$console" ] && [ -n "$share" ] || { echo "fake qemu: no console or share" >&2; exit 3; }
n=$(($(cat "$FAKE_QEMU_COUNT" 2>/dev/null || echo 0) + 1))
echo "$n" >"$FAKE_QEMU_COUNT"
read -ra plan <<<"$FAKE_QEMU_PLAN"
what=${plan[$((n - 1))]:-missing}
case $what in
panic)
	printf '[    1.608175] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\r\n[    1.611149] Kernel panic - not syncing: Fatal exception in interrupt\r\n' >>"$console"
	;;
late)
	printf 'guest-init: kernel 6.12, uptime 3.1s\r\n[   40.1] Kernel panic - not syncing: Fatal exception\r\n' >>"$console"
	;;
die)
	exit 1
	;;
ok)
	printf 'guest-init: kernel 6.12, uptime 3.1s\r\n' >>"$console"
	echo "boot $n" >"$share/guest.log"
	echo "3.1 0.1" >"$share/timing"
	echo 0 >"$share/result.rc"
	;;
*)
	echo "fake qemu: boot $n not in the plan" >&2
	exit 3
	;;
esac
EOF
chmod +x "$tmp/qemu"
printf '#!/bin/sh\nexit 0\n' >"$tmp/guest.sh"

failed=0
# check NAME PLAN WANT_RC WANT_BOOTS WANT_PANICS_LISTED
check() {
	local name=$1 plan=$2 want_rc=$3 want_boots=$4 want_listed=$5 out=$tmp/$1 rc=0 boots listed
	FAKE_QEMU_PLAN=$plan FAKE_QEMU_COUNT=$tmp/$name.count RBLK_VM_QEMU=$tmp/qemu RBLK_VM_OUT=$out \
		RBLK_VM_CACHE=$tmp/cache RBLK_VM_LOCK=$tmp/lock RBLK_VM_TIMEOUT=60 vm/run.sh "$tmp/guest.sh" >"$tmp/$name.log" 2>&1 || rc=$?
	boots=$(cat "$tmp/$name.count" 2>/dev/null || echo 0)
	listed=0
	[ ! -f "$out/boot-panics" ] || listed=$(wc -l <"$out/boot-panics")
	local bad=()
	[ "$rc" = "$want_rc" ] || bad+=("exit $rc, want $want_rc")
	[ "$boots" = "$want_boots" ] || bad+=("$boots boots, want $want_boots")
	[ "$listed" = "$want_listed" ] || bad+=("$listed boots in boot-panics, want $want_listed")
	local i
	for ((i = 1; i <= want_listed; i++)); do
		grep -q 'Kernel panic' "$out/console-boot$i.log" 2>/dev/null || bad+=("console-boot$i.log missing or without the panic")
	done
	if [ ${#bad[@]} -eq 0 ]; then
		echo "PASS  $name ($plan): exit $rc, $boots boot(s)"
	else
		echo "FAIL  $name ($plan): ${bad[*]}"
		sed 's/^/      /' "$tmp/$name.log"
		failed=$((failed + 1))
	fi
}

check panic-then-ok "panic ok" 0 2 1
check panic-twice-then-ok "panic panic ok" 0 3 2
check panic-every-boot "panic panic panic" 1 3 2
check panic-after-init "late ok" 1 1 0
check qemu-died "die ok" 1 1 0
check ok "ok" 0 1 0
# (RBLK_VM_BOOT_TRIES=1: no boot again; 0 or words: refused, no boot)
RBLK_VM_BOOT_TRIES=1 check no-retries "panic ok" 1 1 0
RBLK_VM_BOOT_TRIES=0 check tries-zero "ok" 2 0 0
RBLK_VM_BOOT_TRIES=three check tries-words "ok" 2 0 0

# The last boot's panic is the run's reason, in words.
grep -q 'panicked while it booted, before the guest.s init ran, 3 time' "$tmp/panic-every-boot.log" || {
	echo "FAIL  panic-every-boot: its log does not give the reason"
	failed=$((failed + 1))
}
[ "$failed" = 0 ]
