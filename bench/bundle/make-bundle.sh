#!/usr/bin/env bash
# bench/bundle/make-bundle.sh: builds the rblk benchmark bundle (make bench-bundle): static rblkd,
# rblk-attach and bench.test (the Go benchmarks of bench/) + Debian's fio, nbdkit (file, nbd plugins)
# and jq with their whole shared-library closure and the dynamic loader. Output: $1 (a .tar.xz);
# run it with bench/bundle/run.sh beside it (see bench/bundle/README.md).
set -euo pipefail
OUTF=${1:?usage: make-bundle.sh OUT.tar.xz}
SRC=${SRC:-$PWD}   # the project checkout (run from its root)
ST=$(mktemp -d /tmp/dvstage.XXXXXX)
B=$ST/rblkbench
mkdir -p "$B/bin" "$B/lib" "$B/plugins"
export PATH=$PATH:/usr/local/go/bin
( cd "$SRC" && CGO_ENABLED=0 go build -trimpath -ldflags=-w -o "$B/bin/" ./cmd/rblkd ./cmd/rblk-attach )
( cd "$SRC" && CGO_ENABLED=0 go test -c -trimpath -ldflags=-w -o "$B/bin/bench.test" ./bench/ )
for b in rblkd rblk-attach bench.test; do file "$B/bin/$b" | grep -q 'statically linked' || { echo "$b not static" >&2; exit 1; }; done
cp /usr/bin/fio /usr/bin/nbdkit /usr/bin/jq "$B/bin/"
PL=/usr/lib/x86_64-linux-gnu/nbdkit/plugins
cp "$PL/nbdkit-file-plugin.so" "$PL/nbdkit-nbd-plugin.so" "$B/plugins/"
# closure: every DT_NEEDED (transitively, as ldd resolves it), stored under the name ldd shows (the SONAME)
for f in /usr/bin/fio /usr/bin/nbdkit /usr/bin/jq "$PL/nbdkit-file-plugin.so" "$PL/nbdkit-nbd-plugin.so"; do
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3} $1 ~ /^\/.*ld-linux/ {print "ld-linux-x86-64.so.2", $1}'
done | sort -u | while read -r name path; do
  cp -L "$path" "$B/lib/$name"
done
chmod 755 "$B/lib/ld-linux-x86-64.so.2"
{
  echo "rblk commit: $(cd "$SRC" && git rev-parse HEAD)$(cd "$SRC" && git diff --quiet HEAD || echo -dirty)"
  echo "go: $(go version)"
  echo "built on: $(. /etc/os-release; echo "$PRETTY_NAME"), $(date -u +%FT%TZ)"
  dpkg-query -W -f='${Package} ${Version}\n' fio nbdkit jq libnbd0 libc6
  echo; echo "files:"; (cd "$B" && find . -type f ! -name MANIFEST | sort | xargs sha256sum)
} > "$B/MANIFEST"
cp "$0" "$B/make-bundle.sh"
tar -C "$ST" -cf - rblkbench | xz -9 -T1 > "$OUTF.tmp"
mv "$OUTF.tmp" "$OUTF"
rm -rf "$ST"
ls -la "$OUTF"
