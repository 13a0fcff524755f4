# vm/nvmeof.sh: sourceable helpers for guest scripts (bash): the kernel's own
# NVMe-oF target (nvmet-rdma, nvmet-tcp) and host (nvme-rdma, nvme-tcp), over
# Soft-RoCE or TCP, as a peer to compare rblk with. Inside the guest:
# . "$RBLK_VM_LIB/nvmeof.sh"
#
#   dev=$(nvmet_setup FILE [SIZE])   export FILE (created with SIZE, default
#                                    $NVMET_SIZE or 256M, if missing) through a
#                                    loop device, connect to it over RDMA and
#                                    print the block device (/dev/nvmeXnY);
#                                    FILE may be a block device (/dev/ram0 of
#                                    brd, say): it is exported as it is
#   nvmet_teardown                   disconnect and remove every target set
#                                    up, and their loop devices
#
# Settings: NVMET_TRTYPE (rdma or tcp; default rdma), NVMET_NQN (default
# nqn.2024-01.io.rblk:vmtest), NVMET_ADDR (default $RBLK_VM_ADDR or
# 192.0.2.1), NVMET_PORT (default 4420), NVMET_PORTID (nvmet's port, one per
# export; default 1), NVMET_NR_IO_QUEUES (nvme connect --nr-io-queues;
# default: nvme-cli's, one per CPU).
# Several exports at once, each with its own NQN and port ID; their state is
# kept in /run/rblk-nvmet.state (a line each) so that nvmet_teardown works
# after nvmet_setup ran in a $(...) subshell.
# Messages go to stderr; only the device path goes to stdout.

NVMET_STATE=/run/rblk-nvmet.state
NVMET_CFG=/sys/kernel/config/nvmet

_nvmet_log() { echo "nvmet: $*" >&2; }

# _nvmet_find_dev NQN: print /dev/nvmeXnY of the connected controller for NQN.
_nvmet_find_dev() {
	local nqn=$1 c ns
	for c in /sys/class/nvme/nvme*; do
		[ -e "$c/subsysnqn" ] || continue
		[ "$(cat "$c/subsysnqn")" = "$nqn" ] || continue
		# Native multipath (Debian default): the block device hangs off the
		# subsystem as nvme<subsys>n<ns>; without it, off the controller.
		for ns in "$c"/nvme*n* "$c"/subsystem/nvme*n* /sys/class/nvme-subsystem/*/nvme*n*; do
			[ -e "$ns" ] || continue
			case $ns in
			*/nvme-subsystem/*)
				[ "$(cat "$(dirname "$ns")/subsysnqn")" = "$nqn" ] || continue ;;
			esac
			ns=$(basename "$ns")
			case $ns in *c*n*) continue ;; esac # hidden per-path node
			[ -b "/dev/$ns" ] && { echo "/dev/$ns"; return 0; }
		done
	done
	return 1
}

nvmet_setup() {
	local file=${1:?usage: nvmet_setup FILE [SIZE]} size=${2:-${NVMET_SIZE:-256M}}
	local nqn=${NVMET_NQN:-nqn.2024-01.io.rblk:vmtest} tr=${NVMET_TRTYPE:-rdma} portid=${NVMET_PORTID:-1}
	local addr=${NVMET_ADDR:-${RBLK_VM_ADDR:-192.0.2.1}} port=${NVMET_PORT:-4420}
	local sub pdir dev="" _i queues=()

	case $tr in rdma | tcp) ;; *) _nvmet_log "NVMET_TRTYPE=$tr: rdma or tcp"; return 1 ;; esac
	if [ -e "$NVMET_STATE" ] && grep -q -e "nqn=$nqn " -e "portid=$portid " "$NVMET_STATE"; then
		_nvmet_log "$nqn or port $portid already set up ($NVMET_STATE); call nvmet_teardown first"
		return 1
	fi
	modprobe -a configfs loop nvmet "nvmet-$tr" "nvme-$tr" || return 1
	mountpoint -q /sys/kernel/config || mount -t configfs configfs /sys/kernel/config || return 1

	local nsdev loop=
	if [ -b "$file" ]; then
		nsdev=$file
	else
		if [ ! -e "$file" ]; then
			fallocate -l "$size" "$file" 2>/dev/null || truncate -s "$size" "$file" || return 1
		fi
		# nvmet refuses a regular file on tmpfs as device_path; a loop device works.
		loop=$(losetup -f --show "$file") || return 1
		nsdev=$loop
	fi
	echo "nqn=$nqn loop=$loop portid=$portid port=$port file=$file " >>"$NVMET_STATE"

	sub=$NVMET_CFG/subsystems/$nqn
	pdir=$NVMET_CFG/ports/$portid
	{
		mkdir "$sub" &&
			echo 1 >"$sub/attr_allow_any_host" &&
			mkdir "$sub/namespaces/1" &&
			printf '%s' "$nsdev" >"$sub/namespaces/1/device_path" &&
			echo 1 >"$sub/namespaces/1/enable" &&
			mkdir "$pdir" &&
			echo "$tr" >"$pdir/addr_trtype" &&
			echo ipv4 >"$pdir/addr_adrfam" &&
			echo "$addr" >"$pdir/addr_traddr" &&
			echo "$port" >"$pdir/addr_trsvcid" &&
			ln -s "$sub" "$pdir/subsystems/$nqn"
	} || { _nvmet_log "configfs setup failed"; nvmet_teardown; return 1; }

	[ -z "${NVMET_NR_IO_QUEUES:-}" ] || queues=(--nr-io-queues="$NVMET_NR_IO_QUEUES")
	nvme connect -t "$tr" -a "$addr" -s "$port" -n "$nqn" "${queues[@]}" >&2 ||
		{ _nvmet_log "nvme connect failed"; nvmet_teardown; return 1; }
	for _i in $(seq 100); do
		dev=$(_nvmet_find_dev "$nqn") && break
		sleep 0.2
	done
	if [ -z "$dev" ]; then
		_nvmet_log "no block device appeared for $nqn"
		nvmet_teardown
		return 1
	fi
	_nvmet_log "$file${loop:+ -> $loop} -> $tr $addr:$port $nqn${queues[*]:+ (${queues[*]})} -> $dev"
	echo "$dev"
}

nvmet_teardown() {
	local line rc=0
	[ -e "$NVMET_STATE" ] || return 0
	while read -r line; do
		# shellcheck disable=SC2086 # the line's KEY=VALUE words
		[ -z "$line" ] || _nvmet_teardown_one $line || rc=1
	done <"$NVMET_STATE"
	rm -f "$NVMET_STATE"
	return $rc
}

# _nvmet_teardown_one KEY=VALUE...: one line of the state file.
_nvmet_teardown_one() {
	local nqn="" loop="" portid=1 kv
	for kv in "$@"; do
		case $kv in
		nqn=*) nqn=${kv#nqn=} ;;
		loop=*) loop=${kv#loop=} ;;
		portid=*) portid=${kv#portid=} ;;
		esac
	done
	local sub=$NVMET_CFG/subsystems/$nqn pdir=$NVMET_CFG/ports/$portid
	nvme disconnect -n "$nqn" >&2 2>/dev/null
	rm -f "$pdir/subsystems/$nqn" 2>/dev/null
	[ -d "$pdir" ] && rmdir "$pdir" 2>/dev/null
	[ -e "$sub/namespaces/1/enable" ] && echo 0 >"$sub/namespaces/1/enable"
	[ -d "$sub/namespaces/1" ] && rmdir "$sub/namespaces/1" 2>/dev/null
	[ -d "$sub" ] && rmdir "$sub" 2>/dev/null
	[ -n "$loop" ] && losetup -d "$loop" 2>/dev/null
	if [ -d "$sub" ] || [ -d "$pdir" ]; then
		_nvmet_log "teardown of $nqn incomplete"
		return 1
	fi
	return 0
}
