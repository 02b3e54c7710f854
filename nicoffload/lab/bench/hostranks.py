"""K ranks in each worker host (``nicoffload bench --ranks-per-host K``): the adapter a rank of a
nicoffload system drives there, and which adapter a rank of the plan gets.

Ranks hK .. hK+K-1 run in worker h (:func:`~nicoffload.lab.bench.systems.rank_hosts`). A rank of
xdp or xdp16 builds a :class:`~nicoffload.local.host.HostCommunicator`, as the torch backend does
under ``torchrun --nproc-per-node K``: one HostGroup per host (named after the system's run, so
two runs or two systems never meet in /dev/shm), and for local rank j, where there are several
hosts, lane j: a Communicator of one rank per host on the job ``params["lane_specs"][j]`` (the
sweep loaded every lane's job on its XDP aggregator: drive.lane_spec). With one host there is no
lane and no aggregator: the shared memory path alone. xdpring and udpring have one lane, local
rank 0's node of the ring of the hosts (as the backend's ``NICOFFLOAD_MODE=ring``). gloo needs
nothing of this: its K ranks per namespace are one process group of every rank, placed as torch
places them.
"""
from __future__ import annotations

import numpy as np

from nicoffload.lab.bench.adapters import ADAPTERS, Adapter
from nicoffload.lab.bench.plan import AGG_SYSTEMS, RING_SYSTEMS
from nicoffload.lab.bench.systems import job_spec


#: seconds a ring lane waits for the other hosts' nodes without progress (their first call compiles)
RING_FIRST_CALL_S = 120.0


class HostRanks(Adapter):
    """Rank ``rank`` of a nicoffload aggregator system with ``plan["ranks_per_host"]`` ranks per
    host: shared memory inside the host, its lane across hosts."""

    def __init__(self, plan: dict, rank: int):
        from nicoffload.local.host import HostCommunicator
        from nicoffload.local.segment import HostGroup

        K, H, p = plan["ranks_per_host"], plan["hosts"], plan["params"]
        h, me = divmod(rank, K)
        spec = job_spec(p)
        ring = plan["system"] in RING_SYSTEMS
        L = 1 if ring else K
        self.rank, self.lanes = rank, (16 if spec.lanes == 16 else None)
        host = HostGroup(f"{plan['shm']}-h{h}", me, [h * K + j for j in range(K)], float(plan["timeout"]))
        lane = None
        try:
            if H > 1 and me < L:
                lane = _ring_lane(p, h, H) if ring else _job_lane(p, h, H, me, plan["ips"][rank])
            self.c = HostCommunicator(rank, plan["world"], host, H, h, L, elems=spec.elems, lane=lane)
        except BaseException:
            if lane is not None:
                lane.close()
            host.close()
            raise
        self._one = np.zeros(1, dtype=np.int32)

    def allreduce(self, x, out):
        self.c.allreduce(x, out=out, lanes=self.lanes)

    def flag(self, v):
        self._one[0] = v
        return int(self.c.allreduce(self._one)[0])

    def counters(self):
        s = self.c.stats
        return {"packets": s.packets_sent, "retransmissions": s.retransmissions}

    def close(self):
        self.c.close()


def _job_lane(p: dict, h: int, H: int, j: int, ip: str):
    """Lane j of host h: its rank of lane j's job at the aggregator."""
    from nicoffload.communicators import communicator
    from nicoffload.jobspec import JobSpec

    return communicator(h, H, mode="aggregator", aggregator=p["aggregator"], spec=JobSpec.from_dict(p["lane_specs"][j]),
                        local_ip=ip)


def _ring_lane(p: dict, h: int, H: int):
    """The one lane of host h in a ring mode: its node of the ring of the hosts (xdpring: the
    ring programs the sweep loaded on every worker; udpring: in user space)."""
    from nicoffload.ring.comm import RingCommunicator

    # the passes' kernels compile at their first use (30 s and more on a loaded VM, the first time, one host
    # sooner than the other): here, before the rank says it is ready, with time for the other hosts to
    # compile too, not in a call whose local peers wait for it at a barrier
    spec = job_spec(p)
    spec = spec.replace(timeout=max(spec.timeout, RING_FIRST_CALL_S))
    ring = RingCommunicator.from_spec(h, H, p["peers"], spec, offload=p["offload"], capacity=p["capacity"])
    try:
        for op in ("max", "sum"):
            ring.allreduce(np.zeros(4 * H, np.int32), op=op)
    except BaseException:
        ring.close()
        raise
    return ring


def make_adapter(plan: dict, rank: int | None) -> Adapter:
    """The adapter of rank ``rank`` of ``plan``: a host's rank (:class:`HostRanks`) for a
    nicoffload system with several ranks per host, else the system's own."""
    if plan.get("ranks_per_host", 1) > 1 and plan["system"] in AGG_SYSTEMS + RING_SYSTEMS:
        return HostRanks(plan, rank)
    return ADAPTERS[plan["system"]](plan, rank)
