#!/bin/bash
# Regenerates the Go code of the management API (manage/managepb) with
# Debian's protoc and the pinned protoc-gen-go and protoc-gen-go-grpc
# (installed into a cache folder from the Go module proxy). With --check it
# generates into a temporary folder and fails if the checked-in code
# differs (the test command runs that).
set -euo pipefail
cd "$(dirname "$0")/.."
PROTOC_GEN_GO=v1.36.12
PROTOC_GEN_GO_GRPC=v1.6.0
command -v protoc >/dev/null || { echo "gen-proto: no protoc (apt-get install protobuf-compiler)" >&2; exit 1; }
bin=${RBLK_PROTO_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/rblk-protoc-bin}
mkdir -p "$bin"
[ -x "$bin/protoc-gen-go" ] && "$bin/protoc-gen-go" --version | grep -q "${PROTOC_GEN_GO}$" ||
	GOBIN=$bin go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO"
[ -x "$bin/protoc-gen-go-grpc" ] && "$bin/protoc-gen-go-grpc" --version | grep -q "${PROTOC_GEN_GO_GRPC#v}$" ||
	GOBIN=$bin go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
out=manage/managepb
if [ "${1:-}" = --check ]; then
	out=$(mktemp -d)
	trap 'rm -rf "$out"' EXIT
fi
PATH=$bin:$PATH protoc -I manage/managepb --go_out="$out" --go_opt=paths=source_relative \
	--go-grpc_out="$out" --go-grpc_opt=paths=source_relative manage/managepb/manage.proto
if [ "${1:-}" = --check ]; then
	for f in manage.pb.go manage_grpc.pb.go; do
		diff -u "manage/managepb/$f" "$out/$f" || { echo "gen-proto: manage/managepb/$f is not what manage.proto generates: run scripts/gen-proto.sh" >&2; exit 1; }
	done
	echo "gen-proto: manage/managepb is up to date ($(protoc --version))"
fi
