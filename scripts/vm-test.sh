#!/usr/bin/env bash
# scripts/vm-test.sh: rblk's test on a real kernel RDMA stack, on two guest
# kernels. Builds rblkd and rblk-attach with the verbs provider (-tags
# rdma), their -race builds and the Go test binaries (-race -tags
# rdma,failpoints: e2e.test, target.test, initiator.test; rdma.test and
# kernel.test), then for each kernel boots it under qemu with Soft-RoCE
# (vm/run.sh installs what it needs) and runs vm/rblk-e2e.sh inside: the
# verbs provider's tests; the e2e suite over rdma on the NBD socket and on
# the kernel's /dev/nbdN; ublk; an online grow; the udev rule's
# /dev/disk/by-rblk names; the fio table beside the kernel's NVMe-oF RDMA;
# a cache smaller than the volume under a CPU hog (no reconnect); the soak
# (the target's, the initiator's and the e2e fault tests over rxe under a
# CPU hog, repeated); no panic or race in any log; the guest's dmesg; rxe
# counters.
#
# Kernels (RBLK_VM_KERNELS, default "6.1 6.12"):
#   6.1   Debian 12's linux-image-amd64, installed on the host (/boot)
#   6.12  bookworm-backports' linux-image-6.12.*-amd64, downloaded for the
#         guest only by vm/kernel-backports.sh (cached in /var/cache/rblk-vm;
#         the host's apt sources are not changed)
# Each kernel is its own PASS/FAIL; its share (guest.log, dmesg.log,
# scenarios.txt, e2e-summary.txt, soak-summary.txt, fio-table.txt,
# rxe-counters.txt, logs/) is RESULTS/kernel-VERSION/ and its vm/run.sh
# output RESULTS/kernel-VERSION.log, with
# RESULTS=/var/tmp/rblk-vm/results/DATE-PID (…/results/last: the newest;
# the last 5 are kept). RBLK_VM_RESULTS=DIR chooses it.
#
#   scripts/vm-test.sh                     # both kernels
#   RBLK_VM_KERNELS=6.12 scripts/vm-test.sh
#   RBLK_TRANSPORT=tcp scripts/vm-test.sh  # the scenarios without verbs
#   RBLK_VM_KERNELS=6.12 RBLK_VM_SCENARIOS=bench scripts/vm-test.sh
#                                          # only the fio table (fio-table.txt)
#   RBLK_VM_SOAK_RUNS=3 RBLK_VM_HOG=1 RBLK_VM_SCENARIOS="soak panics dmesg" scripts/vm-test.sh
#                                          # the soak, three runs in a row
#   RBLK_VM_SCENARIOS=e2e RBLK_VM_E2E_RUN=TestFio RBLK_VM_E2E_DEVICES=nbd ...
#                                          # one e2e test on /dev/nbdN
#   RBLK_VM_BASELINE_BIN=DIR ...           # the table gets a column
#                                          # "rblk-before": DIR/rblkd and
#                                          # DIR/rblk-attach (an older build)
#   RBLK_VM_BENCH_KERNELS=6.12 ...         # the bench scenario on 6.12 only
#                                          # (the others skip it, and say so)
#   RBLK_VM_E2E_PLAN="6.1:socket 6.12:nbd" ...
#                                          # the e2e suite on the NBD socket
#                                          # on 6.1, on /dev/nbdN on 6.12
#                                          # (6.1:socket,nbd: both; a kernel
#                                          # not named: RBLK_VM_E2E_DEVICES);
#                                          # RBLK_VM_E2E_SKIP_KERNELS="6.12:RE"
#                                          # is -test.skip RE on 6.12;
#                                          # RBLK_VM_E2E_RUN_KERNELS="6.12:RE"
#                                          # is -test.run RE on 6.12
#   RBLK_VM_E2E_ALSO_KERNELS="6.1:nbd:RE"  # and, on that kernel, the tests RE
#                                          # on that device too
#   RBLK_VM_SOAK_KERNELS=6.12 ...          # the soak on 6.12 only (the
#                                          # others skip it, and say so;
#                                          # "none": on no kernel; so too
#                                          # RBLK_VM_BENCH_KERNELS and
#                                          # RBLK_VM_CSI_KERNELS)
#   RBLK_VM_SOAK_PLAN="6.1:target 6.12:initiator,e2e" ...
#                                          # the soak's suites on each kernel
#                                          # (a kernel not named:
#                                          # RBLK_VM_SOAK_SUITES)
#   RBLK_VM_SKIP_KERNELS="6.12:small-cache,udev" ...
#                                          # scenarios left out on a kernel
#   RBLK_VM_CSI_KERNELS=6.12 ...           # the csi scenario (csi-sanity
#                                          # with Node, on /dev/nbdN) on
#                                          # 6.12 only
# Passed on to the guest: RBLK_TRANSPORT, RBLK_VM_SCENARIOS,
# RBLK_VM_BASELINE_BIN, RBLK_VM_HOG, RBLK_VM_E2E_DEVICES, RBLK_VM_E2E_RUN,
# RBLK_VM_SOAK_RUNS, RBLK_VM_SOAK_SUITES, RBLK_VM_SOAK_RUN, RBLK_VM_SOAK_E2E_RUN, RBLK_VM_TIME_SCALE, RBLK_VM_CSI_RUNS,
# RBLK_VM_SOAK_E2E_DEVICE, RBLK_RDMA_FAILPOINTS, RBLK_FAULT_SEED, and the
# table's FIO_REPS, FIO_RUNTIME, FIO_RAMP, BENCH_MB, BENCH_QUEUES,
# BENCH_NULL_JOBS, BENCH_MIRROR_JOBS, BENCH_MIRROR_BITMAP, BENCH_TCP, BENCH_TCP_JOBS (vm/rblk-e2e.sh). RBLK_VM_MEM (default 3G here) and
# RBLK_VM_TIMEOUT (default: 2700 s plus 1500 s per soak run; every scenario
# takes about 70 minutes on a machine that emulates slowly) size the guest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin
KERNELS=${RBLK_VM_KERNELS:-6.1 6.12}
CACHE=${RBLK_VM_CACHE:-/var/tmp/rblk-vm}

need=()
# (nbdkit and nbd-client: the guest's "nbd null" column of the bench; the
# userspace NBD clients, fio, FUSE and e2fsprogs: the e2e suite, which runs
# in the guest with RBLK_E2E_REQUIRE=1)
for p in libibverbs-dev librdmacm-dev xz-utils kmod nbdkit nbd-client qemu-utils libnbd-bin fio fuse3 e2fsprogs gcc libc6-dev; do
	dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# (nbdfuse: its own package in newer Debian, in libnbd-bin in Debian 12)
if ! command -v nbdfuse >/dev/null 2>&1; then
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nbdfuse >/dev/null
fi

if [ -n "${RBLK_VM_RESULTS:-}" ]; then
	RESULTS=$RBLK_VM_RESULTS
else
	mkdir -p "$CACHE/results"
	{ ls -1dt "$CACHE"/results/*/ 2>/dev/null || true; } | tail -n +5 | xargs -r rm -rf
	RESULTS=$CACHE/results/$(date +%Y%m%d-%H%M%S)-$$
	ln -sfn "$RESULTS" "$CACHE/results/last"
fi
mkdir -p "$RESULTS"

art=$(mktemp -d /var/tmp/rblk-vm-bin.XXXXXX)
trap 'rm -rf "$art"' EXIT
t_build=$SECONDS
echo "== building rblkd and rblk-attach with -tags rdma"
go build -tags rdma -o "$art/" ./cmd/rblkd ./cmd/rblk-attach
cp systemd/99-rblk.rules "$art/" # (the udev scenario)
go test -c -tags rdma -o "$art/rdma.test" ./transport/rdma/
go test -c -o "$art/kernel.test" ./initiator/kernel/
# The csi scenario: rblk-csi, csi-sanity (pinned, cached) and its script.
go build -o "$art/" ./cmd/rblk-csi
CSI_TEST_VERSION=v5.6.0
csi_cache=${XDG_CACHE_HOME:-$HOME/.cache}/rblk-csi-sanity-$CSI_TEST_VERSION
[ -x "$csi_cache/csi-sanity" ] || GOBIN=$csi_cache go install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_TEST_VERSION"
cp "$csi_cache/csi-sanity" scripts/csi-sanity.sh "$art/"
# The e2e suite and the soak: everything with -race, and the failpoints of
# the verbs provider built in (driven by RBLK_RDMA_FAILPOINTS; a tag that
# no file uses yet is harmless). The guest cannot build (no time under
# emulation): e2e.test runs the binaries of race/ (RBLK_E2E_BIN_DIR).
RACE_TAGS=${RBLK_VM_RACE_TAGS:-rdma,failpoints}
echo "== building the -race binaries and test binaries (-tags $RACE_TAGS)"
mkdir -p "$art/race"
go build -race -tags "$RACE_TAGS" -o "$art/race/" ./cmd/rblkd ./cmd/rblk-attach
for pkg in e2e target initiator; do
	go test -c -race -tags "$RACE_TAGS" -o "$art/$pkg.test" "./$pkg/"
done
# The soak's target and initiator suites run over the verbs provider; their
# packages' own tests (package target, not target_test) never use it, and
# the host's run has them: the soak leaves them out (-test.skip), which
# takes about half of the target suite's time off a slow guest.
in_package_tests() { # PKG: ^(TestA|TestB)$, PKG's in-package tests
	local names
	names=$(grep -l "^package $1\$" "$1"/*_test.go | xargs -r sed -nE 's/^func (Test[A-Za-z0-9_]*)\(t \*testing\.T\).*/\1/p' | paste -sd'|')
	[ -z "$names" ] || printf '^(%s)$' "$names"
}
soak_skip_target=$(in_package_tests target)
soak_skip_initiator=$(in_package_tests initiator)
echo "== built in $((SECONDS - t_build))s"
if [ -n "${RBLK_VM_BASELINE_BIN:-}" ]; then
	# (the guest sees the host's root: an absolute host path works there)
	RBLK_VM_BASELINE_BIN=$(cd "$RBLK_VM_BASELINE_BIN" && pwd)
fi
: >"$art/env.base"
for v in RBLK_TRANSPORT RBLK_VM_TIME_SCALE RBLK_VM_CSI_RUNS RBLK_VM_CSI_MIRROR_BLOCK RBLK_VM_SCENARIOS RBLK_VM_BASELINE_BIN RBLK_VM_HOG RBLK_VM_E2E_DEVICES RBLK_VM_E2E_RUN RBLK_VM_E2E_SKIP RBLK_VM_E2E_PARALLEL RBLK_VM_SOAK_RUNS \
	RBLK_VM_SOAK_SUITES RBLK_VM_SOAK_RUN RBLK_VM_SOAK_E2E_RUN RBLK_VM_SOAK_E2E_DEVICE RBLK_RDMA_FAILPOINTS RBLK_FAULT_SEED \
	FIO_REPS FIO_RUNTIME FIO_RAMP FIO_JOBS BENCH_MB BENCH_QUEUES BENCH_NULL_JOBS BENCH_MIRROR_JOBS BENCH_MIRROR_BITMAP BENCH_TCP BENCH_TCP_JOBS; do
	if [ -n "${!v:-}" ]; then
		printf 'export %s=%q\n' "$v" "${!v}" >>"$art/env.base"
	fi
done
printf 'export RBLK_VM_SOAK_SKIP_TARGET=%q RBLK_VM_SOAK_SKIP_INITIATOR=%q\n' "$soak_skip_target" "$soak_skip_initiator" >>"$art/env.base"

# per_kernel K LIST: the VALUE of LIST's entry K:VALUE (entries apart by
# blanks; the last for K, if several), or nothing. (The values are regular
# expressions: no glob expansion.)
per_kernel() {
	local e v='' entries
	read -ra entries <<<"$2"
	for e in "${entries[@]}"; do
		[ "${e%%:*}" != "$1" ] || v=${e#*:}
	done
	printf '%s' "$v"
}

# run_kernel SERIES: the guest test on that kernel; appends to SUMMARY.
SUMMARY=()
run_kernel() {
	local k=$1 kdir='' out=$RESULTS/kernel-$1 t0=$SECONDS rc=0 kver scen
	echo
	echo "== kernel $k: vm/rblk-e2e.sh (results in $out)"
	case $k in
	6.1) ;; # the host's linux-image-amd64
	*)
		if ! kdir=$(vm/kernel-backports.sh "$k" 2>&1 | tee -a "$out.log" | tail -n 1) || [ ! -d "$kdir" ]; then
			SUMMARY+=("FAIL  kernel $k: could not get it from bookworm-backports (see $out.log)")
			return 1
		fi
		;;
	esac
	# The guest's env.sh: the settings above, and the bench left out on a
	# kernel that RBLK_VM_BENCH_KERNELS (if set) does not name.
	cp "$art/env.base" "$art/env.sh"
	if [ -n "${RBLK_VM_BENCH_KERNELS:-}" ] && [[ " $RBLK_VM_BENCH_KERNELS " != *" $k "* ]]; then
		echo 'export RBLK_VM_SKIP_SCENARIOS=bench' >>"$art/env.sh"
	fi
	if [ -n "${RBLK_VM_CSI_KERNELS:-}" ] && [[ " $RBLK_VM_CSI_KERNELS " != *" $k "* ]]; then
		echo "export RBLK_VM_SKIP_SCENARIOS=\"\${RBLK_VM_SKIP_SCENARIOS:-} csi\"" >>"$art/env.sh"
	fi
	if [ -n "${RBLK_VM_SOAK_KERNELS:-}" ] && [[ " $RBLK_VM_SOAK_KERNELS " != *" $k "* ]]; then
		echo "export RBLK_VM_SKIP_SCENARIOS=\"\${RBLK_VM_SKIP_SCENARIOS:-} soak\"" >>"$art/env.sh"
	fi
	# The per-kernel settings (KERNEL:VALUE entries) for this kernel: the
	# e2e suite's devices, tests run and left out, and tests on another
	# device too (DEVICE:REGEXP); the soak's suites; scenarios left out.
	local v
	v=$(per_kernel "$k" "${RBLK_VM_E2E_PLAN:-}")
	[ -z "$v" ] || printf 'export RBLK_VM_E2E_DEVICES=%q\n' "${v//,/ }" >>"$art/env.sh"
	v=$(per_kernel "$k" "${RBLK_VM_E2E_SKIP_KERNELS:-}")
	[ -z "$v" ] || printf 'export RBLK_VM_E2E_SKIP=%q\n' "$v" >>"$art/env.sh"
	v=$(per_kernel "$k" "${RBLK_VM_E2E_RUN_KERNELS:-}")
	[ -z "$v" ] || printf 'export RBLK_VM_E2E_RUN=%q\n' "$v" >>"$art/env.sh"
	v=$(per_kernel "$k" "${RBLK_VM_E2E_ALSO_KERNELS:-}")
	[ -z "$v" ] || printf 'export RBLK_VM_E2E_ALSO_DEVICE=%q RBLK_VM_E2E_ALSO_RUN=%q\n' "${v%%:*}" "${v#*:}" >>"$art/env.sh"
	v=$(per_kernel "$k" "${RBLK_VM_SOAK_PLAN:-}")
	[ -z "$v" ] || printf 'export RBLK_VM_SOAK_SUITES=%q\n' "${v//,/ }" >>"$art/env.sh"
	v=$(per_kernel "$k" "${RBLK_VM_SKIP_KERNELS:-}")
	[ -z "$v" ] || echo "export RBLK_VM_SKIP_SCENARIOS=\"\${RBLK_VM_SKIP_SCENARIOS:-} ${v//,/ }\"" >>"$art/env.sh"
	RBLK_VM_OUT=$out RBLK_VM_KERNEL_DIR=$kdir RBLK_VM_TIMEOUT=${RBLK_VM_TIMEOUT:-$((2700 + 1500 * ${RBLK_VM_SOAK_RUNS:-1}))} \
		RBLK_VM_MEM=${RBLK_VM_MEM:-3G} vm/run.sh vm/rblk-e2e.sh "$art" 2>&1 | tee -a "$out.log" || rc=$?
	kver=$(sed -n 's/^kernel \([^,]*\),.*/\1/p' "$out/guest.log" 2>/dev/null | head -n 1)
	scen=$(awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $3, $1 }' "$out/scenarios.txt" 2>/dev/null || true)
	if [ "$rc" = 0 ]; then
		SUMMARY+=("PASS  kernel $k (${kver:-?}): $((SECONDS - t0))s; $scen")
	else
		SUMMARY+=("FAIL  kernel $k (${kver:-?}): exit $rc after $((SECONDS - t0))s; ${scen:-no scenario ran}; see $out.log")
	fi
	# (boots that panicked before the guest's init ran and were booted
	# again, vm/run.sh)
	if [ -s "$out/boot-panics" ]; then
		while IFS= read -r line; do SUMMARY+=("        the guest kernel panicked before init, booted again: $line"); done <"$out/boot-panics"
	fi
	# (the e2e suite's and the soak's lines: which tests failed, where)
	local l
	for l in "$out/e2e-summary.txt" "$out/soak-summary.txt"; do
		[ -s "$l" ] || continue
		while IFS= read -r line; do SUMMARY+=("        $line"); done < <(grep -v '^  ' "$l")
	done
	return "$rc"
}

failed=0
for k in $KERNELS; do
	mkdir -p "$RESULTS"
	run_kernel "$k" || failed=$((failed + 1))
done
echo
echo "== vm test results ($RESULTS)"
printf '%s\n' "${SUMMARY[@]}" | tee "$RESULTS/summary.txt"
[ "$failed" = 0 ]
