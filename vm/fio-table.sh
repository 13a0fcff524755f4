# vm/fio-table.sh: sourceable fio helpers for guest scripts (bash; needs fio, jq).
# Inside the guest: . "$RBLK_VM_LIB/fio-table.sh"
#
#   fio_run NAME DEVICE JOB CSV      run the named job on DEVICE, append
#                                    "NAME,DEVICE,JOB,iops,bw_MBps,lat_mean_us"
#                                    to CSV (header written if CSV is new)
#   fio_all NAME DEVICE CSV          run every job of $FIO_JOBS in order
#   fio_table CSV [NAME_A [NAME_B]]  side-by-side table from CSV:
#                                    job | NAME_A | NAME_B | B/A (IOPS)
#                                    (defaults "nvme-of rdma" and "rblk")
#
# Jobs (all libaio, direct=1, time based):
#   randread-4k-qd1  randread-4k-qd32  randwrite-4k-qd32
#   randrw-4k-qd32-verify (crc32c; fio reads back what it wrote and fails on
#   a mismatch, so this job is a data check as well as a figure)
#   read-1m-qd8  write-1m-qd8
# Settings: FIO_RUNTIME (seconds per job, default 7), FIO_RAMP (default 1),
# FIO_OUTDIR (fio's JSON and text output kept here; default /tmp/fio-out).
# With the defaults, the six jobs take ~65 s per device under emulation, so
# two devices fit in ~2-3 minutes of guest time.
# Figures under software emulation only mean something as ratios within one run.

FIO_JOBS="randread-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 randrw-4k-qd32-verify read-1m-qd8 write-1m-qd8"

# fio_job_args JOB: the fio options of a named job.
fio_job_args() {
	case $1 in
	randread-4k-qd1) echo "--rw=randread --bs=4k --iodepth=1" ;;
	randread-4k-qd32) echo "--rw=randread --bs=4k --iodepth=32" ;;
	randwrite-4k-qd32) echo "--rw=randwrite --bs=4k --iodepth=32" ;;
	randrw-4k-qd32-verify) echo "--rw=randrw --bs=4k --iodepth=32 --verify=crc32c --verify_fatal=1 --verify_state_save=0" ;;
	read-1m-qd8) echo "--rw=read --bs=1M --iodepth=8" ;;
	write-1m-qd8) echo "--rw=write --bs=1M --iodepth=8" ;;
	*) echo "fio_job_args: unknown job '$1' (known: $FIO_JOBS)" >&2; return 1 ;;
	esac
}

fio_run() {
	local name=${1:?usage: fio_run NAME DEVICE JOB CSV} dev=${2:?} job=${3:?} csv=${4:?}
	local args out rc line
	args=$(fio_job_args "$job") || return 1
	local outdir=${FIO_OUTDIR:-/tmp/fio-out}
	mkdir -p "$outdir"
	out=$outdir/$(echo "$name-$(basename "$dev")-$job" | tr -c 'A-Za-z0-9._\n-' _)
	# shellcheck disable=SC2086 # args is a list of options
	fio --name="$job" --filename="$dev" --ioengine=libaio --direct=1 \
		--time_based --runtime="${FIO_RUNTIME:-7}" --ramp_time="${FIO_RAMP:-1}" \
		--group_reporting $args \
		--output-format=json --output="$out.json" >"$out.txt" 2>&1
	rc=$?
	if [ $rc -ne 0 ] || ! jq -e '.jobs[0]' "$out.json" >/dev/null 2>&1; then
		echo "fio_run: $job on $dev failed (fio exit $rc)" >&2
		cat "$out.txt" >&2
		[ -s "$out.json" ] && jq -c '.jobs[0] | {error, read: .read.io_bytes, write: .write.io_bytes}' "$out.json" >&2 2>/dev/null
		return 1
	fi
	# IOPS and bandwidth: read + write; mean latency (submit to completion):
	# weighted by the number of I/Os of each direction.
	line=$(jq -r --arg name "$name" --arg dev "$dev" --arg job "$job" '
		.jobs[0] as $j
		| ($j.read.total_ios + $j.write.total_ios) as $n
		| [ $name, $dev, $job,
		    (($j.read.iops + $j.write.iops) * 10 | round / 10),
		    (($j.read.bw_bytes + $j.write.bw_bytes) / 1e5 | round / 10),
		    (if $n > 0 then (($j.read.lat_ns.mean * $j.read.total_ios
		                     + $j.write.lat_ns.mean * $j.write.total_ios) / $n / 100 | round / 10)
		     else 0 end) ]
		| map(tostring) | join(",")' "$out.json") || return 1
	[ -s "$csv" ] || echo "name,device,job,iops,bw_MBps,lat_mean_us" >"$csv"
	echo "$line" >>"$csv"
	echo "fio: $line" >&2
}

fio_all() {
	local name=${1:?usage: fio_all NAME DEVICE CSV} dev=${2:?} csv=${3:?} job rc=0
	for job in $FIO_JOBS; do
		fio_run "$name" "$dev" "$job" "$csv" || rc=1
	done
	return $rc
}

fio_table() {
	local csv=${1:?usage: fio_table CSV [NAME_A [NAME_B]]}
	local a=${2:-nvme-of rdma} b=${3:-rblk}
	awk -F, -v A="$a" -v B="$b" '
	function cell(k) {
		if (!(k in iops)) return "-"
		return sprintf("%8.0f IOPS %7.1f MB/s %8.0f us", iops[k], bw[k], lat[k])
	}
	NR == 1 && $1 == "name" { next }
	{
		if (!($3 in seen)) { seen[$3] = 1; jobs[++n] = $3 }
		k = $1 SUBSEP $3
		iops[k] = $4; bw[k] = $5; lat[k] = $6
	}
	END {
		w = 36
		printf "%-22s | %-" w "s | %-" w "s | %s\n", "job", A, B, B "/" A
		line = sprintf("%-22s-+-%-" w "s-+-%-" w "s-+-%s", "", "", "", "------")
		gsub(/ /, "-", line); print line
		for (i = 1; i <= n; i++) {
			j = jobs[i]; ka = A SUBSEP j; kb = B SUBSEP j
			r = ((ka in iops) && (kb in iops) && iops[ka] > 0) ? sprintf("%.2f", iops[kb] / iops[ka]) : "-"
			printf "%-22s | %-" w "s | %-" w "s | %s\n", j, cell(ka), cell(kb), r
		}
	}' "$csv"
}
