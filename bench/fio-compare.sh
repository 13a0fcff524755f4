#!/usr/bin/env bash
# Runs the same fio jobs (fio's nbd engine, unix sockets) against the whole
# rblk path (fio -> rblk-attach -> software RDMA over TCP loopback -> rblkd)
# and against nbdkit's file plugin serving the same kind of file, in one run,
# and prints a table side by side. Only ratios within one run mean anything.
#
#   bench/fio-compare.sh [RUNTIME_SECONDS] [CHUNK_SIZE]
#
# Needs: go, fio, nbdkit (apt-get install fio nbdkit). Run from the repo root.
set -euo pipefail
runtime=${1:-5}
chunk=${2:-1M}
size=1G
work=$(mktemp -d /var/tmp/rblk-bench.XXXXXX)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT

for tool in fio nbdkit go; do
	command -v "$tool" >/dev/null || { echo "bench: $tool is missing (apt-get install fio nbdkit)" >&2; exit 1; }
done
go build -o "$work/bin/" ./cmd/rblkd ./cmd/rblk-attach

port=$((20000 + RANDOM % 20000))
"$work/bin/rblkd" serve --listen "127.0.0.1:$port" --transport tcp --chunk-size "$chunk" --cache-size 1280M \
	--export "vol=$work/rblk.img,size=$size" 2>"$work/rblkd.log" &
pids+=($!)
for _ in $(seq 50); do "$work/bin/rblk-attach" list --target "127.0.0.1:$port" --transport tcp >/dev/null 2>&1 && break; sleep 0.1; done
"$work/bin/rblk-attach" attach --target "127.0.0.1:$port" --export vol --transport tcp \
	--nbd-listen "unix:$work/rblk.sock" 2>"$work/attach.log" &
pids+=($!)
truncate -s "$size" "$work/nbdkit.img"
nbdkit --foreground --unix "$work/nbdkit.sock" --exit-with-parent file "$work/nbdkit.img" 2>"$work/nbdkit.log" &
pids+=($!)
for s in rblk nbdkit; do
	for _ in $(seq 50); do [ -S "$work/$s.sock" ] && break; sleep 0.1; done
done

# name|fio arguments
jobs=(
	"4k randread QD1|--rw=randread --bs=4k --iodepth=1"
	"4k randread QD32|--rw=randread --bs=4k --iodepth=32"
	"4k randwrite QD32|--rw=randwrite --bs=4k --iodepth=32"
	"4k randrw QD32|--rw=randrw --bs=4k --iodepth=32"
	"1M read QD8|--rw=read --bs=1M --iodepth=8"
	"1M write QD8|--rw=write --bs=1M --iodepth=8"
)

# result prints "IOPS MB/s mean-latency-us" of a fio JSON file.
result() {
	python3 - "$1" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 1e6
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
lat = (j["read"]["clat_ns"]["mean"] * j["read"]["total_ios"] + j["write"]["clat_ns"]["mean"] * j["write"]["total_ios"]) / max(ios, 1) / 1e3
print(f"{iops:.0f} {bw:.1f} {lat:.0f}")
PY
}

printf '%-18s | %-28s | %-28s | %s\n' "job (fio nbd)" "rblk: IOPS  MB/s  lat µs" "nbdkit file: IOPS  MB/s  lat µs" "rblk/nbdkit IOPS"
printf '%s\n' "-------------------+------------------------------+----------------------------------+-----------------"
for j in "${jobs[@]}"; do
	name=${j%%|*}
	args=${j#*|}
	declare -A r=()
	for s in rblk nbdkit; do
		# shellcheck disable=SC2086
		fio --name=bench --ioengine=nbd --uri="nbd+unix:///?socket=$work/$s.sock" $args \
			--size=$size --time_based --runtime="$runtime" --ramp_time=1 --output-format=json \
			--output="$work/$s.json" >/dev/null
		r[$s]=$(result "$work/$s.json")
	done
	read -r ri rb rl <<<"${r[rblk]}"
	read -r ni nb nl <<<"${r[nbdkit]}"
	printf '%-18s | %9s %7s %8s   | %9s %7s %8s         | %.2f\n' "$name" "$ri" "$rb" "$rl" "$ni" "$nb" "$nl" \
		"$(python3 -c "print($ri/max($ni,1))")"
done
echo
echo "rblk: chunk size $chunk; rblkd metrics of this run:"
grep -c . "$work/rblkd.log" >/dev/null || true
