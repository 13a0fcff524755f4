# shellcheck shell=bash
# scripts/lib.sh: what scripts/test.sh and scripts/quickstart.sh share:
# messages, running as root, Debian packages and the Go toolchain.
# Source it from the repository root; it changes no shell options.

# say prints a progress line; warn and die print to stderr.
say() { printf '\033[1m==>\033[0m %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() {
	printf 'error: %s\n' "$*" >&2
	exit 1
}

# as_root runs a command as root: directly when we are root, else with sudo.
as_root() {
	if [ "$(id -u)" -eq 0 ]; then
		"$@"
	elif command -v sudo >/dev/null 2>&1; then
		sudo "$@"
	else
		die "need root to run: $* (run this script as root, or install sudo)"
	fi
}

# Some non-login root shells lack the sbin folders.
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/sbin:/sbin" ;; esac
export PATH

# Go needs a home for its caches.
export HOME="${HOME:-/root}"

pkg_installed() {
	dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'
}

_apt_updated=0
apt_update_once() {
	if [ "$_apt_updated" -eq 0 ]; then
		note "apt-get update"
		as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null ||
			die "apt-get update failed"
		_apt_updated=1
	fi
}

# apt_candidate prints the version apt would install of a package, or
# nothing if it has none.
apt_candidate() {
	apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ { if ($2 != "(none)") print $2 }'
}

# ensure_packages installs the Debian packages that are not installed yet,
# with one apt-get update first, and nothing at all if every one is.
ensure_packages() {
	local missing=() p
	for p in "$@"; do
		pkg_installed "$p" || missing+=("$p")
	done
	if [ "${#missing[@]}" -eq 0 ]; then
		note "Debian packages present: $*"
		return 0
	fi
	command -v apt-get >/dev/null 2>&1 ||
		die "missing packages ${missing[*]} and no apt-get: this script expects Debian 12"
	apt_update_once
	note "apt-get install ${missing[*]}"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" ||
		die "apt-get install ${missing[*]} failed"
}

# ensure_nbdfuse installs nbdfuse: its own package where Debian has one
# (newer releases), else libnbd-bin, which ships it in Debian 12.
ensure_nbdfuse() {
	if command -v nbdfuse >/dev/null 2>&1; then
		note "nbdfuse present: $(command -v nbdfuse)"
		return 0
	fi
	apt_update_once
	if [ -n "$(apt_candidate nbdfuse)" ]; then
		ensure_packages nbdfuse
	else
		ensure_packages libnbd-bin
	fi
	command -v nbdfuse >/dev/null 2>&1 || die "nbdfuse is still missing after installing its package"
}

# go_mod_version prints the go line of go.mod (the oldest Go that builds it).
go_mod_version() {
	awk '$1 == "go" { print $2; exit }' go.mod
}

# ensure_go puts a Go toolchain at least as new as go.mod's go line on PATH:
# the one on PATH, else /usr/local/go (the official tarball's place), else
# Debian's golang-go if that is new enough. It fails with the reason
# otherwise: a toolchain is not downloaded from anywhere else.
ensure_go() {
	local want have cand d
	want="$(go_mod_version)"
	[ -n "$want" ] || die "no go line in go.mod"
	if ! command -v go >/dev/null 2>&1; then
		for d in /usr/local/go/bin /usr/lib/go/bin; do
			if [ -x "$d/go" ]; then
				PATH="$PATH:$d"
				break
			fi
		done
	fi
	if ! command -v go >/dev/null 2>&1; then
		apt_update_once
		cand="$(apt_candidate golang-go)"
		cand="${cand#*:}"
		cand="${cand%%[~+-]*}"
		if [ -n "$cand" ] && dpkg --compare-versions "$cand" ge "$want"; then
			ensure_packages golang-go
		else
			die "Go is not installed, and Debian's golang-go (${cand:-none}) is older than the Go ${want} that go.mod needs: install Go ${want} or newer (the official tarball into /usr/local/go) and run this again"
		fi
	fi
	have="$(go env GOVERSION 2>/dev/null)"
	have="${have#go}"
	have="${have%%[ -]*}"
	if ! dpkg --compare-versions "$have" ge "$want"; then
		die "$(command -v go) is Go ${have}, older than the Go ${want} that go.mod needs: install Go ${want} or newer into /usr/local/go"
	fi
	PATH="$PATH:$(go env GOPATH)/bin"
	export PATH
	note "Go ${have}: $(command -v go)"
}
