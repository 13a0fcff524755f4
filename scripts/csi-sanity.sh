#!/usr/bin/env bash
# scripts/csi-sanity.sh: the CSI conformance suite (csi-sanity, from
# github.com/kubernetes-csi/csi-test/v5 v5.6.0) against rblk-csi and a real
# rblkd: rblkd with a pool, its management API (certificates from rblkd
# cert) and an auth file that knows the node's host ID; rblk-csi --mode
# controller with an inventory of that rblkd; rblk-csi --mode node as the
# node; with RBLK_CSI_REPLICAS=2, two rblkd in two zones and volumes of
# replicas: 2. It ends with ginkgo's summary line and exits with csi-sanity's
# status.
#
# On this machine (the test command): over the software transport (tcp on
# loopback), the Identity and Controller specs; the Node specs are skipped
# (no /dev/nbdN here). In the guest (vm/rblk-e2e.sh's csi scenario):
# RBLK_CSI_NODE=1 runs the Node specs too, the node attaching volumes with
# rblk-attach on the kernel's /dev/nbdN over RBLK_CSI_TRANSPORT.
#
# Environment:
#   RBLK_CSI_BIN=DIR        rblkd, rblk-csi and rblk-attach built already (else: go build)
#   CSI_SANITY_BIN=PATH     csi-sanity built already (else: go install, cached)
#   RBLK_CSI_TRANSPORT      tcp (default) or rdma
#   RBLK_CSI_LISTEN         rblkd's address (default 127.0.0.1:0)
#   RBLK_CSI_REPLICAS=2     a second rblkd (storage-2, zone-b, on the next port of RBLK_CSI_LISTEN)
#                           and the StorageClass parameter replicas: "2": every volume a mirror,
#                           an md RAID1 on the node (mdadm)
#   RBLK_CSI_NODE=1         the Node specs run (default: skipped)
#   RBLK_CSI_FS             the node's --default-fs: ext4 (default) or xfs
#   RBLK_CSI_ACCESS         mount (default) or block: csi-sanity's volume access type
#   RBLK_CSI_VOLUME_SIZE    bytes (default 64 MiB; xfs needs 300 MiB)
#   CSI_SANITY_FOCUS, CSI_SANITY_SKIP  ginkgo regexps
#   CSI_SANITY_ARGS         more csi-sanity flags (--ginkgo.v lists each spec and why it was skipped)
#   RBLK_CSI_KEEP=1         keep the work folder
set -euo pipefail

CSI_TEST_VERSION=v5.6.0
work=$(mktemp -d "${TMPDIR:-/tmp}/rblk-csi-sanity.XXXXXX")
pids=()
cleanup() {
	local p rc=$?
	set +e
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	# (volumes a failed run left staged)
	if [ -d "$work/state" ]; then
		for p in "$work"/state/csi-*.json; do
			[ -f "$p" ] || continue
			kill "$(sed -n 's/.*"pid":\([0-9]*\).*/\1/p' "$p")" 2>/dev/null || true
		done
	fi
	grep " $work/" /proc/mounts | cut -d' ' -f2 | sort -r | while read -r m; do umount "$m" 2>/dev/null; done
	if [ "${RBLK_CSI_KEEP:-0}" = 1 ]; then echo "csi-sanity: work folder kept: $work"; else rm -rf "$work"; fi
	exit "$rc"
}
trap cleanup EXIT

bin=${RBLK_CSI_BIN:-}
if [ -z "$bin" ]; then
	cd "$(dirname "${BASH_SOURCE[0]}")/.."
	bin=$work/bin
	mkdir -p "$bin"
	go build -o "$bin/" ./cmd/rblkd ./cmd/rblk-csi ./cmd/rblk-attach
fi
sanity=${CSI_SANITY_BIN:-}
if [ -z "$sanity" ]; then
	cache=${XDG_CACHE_HOME:-$HOME/.cache}/rblk-csi-sanity-$CSI_TEST_VERSION
	if [ ! -x "$cache/csi-sanity" ]; then
		echo "csi-sanity: go install github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
		GOBIN=$cache go install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
	fi
	sanity=$cache/csi-sanity
fi
transport=${RBLK_CSI_TRANSPORT:-tcp}

tls=$work/tls
"$bin/rblkd" cert ca --dir "$tls" >/dev/null
"$bin/rblkd" cert client --dir "$tls" --name rblk-csi-controller >/dev/null
(
	umask 077
	od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$work/node.secret"
	printf 'sanity-node %s\n' "$(cat "$work/node.secret")" >"$work/auth"
)
replicas=${RBLK_CSI_REPLICAS:-1}
case "$replicas" in
1 | 2) ;;
*)
	echo "csi-sanity: RBLK_CSI_REPLICAS=$replicas: want 1 or 2" >&2
	exit 2
	;;
esac

# start_target N LISTEN ZONE: rblkd storage-N with a pool "sanity" in
# ZONE, its data path on LISTEN; its entry goes to inventory.yaml.
echo "targets:" >"$work/inventory.yaml"
start_target() {
	local n=$1 listen=$2 zone=$3 d=$work/storage-$1 pid data api
	mkdir -p "$d"
	"$bin/rblkd" cert server --dir "$tls" --name "storage-$n" --host 127.0.0.1 >/dev/null
	cat >"$d/rblkd.yaml" <<EOF
listen: $listen
transport: $transport
auth_file: $work/auth
cache_size: 64M
chunk_size: 1M
admin_socket: $d/rblkd.sock
log_format: json
pools:
  - name: sanity
    directory: $d/pool
    capacity: 8G
    labels: {topology.rblk.io/zone: $zone}
management:
  listen: 127.0.0.1:0
  cert: $tls/storage-$n.crt
  key: $tls/storage-$n.key
  client_ca: $tls/ca.crt
  clients:
    - identity: rblk-csi-controller
      pools: ["*"]
EOF
	"$bin/rblkd" serve --config "$d/rblkd.yaml" 2>"$d/rblkd.log" &
	pid=$!
	pids+=("$pid")
	# The addresses rblkd bound (port 0: a free one each).
	for _ in $(seq 300); do
		grep -q '"msg":"rblkd serving"' "$d/rblkd.log" && grep -q '"msg":"management API"' "$d/rblkd.log" && break
		kill -0 "$pid" 2>/dev/null || {
			cat "$d/rblkd.log"
			echo "csi-sanity: rblkd storage-$n exited" >&2
			exit 1
		}
		sleep 0.1
	done
	data=$(grep '"msg":"rblkd serving"' "$d/rblkd.log" | head -1 | sed -n 's/.*"listen":"\([^"]*\)".*/\1/p')
	api=$(grep '"msg":"management API"' "$d/rblkd.log" | head -1 | sed -n 's/.*"listen":"\([^"]*\)".*/\1/p')
	[ -n "$data" ] && [ -n "$api" ] || {
		cat "$d/rblkd.log"
		echo "csi-sanity: rblkd storage-$n did not say where it listens" >&2
		exit 1
	}
	echo "csi-sanity: rblkd storage-$n ($zone) serves $data ($transport), its management API $api"
	cat >>"$work/inventory.yaml" <<EOF
  - name: storage-$n
    management: $api
    address: $data
    transport: $transport
EOF
}
listen=${RBLK_CSI_LISTEN:-127.0.0.1:0}
start_target 1 "$listen" zone-a
if [ "$replicas" = 2 ]; then
	# The second copy's target, in another zone: on the next port, or a
	# free one.
	port=${listen##*:}
	[ "$port" = 0 ] || port=$((port + 1))
	start_target 2 "${listen%:*}:$port" zone-b
	printf 'replicas: "2"\n' >"$work/params.yaml"
	CSI_SANITY_ARGS="--csi.testvolumeparameters $work/params.yaml ${CSI_SANITY_ARGS:-}"
fi
"$bin/rblk-csi" --mode controller --endpoint "unix://$work/controller.sock" --inventory "$work/inventory.yaml" \
	--tls-cert "$tls/rblk-csi-controller.crt" --tls-key "$tls/rblk-csi-controller.key" --tls-ca "$tls/ca.crt" 2>"$work/controller.log" &
pids+=($!)
"$bin/rblk-csi" --mode node --endpoint "unix://$work/node.sock" --host-id sanity-node --secret-file "$work/node.secret" \
	--attach-bin "$bin/rblk-attach" --state-dir "$work/state" --default-fs "${RBLK_CSI_FS:-ext4}" \
	--topology topology.rblk.io/zone=zone-a 2>"$work/node.log" &
pids+=($!)
for _ in $(seq 100); do
	[ -S "$work/controller.sock" ] && [ -S "$work/node.sock" ] && break
	sleep 0.1
done

skip=${CSI_SANITY_SKIP-Node Service}
if [ "${RBLK_CSI_NODE:-0}" = 1 ]; then
	skip=${CSI_SANITY_SKIP-}
fi
rc=0
# shellcheck disable=SC2086
"$sanity" --csi.endpoint "$work/node.sock" --csi.controllerendpoint "$work/controller.sock" \
	--csi.testvolumesize "${RBLK_CSI_VOLUME_SIZE:-$((64 << 20))}" --csi.testvolumeexpandsize "$((${RBLK_CSI_VOLUME_SIZE:-$((64 << 20))} * 2))" \
	--csi.testvolumeaccesstype "${RBLK_CSI_ACCESS:-mount}" \
	--csi.mountdir "$work/mnt" --csi.stagingdir "$work/staging" \
	--ginkgo.focus "${CSI_SANITY_FOCUS:-}" --ginkgo.skip "$skip" \
	--ginkgo.no-color --ginkgo.timeout 20m ${CSI_SANITY_ARGS:-} >"$work/sanity.log" 2>&1 || rc=$?
cat "$work/sanity.log"
if [ "$rc" -ne 0 ]; then
	for f in "$work"/storage-*/rblkd.log "$work/controller.log" "$work/node.log"; do
		echo "----- $f (tail)"
		tail -40 "$f"
	done
	for f in "$work"/state/*.log; do
		[ -f "$f" ] || continue
		echo "----- $f (tail)"
		tail -20 "$f"
	done
fi
# With the Node specs, a StorageClass of replicas: 2 must have staged md
# arrays: say how many, and fail if none was.
if [ "$replicas" = 2 ] && [ "${RBLK_CSI_NODE:-0}" = 1 ]; then
	made=$(grep -c '"msg":"mirror created"' "$work/node.log" || true)
	stopped=$(grep -c '"msg":"mirror stopped"' "$work/node.log" || true)
	echo "csi-sanity: the node created $made md arrays and stopped $stopped"
	if [ "$made" -eq 0 ]; then
		echo "csi-sanity: replicas 2, and the node staged no mirror" >&2
		rc=1
	fi
fi
# ginkgo's summary, last: "Ran N of M Specs ...", then PASS/FAIL counts.
grep -E '^Ran [0-9]+ of [0-9]+ Specs|^(SUCCESS|FAIL)! --' "$work/sanity.log" | tail -2
exit "$rc"
