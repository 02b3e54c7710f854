"""Several jobs on one XDP aggregator at once (``nicoffload bench --tenants 1,2,4``): for each
count J, J jobs of the same shape (``workers`` ranks on their own hosts, an equal share of the
slot pool, a group each) run the same AllReduce ``reps`` times at the same moment; each job's
results are checked against the reference, and the aggregate throughput of the J jobs is set
against one job alone on the same testbed and aggregator.

Throughput of a job: bytes of its tensor per AllReduce over the median time of its calls; the
aggregate is the sum over the jobs. On one machine every rank, the bridge and the aggregator
share the CPUs, so the aggregate shows what the shared aggregator costs, not what a switch
with dedicated hosts would give.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nicoffload.agg.control import Aggregator, AggSpec

from ..errors import InputError
from ..jobspec import DEFAULT
from . import reference
from .inputs import make_gradients
from .jobs import tempdir
from .launcher import CLI, Launch, RankSpec, failure
from .links import enable_gro


@dataclass
class TenantRow:
    jobs: int
    workers: int
    nbytes: int
    seconds: list[float]                 # per job: median time of one AllReduce
    exact: bool
    aggregate_gbps: float = 0.0          # sum over the jobs of bytes / median time, in Gbit/s
    per_job_gbps: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def _argv(tb, host, job: int, rank: int, world: int, slots: int, inp: Path, out: Path, reps: int,
          timeout: float) -> list[str]:
    return CLI + ["worker", "--rank", str(rank), "--world", str(world), "--aggregator", tb.agg.ip,
                  "--local-ip", host.ip, "--input", str(inp), "--output", str(out), "--reps", str(reps), "--json",
                  "--job", str(job), "--group", tb.topology.group_of(job), "--port", str(tb.port),
                  "--slots", str(slots), "--timeout", str(timeout)]


def run_jobs_at_once(tb, agg: Aggregator, jobs: int, workers: int, nbytes: int, reps: int, slots: int,
                     seed: int, work: Path, timeout: float = DEFAULT.timeout) -> TenantRow:
    """Register ``jobs`` jobs on ``agg`` (each ``workers`` hosts of its own, ``slots`` slots),
    run them at once, check every rank's result, remove the jobs; one row."""
    hosts = tb.workers
    if jobs * workers > len(hosts):
        raise InputError(f"{jobs} jobs of {workers} workers need {jobs * workers} worker hosts; the testbed has "
                         f"{len(hosts)}")
    n = nbytes // 4
    specs, expect = [], {}
    for j in range(1, jobs + 1):
        mine = hosts[(j - 1) * workers:j * workers]
        agg.add_job(j, workers, tb.topology.group_of(j), [h.ip for h in mine], slots=slots)
        arrays = make_gradients(workers, n, 0.0, seed + j)
        expect[j] = reference.quantized(arrays)
        for r, (h, a) in enumerate(zip(mine, arrays)):
            inp, out = work / f"j{j}r{r}.npy", work / f"j{j}r{r}.out.npy"
            np.save(inp, a)
            specs.append((j, r, out, RankSpec(f"job {j} rank {r}", h,
                                              _argv(tb, h, j, r, workers, slots, inp, out, reps, timeout))))
    try:
        with Launch(tb, [s for *_, s in specs]) as launch:
            outcomes = launch.wait(time.monotonic() + timeout * (reps + 2) + 60)
        err = failure(outcomes, f"{jobs} jobs at once")
        if err is not None:
            raise err
        per_job: dict[int, list[float]] = {}
        exact = True
        for (j, r, out, _), o in zip(specs, outcomes):
            report = json.loads(o.json_lines()[-1])
            per_job.setdefault(j, []).append(report["times"])
            exact &= expect[j].check(np.load(out)).within_bound
        # a job's call takes as long as its slowest rank's
        seconds = [float(np.median(np.max(np.array(t), axis=0))) for _, t in sorted(per_job.items())]
    finally:
        for j in range(1, jobs + 1):
            agg.remove_job(j)
    gbps = [nbytes * 8 / s / 1e9 for s in seconds]
    return TenantRow(jobs, workers, nbytes, seconds, exact, float(sum(gbps)), gbps)


def run(counts: list[int], workers: int = 2, nbytes: int = 16 << 20, reps: int = 10, seed: int = 0,
        progress=print) -> list[TenantRow]:
    """One testbed of max(counts) * workers worker hosts and one aggregator whose pool holds
    every job of the largest count; each count in turn."""
    from ..testbed.testbed import running

    most = max(counts)
    slots = DEFAULT.slots  # each job's share, the same for every count
    rows = []
    with running(most * workers) as tb, tempdir() as d:
        enable_gro(tb)
        with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=slots * most, port=tb.port)) as agg:
            for jobs in counts:
                row = run_jobs_at_once(tb, agg, jobs, workers, nbytes, reps, slots, seed, Path(d))
                progress(describe_row(row, rows[0] if rows else None))
                rows.append(row)
    return rows


def describe_row(row: TenantRow, alone: TenantRow | None) -> str:
    ms = ", ".join(f"{s * 1e3:.1f}" for s in row.seconds)
    vs = f" ({row.aggregate_gbps / alone.aggregate_gbps:.2f}x one job alone)" if alone else ""
    return (f"{row.jobs} job(s) x {row.workers} workers, {row.nbytes >> 20} MiB float32: per job {ms} ms; "
            f"aggregate {row.aggregate_gbps:.2f} Gbit/s{vs}; {'all exact' if row.exact else 'NOT EXACT'}")
