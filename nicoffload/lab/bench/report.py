"""The bench's rows: one per (testbed, system, point), built from the ranks' records, checked
against the reference, written as results.json / results.csv / meta.json and shown as a table
(and as progress lines while the sweep runs).

A rep's time is the slowest rank's. ``cpu_s`` and ``bpf_ns`` are rank 0's whole-machine CPU time
and the XDP program's run time over the timed window divided by the reps (the window holds reps
AllReduces and reps+1 barriers; /proc/stat ticks are 10 ms, hence the bench's ``min_time``);
for the ring offload ``bpf_ns`` is every node's program together. ``proc_cpu_s`` is a rank
process's own CPU time per AllReduce (user + system, the mean over ranks): what the host spends;
``host_cpu_s`` is every rank's together, and ``cpu_share`` that over the machine's cores times the
wall time: on a shaped point at or above :data:`CPU_BOUND` the ranks kept that share of every core
busy, so the cores, not the links, set the time (``limit`` says ``cpu``; else ``link``).
With ``--compute``, ``compute_drop`` is the share of a compute loop's throughput beside every
rank that the AllReduces took (1 - its rate during the reps / its rate while every rank idled).
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from nicoffload.lab.bench.plan import HALF_SYSTEMS, STAR_SYSTEMS, SYSTEMS, Point, bounds, shape_label
from nicoffload.lab.inputs import format_size
from nicoffload.lab.reference import Check

FIELDS = ["system", "workers", "bytes", "sparsity", "rate", "rate_bps", "status", "reason", "reps",
          "median_s", "min_s", "max_s", "goodput_bps", "cpu_s", "cpu_util", "bpf_ns", "bpf_cnt",
          "bound_agg_s", "bound_ring_s", "bound_s", "bound_fraction", "max_abs_err", "within_bound",
          "packets", "retransmissions", "w0_tx_bytes", "w0_rx_bytes", "mode", "shape", "proc_cpu_s",
          "compute_idle", "compute_busy", "compute_drop", "ranks_per_host", "agg_rate_bps", "host_cpu_s",
          "cpu_share", "limit", "window_cuts", "probes", "timeouts"]

#: a shaped point whose ranks kept at least this share of the machine's cores busy is CPU-bound:
#: on a shared 2-core VM the rest goes to the kernel's softirqs charged elsewhere and to other
#: work, and a point past it was measured slower than its link allowed (docs/bench/numbers.md)
CPU_BOUND = 0.5


# --- rows -------------------------------------------------------------------------------------
def row(system: str, workers: int, pt: Point, rate: str, rbps: int | None, ranks_per_host: int = 1,
        agg_bps: int | None = None, **kw) -> dict:
    """A row with the point's bounds (of the bytes the system moves: half of them for the systems
    with two bytes per element; ``workers`` are hosts, each running ``ranks_per_host`` ranks;
    ``agg_bps``: the aggregators' links together); ``kw`` fills the rest (status, reason,
    measurements)."""
    ba, br = bounds(pt.bytes // 2 if system in HALF_SYSTEMS else pt.bytes, workers, rbps, agg_bps)
    r = {k: None for k in FIELDS}
    r.update(system=system, workers=workers, bytes=pt.bytes, sparsity=pt.sparsity, rate=rate, rate_bps=rbps,
             bound_agg_s=ba, bound_ring_s=br, bound_s=ba if system in STAR_SYSTEMS else br,
             ranks_per_host=ranks_per_host, agg_rate_bps=agg_bps)
    r.update(kw)
    return r


def _cpu(r: dict, ranks: int) -> None:
    """The ranks' CPU per AllReduce together, its share of the machine, and what bound the point."""
    if r.get("proc_cpu_s") is None or not r.get("median_s"):
        return
    r["host_cpu_s"] = ranks * r["proc_cpu_s"]
    r["cpu_share"] = r["host_cpu_s"] / ((os.cpu_count() or 1) * r["median_s"])
    if r["rate_bps"]:
        r["limit"] = "cpu" if r["cpu_share"] >= CPU_BOUND else "link"


def measured_row(system: str, workers: int, pt: Point, rate: str, rbps: int | None, recs: list[dict],
                 ranks_per_host: int = 1, agg_bps: int | None = None) -> dict:
    """The row of one point from every rank's record of it (rank 0's holds the window's counters)."""
    recs = sorted(recs, key=lambda d: d["rank"])
    nrep = min(len(d["times"]) for d in recs)
    reps = [max(d["times"][i] for d in recs) for i in range(nrep)]
    lead = recs[0]
    med = float(np.median(reps))
    r = row(system, workers, pt, rate, rbps, ranks_per_host, agg_bps, status="ok", reason="", reps=nrep, median_s=med,
            min_s=float(min(reps)), max_s=float(max(reps)), goodput_bps=pt.bytes * 8 / med,
            cpu_s=lead["cpu_busy_s"] / nrep, times=reps,
            cpu_util=(lead["cpu_busy_s"] / lead["cpu_all_s"]) if lead.get("cpu_all_s") else None)
    if "tx_bytes" in lead:
        r["w0_tx_bytes"], r["w0_rx_bytes"] = lead["tx_bytes"] / nrep, lead["rx_bytes"] / nrep
    if "bpf_ns" in lead:
        r["bpf_ns"], r["bpf_cnt"] = lead["bpf_ns"] / nrep, lead["bpf_cnt"] / nrep
    if all("proc_cpu_s" in d for d in recs):
        r["proc_cpu_s"] = float(np.mean([d["proc_cpu_s"] for d in recs])) / nrep
        _cpu(r, len(recs))
    if all(d.get("compute_idle") for d in recs):
        idle, busy = sum(d["compute_idle"] for d in recs), sum(d["compute_busy"] for d in recs)
        r["compute_idle"], r["compute_busy"], r["compute_drop"] = idle, busy, 1 - busy / idle
    if all("counters" in d for d in recs):
        r["packets"] = sum(d["counters"]["packets"] for d in recs)
        r["retransmissions"] = sum(d["counters"]["retransmissions"] for d in recs)
        for k in ("window_cuts", "probes", "timeouts"):
            r[k] = sum(d["counters"].get(k, 0) for d in recs)
    if r["bound_s"]:
        r["bound_fraction"] = r["bound_s"] / med
    return r


def apply_check(r: dict, check: Check) -> None:
    """Record the reference check in the row; a result out of bounds makes the row an error."""
    r["max_abs_err"], r["within_bound"] = check.max_abs_err, check.within_bound
    if not check.within_bound:
        r.update(status="error", reason=check.reason)


def write(out: Path, rows: list[dict], meta: dict) -> None:
    """results.json (every field), results.csv (FIELDS) and meta.json into ``out``."""
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in FIELDS})


# --- text -------------------------------------------------------------------------------------
def fmt_t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f}ms" if s < 1 else f"{s:.3f}s"


def fmt_row(r: dict) -> str:
    """One line of progress."""
    head = (f"{r['rate']:>9} {shape_label(r['workers'], r.get('ranks_per_host') or 1):<4} "
            f"{format_size(r['bytes']):>7} s={r['sparsity']:<4.2f} {r['system']:<9}")
    if r["status"] == "skipped":
        return f"{head} skipped: {r['reason']}"
    if r["status"] == "error" and r["median_s"] is None:
        return f"{head} ERROR: {r['reason']}"
    s = (f"{head} {fmt_t(r['median_s']):>10} [{fmt_t(r['min_s'])}..{fmt_t(r['max_s'])}] "
         f"{r['goodput_bps'] / 1e9:7.3f} Gb/s  cpu {fmt_t(r['cpu_s'])}")
    if r.get("bpf_ns") is not None:
        s += f"  xdp {r['bpf_ns'] / 1e6:.2f}ms"
    if r.get("bound_fraction") is not None:
        s += f"  {r['bound_fraction']:.0%} of bound"
    if r.get("host_cpu_s") is not None:
        s += f"  ranks' cpu {fmt_t(r['host_cpu_s'])} ({r['cpu_share']:.0%} of the cores)"
    if r.get("limit") == "cpu":
        s += "  CPU-BOUND"
    if r["status"] == "error":
        s += f"  ERROR: {r['reason']}"
    return s


def _order(r: dict) -> tuple:
    return (r["rate"] != "unshaped", r["rate_bps"] or 0, r["workers"], r["bytes"], r["sparsity"],
            SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 99)


def _table_line(r: dict) -> str:
    n = shape_label(r["workers"], r.get("ranks_per_host") or 1)[2:]
    base = f"{r['rate']:>9} {n:>3} {format_size(r['bytes']):>7} {r['sparsity']:>6.2f} {r['system']:<9} "
    if r["median_s"] is None:
        return base + f"{r['status']}: {r['reason']}"
    bpf = f"{r['bpf_ns'] / 1e6:.2f}ms" if r.get("bpf_ns") is not None else "-"
    frac = f"{r['bound_fraction']:.0%}" if r.get("bound_fraction") is not None else "-"
    st = "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
    host = fmt_t(r.get("proc_cpu_s"))
    drop = f"{r['compute_drop']:.0%}" if r.get("compute_drop") is not None else "-"
    share = f"{r['cpu_share']:.0%}" if r.get("cpu_share") is not None else "-"
    return base + (f"{fmt_t(r['median_s']):>10} {fmt_t(r['min_s']):>10} {fmt_t(r['max_s']):>10} "
                   f"{r['goodput_bps'] / 1e9:>5.2f}Gb/s {fmt_t(r['cpu_s']):>10} {host:>10} {share:>6} "
                   f"{r.get('limit') or '-':>5} {bpf:>9} {frac:>7} {drop:>6} {r['reps']:>4}  {st}")


def table(rows: list[dict]) -> str:
    """Every row, grouped by (rate, workers, size, sparsity), systems in SYSTEMS order."""
    hdr = (f"{'rate':>9} {'N':>3} {'size':>7} {'sparse':>6} {'system':<9} {'median':>10} {'min':>10} {'max':>10} "
           f"{'goodput':>10} {'cpu/AR':>10} {'rank cpu':>10} {'cores':>6} {'limit':>5} {'xdp/AR':>9} {'bound%':>7} "
           f"{'drop':>6} {'reps':>4}  "
           f"status")
    lines = [hdr, "-" * len(hdr)]
    prev = None
    for r in sorted(rows, key=_order):
        grp = _order(r)[:5]
        if prev is not None and grp != prev:
            lines.append("")
        prev = grp
        lines.append(_table_line(r))
    return "\n".join(lines)


def summary(rows: list[dict], out: Path, pngs: list[Path]) -> str:
    """What the command prints after the table: skipped systems, where the files are."""
    skipped = {r["system"]: r["reason"] for r in rows if r["status"] == "skipped"}
    lines = [f"skipped {s}: {why}" for s, why in skipped.items()]
    lines.append(f"results: {out / 'results.json'}, {out / 'results.csv'}, {out / 'meta.json'}")
    lines.append("plots:   " + ", ".join(str(p) for p in pngs))
    return "\n".join(lines)


class Progress:
    """Progress lines on stderr: ``[done/total elapsed] message``."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.t0, self.stream = total, 0, time.monotonic(), stream

    def _stamp(self) -> str:
        el = time.monotonic() - self.t0
        return f"[{self.done:>3}/{self.total} {int(el // 60)}m{int(el % 60):02d}s]"

    def note(self, msg: str) -> None:
        print(f"{self._stamp()} {msg}", file=self.stream, flush=True)

    def row(self, r: dict) -> None:
        self.done += 1
        print(f"{self._stamp()} {fmt_row(r)}", file=self.stream, flush=True)
