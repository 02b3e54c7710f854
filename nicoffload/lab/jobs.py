"""One AllReduce job on a namespace testbed: an aggregator (XDP or user-space) on the aggregator
host, one ``nicoffload worker`` process per worker host, their reports gathered. What
``allreduce``, ``demo``, ``agg bench`` and the tests run; :func:`worker_rank` is the worker
process's own side."""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from nicoffload.wire import keys, proto

from ..jobspec import DEFAULT, JobSpec
from . import counters
from .aggregators import AggregatorSet, on_testbed
from .counters import timed_reps
from .launcher import CLI, Launch, RankSpec, failure
from .links import enable_gro


# --- the worker process ---------------------------------------------------------------------
def worker_rank(rank: int, world: int, aggregator: str | None, x: np.ndarray, spec: JobSpec = DEFAULT,
                local_ip: str | None = None, reps: int = 1, peers: Sequence[str] | None = None,
                ring_userspace: bool = False, capacity: int | None = None) -> tuple[np.ndarray, dict]:
    """``reps`` AllReduces of ``x`` as rank ``rank``, each behind a barrier: (the sum, a report
    with each rep's time and the last call's counters). ``spec.mode`` ring: around the ring of
    ``peers`` (the user-space UDP ring with ``ring_userspace``)."""
    from nicoffload.communicators import communicator

    kw = {}
    if spec.mode == "ring":
        kw = {"offload": not ring_userspace, **({"capacity": capacity} if capacity else {})}
    with communicator(rank, world, aggregator=aggregator, peers=peers, spec=spec, local_ip=local_ip, **kw) as c:
        out, times = timed_reps(c, x, reps)
        last = dict(c.last.__dict__)
    return out, {"rank": rank, "times": times, "stats": last, "elements": int(x.size), "dtype": str(x.dtype)}


def describe_rank(report: dict) -> str:
    st = report["stats"]
    return (f"rank {report['rank']}: {report['elements']} {report['dtype']} in {min(report['times']) * 1e3:.1f} ms "
            f"({st['packets_sent']} packets, {st['retransmissions']} retransmitted)")


# --- a job on a testbed ---------------------------------------------------------------------
@dataclass
class JobResult:
    aggregator: str
    workers: int
    rep_seconds: list[float]            # per rep, the slowest rank's time
    ranks: list[dict]                   # each worker's JSON report, by rank
    agg_stats: dict = field(default_factory=dict)  # the aggregator's counters at the end
    agg_bpf_ns: int | None = None       # in-kernel run time of the XDP program (bpf stats)
    agg_bpf_cnt: int | None = None
    mode: str | None = None             # XDP attach mode of the aggregator
    engine: dict = field(default_factory=dict)  # the afxdp engine: how it ran, and its own counters

    @property
    def seconds(self) -> float:
        return float(np.median(self.rep_seconds))

    def totals(self, key: str) -> int:
        return int(sum(r["stats"].get(key, 0) for r in self.ranks))


def _worker_argv(tb, w, spec: JobSpec, inp: Path, out: Path | None, reps: int, pin_cpus: bool,
                 ring_userspace: bool = False, capacity: int | None = None) -> list[str]:
    pin = ["taskset", "-c", str(w.rank % (os.cpu_count() or 1))] if pin_cpus else []
    aggs = ",".join(a.ip for a in tb.aggs)  # several: the job is sharded over them
    argv = pin + CLI + ["worker", "--rank", str(w.rank), "--world", str(len(tb.workers)), "--aggregator", aggs,
                        "--local-ip", w.ip, "--input", str(inp), "--reps", str(reps), "--json", *spec.argv()]
    if spec.mode == "ring":
        argv += ["--peers", ",".join(h.ip for h in tb.workers)] + (["--ring-userspace"] if ring_userspace else []) \
            + (["--capacity", str(capacity)] if capacity else [])
    return argv + (["--output", str(out)] if out is not None else [])


def run_workers(tb, inputs: Sequence[Path], outputs: Sequence[Path | None], spec: JobSpec | None = None, *,
                reps: int = 1, deadline: float | None = None, pin_cpus: bool = False,
                ranks: Sequence[int] | None = None, ring_userspace: bool = False, capacity: int | None = None,
                **fields) -> list[dict]:
    """One worker process per worker host (``ranks``: only these), for the job ``spec`` with
    ``fields`` changed; their JSON reports. Raises one error naming every rank that failed, of
    the class their exit codes say (a rank still running at ``deadline`` is killed: a timeout)."""
    spec = on_testbed(tb, (spec or DEFAULT).replace(**fields))
    specs = [RankSpec(f"rank {w.rank}", w,
                      _worker_argv(tb, w, spec, inp, out, reps, pin_cpus, ring_userspace, capacity))
             for w, inp, out in zip(tb.workers, inputs, outputs) if ranks is None or w.rank in ranks]
    limit = deadline or (time.monotonic() + spec.timeout * (reps + 2) + 60)
    with Launch(tb, specs) as job:
        outcomes = job.wait(limit)
    err = failure(outcomes)
    if err is not None:
        raise err
    return [json.loads(o.json_lines()[-1]) for o in outcomes]


def run_job(tb, inputs: Sequence[Path], outputs: Sequence[Path | None], aggregator: str = "xdp",
            spec: JobSpec | None = None, *, mode: str = "auto", reps: int = 1, engine: dict | None = None,
            **kw) -> JobResult:
    """A fresh ``aggregator`` for this job and its workers (see :func:`run_workers`), with a key
    of its own unless ``spec`` has one (the ring's records carry none); ``engine``: the afxdp
    engine's options (spin_us, tx)."""
    fields = {k: kw.pop(k) for k in list(kw) if k in DEFAULT.to_dict()}
    spec = (spec or DEFAULT).replace(**fields)
    if spec.mode == "aggregator" and not spec.key:
        spec = spec.replace(key=keys.new_key())
    enable_gro(tb)
    with AggregatorSet(tb, aggregator, spec, mode=mode, **(engine or {})) as ap:
        before = ap.bpf_runtime()
        reports = run_workers(tb, inputs, outputs, spec, reps=reps, **kw)
        after = ap.bpf_runtime()
        mode_used = ap.mode
        stats = ap.close()
        p0 = ap.procs[0]
        engine = {**p0.engine_info, "counters": p0.engine_counters} if aggregator == "afxdp" else {}
    nrep = len(reports[0]["times"])
    rep_seconds = [max(r["times"][i] for r in reports) for i in range(nrep)]
    res = JobResult(aggregator, len(tb.workers), rep_seconds, sorted(reports, key=lambda r: r["rank"]), stats,
                    mode=mode_used, engine=engine)
    ran = counters.delta(after, before)
    if ran:
        res.agg_bpf_ns, res.agg_bpf_cnt = ran
    return res


# --- where jobs run -------------------------------------------------------------------------
def testbed(workers: int, elems: int = DEFAULT.elems, **kw):
    """A fresh namespace testbed (context manager) whose MTU fits records of ``elems``."""
    from nicoffload.testbed.testbed import running

    return running(workers, mtu=max(1500, proto.mtu_for_elems(elems)), **kw)


def tempdir() -> tempfile.TemporaryDirectory:
    """A scratch directory for inputs and outputs ($NICOFFLOAD_TMP, else /tmp)."""
    base = Path(os.environ.get("NICOFFLOAD_TMP", "/tmp"))
    return tempfile.TemporaryDirectory(prefix="nicoffload-", dir=base)
