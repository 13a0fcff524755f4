# shellcheck shell=bash
# vm/nbdnull.sh: sourceable helpers for guest scripts (bash): a null NBD
# device, the kernel's NBD front end with nothing behind it, as the floor of
# an NBD-based initiator (rblk-attach --device /dev/nbdN). Inside the guest:
# . "$RBLK_VM_LIB/nbdnull.sh"
#
#   nbd_null_setup DEV SIZE_MB [CONNS]
#                                    nbdkit's null plugin (SIZE_MB MiB;
#                                    reads return zeroes, writes are
#                                    dropped) on a
#                                    unix socket, and DEV (/dev/nbdN, not in
#                                    use) connected to it by nbd-client over
#                                    CONNS connections (default 2), 4 KiB
#                                    blocks; returns once DEV has the size
#   nbd_null_teardown                disconnect DEV, stop nbdkit
#
# Needs nbdkit and nbd-client (Debian: apt-get install nbdkit nbd-client;
# scripts/vm-test.sh installs both on the host, whose root the guest sees)
# and the nbd module. One device at a time; its state is kept in
# /run/rblk-nbdnull.state. Messages go to stderr.

NBDNULL_STATE=/run/rblk-nbdnull.state
NBDNULL_DIR=/run/rblk-nbdnull

_nbdnull_log() { echo "nbd null: $*" >&2; }

# nbd_null_available: nbdkit and nbd-client are installed.
nbd_null_available() { command -v nbdkit >/dev/null && command -v nbd-client >/dev/null; }

nbd_null_setup() {
	local dev=${1:?usage: nbd_null_setup DEV SIZE_MB [CONNS]} size=${2:?usage: nbd_null_setup DEV SIZE_MB [CONNS]} conns=${3:-2}
	local sock=$NBDNULL_DIR/null.sock pidf=$NBDNULL_DIR/nbdkit.pid bytes=$((${2:-0} << 20)) got _i
	if [ -e "$NBDNULL_STATE" ]; then
		_nbdnull_log "already set up ($NBDNULL_STATE); call nbd_null_teardown first"
		return 1
	fi
	nbd_null_available || { _nbdnull_log "nbdkit or nbd-client missing (apt-get install nbdkit nbd-client)"; return 1; }
	[ -b "$dev" ] || { _nbdnull_log "$dev is no block device (modprobe nbd?)"; return 1; }
	if [ -e "/sys/block/${dev#/dev/}/pid" ]; then
		_nbdnull_log "$dev is in use"
		return 1
	fi
	mkdir -p "$NBDNULL_DIR"
	rm -f "$sock" "$pidf"
	# (nbdkit forks into the background once it listens, then writes the
	# pid file)
	nbdkit --unix "$sock" --pidfile "$pidf" null "${size}M" >&2 || { _nbdnull_log "nbdkit null ${size}M failed"; return 1; }
	for _i in $(seq 50); do
		[ -s "$pidf" ] && [ -S "$sock" ] && break
		sleep 0.1
	done
	[ -s "$pidf" ] || { _nbdnull_log "nbdkit wrote no pid file"; return 1; }
	echo "dev=$dev pid=$(cat "$pidf")" >"$NBDNULL_STATE"
	# netlink (the default of nbd-client 3.24): nbd-client configures the
	# device with CONNS sockets and exits; the kernel keeps the sockets.
	nbd-client -unix "$sock" "$dev" -connections "$conns" -block-size 4096 >&2 ||
		{ _nbdnull_log "nbd-client -unix $sock $dev -connections $conns failed"; nbd_null_teardown; return 1; }
	for _i in $(seq 100); do
		got=$(blockdev --getsize64 "$dev" 2>/dev/null) || got=0
		if [ -e "/sys/block/${dev#/dev/}/pid" ] && [ "$got" = "$bytes" ]; then
			_nbdnull_log "nbdkit null ${size}M on $sock -> nbd-client -connections $conns -block-size 4096 -> $dev"
			return 0
		fi
		sleep 0.2
	done
	_nbdnull_log "$dev did not get the size ${size} MiB in 20 s"
	nbd_null_teardown
	return 1
}

nbd_null_teardown() {
	local dev='' pid='' kv _i
	[ -e "$NBDNULL_STATE" ] || return 0
	for kv in $(<"$NBDNULL_STATE"); do
		case $kv in
		dev=*) dev=${kv#dev=} ;;
		pid=*) pid=${kv#pid=} ;;
		esac
	done
	if [ -n "$dev" ] && [ -e "/sys/block/${dev#/dev/}/pid" ]; then
		nbd-client -d "$dev" >&2 || _nbdnull_log "nbd-client -d $dev failed"
	fi
	if [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; then
		for _i in $(seq 50); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$pid" 2>/dev/null; then
			_nbdnull_log "nbdkit (pid $pid) did not stop on SIGTERM in 5 s"
			return 1
		fi
	fi
	rm -f "$NBDNULL_STATE"
	if [ -n "$dev" ] && [ -e "/sys/block/${dev#/dev/}/pid" ]; then
		_nbdnull_log "$dev is still connected"
		return 1
	fi
	return 0
}
