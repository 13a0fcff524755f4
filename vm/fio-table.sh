# vm/fio-table.sh: sourceable fio helpers for guest scripts (bash; needs fio, jq).
# Inside the guest: . "$RBLK_VM_LIB/fio-table.sh"
#
#   fio_run NAME DEVICE JOB CSV [REP]   run the named job on DEVICE, append
#                                    a line to CSV (header written if CSV is
#                                    new): name,device,job,rep,iops,bw_MBps,
#                                    lat_mean_us,lat_p99_us,ios_all,
#                                    cpu_busy_ticks,cpu_us_per_io,
#                                    target_us_per_io,kthread_us_per_io,
#                                    ctxt_per_io
#   fio_all NAME DEVICE CSV [REP]    run every job of $FIO_JOBS in order
#   fio_interleaved CSV NAME=DEV[=JOB,JOB...]...
#                                    every job of $FIO_JOBS on every device,
#                                    $FIO_REPS times, interleaved: for each
#                                    rep, for each job, each device in turn
#                                    (the order rotates from rep to rep); a
#                                    device given with =JOB,JOB... runs only
#                                    those of the jobs
#   fio_table CSV [NAME_A [NAME_B [NAME_C [NAME_X...]]]]
#                                    side-by-side table from CSV, medians of
#                                    the reps: job | A | B | B/A (IOPS)
#                                    [| C | B/C] (defaults "nvme-of rdma" and
#                                    "rblk"; C, e.g. "rblk-before", if not
#                                    empty) [| X | X/A]... (more front ends,
#                                    e.g. "rblk ublk", against A)
#   fio_share CSV FLOOR NAME         per job, FLOOR's mean latency and CPU
#                                    per IO as a share of NAME's (medians):
#                                    how much of NAME's cost its front end
#                                    alone has (FLOOR "nbd null", NAME "rblk")
#   fio_check CSV WHAT B A MIN JOB...
#                                    a target: B's IOPS at least MIN times A's
#                                    on each JOB (medians); prints a line per
#                                    job, "met" or "MISSED"; MIN prefixed
#                                    with "tgt<" instead: B's target CPU per
#                                    IO under MIN times A's
#   fio_json CSV                     the CSV as a JSON array of objects
#   fio_floors JSON                  the fabric's floor on $RBLK_VM_RDMA_DEV:
#                                    perftest's ib_read_lat (4 KiB, QD1) and
#                                    ib_read_bw (4 KiB, QD $FLOOR_QD, default
#                                    32) between two processes on
#                                    $RBLK_VM_ADDR over rdma_cm; writes JSON,
#                                    prints "fabric floor: ..."
#
# Jobs (all libaio, direct=1, time based; the same names as the bare
# harness, bench/run.sh):
#   randread-4k-qd1  randwrite-4k-qd1  randread-4k-qd32  randwrite-4k-qd32
#   randrw-4k-qd32  randread-4k-qd16x2 (numjobs=2 x iodepth=16,
#   group_reporting)  read-1m-qd8  write-1m-qd8
# and, not in the default list, randrw-4k-qd32-verify (crc32c; fio reads
# back what it wrote and fails on a mismatch: a data check).
#
# A run is two job groups: "warm" (FIO_RAMP s, instead of fio's ramp_time,
# whose IOs fio does not count) then "measure" (FIO_RUNTIME s). IOPS,
# bandwidth and latency (mean and p99, submit to completion) are those of
# "measure". CPU per IO: the busy time of all CPUs from /proc/stat
# (user+nice+system+irq+softirq) over the whole fio run, divided by the IOs
# of both groups: the same measure for every device, and one that counts
# the kernel's work (nvmet, nbd, rxe) which no process's accounting shows.
# Target CPU per IO: the CPU time of the device's target over the same
# span, per IO, where the caller says what that is: if it defines
# fio_target_us NAME (prints the CPU time in microseconds used so far by
# the target of the device named NAME, _proc_us helps; or "kernel" for
# the kernel threads' time below; nothing if none), its difference;
# otherwise empty. Kernel threads' CPU per IO (kthread_us_per_io): the
# CPU time of every kernel thread (the children of kthreadd) over the
# span, per IO: where a kernel target (nvmet) and Soft-RoCE (rxe) do their
# work, besides softirqs. It is counted thread by thread, so that a thread
# that comes or goes meanwhile (kworkers do) takes nothing off the others:
# a thread that ended during the run is missing (the figure is a floor).
# Context switches per IO (ctxt_per_io): every CPU's, from /proc/stat's
# ctxt over the whole fio run, divided by the IOs of both groups: each
# time a process or thread leaves a CPU to another (or to idle), which
# under emulation costs far more than on hardware, and a user-space
# target and initiator make on both sides of every IO.
# Settings: FIO_RUNTIME (seconds, default 7), FIO_RAMP (default 1), FIO_REPS
# (default 2), FIO_OUTDIR (fio's JSON and text output; default /tmp/fio-out).
# Figures under software emulation only mean something as ratios within one run.

FIO_JOBS=${FIO_JOBS:-"randread-4k-qd1 randwrite-4k-qd1 randread-4k-qd32 randwrite-4k-qd32 randrw-4k-qd32 randread-4k-qd16x2 read-1m-qd8 write-1m-qd8"}
FIO_CSV_HEADER="name,device,job,rep,iops,bw_MBps,lat_mean_us,lat_p99_us,ios_all,cpu_busy_ticks,cpu_us_per_io,target_us_per_io,kthread_us_per_io,ctxt_per_io"

# fio_job_args JOB: the fio options of a named job.
fio_job_args() {
	case $1 in
	randread-4k-qd1) echo "--rw=randread --bs=4k --iodepth=1" ;;
	randwrite-4k-qd1) echo "--rw=randwrite --bs=4k --iodepth=1" ;;
	randread-4k-qd32) echo "--rw=randread --bs=4k --iodepth=32" ;;
	randwrite-4k-qd32) echo "--rw=randwrite --bs=4k --iodepth=32" ;;
	randrw-4k-qd32) echo "--rw=randrw --bs=4k --iodepth=32" ;;
	randread-4k-qd16x2) echo "--rw=randread --bs=4k --iodepth=16 --numjobs=2" ;;
	randrw-4k-qd32-verify) echo "--rw=randrw --bs=4k --iodepth=32 --verify=crc32c --verify_fatal=1 --verify_state_save=0" ;;
	read-1m-qd8) echo "--rw=read --bs=1M --iodepth=8" ;;
	write-1m-qd8) echo "--rw=write --bs=1M --iodepth=8" ;;
	*) echo "fio_job_args: unknown job '$1' (known: $FIO_JOBS randrw-4k-qd32-verify)" >&2; return 1 ;;
	esac
}

# _cpu_busy: busy clock ticks of all CPUs since boot (/proc/stat).
_cpu_busy() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }

# _ctxt: the context switches of every CPU since boot.
_ctxt() { awk '$1 == "ctxt" { print $2; exit }' /proc/stat; }

# _kthread_snap: "PID TICKS" of each kernel thread alive now, its CPU time
# (user + system) so far: kthreadd's children (a kernel thread's name has
# no blank, so the fields of its stat line are where they should be).
_kthread_snap() { awk '$4 == 2 { print $1, $14 + $15 }' /proc/[0-9]*/stat 2>/dev/null; }

# _kthread_delta_us SNAP0 SNAP1: the kernel threads' CPU time between two
# snapshots, in microseconds: each thread of SNAP1 less what it had in
# SNAP0 (all of it if it is new).
_kthread_delta_us() {
	awk -v hz="$(getconf CLK_TCK)" 'FNR == NR { t0[$1] = $2; next } { d = $2 - t0[$1]; if (d > 0) s += d }
		END { printf "%.0f\n", s * 1e6 / hz }' <(printf '%s\n' "$1") <(printf '%s\n' "$2")
}

# _proc_us PID...: the CPU time in microseconds used by the processes PID,
# every thread (the scheduler's own account, /proc/PID/task/*/schedstat,
# in nanoseconds: clock ticks are too coarse for a target that is meant
# to do almost nothing).
_proc_us() {
	local p
	for p in "$@"; do cat /proc/"$p"/task/*/schedstat 2>/dev/null; done | awk '{ s += $1 } END { printf "%.0f\n", s / 1000 }'
}

# _target_us NAME: fio_target_us NAME if the caller defined it.
_target_us() { if declare -F fio_target_us >/dev/null; then fio_target_us "$1"; fi; }

fio_run() {
	local name=${1:?usage: fio_run NAME DEVICE JOB CSV [REP]} dev=${2:?} job=${3:?} csv=${4:?} rep=${5:-1}
	local args out rc line c0 c1 x0 x1 t0 t1 k0 k1 kus tus groups=()
	args=$(fio_job_args "$job") || return 1
	local outdir=${FIO_OUTDIR:-/tmp/fio-out}
	mkdir -p "$outdir"
	out=$outdir/$(echo "$name-$(basename "$dev")-$job-rep$rep" | tr -c 'A-Za-z0-9._\n-' _)
	if [ "${FIO_RAMP:-1}" != 0 ]; then groups+=(--name=warm --time_based --runtime="${FIO_RAMP:-1}"); fi
	groups+=(--name=measure --stonewall --time_based --runtime="${FIO_RUNTIME:-7}")
	t0=$(_target_us "$name") k0=$(_kthread_snap)
	c0=$(_cpu_busy) x0=$(_ctxt)
	# shellcheck disable=SC2086 # args is a list of options
	fio --filename="$dev" --ioengine=libaio --direct=1 --group_reporting --lat_percentiles=1 $args \
		"${groups[@]}" --output-format=json --output="$out.json" >"$out.txt" 2>&1
	rc=$?
	c1=$(_cpu_busy) x1=$(_ctxt)
	t1=$(_target_us "$name") k1=$(_kthread_snap)
	kus=$(_kthread_delta_us "$k0" "$k1")
	case $t0 in
	kernel) tus=$kus ;;
	'') tus=null ;;
	*) tus=$([ -n "$t1" ] && echo $((t1 - t0)) || echo null) ;;
	esac
	if [ $rc -ne 0 ] || ! jq -e '.jobs[0]' "$out.json" >/dev/null 2>&1; then
		echo "fio_run: $job on $dev failed (fio exit $rc)" >&2
		cat "$out.txt" >&2
		[ -s "$out.json" ] && jq -c '.jobs[] | {jobname, error, read: .read.io_bytes, write: .write.io_bytes}' "$out.json" >&2 2>/dev/null
		return 1
	fi
	# IOPS and bandwidth: read + write; mean latency (submit to completion):
	# weighted by the number of I/Os of each direction; p99: the larger of
	# both directions'.
	line=$(jq -r --arg name "$name" --arg dev "$dev" --arg job "$job" --argjson rep "$rep" \
		--argjson ticks "$((c1 - c0))" --argjson hz "$(getconf CLK_TCK)" \
		--argjson tus "$tus" --argjson kus "$kus" --argjson ctxt "$((x1 - x0))" '
		([.jobs[] | .read.total_ios + .write.total_ios] | add) as $all
		| ([.jobs[] | select(.jobname == "measure")] + [.jobs[-1]])[0] as $j
		| ($j.read.total_ios + $j.write.total_ios) as $n
		| [ $name, $dev, $job, $rep,
		    (($j.read.iops + $j.write.iops) * 10 | round / 10),
		    (($j.read.bw_bytes + $j.write.bw_bytes) / 1e5 | round / 10),
		    (if $n > 0 then (($j.read.lat_ns.mean * $j.read.total_ios
		                     + $j.write.lat_ns.mean * $j.write.total_ios) / $n / 100 | round / 10)
		     else 0 end),
		    ([$j.read, $j.write | select(.total_ios > 0) | .lat_ns.percentile["99.000000"] // 0] | max // 0 | . / 100 | round / 10),
		    $all, $ticks,
		    (if $all > 0 then ($ticks * 1e6 / $hz / $all * 10 | round / 10) else 0 end),
		    (if $all > 0 and $tus != null then ($tus / $all * 100 | round / 100) else "" end),
		    (if $all > 0 then ($kus / $all * 10 | round / 10) else 0 end),
		    (if $all > 0 then ($ctxt / $all * 100 | round / 100) else 0 end) ]
		| map(tostring) | join(",")' "$out.json") || return 1
	[ -s "$csv" ] || echo "$FIO_CSV_HEADER" >"$csv"
	echo "$line" >>"$csv"
	echo "fio: $line" >&2
}

fio_all() {
	local name=${1:?usage: fio_all NAME DEVICE CSV [REP]} dev=${2:?} csv=${3:?} rep=${4:-1} job rc=0
	for job in $FIO_JOBS; do
		fio_run "$name" "$dev" "$job" "$csv" "$rep" || rc=1
	done
	return $rc
}

fio_interleaved() {
	local csv=${1:?usage: fio_interleaved CSV NAME=DEVICE[=JOB,JOB...]...} rep job i n d rc=0 nd
	shift
	local devs=("$@")
	nd=${#devs[@]}
	for rep in $(seq 1 "${FIO_REPS:-2}"); do
		for job in $FIO_JOBS; do
			for i in $(seq 0 $((nd - 1))); do
				n=${devs[$(((i + rep - 1) % nd))]}
				d=${n#*=}
				# (=JOB,JOB...: this device runs only those jobs)
				if [ "${d#*=}" != "$d" ]; then
					case ,${d#*=}, in *,"$job",*) ;; *) continue ;; esac
					d=${d%%=*}
				fi
				fio_run "${n%%=*}" "$d" "$job" "$csv" "$rep" || rc=1
			done
		done
	done
	return $rc
}

fio_table() {
	local csv=${1:?usage: fio_table CSV [NAME_A [NAME_B [NAME_C [NAME_X...]]]]}
	local a=${2:-nvme-of rdma} b=${3:-rblk} c=${4:-} x=''
	if [ $# -gt 4 ]; then
		shift 4
		x=$(printf '%s|' "$@")
		x=${x%|}
	fi
	awk -F, -v A="$a" -v B="$b" -v C="$c" -v X="$x" '
	# med KEY FIELD: the median of the reps of (name, job) KEY for FIELD
	function med(k, f,    n, i, j, t, v) {
		n = cnt[k]
		for (i = 1; i <= n; i++) v[i] = val[k, f, i]
		for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
		return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
	}
	function cell(k,    t, x) {
		if (!(k in cnt)) return "-"
		t = (tn[k] == cnt[k]) ? sprintf("%6.1f", med(k, "tgt")) : "     -"
		x = (xn[k] == cnt[k]) ? sprintf("%5.1f", med(k, "sw")) : "    -"
		return sprintf("%7.0f IOPS %6.1f MB/s %7.0f us %6.0f cpu-us/IO %s tgt %s sw/IO", med(k, "iops"), med(k, "bw"), med(k, "lat"), med(k, "cpu"), t, x)
	}
	function r(x, y) { return ((x in cnt) && (y in cnt) && med(y, "iops") > 0) ? sprintf("%.2f", med(x, "iops") / med(y, "iops")) : "-" }
	NR == 1 && $1 == "name" { for (i = 1; i <= NF; i++) col[$i] = i; next }
	{
		job = $(col["job"])
		if (!(job in seen)) { seen[job] = 1; jobs[++n] = job }
		k = $(col["name"]) SUBSEP job
		i = ++cnt[k]
		val[k, "iops", i] = $(col["iops"]); val[k, "bw", i] = $(col["bw_MBps"])
		val[k, "lat", i] = $(col["lat_mean_us"]); val[k, "cpu", i] = ("cpu_us_per_io" in col) ? $(col["cpu_us_per_io"]) : 0
		if (("target_us_per_io" in col) && $(col["target_us_per_io"]) != "") { val[k, "tgt", i] = $(col["target_us_per_io"]); tn[k]++ }
		if (("ctxt_per_io" in col) && $(col["ctxt_per_io"]) != "") { val[k, "sw", i] = $(col["ctxt_per_io"]); xn[k]++ }
		if (i > reps) reps = i
	}
	END {
		w = 75; rw = length(B "/" A); rc = length(B "/" C)
		nx = (X == "") ? 0 : split(X, xs, "|")
		printf "%-20s | %-" w "s | %-" w "s | %-" rw "s", "job", A, B, B "/" A
		if (nx == 0) rc = 0 # (the last column: no padding)
		if (C != "") printf " | %-" w "s | %-" rc "s", C, B "/" C
		for (q = 1; q <= nx; q++) printf " | %-" w "s | %s", xs[q], xs[q] "/" A
		printf "\n"
		line = sprintf("%-20s-+-%-" w "s-+-%-" w "s-+-%-" rw "s", "", "", "", "")
		if (C != "") line = line sprintf("-+-%-" w "s-+-%-" length(B "/" C) "s", "", "")
		for (q = 1; q <= nx; q++) line = line sprintf("-+-%-" w "s-+-%-" length(xs[q] "/" A) "s", "", "")
		gsub(/ /, "-", line); print line
		for (i = 1; i <= n; i++) {
			j = jobs[i]; ka = A SUBSEP j; kb = B SUBSEP j; kc = C SUBSEP j
			printf "%-20s | %-" w "s | %-" w "s | %-" rw "s", j, cell(ka), cell(kb), r(kb, ka)
			if (C != "") printf " | %-" w "s | %-" rc "s", cell(kc), r(kb, kc)
			for (q = 1; q <= nx; q++) printf " | %-" w "s | %s", cell(xs[q] SUBSEP j), r(xs[q] SUBSEP j, ka)
			printf "\n"
		}
		printf "(median of %d rep(s); latency: mean, submit to completion; cpu-us/IO: busy time of all CPUs per IO;\n", reps
		printf " tgt: the target\x27s CPU time per IO in us, rblkd\x27s process for rblk, all kernel threads\x27 for NVMe-oF:\n"
		printf " nvmet\x27s work and Soft-RoCE\x27s of both sides, an upper bound of nvmet\x27s;\n"
		printf " sw/IO: context switches of all CPUs per IO)\n"
	}' "$csv"
}

fio_share() {
	local csv=${1:?usage: fio_share CSV FLOOR NAME} f=${2:?usage: fio_share CSV FLOOR NAME} b=${3:?usage: fio_share CSV FLOOR NAME}
	awk -F, -v F="$f" -v B="$b" '
	function med(k, x,    n, i, j, t, v) {
		n = cnt[k]
		for (i = 1; i <= n; i++) v[i] = val[k, x, i]
		for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
		return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
	}
	function pct(x, y) { return (y > 0) ? sprintf("%3.0f%%", 100 * x / y) : "   -" }
	NR == 1 && $1 == "name" { for (i = 1; i <= NF; i++) col[$i] = i; next }
	{
		job = $(col["job"])
		if (!(job in seen)) { seen[job] = 1; jobs[++n] = job }
		k = $(col["name"]) SUBSEP job
		i = ++cnt[k]
		val[k, "lat", i] = $(col["lat_mean_us"]); val[k, "cpu", i] = $(col["cpu_us_per_io"])
	}
	END {
		printf "%s as a share of %s (the front end alone: the same kernel NBD device and fio, no network, no data):\n", F, B
		for (i = 1; i <= n; i++) {
			kf = F SUBSEP jobs[i]; kb = B SUBSEP jobs[i]
			if (!(kf in cnt) || !(kb in cnt)) continue
			printf "  %-20s latency %6.0f of %6.0f us (%s)   cpu %5.0f of %5.0f us/IO (%s)\n", jobs[i],
				med(kf, "lat"), med(kb, "lat"), pct(med(kf, "lat"), med(kb, "lat")),
				med(kf, "cpu"), med(kb, "cpu"), pct(med(kf, "cpu"), med(kb, "cpu"))
		}
	}' "$csv"
}

fio_check() {
	local csv=${1:?usage: fio_check CSV WHAT B A MIN JOB...} what=${2:?} b=${3:?} a=${4:?} min=${5:?}
	shift 5
	awk -F, -v W="$what" -v A="$a" -v B="$b" -v MIN="$min" -v JOBS="$*" '
	function med(k, f,    n, i, j, t, v) {
		n = cnt[k]
		for (i = 1; i <= n; i++) v[i] = val[k, f, i]
		for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] > t; j--) v[j + 1] = v[j]; v[j + 1] = t }
		return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
	}
	NR == 1 && $1 == "name" { for (i = 1; i <= NF; i++) col[$i] = i; next }
	{
		k = $(col["name"]) SUBSEP $(col["job"])
		i = ++cnt[k]
		val[k, "iops", i] = $(col["iops"])
		if (("target_us_per_io" in col) && $(col["target_us_per_io"]) != "") { val[k, "tgt", i] = $(col["target_us_per_io"]); tn[k]++ }
	}
	END {
		cpu = (MIN ~ /^tgt</); lim = MIN; sub(/^tgt</, "", lim)
		n = split(JOBS, js, " ")
		for (q = 1; q <= n; q++) {
			ka = A SUBSEP js[q]; kb = B SUBSEP js[q]
			if (cpu) {
				if (tn[ka] != cnt[ka] || tn[kb] != cnt[kb] || !(ka in cnt) || !(kb in cnt) || med(ka, "tgt") <= 0) { printf "target: %s, %s: not measured\n", W, js[q]; continue }
				r = med(kb, "tgt") / med(ka, "tgt")
				printf "target: %s, %s: %s %.2f us/IO / %s %.2f = %.3f, want < %s: %s\n", W, js[q], B, med(kb, "tgt"), A, med(ka, "tgt"), r, lim, (r < lim) ? "met" : "MISSED"
			} else {
				if (!(ka in cnt) || !(kb in cnt) || med(ka, "iops") <= 0) { printf "target: %s, %s: not measured\n", W, js[q]; continue }
				r = med(kb, "iops") / med(ka, "iops")
				printf "target: %s, %s: %s/%s %.2f, want >= %s: %s\n", W, js[q], B, A, r, lim, (r >= lim) ? "met" : "MISSED"
			}
		}
	}' "$csv"
}

fio_json() {
	local csv=${1:?usage: fio_json CSV}
	jq -R -s '
		split("\n") | map(select(length > 0) | split(",")) | .[0] as $h
		| .[1:] | map([$h, .] | transpose | map({(.[0]): (.[1] | tonumber? // .)}) | add)' "$csv"
}

# _perftest NAME ARGS...: server and client of perftest tool NAME on
# $RBLK_VM_ADDR (rdma_cm); the client's output on stdout. Up to 3 tries,
# each with a new server: under a loaded host a perftest process has been
# seen to crash in librdmacm (a general protection fault) and take the
# pair down.
_perftest() {
	local tool=$1 spid out try i rc=1
	shift
	local addr=${RBLK_VM_ADDR:-192.0.2.1} dev=${RBLK_VM_RDMA_DEV:-rxe0}
	for try in 1 2 3; do
		timeout 60 "$tool" -d "$dev" -R -F "$@" >/tmp/perftest-server.txt 2>&1 &
		spid=$!
		for i in 1 2 3 4 5 6 7 8 9 10; do
			sleep 0.5
			if out=$(timeout 60 "$tool" -d "$dev" -R -F "$@" "$addr" 2>&1); then rc=0; break; fi
			kill -0 "$spid" 2>/dev/null || break
		done
		[ $rc = 0 ] || kill "$spid" 2>/dev/null
		wait "$spid" 2>/dev/null
		[ $rc != 0 ] || break
		echo "_perftest: $tool, try $try of 3 failed (client attempt $i): $(tail -n 2 <<<"$out" | tr '\n' ' ')" >&2
	done
	echo "$out"
	return $rc
}

fio_floors() {
	local json=${1:?usage: fio_floors JSON} lat bw qd=${FLOOR_QD:-32}
	lat=$(_perftest ib_read_lat -s 4096 -n "${FLOOR_ITERS:-5000}") || { echo "fio_floors: ib_read_lat failed: $lat" >&2; return 1; }
	bw=$(_perftest ib_read_bw -s 4096 -t "$qd" -D "${FLOOR_SECONDS:-2}") || { echo "fio_floors: ib_read_bw failed: $bw" >&2; return 1; }
	echo "$lat" >"${json%.json}-ib_read_lat.txt"
	echo "$bw" >"${json%.json}-ib_read_bw.txt"
	# ib_read_lat: #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
	# ib_read_bw:  #bytes #iterations BW-peak BW-average(MB/s) MsgRate(Mpps)
	awk -v qd="$qd" -v kernel="$(uname -r)" '
		FNR == NR && $1 == 4096 && NF >= 8 { lat = $6; p99 = $8 }
		FNR != NR && $1 == 4096 && NF >= 5 { mbps = $4; mpps = $5 }
		END {
			if (lat == "" || mpps == "") exit 1
			printf "{\"tool\":\"perftest ib_read_lat/ib_read_bw, rdma_cm\",\"kernel\":\"%s\",\"bs\":4096,", kernel
			printf "\"read_lat_us\":%s,\"read_lat_p99_us\":%s,\"read_bw_qd\":%d,\"read_MBps\":%s,\"read_iops\":%.0f}\n", lat, p99, qd, mbps, mpps * 1e6
		}' <(echo "$lat") <(echo "$bw") >"$json" || { echo "fio_floors: no figures in perftest's output" >&2; return 1; }
	jq -r '"fabric floor: RDMA READ 4k lat \(.read_lat_us) µs (QD1, p99 \(.read_lat_p99_us) µs), \(.read_iops) IOPS (QD\(.read_bw_qd), \(.read_MBps) MB/s)"' "$json"
}
