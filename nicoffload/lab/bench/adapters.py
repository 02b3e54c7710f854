"""The adapter per system that a bench rank (:mod:`.ranks`) drives: each gives the same calls,
an AllReduce into ``out`` (with untimed ``prepare`` and ``collect`` around it where the system
reduces in place or in a buffer of its own), and a one-element AllReduce (``flag``) that is the
barrier and carries rank 0's decision to go on; ``emit`` prints a record, ``counters`` the
system's own (packets, retransmissions).
"""
from __future__ import annotations

import json
import socket

import numpy as np

from nicoffload.lab.bench.systems import job_spec


class Adapter:
    """One system's calls, as a rank of a bench run makes them."""

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


class _Nicoffload(Adapter):
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
        return {"packets": s.packets_sent, "retransmissions": s.retransmissions,  # the ring offload has no
                **{k: getattr(s, k, 0) for k in ("window_cuts", "probes", "timeouts")}}  # window, probes, timers

    def close(self):
        self.c.close()


class _Ring(Adapter):
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


class _Gloo(Adapter):
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


class _Mpi(Adapter):
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
