#!/usr/bin/env python3
"""bench/report.py OUT [--elapsed SECONDS]: the report of a bench/run.sh run.

Reads OUT/meta.json, OUT/runs.jsonl, OUT/fio/*.json and OUT/floors.jsonl
(bench/run.sh) and, when present, OUT/guest/ (the guest's fio table of
vm/fio-table.sh: fio-table.csv, fio-floors.json, copied there by
`make bench`). Writes:

  OUT/results.json   every run (server, job, rep, IOPS, bandwidth, latency
                     mean/p50/p99, CPU µs per IO per process), the floors,
                     the per-job summary and the guest's runs
  OUT/table.md       per job: min/median/max IOPS, median latency, CPU µs
                     per IO of every server; ratio columns; the floors; the
                     targets of issue 8 and whether they are met
  OUT/plot.gp        gnuplot script (run in OUT) for bench.png (and
                     guest.png with guest results), with its data files

Python 3 standard library only.
"""

import argparse
import csv
import json
import os
import statistics
import sys

RBLK, BEFORE, NBDKIT, QEMU, NULL = "rblk", "rblk-before", "nbdkit-file", "qemu-nbd", "nbdkit-null"
NVME, GRBLK, GBEFORE = "nvme-of rdma", "rblk", "rblk-before"
# the guest's NBD front end alone (nbdkit null through nbd-client): its floor
GNULL = "nbd null"

# The fabric's floor for each job: the raw one-sided operation of the
# software transport with the same block size and requests in flight
# (op, block size, depth) as rdmaread measures them.
FABRIC = {
    "randread-4k-qd1": [("read", 4096, 1)],
    "randwrite-4k-qd1": [("write", 4096, 1)],
    "randread-4k-qd32": [("read", 4096, 32)],
    "randwrite-4k-qd32": [("write", 4096, 32)],
    "randrw-4k-qd32": [("read", 4096, 32), ("write", 4096, 32)],
    "randread-4k-qd16x2": [("read", 4096, 32)],
    "read-1m-qd8": [("read", 1 << 20, 8)],
    "write-1m-qd8": [("write", 1 << 20, 8)],
}
# Targets: "QD32 and 1M jobs at least nbdkit-file's IOPS" (the QD16 x 2
# job has 32 requests in flight as well).
THROUGHPUT_JOBS = ["randread-4k-qd32", "randwrite-4k-qd32", "randrw-4k-qd32", "randread-4k-qd16x2", "read-1m-qd8", "write-1m-qd8"]
LAT_TARGET = 1.15


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt_n(x, digits=0):
    if x is None:
        return "-"
    if digits == 0 and abs(x) >= 1000:
        return f"{x / 1000:.1f}k"
    return f"{x:.{digits}f}"


def fmt_i(x):
    return "-" if x is None else f"{x:.0f}"


def fmt_r(x):
    return "-" if x is None else f"{x:.2f}"


def fmt_bs(bs):
    return f"{bs >> 20}M" if bs >= 1 << 20 else f"{bs >> 10}K"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def fio_measure(path):
    """IOPS, MB/s, latency (mean, p50, p99 µs, submit to completion) of the
    "measure" group of a fio JSON file, and the IOs of every group."""
    j = json.load(open(path))
    jobs = j["jobs"]
    m = [x for x in jobs if x["jobname"] == "measure"]
    if not m:
        m = jobs[-1:]
    m = m[0]
    ios_all = sum(x[d]["total_ios"] for x in jobs for d in ("read", "write"))
    dirs = [m[d] for d in ("read", "write") if m[d]["total_ios"] > 0]
    n = sum(d["total_ios"] for d in dirs)

    def pct(d, p):
        lat = d.get("lat_ns", {})
        pc = lat.get("percentile") or d.get("clat_ns", {}).get("percentile") or {}
        v = pc.get(p)
        return v / 1e3 if v is not None else None

    r = {
        "iops": sum(m[d]["iops"] for d in ("read", "write")),
        "bw_MBps": sum(m[d]["bw_bytes"] for d in ("read", "write")) / 1e6,
        "ios_measure": n,
        "ios_all": ios_all,
        "runtime_ms": m.get("job_runtime") or m["read"].get("runtime") or m["write"].get("runtime"),
        "lat_mean_us": sum(d["lat_ns"]["mean"] * d["total_ios"] for d in dirs) / n / 1e3 if n else None,
        # (a mixed job: the larger of both directions' percentiles)
        "lat_p50_us": max((pct(d, "50.000000") for d in dirs if pct(d, "50.000000") is not None), default=None),
        "lat_p99_us": max((pct(d, "99.000000") for d in dirs if pct(d, "99.000000") is not None), default=None),
        "error": m.get("error", 0),
    }
    return r


def load_bare(out):
    meta = json.load(open(os.path.join(out, "meta.json")))
    runs = []
    for line in open(os.path.join(out, "runs.jsonl")):
        if not line.strip():
            continue
        run = json.loads(line)
        path = os.path.join(out, run["fio_json"])
        if run["fio_rc"] != 0 or not os.path.exists(path):
            run["failed"] = True
            runs.append(run)
            continue
        try:
            run.update(fio_measure(path))
        except (ValueError, KeyError, IndexError) as e:
            run["failed"] = True
            run["parse_error"] = str(e)
            runs.append(run)
            continue
        tck = run["clk_tck"]
        cpu = {p: t * 1e6 / tck / run["ios_all"] if run["ios_all"] else None for p, t in run["cpu_ticks"].items()}
        cpu["total"] = sum(v for v in cpu.values() if v is not None)
        run["cpu_us_per_io"] = cpu
        runs.append(run)
    floors = []
    fp = os.path.join(out, "floors.jsonl")
    if os.path.exists(fp):
        floors = [json.loads(line) for line in open(fp) if line.strip()]
    return meta, runs, floors


def summarize(meta, runs):
    """job -> server -> figures over the reps."""
    summ = {}
    for job in [j["name"] for j in meta["jobs"]]:
        summ[job] = {}
        for s in meta["servers"]:
            rs = [r for r in runs if r["job"] == job and r["server"] == s and not r.get("failed")]
            nfail = len([r for r in runs if r["job"] == job and r["server"] == s and r.get("failed")])
            if not rs:
                summ[job][s] = {"n": 0, "failed": nfail}
                continue
            iops = [r["iops"] for r in rs]
            procs = sorted({p for r in rs for p in r["cpu_us_per_io"]})
            summ[job][s] = {
                "n": len(rs),
                "failed": nfail,
                "iops_min": min(iops),
                "iops_med": med(iops),
                "iops_max": max(iops),
                "bw_MBps_med": med([r["bw_MBps"] for r in rs]),
                "lat_mean_us_med": med([r["lat_mean_us"] for r in rs]),
                "lat_p50_us_med": med([r["lat_p50_us"] for r in rs]),
                "lat_p99_us_med": med([r["lat_p99_us"] for r in rs]),
                "cpu_us_per_io_med": {p: med([r["cpu_us_per_io"].get(p) for r in rs]) for p in procs},
            }
    return summ


def floor_summary(floors):
    """(op, bs, qd) -> best mode's median IOPS and latency over the reps."""
    out = {}
    keys = sorted({(f["op"], f["bs"], f["qd"]) for f in floors})
    for k in keys:
        reps = sorted({f["rep"] for f in floors if (f["op"], f["bs"], f["qd"]) == k})
        lat, iops, modes = [], [], set()
        for rep in reps:
            fs = [f for f in floors if (f["op"], f["bs"], f["qd"]) == k and f["rep"] == rep]
            best = min(fs, key=lambda f: f["lat_mean_us"])  # (the faster mode of this rep)
            modes.add(best["mode"])
            lat.append(best["lat_mean_us"])
            iops.append(max(f["iops"] for f in fs))
        out[k] = {"op": k[0], "bs": k[1], "qd": k[2], "lat_mean_us": med(lat), "iops": med(iops),
                  "iops_min": min(iops), "iops_max": max(iops), "modes": sorted(modes), "reps": len(reps)}
    return out


def fabric_for(job, floors):
    """The raw RDMA floor of job: its own measurements (rdmaread in the job's
    rotation), else any of the same operations; per rep the faster mode, the
    mean of the job's operations (randrw: READ and WRITE), then the median of
    the reps."""
    ks = FABRIC.get(job, [])
    if not ks:
        return None
    fs = [f for f in floors if f.get("job") == job] or [f for f in floors if (f["op"], f["bs"], f["qd"]) in ks]
    lat, iops = [], []
    for rep in sorted({f["rep"] for f in fs}):
        per = []
        for k in ks:
            m = [f for f in fs if f["rep"] == rep and (f["op"], f["bs"], f["qd"]) == k]
            if m:
                per.append((min(f["lat_mean_us"] for f in m), max(f["iops"] for f in m)))
        if len(per) == len(ks):
            lat.append(statistics.mean(p[0] for p in per))
            iops.append(statistics.mean(p[1] for p in per))
    if not lat:
        return None
    return {"iops": med(iops), "lat_mean_us": med(lat), "reps": len(lat),
            "what": " + ".join(f"{k[0]} {fmt_bs(k[1])} QD{k[2]}" for k in ks)}


def load_guest(out):
    gdir = os.path.join(out, "guest")
    path = os.path.join(gdir, "fio-table.csv")
    if not os.path.exists(path):
        return None
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        for k in ("iops", "bw_MBps", "lat_mean_us", "lat_p99_us", "cpu_us_per_io"):
            try:
                r[k] = float(r[k])
            except (KeyError, ValueError, TypeError):
                r[k] = None
        r["rep"] = int(r.get("rep") or 1)
    floors = None
    fp = os.path.join(gdir, "fio-floors.json")
    if os.path.exists(fp):
        try:
            floors = json.load(open(fp))
        except ValueError:
            floors = None
    info = {}
    ip = os.path.join(gdir, "fio-info.txt")
    if os.path.exists(ip):
        info["text"] = open(ip).read()
    names, jobs = [], []
    for r in rows:
        if r["name"] not in names:
            names.append(r["name"])
        if r["job"] not in jobs:
            jobs.append(r["job"])
    summ = {}
    for j in jobs:
        summ[j] = {}
        for n in names:
            rs = [r for r in rows if r["job"] == j and r["name"] == n]
            if not rs:
                continue
            iops = [r["iops"] for r in rs]
            summ[j][n] = {"n": len(rs), "iops_min": min(iops), "iops_med": med(iops), "iops_max": max(iops),
                          "bw_MBps_med": med([r["bw_MBps"] for r in rs]), "lat_mean_us_med": med([r["lat_mean_us"] for r in rs]),
                          "lat_p99_us_med": med([r["lat_p99_us"] for r in rs]), "cpu_us_per_io_med": med([r["cpu_us_per_io"] for r in rs])}
    return {"rows": rows, "names": names, "jobs": jobs, "summary": summ, "floors": floors, "info": info}


def table_md(meta, summ, fl, floors, guest, elapsed):
    servers = meta["servers"]
    L = []
    L.append(f"# rblk benchmark ({meta['date']}, commit {meta['commit']})")
    L.append("")
    L.append(f"Bare machine: {meta['host']}, {meta['cpus']} CPUs ({meta['cpu_model']}), kernel {meta['kernel']}; "
             f"{meta['fio']}, {meta['nbdkit']}, {meta['qemu_nbd']}.")
    L.append(f"fio's nbd engine over unix sockets; each file server on its own {meta['size']} file on /var/tmp filled with random bytes "
             f"(in the page cache); rblkd --transport tcp --chunk-size {meta['chunk']} with a cache that holds the volume. "
             f"Each run: {meta['ramp_s']} s warm (its own fio job group) then {meta['runtime_s']} s measured; "
             f"{meta['reps']} rep(s), interleaved (rep, job, server; the server order rotates).")
    if meta.get("baseline"):
        L.append(f"rblk-before: the binaries of {meta['baseline']}.")
    if elapsed:
        L.append(f"Run time of the harness: {elapsed} s.")
    L.append("Only ratios within one run mean anything: the machine is shared and its figures drift.")
    L.append("")

    def has(s):
        return s in servers

    ratios = [(RBLK, NBDKIT), (RBLK, QEMU), (RBLK, BEFORE)]
    ratios = [(a, b) for a, b in ratios if has(a) and has(b)]

    # IOPS
    L.append("## IOPS (median of the reps, min-max)")
    L.append("")
    hdr = ["job"] + servers + [f"{a}/{b}" for a, b in ratios]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for job, row in summ.items():
        cells = [job]
        for s in servers:
            x = row.get(s, {})
            if not x.get("n"):
                cells.append("failed" if x.get("failed") else "-")
            else:
                cells.append(f"{fmt_n(x['iops_med'])} ({fmt_n(x['iops_min'])}-{fmt_n(x['iops_max'])})")
        for a, b in ratios:
            cells.append(fmt_r(ratio(row.get(a, {}).get("iops_med"), row.get(b, {}).get("iops_med"))))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    # Latency
    L.append("## Latency, µs (mean, median of the reps; p99 in parentheses)")
    L.append("")
    hdr = ["job"] + servers
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for job, row in summ.items():
        cells = [job]
        for s in servers:
            x = row.get(s, {})
            cells.append(f"{fmt_n(x.get('lat_mean_us_med'), 1)} ({fmt_i(x.get('lat_p99_us_med'))})" if x.get("n") else "-")
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    # CPU
    L.append("## CPU µs per IO of the server processes (median of the reps)")
    L.append("")
    L.append("utime+stime from /proc/PID/stat over the whole fio run (warm and measured groups) divided by all its IOs. "
             "rblk: rblkd + rblk-attach (each in parentheses).")
    L.append("")
    cr = [(a, b) for a, b in [(RBLK, NBDKIT), (RBLK, QEMU), (RBLK, BEFORE)] if has(a) and has(b)]
    hdr = ["job"] + servers + [f"{a}/{b}" for a, b in cr]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for job, row in summ.items():
        cells = [job]
        for s in servers:
            x = row.get(s, {})
            c = x.get("cpu_us_per_io_med") or {}
            if not x.get("n"):
                cells.append("-")
            elif s in (RBLK, BEFORE):
                cells.append(f"{fmt_n(c.get('total'), 1)} ({fmt_n(c.get('rblkd'), 1)} + {fmt_n(c.get('rblk-attach'), 1)})")
            else:
                cells.append(fmt_n(c.get("total"), 1))
        for a, b in cr:
            ca = (row.get(a, {}).get("cpu_us_per_io_med") or {}).get("total")
            cb = (row.get(b, {}).get("cpu_us_per_io_med") or {}).get("total")
            cells.append(fmt_r(ratio(ca, cb)))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    # Floors
    L.append("## Floors: how far rblk is from what the front end and the fabric allow")
    L.append("")
    L.append("- front end: nbdkit's null plugin (`nbdkit-null`), one NBD hop with no data work, the same fio jobs;")
    L.append("- fabric: a raw RDMA READ or WRITE of the same size and depth between two processes over the software "
             "transport (tcp provider) on loopback (`bench/cmd/rdmaread`), run in each job's rotation beside the servers "
             "(median of the reps; randrw: the mean of READ and WRITE);")
    L.append("- two-process floor (QD1 jobs): null NBD round trip + raw RDMA round trip: the least an NBD request that becomes "
             "one RDMA operation can take with rblk's two processes.")
    L.append("")
    if fl:
        L.append("Raw RDMA over the software transport, all runs: " + "; ".join(
            f"{f['op']} {fmt_bs(f['bs'])} QD{f['qd']}: {fmt_n(f['iops'])} IOPS, {f['lat_mean_us']:.1f} µs"
            for f in fl.values()) + ".")
        L.append("")
    hdr = ["job", "null NBD IOPS", "raw RDMA IOPS", "rblk IOPS", "rblk/null", "rblk/RDMA",
           "null NBD µs", "raw RDMA µs", "two-process floor µs", "rblk µs", "rblk/floor"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for job, row in summ.items():
        r = row.get(RBLK, {})
        n = row.get(NULL, {})
        f = fabric_for(job, floors)
        qd1 = job.endswith("-qd1")
        floor = None
        if qd1 and f and n.get("n"):
            floor = n["lat_mean_us_med"] + f["lat_mean_us"]
        cells = [job, fmt_n(n.get("iops_med")), fmt_n(f and f["iops"]), fmt_n(r.get("iops_med")),
                 fmt_r(ratio(r.get("iops_med"), n.get("iops_med"))), fmt_r(ratio(r.get("iops_med"), f and f["iops"])),
                 fmt_n(n.get("lat_mean_us_med"), 1), fmt_n(f and f["lat_mean_us"], 1), fmt_n(floor, 1),
                 fmt_n(r.get("lat_mean_us_med"), 1), fmt_r(ratio(r.get("lat_mean_us_med"), floor))]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    # Targets
    L.append("## Targets of issue 8")
    L.append("")
    L.append("| target | measured | met |")
    L.append("|---|---|---|")
    yes = lambda ok: "-" if ok is None else ("yes" if ok else "**no**")
    row = summ.get("randread-4k-qd1", {})
    f = fabric_for("randread-4k-qd1", floors)
    n = row.get(NULL, {})
    if f and n.get("n") and row.get(RBLK, {}).get("n"):
        floor = n["lat_mean_us_med"] + f["lat_mean_us"]
        rr = row[RBLK]["lat_mean_us_med"] / floor
        L.append(f"| bare: 4k QD1 read latency within {LAT_TARGET}x the two-process floor | rblk {row[RBLK]['lat_mean_us_med']:.1f} µs, "
                 f"floor {floor:.1f} µs ({n['lat_mean_us_med']:.1f} null NBD + {f['lat_mean_us']:.1f} raw RDMA READ): {rr:.2f}x | {yes(rr <= LAT_TARGET)} |")
    for job in [j for j in THROUGHPUT_JOBS if j in summ]:
        row = summ[job]
        q = ratio(row.get(RBLK, {}).get("iops_med"), row.get(NBDKIT, {}).get("iops_med"))
        L.append(f"| bare: {job} IOPS at least nbdkit-file's | {fmt_r(q)}x | {yes(None if q is None else q >= 1.0)} |")
    for job, row in summ.items():
        ca = (row.get(RBLK, {}).get("cpu_us_per_io_med") or {}).get("total")
        cb = (row.get(NBDKIT, {}).get("cpu_us_per_io_med") or {}).get("total")
        q = ratio(ca, cb)
        L.append(f"| bare: {job} CPU per IO at most nbdkit-file's | {fmt_n(ca, 1)} vs {fmt_n(cb, 1)} µs: {fmt_r(q)}x | "
                 f"{yes(None if q is None else q <= 1.0)} |")
    if guest:
        for job in guest["jobs"]:
            g = guest["summary"][job]
            q = ratio(g.get(GRBLK, {}).get("iops_med"), g.get(NVME, {}).get("iops_med"))
            L.append(f"| guest: {job} at least 1.0x NVMe-oF RDMA | {fmt_r(q)}x | {yes(None if q is None else q >= 1.0)} |")
    L.append("")

    if guest:
        L.extend(guest_md(guest))
    return "\n".join(L) + "\n"


def guest_md(guest):
    L = ["## Guest: rblk over verbs beside the kernel's NVMe-oF RDMA (Soft-RoCE under qemu TCG)", ""]
    if guest["info"].get("text"):
        L.append("```")
        L.append(guest["info"]["text"].rstrip())
        L.append("```")
        L.append("")
    fl = guest.get("floors") or {}
    if fl:
        L.append(f"Fabric floor (perftest on rxe0): RDMA READ 4k latency {fl.get('read_lat_us', '-')} µs (QD1), "
                 f"{fl.get('read_iops', '-')} IOPS (QD{fl.get('read_bw_qd', '?')}).")
        L.append("")
    names = guest["names"]
    rat = [(GRBLK, NVME)] + ([(GRBLK, GBEFORE)] if GBEFORE in names else []) + ([(GRBLK, GNULL)] if GNULL in names else [])
    hdr = ["job"] + [f"{n} IOPS" for n in names] + [f"{a}/{b}" for a, b in rat] + [f"{n} µs" for n in names] + [f"{n} CPU µs/IO" for n in names]
    L.append("IOPS: median of the reps (min-max); latency: mean, median of the reps; CPU: busy time of all CPUs "
             "(/proc/stat: user+nice+system+irq+softirq) over the whole fio run divided by all its IOs (fio, kernel, "
             "target and initiator alike).")
    L.append("")
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for j in guest["jobs"]:
        row = guest["summary"][j]
        cells = [j]
        for n in names:
            x = row.get(n)
            cells.append(f"{fmt_n(x['iops_med'])} ({fmt_n(x['iops_min'])}-{fmt_n(x['iops_max'])})" if x else "-")
        for a, b in rat:
            cells.append(fmt_r(ratio((row.get(a) or {}).get("iops_med"), (row.get(b) or {}).get("iops_med"))))
        for n in names:
            cells.append(fmt_i((row.get(n) or {}).get("lat_mean_us_med")))
        for n in names:
            cells.append(fmt_i((row.get(n) or {}).get("cpu_us_per_io_med")))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    return L


# The same colour for a server in every plot.
COLORS = {RBLK: "#7b2cbf", BEFORE: "#c8a2e8", NBDKIT: "#3a86ff", QEMU: "#fb8500", NULL: "#9e9e9e", NVME: "#3a86ff"}


def gp_quote(s):
    return '"' + s.replace('"', '\\"') + '"'


def plot_files(out, meta, summ, guest):
    """Data files and plot.gp: grouped bars of IOPS normalized to a reference
    (with min-max error bars) and of CPU µs per IO, per job and server."""
    gp = ["# gnuplot script written by bench/report.py; run in this directory: gnuplot plot.gp",
          "set terminal pngcairo size 1600,1100 font 'sans,10'",
          "set style data histograms",
          "set style histogram errorbars gap 2 lw 1",
          "set style fill solid 0.85 border -1",
          "set boxwidth 0.9",
          "set grid ytics",
          "set key outside right top",
          "set xtics rotate by -25 left"]

    def panel(datafile, title, ylabel, series, rows, normalize, logscale=False):
        # rows: job -> series -> (value, lo, hi)
        with open(os.path.join(out, datafile), "w") as f:
            f.write("# job " + " ".join(f"{s}_v {s}_lo {s}_hi" for s in series) + "\n")
            for job, vals in rows.items():
                cells = []
                for s in series:
                    v = vals.get(s)
                    cells += ["NaN"] * 3 if v is None or v[0] is None else [f"{x:.6g}" for x in v]
                f.write(job + " " + " ".join(cells) + "\n")
        g = [f"set title {gp_quote(title)}", f"set ylabel {gp_quote(ylabel)}", f"set xrange [-0.6:{len(rows) - 0.4}]"]
        g.append("set logscale y" if logscale else "unset logscale y")
        g.append("set yrange [*:*]" if logscale else "set yrange [0:*]")
        if normalize:
            g.append("set arrow 1 from graph 0, first 1 to graph 1, first 1 nohead dt 2 lw 2 lc rgb 'black' front")
        else:
            g.append("unset arrow 1")
        if not any(v is not None and v[0] is not None for vals in rows.values() for v in vals.values()):
            # (nothing to draw, say so rather than fail)
            return g + ["set label 1 'no data' at graph 0.5, graph 0.5 center", "unset logscale y", "set yrange [0:1]",
                        "plot 2 notitle", "unset label 1"]
        plots = []
        for i, s in enumerate(series):
            c = 2 + 3 * i
            color = f" lc rgb {gp_quote(COLORS[s])}" if s in COLORS else ""
            plots.append(f"{gp_quote(datafile)} using {c}:{c + 1}:{c + 2}:xtic(1) title {gp_quote(s)}{color}")
        g.append("plot " + ", \\\n     ".join(plots))
        return g

    servers = meta["servers"]
    iops_rows, cpu_rows = {}, {}
    for job, row in summ.items():
        ref = row.get(NBDKIT, {}).get("iops_med")
        iops_rows[job], cpu_rows[job] = {}, {}
        for s in servers:
            x = row.get(s, {})
            if not x.get("n"):
                continue
            if ref:
                iops_rows[job][s] = (x["iops_med"] / ref, x["iops_min"] / ref, x["iops_max"] / ref)
            c = (x.get("cpu_us_per_io_med") or {}).get("total")
            cpu_rows[job][s] = (c, c, c)
    gp.append("set output 'bench.png'")
    gp.append("set multiplot layout 2,1 title " + gp_quote(f"rblk bench, bare machine ({meta['date'][:10]}, {meta['commit']}): "
                                                           f"{meta['reps']} rep(s) x {meta['runtime_s']} s"))
    gp += panel("bench-iops.dat", "IOPS relative to nbdkit-file (median; bars: min-max of the reps)", "IOPS / nbdkit-file",
                servers, iops_rows, True)
    gp += panel("bench-cpu.dat", "CPU time of the server processes per IO (median of the reps)", "CPU µs per IO (log)",
                servers, cpu_rows, False, logscale=True)
    gp.append("unset multiplot")
    if guest:
        names = guest["names"]
        giops, gcpu = {}, {}
        for j in guest["jobs"]:
            row = guest["summary"][j]
            ref = (row.get(NVME) or {}).get("iops_med")
            giops[j], gcpu[j] = {}, {}
            for n in names:
                x = row.get(n)
                if not x:
                    continue
                if ref:
                    giops[j][n] = (x["iops_med"] / ref, x["iops_min"] / ref, x["iops_max"] / ref)
                c = x.get("cpu_us_per_io_med")
                gcpu[j][n] = (c, c, c)
        gp.append("set output 'guest.png'")
        gp.append("set multiplot layout 2,1 title " + gp_quote("rblk over verbs vs the kernel's NVMe-oF RDMA (guest, Soft-RoCE, qemu TCG)"))
        gp += panel("guest-iops.dat", "IOPS relative to NVMe-oF RDMA (median; bars: min-max of the reps)", "IOPS / nvme-of rdma",
                    names, giops, True)
        gp += panel("guest-cpu.dat", "busy CPU of the whole guest per IO (median of the reps)", "CPU µs per IO (log)",
                    names, gcpu, False, logscale=True)
        gp.append("unset multiplot")
    with open(os.path.join(out, "plot.gp"), "w") as f:
        f.write("\n".join(gp) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--elapsed", type=int, default=None, help="run time of the harness, seconds (for the table)")
    a = ap.parse_args()
    out = a.out
    meta, runs, floors = load_bare(out)
    if a.elapsed is not None:
        meta["elapsed_s"] = a.elapsed
    elif os.path.exists(os.path.join(out, "results.json")):
        meta["elapsed_s"] = json.load(open(os.path.join(out, "results.json")))["meta"].get("elapsed_s")
    summ = summarize(meta, runs)
    fl = floor_summary(floors)
    guest = load_guest(out)
    res = {"meta": meta, "runs": runs,
           "floors": {"rdma_raw": floors, "rdma_raw_summary": list(fl.values()),
                      "rdma_raw_per_job": {j: fabric_for(j, floors) for j in summ}},
           "summary": summ}
    if guest:
        res["guest"] = {"runs": guest["rows"], "summary": guest["summary"], "floors": guest["floors"]}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table_md(meta, summ, fl, floors, guest, meta.get("elapsed_s")))
    plot_files(out, meta, summ, guest)
    failed = [r for r in runs if r.get("failed")]
    if failed:
        print(f"report: {len(failed)} failed runs", file=sys.stderr)


if __name__ == "__main__":
    main()
