#!/bin/bash
# Guest test of an online grow of a kernel NBD device, for vm/run.sh: the
# cwd holds kernel.test, the test binary of package initiator/kernel built
# on the host:
#
#   d=$(mktemp -d) && go test -c -o "$d/kernel.test" ./initiator/kernel &&
#     vm/run.sh initiator/kernel/testdata/guest-resize.sh "$d"
#   # and on 6.12:
#   RBLK_VM_KERNEL_DIR=$(vm/kernel-backports.sh 6.12) vm/run.sh initiator/kernel/testdata/guest-resize.sh "$d"
#
# TestGuestResize runs a target in process, attaches its volume as
# /dev/nbdN, grows the volume, and checks that /sys/block/nbdN/size shows
# the new size (NBD_CMD_RECONFIGURE) and that IO at the new end works.
set -uo pipefail
echo "kernel $(uname -r)"
RBLK_KERNEL_GUEST_REQUIRE=1 ./kernel.test -test.run '^TestGuestResize$' -test.v -test.count=1 -test.timeout=5m 2>&1 | tee kernel-test.log
rc=${PIPESTATUS[0]}
grep -q -- '--- PASS: TestGuestResize' kernel-test.log || { echo "FAIL: TestGuestResize did not pass (rc $rc)"; exit 1; }
echo "----- kernel log (nbd)"
dmesg | grep -i nbd | tail -n 10
[ "$rc" = 0 ] && echo PASS
exit "$rc"
