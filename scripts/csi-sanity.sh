#!/usr/bin/env bash
# scripts/csi-sanity.sh: the CSI conformance suite (csi-sanity, from
# github.com/kubernetes-csi/csi-test/v5 v5.6.0) against rblk-csi and a real
# rblkd on this machine, over the software transport (tcp on loopback):
# rblkd with a pool, its management API (certificates from rblkd cert) and
# an auth file that knows the node's host ID; rblk-csi --mode controller
# with an inventory of that rblkd; rblk-csi --mode node as the node. The
# Identity and Controller specs run; the Node specs are skipped here (no
# /dev/nbdN on this machine; the node service does not stage yet). It ends
# with ginkgo's summary line and exits with csi-sanity's status.
#
# Environment: CSI_SANITY_FOCUS, CSI_SANITY_SKIP (ginkgo regexps; default
# skip "Node Service"), CSI_SANITY_ARGS (more csi-sanity flags, such as
# --ginkgo.v to list each spec and why it was skipped), RBLK_CSI_KEEP=1
# (keep the work folder).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CSI_TEST_VERSION=v5.6.0
work=$(mktemp -d /tmp/rblk-csi-sanity.XXXXXX)
pids=()
cleanup() {
	local p
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	if [ "${RBLK_CSI_KEEP:-0}" = 1 ]; then echo "csi-sanity: work folder kept: $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

bin=$work/bin
mkdir -p "$bin"
go build -o "$bin/" ./cmd/rblkd ./cmd/rblk-csi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/rblk-csi-sanity-$CSI_TEST_VERSION
if [ ! -x "$cache/csi-sanity" ]; then
	echo "csi-sanity: go install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
	GOBIN=$cache go install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
fi

tls=$work/tls
"$bin/rblkd" cert ca --dir "$tls" >/dev/null
"$bin/rblkd" cert server --dir "$tls" --name storage-1 --host 127.0.0.1 >/dev/null
"$bin/rblkd" cert client --dir "$tls" --name rblk-csi-controller >/dev/null
printf 'sanity-node %s\n' "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$work/auth"
chmod 600 "$work/auth"
cat >"$work/rblkd.yaml" <<EOF
listen: 127.0.0.1:0
transport: tcp
auth_file: $work/auth
cache_size: 64M
chunk_size: 1M
admin_socket: $work/rblkd.sock
log_format: json
pools:
  - name: sanity
    directory: $work/pool
    capacity: 4G
    labels: {topology.rblk.io/zone: zone-a}
management:
  listen: 127.0.0.1:0
  cert: $tls/storage-1.crt
  key: $tls/storage-1.key
  client_ca: $tls/ca.crt
  clients:
    - identity: rblk-csi-controller
      pools: ["*"]
EOF
"$bin/rblkd" serve --config "$work/rblkd.yaml" 2>"$work/rblkd.log" &
pids+=($!)
# The addresses rblkd bound (port 0: a free one each).
for _ in $(seq 100); do
	grep -q '"msg":"rblkd serving"' "$work/rblkd.log" && grep -q '"msg":"management API"' "$work/rblkd.log" && break
	kill -0 "${pids[0]}" 2>/dev/null || { cat "$work/rblkd.log"; echo "csi-sanity: rblkd exited" >&2; exit 1; }
	sleep 0.1
done
field() { grep "\"msg\":\"$1\"" "$work/rblkd.log" | head -1 | sed -n 's/.*"listen":"\([^"]*\)".*/\1/p'; }
data=$(field "rblkd serving")
api=$(field "management API")
[ -n "$data" ] && [ -n "$api" ] || { cat "$work/rblkd.log"; echo "csi-sanity: rblkd did not say where it listens" >&2; exit 1; }
echo "csi-sanity: rblkd serves $data, its management API $api"
cat >"$work/inventory.yaml" <<EOF
targets:
  - name: storage-1
    management: $api
    address: $data
    transport: tcp
EOF
"$bin/rblk-csi" --mode controller --endpoint "unix://$work/controller.sock" --inventory "$work/inventory.yaml" \
	--tls-cert "$tls/rblk-csi-controller.crt" --tls-key "$tls/rblk-csi-controller.key" --tls-ca "$tls/ca.crt" 2>"$work/controller.log" &
pids+=($!)
"$bin/rblk-csi" --mode node --endpoint "unix://$work/node.sock" --host-id sanity-node \
	--topology topology.rblk.io/zone=zone-a 2>"$work/node.log" &
pids+=($!)
for _ in $(seq 100); do
	[ -S "$work/controller.sock" ] && [ -S "$work/node.sock" ] && break
	sleep 0.1
done

rc=0
"$cache/csi-sanity" --csi.endpoint "$work/node.sock" --csi.controllerendpoint "$work/controller.sock" \
	--csi.testvolumesize $((64 << 20)) --csi.testvolumeexpandsize $((128 << 20)) \
	--csi.mountdir "$work/mnt" --csi.stagingdir "$work/staging" \
	--ginkgo.focus "${CSI_SANITY_FOCUS:-}" --ginkgo.skip "${CSI_SANITY_SKIP:-Node Service}" \
	--ginkgo.no-color --ginkgo.timeout 20m ${CSI_SANITY_ARGS:-} >"$work/sanity.log" 2>&1 || rc=$?
cat "$work/sanity.log"
if [ "$rc" -ne 0 ]; then
	for f in rblkd controller node; do
		echo "----- $f.log (tail)"
		tail -40 "$work/$f.log"
	done
fi
# ginkgo's summary, last: "Ran N of M Specs ...", then PASS/FAIL counts.
grep -E '^Ran [0-9]+ of [0-9]+ Specs|^(SUCCESS|FAIL)! --' "$work/sanity.log" | tail -2
exit "$rc"
