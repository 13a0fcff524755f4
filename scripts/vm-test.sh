#!/usr/bin/env bash
# scripts/vm-test.sh: rblk's end-to-end test on a real kernel RDMA stack.
# Builds rblkd and rblk-attach with the verbs provider (-tags rdma), boots
# Debian's kernel under qemu with Soft-RoCE (vm/run.sh installs what it
# needs) and runs vm/rblk-e2e.sh inside: the verbs provider's tests, then
# rblk over RDMA on /dev/nbd0 with ext4 and fio, side by side with the
# kernel's NVMe-oF RDMA.
#
#   scripts/vm-test.sh            # RBLK_TRANSPORT=tcp to run it without verbs
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin
need=()
for p in libibverbs-dev librdmacm-dev; do
	dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
art=$(mktemp -d /var/tmp/rblk-vm-bin.XXXXXX)
trap 'rm -rf "$art"' EXIT
echo "== building rblkd and rblk-attach with -tags rdma"
go build -tags rdma -o "$art/" ./cmd/rblkd ./cmd/rblk-attach
go test -c -tags rdma -o "$art/rdma.test" ./transport/rdma/
if [ -n "${RBLK_TRANSPORT:-}" ]; then
	printf 'export RBLK_TRANSPORT=%q\n' "$RBLK_TRANSPORT" >"$art/env.sh"
fi
echo "== booting the guest: vm/rblk-e2e.sh"
RBLK_VM_TIMEOUT=${RBLK_VM_TIMEOUT:-900} vm/run.sh vm/rblk-e2e.sh "$art"
