"""Run an AllReduce job on a namespace testbed: the aggregator (XDP or user-space) on the
aggregator host, one ``nicoffload worker`` process per worker host, results gathered.
Shared by ``nicoffload allreduce``, ``demo`` and ``bench``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from . import bpf, libbpf, proto
from .errors import NicoffloadError, TimeoutError_

PY = [sys.executable, "-m", "nicoffload.cli"]


def enable_gro(tb) -> None:
    """GRO on every worker's interface: veth then runs NAPI and UDP_GRO hands the worker
    batches of results (one receive for many datagrams)."""
    from pyroute2.ethtool import Ethtool

    for w in tb.workers:
        with bpf.netns(w.netns):
            e = Ethtool()
            try:
                f = e.get_features(w.iface)
                if "rx-gro" in f.features and not f.features["rx-gro"].enable:
                    f.features["rx-gro"].enable = True
                    e.set_features(w.iface, f)
            finally:
                e.close()


@dataclass
class JobResult:
    aggregator: str
    workers: int
    rep_seconds: list[float]            # per rep, the slowest rank's time
    ranks: list[dict]                   # each worker's JSON report
    agg_stats: dict = field(default_factory=dict)
    agg_bpf_ns: int | None = None       # in-kernel run time of the XDP program (bpf stats)
    agg_bpf_cnt: int | None = None
    mode: str | None = None             # XDP attach mode of the aggregator

    @property
    def seconds(self) -> float:
        return float(np.median(self.rep_seconds))

    def totals(self, key: str) -> int:
        return int(sum(r["stats"].get(key, 0) for r in self.ranks))


class AggregatorProcess:
    """The aggregator side of a job: ``xdp`` (loaded and attached here) or ``userspace``
    (a process on the aggregator host)."""

    def __init__(self, tb, kind: str, slots: int, elems: int, job: int = 1, mode: str = "auto"):
        self.tb, self.kind = tb, kind
        self.agg = None
        self.proc = None
        n = len(tb.workers)
        ips = [w.ip for w in tb.workers]
        a = tb.agg
        if kind == "xdp":
            from .aggregator import AggSpec, Aggregator, resolve_mode

            mode, _why = resolve_mode(mode, a.iface, a.netns)
            tb.set_agg_napi(mode == "native")  # native XDP_TX on veth needs it; generic must not have it
            self.agg = Aggregator.load(AggSpec(a.netns, a.iface, n, slots, elems, tb.port, mode, job,
                                               tb.mcast_group, ips))
        elif kind == "userspace":
            argv = PY + ["aggregator-userspace", "--workers", str(n), "--slots", str(slots),
                         "--elems", str(elems), "--port", str(tb.port), "--job", str(job),
                         "--group", tb.mcast_group, "--local-ip", a.ip, "--json"]
            for ip in ips:
                argv += ["--worker-ip", ip]
            self.proc = tb.popen("agg", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = self.proc.stdout.readline()
            if "ready" not in line:
                err = self.proc.stderr.read() if self.proc.poll() is not None else ""
                raise NicoffloadError(f"the user-space aggregator did not start: {line.strip()} {err.strip()}")
        else:
            raise NicoffloadError(f"unknown aggregator {kind!r}: choose xdp or userspace")

    def bpf_runtime(self) -> tuple[int, int] | None:
        if self.agg is None or not self.agg.spec.prog_id:
            return None
        st = libbpf.prog_stats(self.agg.spec.prog_id)
        return st.run_time_ns, st.run_cnt

    def stats(self) -> dict:
        return self.agg.stats() if self.agg is not None else {}

    def close(self) -> dict:
        st: dict = {}
        if self.agg is not None:
            try:
                st = self.agg.stats()
            finally:
                self.agg.close()
                self.agg = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                out, _ = self.proc.communicate(timeout=10)
                for line in out.splitlines():
                    if line.startswith("{"):
                        st = json.loads(line).get("stats", st)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
            self.proc = None
        return st

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_workers(tb, inputs: Sequence[Path], outputs: Sequence[Path | None], *, reps: int = 1,
                elems: int = proto.DEFAULT_ELEMS, slots: int = 1024, window: int | None = None,
                timeout: float = 10.0, sparse: bool = True, job: int = 1,
                deadline: float | None = None, pin_cpus: bool = False,
                ranks: Sequence[int] | None = None) -> list[dict]:
    """Start one worker process per worker host and wait for all; return their JSON reports.
    A worker that fails makes this raise with its rank and its own error message."""
    procs = []
    ncpu = os.cpu_count() or 1
    for w, inp, out in zip(tb.workers, inputs, outputs):
        if ranks is not None and w.rank not in ranks:
            continue  # a rank that never shows up (tests of the timeout path)
        pin = ["taskset", "-c", str(w.rank % ncpu)] if pin_cpus else []
        argv = pin + PY + ["worker", "--rank", str(w.rank), "--world", str(len(tb.workers)),
                     "--aggregator", tb.agg.ip, "--group", tb.mcast_group, "--local-ip", w.ip,
                     "--port", str(tb.port), "--job", str(job), "--input", str(inp),
                     "--elems", str(elems), "--slots", str(slots), "--timeout", str(timeout),
                     "--reps", str(reps), "--json"]
        if out is not None:
            argv += ["--output", str(out)]
        if window:
            argv += ["--window", str(window)]
        if not sparse:
            argv += ["--dense"]
        procs.append((w, tb.popen(w, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    limit = deadline or (time.monotonic() + timeout * (reps + 2) + 60)
    reports, failures = [], []
    for w, p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failures.append(f"rank {w.rank} did not finish in time")
            continue
        if p.returncode != 0:
            msg = (err.strip().splitlines() or ["(no message)"])[-1]
            failures.append(f"rank {w.rank} failed: {msg.removeprefix('nicoffload: error: ')}")
            continue
        line = [x for x in out.splitlines() if x.startswith("{")]
        reports.append(json.loads(line[-1]))
    if failures:
        raise TimeoutError_("; ".join(failures)) if all("time" in f for f in failures) \
            else NicoffloadError("; ".join(failures))
    return reports


def run_job(tb, inputs: Sequence[Path], outputs: Sequence[Path | None], aggregator: str = "xdp",
            **kw) -> JobResult:
    enable_gro(tb)
    mode = kw.pop("mode", "auto")
    with AggregatorProcess(tb, aggregator, kw.get("slots", 1024), kw.get("elems", proto.DEFAULT_ELEMS),
                           kw.get("job", 1), mode=mode) as ap:
        before = ap.bpf_runtime()
        mode = ap.agg.spec.mode if ap.agg is not None else None
        reports = run_workers(tb, inputs, outputs, **kw)
        after = ap.bpf_runtime()
        stats = ap.close()
    reps = len(reports[0]["times"])
    rep_seconds = [max(r["times"][i] for r in reports) for i in range(reps)]
    res = JobResult(aggregator, len(tb.workers), rep_seconds, sorted(reports, key=lambda r: r["rank"]), stats,
                    mode=mode)
    if before and after:
        res.agg_bpf_ns, res.agg_bpf_cnt = after[0] - before[0], after[1] - before[1]
    return res


def tempdir() -> tempfile.TemporaryDirectory:
    base = Path(os.environ.get("NICOFFLOAD_TMP", "/tmp"))
    return tempfile.TemporaryDirectory(prefix="nicoffload-", dir=base)
