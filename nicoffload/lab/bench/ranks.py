"""One rank of a ``nicoffload bench`` run: ``python -m nicoffload.lab.bench.ranks --system S --plan FILE
[--rank R]``. An adapter per system gives the same two calls (an AllReduce into ``out``, and a
one-element AllReduce that is the barrier and carries rank 0's decision to go on); the rank goes
through every point of the plan with them and prints one JSON line per point.

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
import socket
import sys
import time
from pathlib import Path

import numpy as np

from nicoffload.lab import counters
from nicoffload.lab.bench.plan import SYSTEMS
from nicoffload.lab.bench.systems import job_spec


class _Adapter:
    rank: int

    def prepare(self, x: np.ndarray, out: np.ndarray) -> None:
        """Before each timed AllReduce, untimed: what a system that reduces in place needs (the
        input copied into the buffer it reduces)."""

    def allreduce(self, x: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def collect(self, out: np.ndarray) -> None:
        """After each timed AllReduce, untimed: what a system that reduces into a buffer of its
        own needs (the result copied into ``out``)."""

    def flag(self, v: int) -> int:
        raise NotImplementedError

    def emit(self, rec: dict) -> None:
        print(json.dumps(rec), flush=True)

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Nicoffload(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from nicoffload.communicators import communicator

        p = plan["params"]
        self.rank = rank
        # several aggregators (comma-separated): a job sharded over them
        self.c = communicator(rank, plan["world"], aggregator=p["aggregator"], spec=job_spec(p),
                              local_ip=plan["ips"][rank])
        self._one = np.zeros(1, dtype=np.int32)

    def allreduce(self, x, out):
        self.c.allreduce(x, out=out)

    def flag(self, v):
        self._one[0] = v
        return int(self.c.allreduce(self._one)[0])

    def counters(self):
        s = self.c.stats
        return {"packets": s.packets_sent, "retransmissions": s.retransmissions}

    def close(self):
        self.c.close()


class _Ring(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from nicoffload.lab.bench.tcpring import RingComm

        self.rank = rank
        self.r = RingComm(rank, plan["world"], plan["ips"], plan["params"]["port"], plan["timeout"])
        self._f = np.zeros(plan["world"], dtype=np.int32)

    def allreduce(self, x, out):
        self.r.allreduce(x, out)

    def flag(self, v):
        self._f[:] = 0
        self._f[0] = v
        return int(self.r.allreduce(self._f)[0])

    def close(self):
        self.r.close()


class _RingMode(_Nicoffload):
    """nicoffload's ring mode: the ring offload (xdpring; the ring programs are loaded by the
    sweep) or the user-space UDP ring (udpring); the same calls as the aggregator mode's."""

    def __init__(self, plan: dict, rank: int):
        from nicoffload.ring.comm import RingCommunicator

        p = plan["params"]
        self.rank = rank
        self.c = RingCommunicator.from_spec(rank, plan["world"], p["peers"], job_spec(p), offload=p["offload"],
                                            capacity=p["capacity"])
        self._one = np.zeros(1, dtype=np.int32)


class _Gloo(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        self.rank, self.torch, self.dist = rank, torch, dist
        # one thread per rank (ranks share the machine): torch's pool would spin between calls, on
        # the cores the next system of an interleaved sweep runs on
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=plan["world"],
                                timeout=timedelta(seconds=max(60.0, plan["timeout"] * 3)))
        self._f = torch.zeros(1, dtype=torch.int32)

    def prepare(self, x, out):
        np.copyto(out, x)  # gloo reduces in place: the timed call is the all_reduce alone

    def allreduce(self, x, out):
        self.dist.all_reduce(self.torch.from_numpy(out))

    def flag(self, v):
        self._f[0] = v
        self.dist.all_reduce(self._f)
        return int(self._f[0])

    def close(self):
        self.dist.destroy_process_group()


class _GlooHalf(_Gloo):
    """gloo all-reducing a half-precision copy of the gradients (bfloat16 or float16), as DDP's
    compress hooks do; the casts in and out are untimed (prepare, collect)."""

    def __init__(self, plan: dict, rank: int):
        super().__init__(plan, rank)
        from nicoffload.lab.bench.plan import HALF_GLOO

        self._dtype = getattr(self.torch, HALF_GLOO[plan["system"]])
        self._buf = None

    def prepare(self, x, out):
        t = self.torch.from_numpy(x)
        if self._buf is None or self._buf.numel() != t.numel():
            self._buf = self.torch.empty(t.shape, dtype=self._dtype)
        self._buf.copy_(t)

    def allreduce(self, x, out):
        self.dist.all_reduce(self._buf)

    def collect(self, out):
        self.torch.from_numpy(out).copy_(self._buf)


class _Torch(_Gloo):
    """torch.distributed with the backend "nicoffload" (the service's job); like gloo's adapter,
    the input is copied into the tensor reduced in place."""

    def __init__(self, plan: dict, rank: int):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        import nicoffload.torch  # noqa: F401  (registers the backend)

        self.rank, self.torch, self.dist = rank, torch, dist
        torch.set_num_threads(1)
        dist.init_process_group("nicoffload", rank=rank, world_size=plan["world"],
                                timeout=timedelta(seconds=max(60.0, plan["timeout"] * 3)))
        self._f = torch.zeros(1, dtype=torch.int32)

    def counters(self):
        c = self.dist.distributed_c10d._get_default_group().comm
        return {"packets": c.stats.packets_sent, "retransmissions": c.stats.retransmissions}


class _Mpi(_Adapter):
    def __init__(self, plan: dict, rank: int | None):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        if self.comm.Get_size() != plan["world"]:
            raise RuntimeError(f"mpirun started {self.comm.Get_size()} ranks, the plan has {plan['world']}")
        _check_local_ip(plan["ips"][self.rank], f"MPI rank {self.rank}")
        self._f, self._g = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)

    def allreduce(self, x, out):
        self.comm.Allreduce(x, out, op=self.MPI.SUM)

    def flag(self, v):
        self._f[0] = v
        self.comm.Allreduce(self._f, self._g, op=self.MPI.SUM)
        return int(self._g[0])

    def emit(self, rec):
        # mpirun merges every rank's stdout: gather to rank 0, which prints whole lines
        recs = self.comm.gather(rec, root=0)
        if self.rank == 0:
            for r in recs:
                print(json.dumps(r), flush=True)


def _check_local_ip(ip: str, who: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((ip, 0))
    except OSError:
        raise RuntimeError(f"{who} is not on the host with address {ip} (placement went wrong)") from None
    finally:
        s.close()


ADAPTERS = {"xdp": _Nicoffload, "afxdp": _Nicoffload, "userspace": _Nicoffload, "ring": _Ring, "gloo": _Gloo,
            "mpi": _Mpi, "xdpring": _RingMode, "udpring": _RingMode, "xdptorch": _Torch, "xdpuni": _Nicoffload,
            "xdp16": _Nicoffload, "gloobf16": _GlooHalf, "gloofp16": _GlooHalf}
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


def run_point(a: _Adapter, x: np.ndarray, out: np.ndarray, lead: bool, plan: dict, loop=None) -> dict:
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


def run_driven_point(a: _Adapter, x: np.ndarray, out: np.ndarray, fd: int, index: int) -> dict:
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
    plan = json.loads(args.plan.read_text())
    loop = None
    try:
        if plan.get("compute"):
            from nicoffload.lab.bench.compute import ComputeLoop

            loop = ComputeLoop()
        a = ADAPTERS[args.system](plan, args.rank)
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


if __name__ == "__main__":
    sys.exit(main())
