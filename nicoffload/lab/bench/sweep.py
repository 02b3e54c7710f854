"""``nicoffload bench``: every system over the points of each testbed of the plan.

How one (testbed, system) pair runs: ONE set of rank processes (:mod:`nicoffload.lab.bench.ranks`)
goes through every point of the testbed in turn, so start-up costs (imports, connection set-up,
compiling the XDP program) are paid once; their records become rows (:mod:`.report`), each
checked against :mod:`.reference` once the ranks are gone (so the check never loads the CPU
windows).

Links: every system runs on the testbed as it is built (GRO enabled on every worker's interface
for all of them). The testbed keeps its NAPI XDP_PASS program on the aggregator's bridge-side
veth for every system, so TSO/GSO stays off on the aggregator's own interface throughout; worker
links carry no XDP for any system (TSO on). Only during xdp runs does the aggregator's program on
its interface also turn TSO off on the bridge side of that link (traffic of the other systems
never crosses it). The state of each system's links is recorded in meta.json.
"""
from __future__ import annotations

import json
import os
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nicoffload.ebpf import libbpf
from nicoffload.lab import reference
from nicoffload.lab.aggregators import AggregatorSet
from nicoffload.lab.bench import report, systems
from nicoffload.lab.bench.plan import AGG_SYSTEMS, QUANTIZED, BenchConfig, Point, rate_bps, rate_label, sweep_plan
from nicoffload.lab.bench.plot import plot
from nicoffload.lab.inputs import as_int32, make_gradients
from nicoffload.lab.jobs import tempdir, testbed
from nicoffload.lab.launcher import Launch
from nicoffload.lab.links import enable_gro, link_state
from nicoffload.lab.rings import RingPrograms
from nicoffload.lab.train.torchrun import ServiceProcess, write_token


@dataclass
class Bed:
    """One testbed of the sweep and what every system on it shares."""

    tb: object
    cfg: BenchConfig
    points: list[Point]
    inputs: list[list[Path]]        # per point, one .npy per rank
    work: Path
    rate: str                       # its label
    rbps: int | None
    prog: report.Progress
    meta: dict                      # this testbed's entry of meta.json
    expected: dict = field(default_factory=dict)  # (point, quantizes) -> reference.Expected

    def reference(self, pt: Point, system: str) -> reference.Expected:
        key = (pt.index, system in QUANTIZED)
        if key not in self.expected:
            xs = [np.load(p, mmap_mode="r") for p in self.inputs[pt.index]]
            self.expected[key] = reference.expected(xs, key[1], self.cfg.spec.elems)
        return self.expected[key]


def make_inputs(points: list[Point], workers: int, seed: int, work: Path, elems: int,
                dtype: str = "float32") -> list[list[Path]]:
    """Seeded inputs of every point, saved in ``work``: per point, one .npy per rank."""
    out = []
    for pt in points:
        n = max(1, pt.bytes // 4)
        sd = seed + 7919 * pt.index + 104729 * workers
        grads = make_gradients(workers, n, pt.sparsity, sd, elems)
        if dtype == "int32":
            grads = as_int32(grads, sd)
        paths = [work / f"in{pt.index}-r{r}.npy" for r in range(workers)]
        for g, p in zip(grads, paths):
            np.save(p, g)
        out.append(paths)
    return out


class _Abort(Exception):
    pass


class SystemRun:
    """All points of one system on one testbed: start its aggregator (xdp, userspace) and its
    ranks, turn their records into rows as they arrive, check the results, stop everything."""

    def __init__(self, bed: Bed, system: str):
        self.bed, self.system = bed, system
        self.n = len(bed.tb.workers)
        self.outputs = [bed.work / f"{system}-out{pt.index}.npy" for pt in bed.points]
        self.rows: dict[int, dict] = {}
        self.failure: str | None = None
        self.startup_failure: str | None = None
        self.ap: AggregatorSet | None = None
        self.rp: RingPrograms | None = None     # xdpring: the ring programs on every worker
        self.svc: ServiceProcess | None = None  # xdptorch: nicoffload agg serve on the aggregator host
        self.job: Launch | None = None

    def plan(self) -> dict:
        b, cfg = self.bed, self.bed.cfg
        params = systems.rank_params(b.tb, self.system, cfg)
        if self.svc is not None:
            params.update(service=self.svc.url, token_file=str(self.svc.token_file))
        return {"system": self.system, "world": self.n, "ips": [w.ip for w in b.tb.workers],
                "iface": b.tb.workers[0].iface, "params": params,
                "warmup": cfg.warmup, "reps": cfg.reps, "min_time": cfg.min_time, "max_reps": cfg.max_reps,
                "max_point_s": cfg.max_point_s, "timeout": cfg.timeout,
                "prog_id": self.ap.prog_id if self.ap else None, "mode": self._mode(),
                "prog_ids": self.rp.prog_ids if self.rp else None, "compute": cfg.compute,
                "points": [{"index": pt.index, "inputs": [str(p) for p in b.inputs[pt.index]], "output": str(o)}
                           for pt, o in zip(b.points, self.outputs)]}

    def start(self) -> None:
        b, cfg = self.bed, self.bed.cfg
        if self.system in AGG_SYSTEMS:
            try:
                self.ap = AggregatorSet(b.tb, systems.agg_kind(self.system), systems.agg_spec(self.system, cfg),
                                        mode=cfg.mode)
            except Exception as e:
                self.startup_failure = f"the {self.system} aggregator did not start: {e}"
                raise _Abort(self.startup_failure)
        if self.system == "xdptorch":
            try:
                extra = ["--mode", cfg.mode] + ([] if cfg.multicast else ["--no-multicast"])
                self.svc = ServiceProcess(b.tb, write_token(b.work / "service"), extra=extra).start()
            except Exception as e:
                self.startup_failure = f"the aggregator service did not start: {e}"
                raise _Abort(self.startup_failure)
        if self.system == "xdpring":
            try:
                self.rp = RingPrograms(b.tb, cfg.spec, mode=cfg.mode, capacity=systems.ring_capacity(cfg))
            except Exception as e:
                self.startup_failure = f"the ring programs did not load: {e}"
                raise _Abort(self.startup_failure)
        b.meta["links"][self.system] = link_state(b.tb)
        plan = self.plan()
        path = b.work / f"{self.system}-plan.json"
        path.write_text(json.dumps(plan))
        b.prog.note(f"{self.system}: starting {self.n} ranks on {b.rate} x{self.n}")
        self.job = Launch(b.tb, systems.rank_specs(b.tb, self.system, path, plan["params"], b.work, cfg))

    def _record(self, d: dict, pending: dict[int, list[dict]]) -> None:
        recs = pending.setdefault(d["point"], [])
        recs.append(d)
        if len(recs) == self.n:
            b = self.bed
            pt = b.points[d["point"]]
            self.rows[pt.index] = r = report.measured_row(self.system, self.n, pt, b.rate, b.rbps, recs)
            b.prog.row(r)

    def _fail(self, what: str, started: bool) -> None:
        self.failure = what
        if not started:
            self.startup_failure = what

    def collect(self) -> None:
        """Read the ranks' lines until every point has its row, or they fail or stall."""
        cfg, job = self.bed.cfg, self.job
        pending: dict[int, list[dict]] = {}
        ready: set[int] = set()
        ended, limit, last = 0, cfg.start_timeout, time.monotonic()
        while len(self.rows) < len(self.bed.points):
            try:
                _, line = job.next_line(limit - (time.monotonic() - last))
            except queue.Empty:
                what = "did not start" if len(ready) < self.n else "made no progress"
                self._fail(f"{self.system} {what} within {limit:.0f}s", len(ready) == self.n)
                return
            if line is None:
                ended += 1
                if ended == len(job.procs):
                    time.sleep(0.2)
                    self._fail(self._errors() or f"{self.system} ranks exited before finishing", len(ready) == self.n)
                    return
                continue
            try:
                d = json.loads(line) if line.startswith("{") else None
            except ValueError:
                d = None
            if d is None:
                continue
            last = time.monotonic()
            if d.get("ready"):
                ready.add(d["rank"])
                if len(ready) == self.n:
                    limit = max(120.0, 3 * cfg.max_point_s + 4 * cfg.timeout)
            elif "point" in d:
                self._record(d, pending)

    def _errors(self) -> str:
        return "; ".join(o.describe() for o in self.job.ended() if not o.ok)

    def _mode(self) -> str | None:
        return self.ap.mode if self.ap else self.rp.mode if self.rp else None

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()
        if self.svc is not None:
            try:
                self.svc.stop()
            except Exception:
                pass
        if self.rp is not None:
            b = self.bed
            stats = self.rp.close()
            b.meta.setdefault("ring_stats", {}).setdefault(self.system, []).append(
                {"workers": self.n, "rate": b.rate, "stats": stats})
        if self.ap is not None:
            b = self.bed
            try:
                b.meta.setdefault("aggregator_stats", {}).setdefault(self.system, []).append(
                    {"workers": self.n, "rate": b.rate, "stats": self.ap.close()})
            except Exception:
                pass

    def finish(self) -> list[dict]:
        """The rows of every point: measured ones checked, missing ones errors naming the failure."""
        b = self.bed
        shape = systems.packet_shape(self.system, self._mode(), b.cfg.spec)
        out = []
        for pt, o in zip(b.points, self.outputs):
            r = self.rows.get(pt.index)
            if r is None:
                r = report.row(self.system, self.n, pt, b.rate, b.rbps, status="error", reason=self.failure or "no result")
                b.prog.row(r)
            else:
                self._check(r, pt, o)
            r.update(shape)
            o.unlink(missing_ok=True)
            out.append(r)
        return out

    def _check(self, r: dict, pt: Point, output: Path) -> None:
        try:
            y = np.load(output)
        except Exception as e:
            r.update(status="error", reason=f"no output to check ({e})")
            return
        report.apply_check(r, self.bed.reference(pt, self.system).check(y))

    def run(self) -> tuple[list[dict], str | None]:
        """(rows, start-up failure or None)."""
        try:
            self.start()
            self.collect()
            if self.failure and self.job is not None:
                errs = self._errors()
                if errs and errs not in self.failure:
                    self.failure = f"{self.failure}: {errs}"
        except _Abort as e:
            self.failure = str(e)
        finally:
            self.stop()
        return self.finish(), self.startup_failure


# --- the sweep ------------------------------------------------------------------------------
def _meta(cfg: BenchConfig, argv, avail: dict, versions: dict) -> dict:
    return {"command": argv, "config": cfg.to_dict(),
            "systems": {s: {"description": systems.DESCRIPTION[s], "available": avail[s] is None,
                            "reason": avail[s], "version": versions[s]} for s in cfg.systems},
            "cpus": os.cpu_count(), "kernel": os.uname().release, "testbeds": []}


def _skipped(system: str, n: int, points: list[Point], rate: str, rbps, reason: str, prog) -> list[dict]:
    rows = [report.row(system, n, pt, rate, rbps, status="skipped", reason=reason) for pt in points]
    for r in rows:
        prog.row(r)
    return rows


def _run_testbed(cfg: BenchConfig, rate: str, n: int, points: list[Point], avail: dict, meta: dict,
                 prog: report.Progress, rows: list[dict]) -> None:
    """Every system on one fresh testbed of ``n`` workers at ``rate``; rows appended to ``rows``
    and written after each system (partial results survive an interruption)."""
    from nicoffload.testbed.topology import Link

    from nicoffload.testbed.topology import AGG, parse_rate

    rbps, label = rate_bps(rate), rate_label(rate)
    agg_bps = (parse_rate(cfg.agg_rate) if cfg.agg_rate else n * rbps) if rbps else None
    aggs = [AGG] + [f"{AGG}{k}" for k in range(1, cfg.aggregators)]
    links = {a: Link(rate=agg_bps) for a in aggs} if rbps else None
    k = f"{cfg.aggregators} aggregators" if cfg.aggregators > 1 else "aggregator"
    prog.note(f"testbed: {n} workers, links {label}" + (f", {k} at {agg_bps / 1e9:g} Gbit/s" if rbps else ""))
    tbmeta = {"workers": n, "rate": label, "agg_rate_bps": agg_bps, "aggregators": cfg.aggregators, "links": {}}
    meta["testbeds"].append(tbmeta)
    with testbed(n, cfg.spec.elems, rate=rbps, links=links, multicast=cfg.multicast,
                 aggregators=cfg.aggregators) as tb, tempdir() as d:
        enable_gro(tb)
        work = Path(d)
        inputs = make_inputs(points, n, cfg.seed, work, cfg.spec.elems, cfg.dtype)
        bed = Bed(tb, cfg, points, inputs, work, label, rbps, prog, tbmeta)
        for s in cfg.systems:
            if avail[s]:
                rows += _skipped(s, n, points, label, rbps, avail[s], prog)
                continue
            got, start_fail = SystemRun(bed, s).run()
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
                    rows += _skipped(s, n, points, rate_label(rate), rate_bps(rate), avail[s], prog)
                continue
            _run_testbed(cfg, rate, n, points, avail, meta, prog, rows)
    report.write(cfg.out, rows, meta)
    return rows, plot(rows, cfg)

