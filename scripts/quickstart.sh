#!/usr/bin/env bash
# scripts/quickstart.sh: rblk from nothing to a mounted file system, in one
# command, on a Debian machine, as root:
#
#   1. installs what is missing (Debian packages; Go if missing and Debian's
#      is new enough),
#   2. builds bin/rblkd and bin/rblk-attach,
#   3. starts rblkd on a sparse volume ($QS_DIR/vol0.img, $QS_SIZE),
#   4. attaches it with rblk-attach, which serves it over NBD on a unix socket,
#   5. makes it a block device: /dev/nbd0 through the kernel's nbd module when
#      it loads and nbd-client is installed, else nbdfuse and a loop device,
#   6. makes an ext4 file system on it (keeps the one an earlier run made),
#      mounts it, writes a file, remounts and reads it back (sha256 both times),
#   7. shows some of both metrics endpoints,
#   8. and cleans everything up, also on failure: unmount, detach, SIGTERM to
#      rblk-attach then rblkd, and waits for them.
#
# The volume file stays, so a second run finds the first run's files.
# Environment: QS_DIR (default /var/tmp/rblk-quickstart), QS_SIZE (default
# 1G), QS_PORT (rblkd, default 7480), QS_METRICS_PORT (rblkd's metrics,
# default 9480; rblk-attach's is the next one).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

QS_DIR="${QS_DIR:-/var/tmp/rblk-quickstart}"
QS_SIZE="${QS_SIZE:-1G}"
QS_PORT="${QS_PORT:-7480}"
QS_METRICS_PORT="${QS_METRICS_PORT:-9480}"
ATTACH_METRICS_PORT=$((QS_METRICS_PORT + 1))
VOLUME="$QS_DIR/vol0.img"
SOCK="$QS_DIR/nbd.sock"
URI="nbd+unix:///vol0?socket=$SOCK"
FUSE_DIR="$QS_DIR/fuse"
MNT="$QS_DIR/mnt"

RBLKD_PID=""
ATTACH_PID=""
NBDFUSE_PID=""
LOOP_DEV=""
KERNEL_DEV=""
MOUNTED=0
STEP=0
TOTAL=8

step() {
	STEP=$((STEP + 1))
	printf '\n\033[1m[%d/%d] %s\033[0m\n' "$STEP" "$TOTAL" "$*"
}

# show runs a command after printing it.
show() {
	printf '    $ %s\n' "$*"
	"$@"
}

# stop_daemon NAME PID: SIGTERM, wait up to 90s, report the exit status.
stop_daemon() {
	local name="$1" pid="$2" rc=0
	[ -n "$pid" ] || return 0
	if ! kill -0 "$pid" 2>/dev/null; then
		wait "$pid" 2>/dev/null || rc=$?
		warn "$name (pid $pid) had already exited with status $rc; the end of its log ($QS_DIR/$name.log):"
		tail -n 5 "$QS_DIR/$name.log" >&2 || true
		return 1
	fi
	note "SIGTERM $name (pid $pid), waiting for it to flush and exit"
	kill -TERM "$pid"
	for _ in $(seq 1 900); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$pid" 2>/dev/null; then
		warn "$name did not exit within 90s of SIGTERM: killing it"
		kill -KILL "$pid" 2>/dev/null || true
	fi
	wait "$pid" 2>/dev/null || rc=$?
	if [ "$rc" -eq 0 ]; then
		note "$name exited cleanly (status 0)"
	else
		warn "$name exited with status $rc; the end of its log ($QS_DIR/$name.log):"
		tail -n 5 "$QS_DIR/$name.log" >&2 || true
		return 1
	fi
}

cleanup() {
	local rc=$? bad=0
	trap - EXIT INT TERM
	printf '\n\033[1m[cleanup]\033[0m\n'
	if [ "$MOUNTED" = 1 ]; then
		show umount "$MNT" || { umount -l "$MNT" || true; bad=1; }
		MOUNTED=0
	fi
	if [ -n "$KERNEL_DEV" ]; then
		show nbd-client -d "$KERNEL_DEV" || bad=1
	fi
	if [ -n "$LOOP_DEV" ]; then
		show losetup -d "$LOOP_DEV" || bad=1
	fi
	if [ -n "$NBDFUSE_PID" ]; then
		for _ in $(seq 1 50); do
			fusermount3 -u "$FUSE_DIR" 2>/dev/null && break
			sleep 0.2
		done
		note "fusermount3 -u $FUSE_DIR"
		wait "$NBDFUSE_PID" 2>/dev/null || true
	fi
	stop_daemon rblk-attach "$ATTACH_PID" || bad=1
	stop_daemon rblkd "$RBLKD_PID" || bad=1
	rm -f "$SOCK"
	if [ "$rc" -eq 0 ] && [ "$bad" -eq 0 ]; then
		printf '\n\033[32mquickstart passed.\033[0m The volume stays in %s (rm -r %s to remove it).\n' "$VOLUME" "$QS_DIR"
		printf 'Next: scripts/test.sh (as root) runs every test; README.md has the CLI reference.\n'
		exit 0
	fi
	printf '\n\033[31mquickstart failed.\033[0m Logs: %s/rblkd.log, %s/rblk-attach.log\n' "$QS_DIR" "$QS_DIR" >&2
	exit 1
}

# wait_for WHAT PID CMD...: polls CMD until it succeeds, PID dies, or 30s.
wait_for() {
	local what="$1" pid="$2"
	shift 2
	for _ in $(seq 1 300); do
		if "$@" >/dev/null 2>&1; then
			return 0
		fi
		if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
			die "$what: the process exited; see its log"
		fi
		sleep 0.1
	done
	die "$what: not ready after 30s"
}

[ "$(id -u)" -eq 0 ] || die "run as root (as root: $0; or sudo $0): it loads modules, sets up a loop device and mounts"
trap cleanup EXIT
trap 'exit 130' INT TERM

step "Install what is missing"
ensure_packages fuse3 e2fsprogs util-linux mount curl libnbd-bin kmod ca-certificates
ensure_nbdfuse
ensure_go

step "Build bin/rblkd and bin/rblk-attach"
mkdir -p bin
show go build -o bin/ ./cmd/rblkd ./cmd/rblk-attach

step "Start rblkd on $VOLUME ($QS_SIZE, sparse), transport auto"
mkdir -p "$QS_DIR" "$FUSE_DIR" "$MNT"
for port in "$QS_PORT" "$QS_METRICS_PORT" "$ATTACH_METRICS_PORT"; do
	if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
		die "port $port on 127.0.0.1 is in use (an rblkd already running? systemctl status rblkd): set QS_PORT / QS_METRICS_PORT"
	fi
done
printf '    $ bin/rblkd serve --listen 127.0.0.1:%s --transport auto --export vol0=%s,size=%s --metrics-listen 127.0.0.1:%s 2>%s\n' \
	"$QS_PORT" "$VOLUME" "$QS_SIZE" "$QS_METRICS_PORT" "$QS_DIR/rblkd.log"
bin/rblkd serve --listen "127.0.0.1:$QS_PORT" --transport auto --export "vol0=$VOLUME,size=$QS_SIZE" \
	--metrics-listen "127.0.0.1:$QS_METRICS_PORT" 2>"$QS_DIR/rblkd.log" &
RBLKD_PID=$!
wait_for "rblkd" "$RBLKD_PID" curl -sf "http://127.0.0.1:$QS_METRICS_PORT/metrics"
wait_for "rblkd" "$RBLKD_PID" grep -q "rblkd serving" "$QS_DIR/rblkd.log"
note "rblkd is up (pid $RBLKD_PID): $(grep -o '"transport": "[^"]*"' "$QS_DIR/rblkd.log" | head -1)"

step "Attach vol0 with rblk-attach, serving NBD on $SOCK"
printf '    $ bin/rblk-attach attach --target 127.0.0.1:%s --export vol0 --transport auto --nbd-listen unix:%s --metrics-listen 127.0.0.1:%s 2>%s\n' \
	"$QS_PORT" "$SOCK" "$ATTACH_METRICS_PORT" "$QS_DIR/rblk-attach.log"
bin/rblk-attach attach --target "127.0.0.1:$QS_PORT" --export vol0 --transport auto --nbd-listen "unix:$SOCK" \
	--metrics-listen "127.0.0.1:$ATTACH_METRICS_PORT" 2>"$QS_DIR/rblk-attach.log" &
ATTACH_PID=$!
wait_for "rblk-attach" "$ATTACH_PID" nbdinfo --size "$URI"
show bin/rblk-attach list --target "127.0.0.1:$QS_PORT"
printf '    $ nbdinfo %s\n' "$URI"
nbdinfo "$URI" | grep -E 'export-size|can_flush|can_fua|can_trim|can_zero|can_multi_conn|is_read_only' | sed 's/^[[:space:]]*/      /'

step "Make it a block device"
DEV=""
if command -v nbd-client >/dev/null 2>&1 && modprobe nbd 2>/dev/null && [ -b /dev/nbd0 ]; then
	note "the kernel's nbd module loaded and nbd-client is installed: /dev/nbd0"
	show nbd-client -unix "$SOCK" /dev/nbd0 -N vol0
	KERNEL_DEV=/dev/nbd0
	DEV=/dev/nbd0
else
	if ! command -v nbd-client >/dev/null 2>&1; then
		note "nbd-client is not installed: using nbdfuse and a loop device"
	else
		note "the kernel's nbd module does not load here: using nbdfuse and a loop device"
	fi
	[ -e /dev/fuse ] || die "/dev/fuse is missing: FUSE is needed for nbdfuse"
	printf '    $ nbdfuse -P %s %s %s &\n' "$QS_DIR/nbdfuse.pid" "$FUSE_DIR" "$URI"
	rm -f "$QS_DIR/nbdfuse.pid"
	nbdfuse -P "$QS_DIR/nbdfuse.pid" "$FUSE_DIR" "$URI" &
	NBDFUSE_PID=$!
	wait_for "nbdfuse" "$NBDFUSE_PID" test -e "$QS_DIR/nbdfuse.pid"
	note "the export is the file $FUSE_DIR/nbd ($(stat -c %s "$FUSE_DIR/nbd") bytes)"
	printf '    $ losetup --find --show %s\n' "$FUSE_DIR/nbd"
	LOOP_DEV="$(losetup --find --show "$FUSE_DIR/nbd")"
	DEV="$LOOP_DEV"
fi
note "block device: $DEV"

step "Make an ext4 file system on $DEV, mount it, write a file and read it back"
if [ "$(blkid -p -o value -s TYPE "$DEV" 2>/dev/null || true)" = ext4 ]; then
	note "$DEV already holds the ext4 file system an earlier run made: keeping it"
	show e2fsck -fn "$DEV"
else
	show mkfs.ext4 -q -L rblk-vol0 "$DEV"
fi
show mount "$DEV" "$MNT"
MOUNTED=1
if [ -e "$MNT/hello.bin" ]; then
	note "an earlier run left hello.bin: $(sha256sum "$MNT/hello.bin" | cut -d' ' -f1)"
fi
show dd if=/dev/urandom of="$MNT/hello.bin" bs=1M count=16 status=none
show sync -f "$MNT"
written="$(sha256sum "$MNT/hello.bin" | cut -d' ' -f1)"
note "sha256 written:   $written"
note "unmounting and mounting again, so the read comes from the volume, not the page cache"
show umount "$MNT"
MOUNTED=0
show mount "$DEV" "$MNT"
MOUNTED=1
read_back="$(sha256sum "$MNT/hello.bin" | cut -d' ' -f1)"
note "sha256 read back: $read_back"
[ "$written" = "$read_back" ] || die "the file read back differs from the one written"
printf '    $ df -h %s\n' "$MNT"
df -h "$MNT" | sed 's/^/      /'

step "A few lines of both metrics endpoints"
printf '    $ curl -s http://127.0.0.1:%s/metrics | grep ^rblkd_\n' "$QS_METRICS_PORT"
curl -s "http://127.0.0.1:$QS_METRICS_PORT/metrics" |
	grep -E '^rblkd_(sessions|requests_total|cache_(loads|evictions)_total|cache_used_bytes|grants_total|revokes_total|writeback_bytes_total|written_bytes_total)' |
	head -n 15 | sed 's/^/    /' || true
printf '    $ curl -s http://127.0.0.1:%s/metrics | grep ^rblk_attach_\n' "$ATTACH_METRICS_PORT"
curl -s "http://127.0.0.1:$ATTACH_METRICS_PORT/metrics" |
	grep -E '^rblk_attach_(rdma_ops_total|rdma_bytes_total|grants_held|grant_requests_total|nbd_requests_total|nbd_connections)' |
	head -n 15 | sed 's/^/    /' || true

step "Clean up"
# The EXIT trap does it, in order: unmount, detach, stop rblk-attach, stop rblkd.
