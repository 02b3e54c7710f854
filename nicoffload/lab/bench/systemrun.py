"""One system's ranks on one testbed of the sweep (:mod:`.sweep`): start its aggregator (xdp,
afxdp, userspace), the service (xdptorch) or the ring programs (xdpring) and its ranks
(:mod:`nicoffload.lab.bench.ranks`); turn their records into rows as they arrive, by themselves
(:meth:`SystemRun.run`) or rep by rep as the sweep hands them out (driven, :mod:`.drive`); check
every result against :mod:`nicoffload.lab.reference` once the ranks are gone; stop everything,
recording each aggregator's and ring's counters in meta.json.
"""
from __future__ import annotations

import json
import os
import queue
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nicoffload.lab import reference
from nicoffload.lab.aggregators import AggregatorSet, on_testbed
from nicoffload.lab.bench import drive, report, systems
from nicoffload.lab.bench.plan import AGG_SYSTEMS, XDP_AGG_SYSTEMS, BenchConfig, Point, reference_kind
from nicoffload.lab.launcher import Launch
from nicoffload.lab.links import link_state
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
    expected: dict = field(default_factory=dict)  # (point, reference kind) -> reference.Expected
    agg_bps: int | None = None      # the aggregators' links together (shaped; the bound's N x M go through them)

    def reference(self, pt: Point, system: str) -> reference.Expected:
        kind = reference_kind(system, self.cfg.spec)
        key = (pt.index, kind)
        if key not in self.expected:
            xs = [np.load(p, mmap_mode="r") for p in self.inputs[pt.index]]
            if kind in reference.HALF_UNIT:
                self.expected[key] = reference.half_sum(xs, kind)
            else:
                self.expected[key] = reference.expected(xs, kind != "host", self.cfg.spec.elems,
                                                        16 if kind == "q16" else 32)
        return self.expected[key]


class Abort(Exception):
    """A system could not start (its aggregator, the service or the ring programs)."""


class Failed(Exception):
    """A system of a driven group failed (a rank ended, or none made progress in time)."""


class SystemRun:
    """All points of one system on one testbed: start its aggregator (xdp, afxdp, userspace) and its
    ranks, turn their records into rows as they arrive, check the results, stop everything.
    ``driven``: the sweep hands out every rep (:mod:`.drive`; the XDP systems of the group on
    the ``shared`` aggregator), else the ranks go through the points by themselves."""

    def __init__(self, bed: Bed, system: str, driven: bool = False, shared: drive.SharedXdp | None = None):
        self.bed, self.system = bed, system
        self.hosts, self.k = len(bed.tb.workers), bed.cfg.ranks_per_host
        self.n = self.hosts * self.k  # ranks
        # several ranks per host and one host: the shared memory path alone, no aggregator
        self.local_only = self.k > 1 and self.hosts == 1
        self.shm = f"nicoffload-bench{os.getpid()}-{secrets.token_hex(4)}-{system}"  # HostGroups' names
        self.outputs = [bed.work / f"{system}-out{pt.index}.npy" for pt in bed.points]
        self.rows: dict[int, dict] = {}
        self.failure: str | None = None
        self.startup_failure: str | None = None
        self.ap: AggregatorSet | None = None
        self.rp: RingPrograms | None = None     # xdpring: the ring programs on every worker
        self.svc: ServiceProcess | None = None  # xdptorch: nicoffload agg serve on the aggregator host
        self.job: Launch | None = None
        self.driven = driven
        self.shared = shared if system in XDP_AGG_SYSTEMS else None
        self.beside_xdp = shared if system == "afxdp" else None  # the engine beside the XDP aggregator
        self.handed: drive.HandedOff | None = None
        self.fifos = [bed.work / f"{system}-fifo{r}" for r in range(self.n)] if driven else []
        self.fds: list[int] = []

    def plan(self) -> dict:
        b, cfg = self.bed, self.bed.cfg
        params = systems.rank_params(b.tb, self.system, cfg, side=self.driven)
        if self.svc is not None:
            params.update(service=self.svc.url, token_file=str(self.svc.token_file))
        return {"system": self.system, "world": self.n, "ips": [w.ip for w in systems.rank_hosts(b.tb, cfg)],
                "hosts": self.hosts, "ranks_per_host": self.k, "shm": self.shm,
                "iface": b.tb.workers[0].iface, "params": params,
                "warmup": cfg.warmup, "reps": cfg.reps, "min_time": cfg.min_time, "max_reps": cfg.max_reps,
                "max_point_s": cfg.max_point_s, "timeout": cfg.timeout,
                "prog_id": self.ap.prog_id if self.ap else None, "mode": self._mode(),
                "prog_ids": self.rp.prog_ids if self.rp else None, "compute": cfg.compute,
                "fifos": [str(f) for f in self.fifos] or None,
                "points": [{"index": pt.index, "inputs": [str(p) for p in b.inputs[pt.index]], "output": str(o)}
                           for pt, o in zip(b.points, self.outputs)]}

    def start(self) -> None:
        b, cfg = self.bed, self.bed.cfg
        if self.system in AGG_SYSTEMS and self.shared is None and not self.local_only:
            try:
                spec = systems.agg_spec(self.system, cfg)
                if self.driven:
                    spec = drive.side_spec(self.system, on_testbed(b.tb, spec))
                engine = {"tx": cfg.afxdp_tx} if self.system == "afxdp" else {}
                if self.beside_xdp is not None:
                    self.handed = drive.HandedOff(b.tb, self.beside_xdp, spec, **engine)
                else:
                    self.ap = AggregatorSet(b.tb, systems.agg_kind(self.system), spec, mode=cfg.mode,
                                            placed=self.driven, **engine)
            except Exception as e:
                self.startup_failure = f"the {self.system} aggregator did not start: {e}"
                raise Abort(self.startup_failure)
        if self.system == "xdptorch":
            try:
                extra = ["--mode", cfg.mode] + ([] if cfg.multicast else ["--no-multicast"])
                self.svc = ServiceProcess(b.tb, write_token(b.work / "service"), extra=extra).start()
            except Exception as e:
                self.startup_failure = f"the aggregator service did not start: {e}"
                raise Abort(self.startup_failure)
        if self.system == "xdpring" and not self.local_only:
            try:
                self.rp = RingPrograms(b.tb, cfg.spec.replace(lanes=32), mode=cfg.mode,
                                       capacity=systems.ring_capacity(cfg))
            except Exception as e:
                self.startup_failure = f"the ring programs did not load: {e}"
                raise Abort(self.startup_failure)
        b.meta["links"][self.system] = link_state(b.tb)
        for f in self.fifos:
            f.unlink(missing_ok=True)
            os.mkfifo(f, 0o600)
        plan = self.plan()
        path = b.work / f"{self.system}-plan.json"
        path.write_text(json.dumps(plan))
        each = f" ({self.k} in each of {self.hosts} hosts)" if self.k > 1 else ""
        b.prog.note(f"{self.system}: starting {self.n} ranks{each} on {b.rate} x{self.hosts}")
        self.job = Launch(b.tb, systems.rank_specs(b.tb, self.system, path, plan["params"], b.work, cfg))

    # --- driven: the sweep hands out the reps ------------------------------------------------
    def _line(self, timeout: float) -> dict:
        """The next JSON line of any rank; Failed when a rank ends or none says anything in time."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                _, line = self.job.next_line(deadline - time.monotonic())
            except queue.Empty:
                raise Failed(f"{self.system} made no progress within {timeout:.0f}s") from None
            if line is None:
                time.sleep(0.2)
                raise Failed(self._errors() or f"a {self.system} rank exited before finishing")
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue

    def _limit(self) -> float:
        cfg = self.bed.cfg
        return max(120.0, 3 * cfg.max_point_s + 4 * cfg.timeout)

    def wait_ready(self) -> None:
        ready: set[int] = set()
        while len(ready) < self.n:
            d = self._line(self.bed.cfg.start_timeout)
            if d.get("ready"):
                ready.add(d["rank"])
        self.fds = [os.open(f, os.O_RDWR) for f in self.fifos]  # the ranks hold the other ends

    def rep(self, token: bytes) -> float:
        """One rep of every rank (drive.WARM or drive.REP); the slowest rank's time."""
        for fd in self.fds:
            os.write(fd, token)
        ts: dict[int, float] = {}
        while len(ts) < self.n:
            d = self._line(self._limit())
            if "rep" in d:
                ts[d["rank"]] = d["t"]
        return max(ts.values())

    def end_point(self, pt: Point, window: drive.Window) -> None:
        """The point is over: every rank's record of it, with the sweep's readings, as a row."""
        for fd in self.fds:
            os.write(fd, drive.NEXT)
        recs: list[dict] = []
        while len(recs) < self.n:
            d = self._line(self._limit())
            if "point" in d:
                recs.append(d)
        recs.sort(key=lambda d: d["rank"])
        recs[0].update(window.record())
        b = self.bed
        self.rows[pt.index] = r = report.measured_row(self.system, self.hosts, pt, b.rate, b.rbps, recs, self.k,
                                                      b.agg_bps)
        b.prog.row(r)

    def fail(self, why: str) -> None:
        self.failure = why
        if self.job is not None:
            self.job.stop()

    @property
    def rank0_pid(self) -> int:
        return self.job.procs[0].pid

    @property
    def prog_ids(self) -> list[int]:
        """The XDP programs whose run time the system's rows count."""
        if self.shared is not None:
            return self.shared.prog_ids
        if self.rp is not None:
            return list(self.rp.prog_ids)
        if self.ap is not None and self.ap.prog_id:
            return [p.prog_id for p in self.ap.procs]
        return []

    def _record(self, d: dict, pending: dict[int, list[dict]]) -> None:
        recs = pending.setdefault(d["point"], [])
        recs.append(d)
        if len(recs) == self.n:
            b = self.bed
            pt = b.points[d["point"]]
            self.rows[pt.index] = r = report.measured_row(self.system, self.hosts, pt, b.rate, b.rbps, recs, self.k,
                                                          b.agg_bps)
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
        if self.shared is not None:
            return self.shared.mode
        if self.handed is not None:
            return "afxdp"
        return self.ap.mode if self.ap else self.rp.mode if self.rp else None

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for f in self.fifos:
            f.unlink(missing_ok=True)
        if self.shared is not None:
            b = self.bed
            b.meta.setdefault("aggregator_stats", {}).setdefault(self.system, []).append(
                {"workers": self.hosts, "rate": b.rate, "stats": self.shared.stats(self.system)})
        if self.svc is not None:
            try:
                self.svc.stop()
            except Exception:
                pass
        if self.rp is not None:
            b = self.bed
            stats = self.rp.close()
            b.meta.setdefault("ring_stats", {}).setdefault(self.system, []).append(
                {"workers": self.hosts, "rate": b.rate, "stats": stats})
        if self.handed is not None:
            b = self.bed
            try:
                info = self.handed.engine_info
                entry = {"workers": self.hosts, "rate": b.rate, "stats": self.handed.close(), "engines": info,
                         "beside": "the XDP aggregator (its program steers the job's frames to the engine)"}
                b.meta.setdefault("aggregator_stats", {}).setdefault(self.system, []).append(entry)
            except Exception:
                pass
            self.handed = None
        if self.ap is not None:
            b = self.bed
            try:
                entry = {"workers": self.hosts, "rate": b.rate, "stats": self.ap.close()}
                if self.ap.kind == "afxdp":  # what each engine said at start, and its own counters
                    entry["engines"] = [{**p.engine_info, "counters": p.engine_counters} for p in self.ap.procs]
                b.meta.setdefault("aggregator_stats", {}).setdefault(self.system, []).append(entry)
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
                r = report.row(self.system, self.hosts, pt, b.rate, b.rbps, self.k, b.agg_bps, status="error",
                               reason=self.failure or "no result")
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
        except Abort as e:
            self.failure = str(e)
        finally:
            self.stop()
        return self.finish(), self.startup_failure
