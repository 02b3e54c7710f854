"""The DDP hook's failover (``NicoffloadHookState(..., failover=SECONDS)``): the hook's
Communicator wrapped in the backend's :class:`~nicoffload.torch.failover.Failover`, so a
training job that registered the hook goes on when its aggregator goes away, bit for bit.

What the backend gets from its own process group, the hook takes from the default one (which
DDP needs anyway): the agreement on the call that was cut goes through the default group's
store, and the fallback sums the aggregator's fixed point through a gloo group of its own, made
here (``dist.new_group``: every rank builds its hook state at the same point of the program,
as DDP's ``register_comm_hook`` already requires), so that its calls never interleave with the
user's on the default group. No rejoin: the hook has no service to ask for a job again; a run
that lost its aggregator finishes on the fallback."""
from __future__ import annotations

import torch.distributed as dist

from nicoffload.errors import NicoffloadError
from nicoffload.torch.failover import Failover
from nicoffload.torch.fixedgloo import FixedGloo
from nicoffload.torch.rendezvous import Rendezvous


def watch(failover: float, timeout: float) -> dict:
    """The Communicator's settings under failover: silent ``failover`` seconds means gone, and a
    call returns only once every rank holds its results (what the agreement needs)."""
    return {"silence": min(failover, timeout), "confirm": True}


def with_failover(comm, elems: int, timeout: float) -> Failover:
    """``comm`` (the hook's aggregator Communicator, built with :func:`watch`'s settings) with
    the gloo fallback of the default process group's ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        raise NicoffloadError("the DDP hook's failover agrees through the default process group: call "
                              "torch.distributed.init_process_group first (or leave failover at 0)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (comm.rank, comm.world):
        raise NicoffloadError(f"the DDP hook's failover needs the default group's ranks: the hook is rank "
                              f"{comm.rank} of {comm.world}, the default group says {rank} of {world}")
    store = dist.distributed_c10d._get_default_store()
    gloo = dist.new_group(backend="gloo")
    wait = max(30.0, timeout)
    return Failover(comm, FixedGloo(gloo, rank, world, elems), Rendezvous(store, rank, world, wait),
                    "ddp-hook", elems, make_primary=None, wait_s=wait)


def stats(comm) -> dict:
    """What the failover did (the backend's ``stats()`` fields), or {} without one."""
    return comm.summary() if isinstance(comm, Failover) else {}
