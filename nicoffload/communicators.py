"""The communicator factory, one floor above the communicators it builds:
``communicator(rank, world, mode=...)`` returns the :class:`~nicoffload.collective.Collective` of
a mode (registered in :mod:`nicoffload.collective`):

    aggregator   one address: :class:`~nicoffload.worker.Communicator`; several (``"IP1,IP2"``):
                 :class:`~nicoffload.worker.shards.ShardedCommunicator`, a shard of every tensor
                 on each (``specs``: each aggregator's job, else ``spec`` with a port per shard);
                 more than 32 ranks: :class:`~nicoffload.worker.hier.HierCommunicator`
    ring         :class:`~nicoffload.ring.RingCommunicator` for the ring of ``peers`` (every
                 rank's address, by rank; ``offload=False``: the user-space UDP ring)

``nicoffload.worker.communicator`` is the same function (its documented old home).
"""
from __future__ import annotations

from typing import Sequence

from nicoffload import collective
from nicoffload.collective import Collective
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto

__all__ = ["communicator"]


def _aggregator(rank: int, world: int, *, aggregator: str | None = None, spec: JobSpec = DEFAULT,
                specs: Sequence[JobSpec] | None = None, local_ip: str | None = None, peers=None,
                **kw) -> Collective:
    aggs = [a.strip() for a in (aggregator or "").split(",") if a.strip()]
    if not aggs:
        raise InputError("the aggregator mode needs the aggregator's address")
    if world > proto.MAX_WORKERS:
        from nicoffload.worker.hier import HierCommunicator

        if len(aggs) > 1:
            raise InputError(f"a job of {world} ranks (two levels of aggregator jobs) takes one aggregator")
        return HierCommunicator(rank, world, aggs[0], spec, local_ip=local_ip, **kw)
    if len(aggs) > 1:
        from nicoffload.worker.shards import ShardedCommunicator

        return ShardedCommunicator(rank, world, aggs, list(specs) if specs else spec, local_ip=local_ip,
                                   layout=spec.layout, **kw)
    from nicoffload.worker.comm import Communicator

    return Communicator.from_spec(rank, world, aggs[0], specs[0] if specs else spec, local_ip=local_ip, **kw)


def _ring(rank: int, world: int, *, peers=None, spec: JobSpec = DEFAULT, aggregator: str | None = None,
          local_ip: str | None = None, specs=None, **kw) -> Collective:
    from nicoffload.ring.comm import RingCommunicator

    if not peers:
        raise InputError("the ring mode needs every rank's address (peers)")
    return RingCommunicator.from_spec(rank, world, list(peers), spec, **kw)


collective.register("aggregator", _aggregator)
collective.register("ring", _ring)


def communicator(rank: int, world: int, *, mode: str | None = None, aggregator: str | None = None,
                 peers=None, spec: JobSpec = DEFAULT, local_ip: str | None = None, **kw) -> Collective:
    """The communicator of ``mode`` (default ``spec.mode``), with the API of
    :class:`~nicoffload.collective.Collective`: ``aggregator`` sums through the aggregator at
    ``aggregator`` (several, comma-separated: one shard of every tensor on each); ``ring`` through
    the ring of ``peers``. ``kw`` goes to the class (``specs``: a sharded job's jobs, one per
    aggregator)."""
    return collective.builder(mode or spec.mode)(rank, world, aggregator=aggregator, peers=peers, spec=spec,
                                                 local_ip=local_ip, **kw)
