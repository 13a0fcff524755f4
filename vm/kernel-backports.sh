#!/usr/bin/env bash
# vm/kernel-backports.sh [SERIES]: a bookworm-backports kernel for the guest
# only, unpacked (dpkg -x) into a cache dir; prints that dir.
#
#   dir=$(vm/kernel-backports.sh 6.12)
#   RBLK_VM_KERNEL_DIR=$dir vm/run.sh GUEST_SCRIPT
#
# The dir holds boot/vmlinuz-VERSION and lib/modules/VERSION (with depmod
# run for it). vm/run.sh boots that kernel and bind-mounts the dir's
# lib/modules over the guest's /lib/modules, so the host's /lib/modules and
# its package state are not touched.
#
# The host's apt configuration is left alone: bookworm-backports is given to
# apt for this download only (its own sources list, package lists and
# package cache, under the cache dir). The host never installs from it.
#
# Cached: a second call finds the unpacked kernel and does not go to the
# network. RBLK_VM_KERNEL_REFRESH=1 looks for a newer package first.
#
# Environment:
#   RBLK_VM_KCACHE  cache dir (default /var/cache/rblk-vm)
#   RBLK_VM_KERNEL_REFRESH  1: apt-get update and take the newest package
#   RBLK_VM_BACKPORTS_MIRROR  (default http://deb.debian.org/debian)
set -euo pipefail

SERIES=${1:-6.12}
KCACHE=${RBLK_VM_KCACHE:-/var/cache/rblk-vm}
MIRROR=${RBLK_VM_BACKPORTS_MIRROR:-http://deb.debian.org/debian}
log() { echo "[kernel] $*" >&2; }
die() { echo "[kernel] error: $*" >&2; exit 2; }

# newest_unpacked: the newest unpacked kernel of SERIES in the cache, or "".
newest_unpacked() {
	local d v best=
	for d in "$KCACHE"/kernels/linux-image-"$SERIES".*; do
		[ -f "$d/.done" ] || continue
		v=${d##*/}
		[ "$(printf '%s\n%s\n' "${best##*/}" "$v" | sort -V | tail -n 1)" = "$v" ] && best=$d
	done
	echo "$best"
}

if [ "${RBLK_VM_KERNEL_REFRESH:-0}" != 1 ]; then
	dir=$(newest_unpacked)
	if [ -n "$dir" ]; then
		log "cached: $dir"
		echo "$dir"
		exit 0
	fi
fi

[ "$(id -u)" = 0 ] || die "need root for apt-get (to download $SERIES into $KCACHE)"
for t in apt-get dpkg depmod xz; do
	command -v "$t" >/dev/null || die "$t not found"
done

APT=$KCACHE/apt
mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$APT/cache" "$KCACHE/kernels" "$KCACHE/debs"
echo "deb $MIRROR bookworm-backports main" >"$APT/sources.list"
# Everything apt writes goes under $APT: the host's lists (and its
# sources.list.d) are neither read nor cleaned up by this update.
APT_OPTS=(
	-o "Dir::Etc::sourcelist=$APT/sources.list" -o "Dir::Etc::sourceparts=-"
	-o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache"
	-o "Dir::Cache::Archives=$APT/archives" -o "APT::Get::List-Cleanup=0"
	-o "APT::Sandbox::User=root" -o "Acquire::Languages=none"
)
log "apt-get update (bookworm-backports only, lists in $APT/lists)"
apt-get "${APT_OPTS[@]}" update -qq >&2 || die "apt-get update for bookworm-backports failed"

# The newest linux-image-SERIES.*-amd64 (the signed image: it has the
# modules too); not -unsigned, -dbg, -rt or -cloud.
pkg=$(apt-cache "${APT_OPTS[@]}" pkgnames linux-image-"$SERIES". |
	grep -E "^linux-image-${SERIES//./\\.}\.[0-9]+[^-]*-amd64$" | sort -V | tail -n 1)
[ -n "$pkg" ] || die "no linux-image-$SERIES.*-amd64 in bookworm-backports"
dest=$KCACHE/kernels/$pkg
if [ -f "$dest/.done" ]; then
	log "cached: $dest"
	echo "$dest"
	exit 0
fi

log "apt-get download $pkg"
(cd "$KCACHE/debs" && apt-get "${APT_OPTS[@]}" download -qq "$pkg" >&2) || die "apt-get download $pkg failed"
debs=("$KCACHE/debs/${pkg}"_*.deb)
deb=${debs[-1]}
[ -f "$deb" ] || die "apt-get download left no ${pkg}_*.deb"
rm -rf "$dest"
mkdir -p "$dest"
log "dpkg -x $(basename "$deb")"
dpkg -x "$deb" "$dest"
# (a package built for usrmerge may ship usr/lib/modules)
if [ ! -d "$dest/lib/modules" ] && [ -d "$dest/usr/lib/modules" ]; then
	mkdir -p "$dest/lib"
	ln -s ../usr/lib/modules "$dest/lib/modules"
fi
kver=$(basename "$(ls -d "$dest"/lib/modules/"$SERIES".*)")
[ -f "$dest/boot/vmlinuz-$kver" ] || die "no boot/vmlinuz-$kver in $deb"
depmod -b "$dest" -a "$kver" || die "depmod $kver"
# Keep only the newest .deb: the unpacked tree is what runs use.
find "$KCACHE/debs" -name '*.deb' ! -newer "$deb" ! -samefile "$deb" -delete
touch "$dest/.done"
log "unpacked $kver into $dest"
echo "$dest"
