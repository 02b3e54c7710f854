"""One rank of a ``nicoffload bench`` run: ``python -m nicoffload.lab.bench.ranks --system S --plan FILE
[--rank R]``. An adapter per system gives the same two calls (an AllReduce into ``out``, and a
one-element AllReduce that is the barrier and carries rank 0's decision to go on); the rank goes
through every point of the plan with them (:mod:`.adapters`) and prints one JSON line per point.

Per point every rank loads its input, runs ``warmup`` untimed AllReduces, then timed ones: each
is preceded by the one-element AllReduce (at least ``reps`` reps and ``min_time`` seconds, at
most ``max_reps`` and ``max_point_s``). Rank 0 reads /proc/stat (the whole machine: every rank,
the aggregator, softirqs), worker 0's interface bytes and the XDP program's bpf stats just
before the first timed rep and just after the final barrier.

Driven (the plan names a FIFO per rank: the sweep interleaves the systems of a testbed rep by
rep): the sweep writes a token per rep into every rank's FIFO, each rank runs that rep and says
so on stdout, and the sweep takes the readings around each rep itself (run_driven_point).

A rank that fails says why on stderr and exits with its error class's code (1 for anything else).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from nicoffload.lab import counters
from nicoffload.lab.bench.adapters import Adapter
from nicoffload.lab.bench.hostranks import make_adapter
from nicoffload.lab.bench.plan import SYSTEMS

#: seconds every rank measures its compute loop with nothing else running (plan["compute"])
IDLE_S = 1.0


# --- one point ------------------------------------------------------------------------------
class _Window:
    """Rank 0's readings around the timed reps: CPU ticks, interface bytes, BPF run time."""

    def __init__(self, plan: dict):
        self.iface, self.prog_id = plan["iface"], plan.get("prog_id")
        self.prog_ids = plan.get("prog_ids") or ([self.prog_id] if self.prog_id else [])
        self.bpf0 = self._bpf()
        self.net0 = counters.iface_bytes(self.iface)
        self.cpu0 = counters.cpu_ticks()
        self.t0 = time.monotonic()

    def _bpf(self) -> tuple[int, int] | None:
        """(run_time_ns, run_cnt) of the system's XDP programs together (the ring: every node's)."""
        got = [counters.bpf_runtime(p) for p in self.prog_ids]
        if not got or any(g is None for g in got):
            return None
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def close(self) -> dict:
        cpu1, t1 = counters.cpu_ticks(), time.monotonic()
        net = counters.delta(counters.iface_bytes(self.iface), self.net0)
        bpf = counters.delta(self._bpf(), self.bpf0)
        hz = os.sysconf("SC_CLK_TCK")
        rec = {"cpu_busy_s": (cpu1[0] - self.cpu0[0]) / hz, "cpu_all_s": (cpu1[1] - self.cpu0[1]) / hz,
               "window_s": t1 - self.t0}
        if bpf:
            rec["bpf_ns"], rec["bpf_cnt"] = bpf
        if net:
            rec["rx_bytes"], rec["tx_bytes"] = net
        return rec


def _go_on(plan: dict, done: int, elapsed: float) -> bool:
    """Rank 0's decision: another rep of this point?"""
    if not done:
        return True
    return done < plan["max_reps"] and elapsed < plan["max_point_s"] and \
        (done < plan["reps"] or elapsed < plan["min_time"])


def run_point(a: Adapter, x: np.ndarray, out: np.ndarray, lead: bool, plan: dict, loop=None) -> dict:
    """Warm-up, then timed reps, each behind a one-element AllReduce (barrier + rank 0's go-on).
    Every rank also reports its own process's CPU time over the reps; with a compute ``loop``
    (:class:`~nicoffload.lab.bench.compute.ComputeLoop`), its rate while every rank idles and while
    the reps run."""
    for _ in range(plan["warmup"]):
        a.flag(1)
        a.prepare(x, out)
        a.allreduce(x, out)
        a.collect(out)
    c_before = a.counters()
    if loop is not None:
        a.flag(0)
        loop.idle_rate(IDLE_S)
        a.flag(0)
    window = _Window(plan) if lead else None
    cpu0, k0, t00 = time.process_time(), loop.count() if loop else 0, time.monotonic()
    times: list[float] = []
    while a.flag(int(_go_on(plan, len(times), window.elapsed())) if lead else 0):
        a.prepare(x, out)
        t0 = time.perf_counter()
        a.allreduce(x, out)
        times.append(time.perf_counter() - t0)
        a.collect(out)
    rec: dict = {"times": times, "proc_cpu_s": time.process_time() - cpu0, **(window.close() if lead else {})}
    if loop is not None:
        busy = (loop.count() - k0) / (time.monotonic() - t00)
        a.flag(0)  # idle once more after the reps: a window some other work spoiled must not be the baseline
        idle = loop.idle_rate(IDLE_S)
        a.flag(0)
        rec["compute_idle"], rec["compute_busy"] = idle, busy
    c_after = a.counters()
    if c_after:
        rec["counters"] = {k: c_after[k] - c_before.get(k, 0) for k in c_after}
    return rec


# --- driven by the sweep (systems interleaved rep by rep) ------------------------------------
#: tokens the sweep writes into a rank's FIFO: a warm-up rep, a timed rep, the point is over
WARM, REP, NEXT = b"w", b"r", b"n"


def _token(fd: int) -> bytes:
    t = os.read(fd, 1)
    if not t:
        raise RuntimeError("the bench's driver went away")
    return t


def run_driven_point(a: Adapter, x: np.ndarray, out: np.ndarray, fd: int, index: int) -> dict:
    """One point with the sweep deciding every rep (``WARM``/``REP`` tokens from the FIFO ``fd``,
    ``NEXT`` ends the point): each rep is the one-element AllReduce (a barrier), then the timed
    AllReduce; after each, a line {"rep": index, "rank", "t"} tells the sweep this rank is done,
    so that the next system's rep starts on an idle machine. Returns the point's record."""
    times: list[float] = []
    cpu = 0.0
    c_before = a.counters()
    while True:
        tok = _token(fd)
        if tok == NEXT:
            break
        if tok not in (WARM, REP):
            raise RuntimeError(f"unknown token {tok!r} from the bench's driver")
        c0 = time.process_time()
        a.flag(1)
        a.prepare(x, out)
        t0 = time.perf_counter()
        a.allreduce(x, out)
        t = time.perf_counter() - t0
        a.collect(out)
        if tok == REP:
            times.append(t)
            cpu += time.process_time() - c0
        a.emit({"rep": index, "rank": a.rank, "t": t, "warm": tok == WARM})
    rec: dict = {"times": times, "proc_cpu_s": cpu}
    c_after = a.counters()
    if c_after:
        rec["counters"] = {k: c_after[k] - c_before.get(k, 0) for k in c_after}
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nicoffload.lab.bench.ranks",
                                description="internal: one rank of a `nicoffload bench` run")
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--rank", type=int, default=None, help="(not for mpi: the rank comes from MPI)")
    args = p.parse_args(argv)
    where = os.environ.get("NICOFFLOAD_BENCH_PROFILE")
    return _profiled(args, where) if where else _run(args)


def _run(args: argparse.Namespace) -> int:
    plan = json.loads(args.plan.read_text())
    loop = None
    try:
        if plan.get("compute"):
            from nicoffload.lab.bench.compute import ComputeLoop

            loop = ComputeLoop()
        a = make_adapter(plan, args.rank)
        fd = os.open(plan["fifos"][a.rank], os.O_RDWR) if plan.get("fifos") else None  # O_RDWR: never blocks
        a.emit({"ready": True, "rank": a.rank})
        for pt in plan["points"]:
            x = np.load(pt["inputs"][a.rank], allow_pickle=False)
            out = np.empty_like(x)
            if fd is not None:
                rec = run_driven_point(a, x, out, fd, pt["index"])
            else:
                rec = run_point(a, x, out, a.rank == 0, plan, loop)
            if a.rank == 0 and pt.get("output"):
                np.save(pt["output"], out)
            a.emit({"point": pt["index"], "rank": a.rank, **rec})
            del x, out
        a.close()
    except Exception as e:
        print(f"{args.system} rank {args.rank if args.rank is not None else '?'}: {e.__class__.__name__}: {e}",
              file=sys.stderr, flush=True)
        if args.system == "mpi":
            _mpi_abort()
        return getattr(e, "exit_code", 1)
    finally:
        if loop is not None:
            loop.close()
    return 0


def _mpi_abort() -> None:
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    except Exception:
        pass


def _profiled(args: argparse.Namespace, where: str) -> int:
    """The rank under cProfile (NICOFFLOAD_BENCH_PROFILE names the folder): it writes
    ``<system>-rank<R>.prof`` there (read it with ``python -m pstats``), also when the sweep
    ends it with SIGTERM, as it ends driven ranks, and when it fails."""
    import cProfile
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave through ``finally``
    prof = cProfile.Profile()
    try:
        return prof.runcall(_run, args)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the dump short
        os.makedirs(where, exist_ok=True)
        rank = args.rank if args.rank is not None else os.getpid()
        prof.dump_stats(os.path.join(where, f"{args.system}-rank{rank}.prof"))


if __name__ == "__main__":
    sys.exit(main())
