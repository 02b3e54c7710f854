"""``nicoffload bench``: every system over the points of each testbed of the plan.

How the systems of a testbed run: ONE set of rank processes per system
(:mod:`nicoffload.lab.bench.ranks`, started and read by :mod:`.systemrun`) goes through every
point of the testbed, so start-up costs (imports, connection set-up, compiling the XDP program)
are paid once; the systems that can share the testbed run side by side, interleaved rep by rep
by the sweep (:mod:`.drive`: paired ratios from one run), the others alone after them (and all
alone with ``--compute``). Their records become rows (:mod:`.report`), each checked against
:mod:`.reference` once the ranks are gone (so the check never loads the CPU windows).

Links: every system runs on the testbed as it is built (GRO enabled on every worker's interface
for all of them). The testbed keeps its NAPI XDP_PASS program on the aggregator's bridge-side
veth for every system, so TSO/GSO stays off on the aggregator's own interface throughout; worker
links carry no XDP for any system (TSO on). Only during xdp runs does the aggregator's program on
its interface also turn TSO off on the bridge side of that link (traffic of the other systems
never crosses it). The state of each system's links is recorded in meta.json.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from nicoffload.ebpf import libbpf
from nicoffload.lab.aggregators import on_testbed
from nicoffload.lab.bench import drive, report, systems
from nicoffload.lab.bench.plan import (
    XDP_AGG_SYSTEMS,
    BenchConfig,
    Point,
    agg_rate_bps,
    rate_bps,
    rate_label,
    sweep_plan,
)
from nicoffload.lab.bench.plot import plot
from nicoffload.lab.bench.systemrun import Abort, Bed, Failed, SystemRun
from nicoffload.lab.inputs import as_int32, make_gradients
from nicoffload.lab.jobs import tempdir, testbed
from nicoffload.lab.links import enable_gro


def make_inputs(points: list[Point], workers: int, seed: int, work: Path, elems: int,
                dtype: str = "float32", zero_run: int = 1) -> list[list[Path]]:
    """Seeded inputs of every point, saved in ``work``: per point, one .npy per rank (``workers``
    ranks; zero blocks in runs of ``zero_run``)."""
    out = []
    for pt in points:
        n = max(1, pt.bytes // 4)
        sd = seed + 7919 * pt.index + 104729 * workers
        grads = make_gradients(workers, n, pt.sparsity, sd, elems, zero_run)
        if dtype == "int32":
            grads = as_int32(grads, sd)
        paths = [work / f"in{pt.index}-r{r}.npy" for r in range(workers)]
        for g, p in zip(grads, paths):
            np.save(p, g)
        out.append(paths)
    return out


def run_group(bed: Bed, names: list[str]) -> list[tuple[list[dict], str | None]]:
    """The systems ``names`` side by side on ``bed``, interleaved rep by rep (:mod:`.drive`):
    per system, (rows, start-up failure or None), in the order given."""
    cfg, tb = bed.cfg, bed.tb
    shared = None
    runs: list[SystemRun] = []
    try:
        # several ranks on the one host: the shared memory path alone, no aggregator
        local_only = cfg.ranks_per_host > 1 and len(tb.workers) == 1
        xdps = [] if local_only else [s for s in names if s in XDP_AGG_SYSTEMS]
        shared_fail = None
        if xdps:
            specs = {s: drive.side_spec(s, on_testbed(tb, systems.agg_spec(s, cfg))) for s in xdps}
            try:
                shared = drive.SharedXdp(tb, specs, cfg.mode, lanes=cfg.ranks_per_host)
            except Exception as e:
                shared_fail = f"the XDP aggregator did not start: {e}"
        for s in names:
            r = SystemRun(bed, s, driven=True, shared=shared)
            runs.append(r)
            if s in xdps and shared is None:
                r.failure = r.startup_failure = shared_fail
                continue
            try:
                r.start()
            except Abort as e:
                r.failure = str(e)
        for r in runs:
            if r.failure is None:
                try:
                    r.wait_ready()
                except Failed as e:
                    r.startup_failure = str(e)
                    r.fail(str(e))
        for pt in bed.points:
            _driven_point(bed, [r for r in runs if r.failure is None], pt)
            drive.paired([r.rows[pt.index] for r in runs if pt.index in r.rows])
    finally:
        for r in runs:
            r.stop()
        if shared is not None:
            shared.close()
    return [(r.finish(), r.startup_failure) for r in runs]


def _driven_point(bed: Bed, runs: list[SystemRun], pt: Point) -> None:
    """One point of every system of a group: warm-ups, then rounds of one timed rep each (ABBA),
    until drive.schedule_done; a system that fails is dropped from the rest."""
    cfg, iface = bed.cfg, bed.tb.workers[0].iface
    windows = {r.system: drive.Window() for r in runs}
    elapsed = {r.system: 0.0 for r in runs}

    def guarded(r: SystemRun, fn) -> None:
        try:
            fn()
        except Failed as e:
            r.fail(str(e))

    for r in runs:
        for _ in range(cfg.warmup):
            if r.failure is None:
                guarded(r, lambda: r.rep(drive.WARM))
    t0, rounds = time.monotonic(), 0
    while True:
        live = [r for r in runs if r.failure is None]
        if not live:
            return
        for r in drive.order(live, rounds):
            def one(r=r):
                elapsed[r.system] += windows[r.system].around(iface, r.rank0_pid, r.prog_ids,
                                                              lambda: r.rep(drive.REP))
            guarded(r, one)
        rounds += 1
        live = [r for r in runs if r.failure is None]
        if drive.schedule_done(cfg, rounds, {r.system: elapsed[r.system] for r in live},
                               time.monotonic() - t0, len(live)):
            break
    for r in runs:
        if r.failure is None:
            guarded(r, lambda: r.end_point(pt, windows[r.system]))


# --- the sweep ------------------------------------------------------------------------------
def _meta(cfg: BenchConfig, argv, avail: dict, versions: dict) -> dict:
    return {"command": argv, "config": cfg.to_dict(),
            "systems": {s: {"description": systems.DESCRIPTION[s], "available": avail[s] is None,
                            "reason": avail[s], "version": versions[s]} for s in cfg.systems},
            "cpus": os.cpu_count(), "kernel": os.uname().release, "testbeds": []}


def _skipped(system: str, n: int, points: list[Point], rate: str, rbps, reason: str, prog, k: int = 1,
             agg_bps: int | None = None) -> list[dict]:
    rows = [report.row(system, n, pt, rate, rbps, k, agg_bps, status="skipped", reason=reason) for pt in points]
    for r in rows:
        prog.row(r)
    return rows


def _run_testbed(cfg: BenchConfig, rate: str, n: int, points: list[Point], avail: dict, meta: dict,
                 prog: report.Progress, rows: list[dict]) -> None:
    """Every system on one fresh testbed of ``n`` workers at ``rate``; rows appended to ``rows``
    and written after each system (partial results survive an interruption)."""
    from nicoffload.testbed.topology import AGG, Link

    rbps, label = rate_bps(rate), rate_label(rate)
    agg_bps = agg_rate_bps(cfg.agg_rate, n, rbps)
    aggs = [AGG] + [f"{AGG}{k}" for k in range(1, cfg.aggregators)]
    links = {a: Link(rate=agg_bps) for a in aggs} if rbps else None
    k = f"{cfg.aggregators} aggregators" if cfg.aggregators > 1 else "aggregator"
    K = cfg.ranks_per_host
    each = f" of {K} ranks each" if K > 1 else ""
    prog.note(f"testbed: {n} workers{each}, links {label}" + (f", {k} at {agg_bps / 1e9:g} Gbit/s" if rbps else ""))
    total_agg = agg_bps * cfg.aggregators if agg_bps else None  # the bound's: every contribution crosses one
    tbmeta = {"workers": n, "ranks_per_host": K, "rate": label, "agg_rate_bps": agg_bps,
              "aggregators": cfg.aggregators, "links": {}}
    meta["testbeds"].append(tbmeta)
    with testbed(n, cfg.spec.elems, rate=rbps, links=links, multicast=cfg.multicast,
                 aggregators=cfg.aggregators) as tb, tempdir() as d:
        enable_gro(tb)
        work = Path(d)
        inputs = make_inputs(points, n * K, cfg.seed, work, cfg.spec.elems, cfg.dtype, cfg.zero_run)
        bed = Bed(tb, cfg, points, inputs, work, label, rbps, prog, tbmeta, agg_bps=total_agg)
        for group in drive.groups(cfg, n):
            for s in group:
                if avail[s]:
                    rows += _skipped(s, n, points, label, rbps, avail[s], prog, K, total_agg)
            names = [s for s in group if not avail[s]]
            if not names:
                continue
            if cfg.compute:  # the ranks' compute loop needs them to run their points alone
                results = [SystemRun(bed, s).run() for s in names]
            else:
                results = run_group(bed, names)
            for s, (got, start_fail) in zip(names, results):
                rows += got
                if start_fail:
                    avail[s] = f"failed to start on an earlier testbed: {start_fail}"
                    meta["systems"][s]["reason"] = start_fail
            report.write(cfg.out, rows, meta)


def run(cfg: BenchConfig, argv: list[str] | None = None) -> tuple[list[dict], list[Path]]:
    """The whole sweep; writes results.json, results.csv, meta.json and the plots into cfg.out."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    avail: dict[str, str | None] = {}
    versions: dict[str, str] = {}
    for s in cfg.systems:
        avail[s], versions[s] = systems.probe(s, cfg.mpirun)
    meta = _meta(cfg, argv, avail, versions)
    plan = sweep_plan(cfg)
    prog = report.Progress(sum(len(p) for _, _, p in plan) * len(cfg.systems))
    for s in cfg.systems:
        if avail[s]:
            prog.note(f"{s}: skipped ({avail[s]})")
    rows: list[dict] = []
    with libbpf.stats_enabled():
        for rate, n, points in plan:
            if all(avail[s] for s in cfg.systems):  # nothing can run: no testbed needed
                for s in cfg.systems:
                    rows += _skipped(s, n, points, rate_label(rate), rate_bps(rate), avail[s], prog,
                                     cfg.ranks_per_host)
                continue
            _run_testbed(cfg, rate, n, points, avail, meta, prog, rows)
    report.write(cfg.out, rows, meta)
    return rows, plot(rows, cfg)
