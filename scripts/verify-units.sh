#!/usr/bin/env bash
# scripts/verify-units.sh: systemd-analyze verify of every unit in systemd/,
# against the binaries built in bin/ (verify wants ExecStart's binary to
# exist: a copy of each unit has /usr/local/bin/ replaced by this
# checkout's bin/). Any warning fails. First it checks that verify does
# fail on a broken unit, so a verify that passes everything is caught.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v systemd-analyze >/dev/null || { echo "systemd-analyze is missing (apt-get install systemd)"; exit 1; }
if [ ! -x bin/rblkd ] || [ ! -x bin/rblk-attach ] || [ ! -x bin/rblk-mirror ]; then
	echo "bin/rblkd, bin/rblk-attach or bin/rblk-mirror is missing: make build"
	exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
bin="$(pwd)/bin"

# verify_one UNIT-FILE: systemd-analyze verify, failing on any output.
verify_one() {
	local out rc=0
	out="$(systemd-analyze verify --man=no "$1" 2>&1)" || rc=$?
	# Lines about units of the machine (not ours) are not ours to judge.
	out="$(grep -v -e '^$' <<<"$out" || true)"
	if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
		printf '%s: exit %d\n%s\n' "$(basename "$1")" "$rc" "$out"
		return 1
	fi
}

units=()
for u in systemd/*.service; do
	name="$(basename "$u")"
	# A template is verified as an instance.
	[[ "$name" == *@.service ]] && name="${name%@.service}@vol0.service"
	sed "s|/usr/local/bin/|$bin/|g" "$u" >"$tmp/$name"
	units+=("$tmp/$name")
done

# The negative control: an unknown Type= and a missing binary must fail.
sed -e 's/^Type=notify/Type=notifi/' "${units[0]}" >"$tmp/broken-type.service"
sed -e "s|$bin/|/nonexistent/|" "${units[0]}" >"$tmp/broken-exec.service"
for b in "$tmp/broken-type.service" "$tmp/broken-exec.service"; do
	if verify_one "$b" >/dev/null; then
		echo "systemd-analyze verify passed the broken unit $(basename "$b"): this check would catch nothing"
		exit 1
	fi
done

rc=0
for u in "${units[@]}"; do
	if verify_one "$u"; then
		echo "ok   $(basename "$u")"
	else
		rc=1
	fi
done
exit "$rc"
