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

import os
from typing import Sequence

from nicoffload import collective
from nicoffload.collective import Collective
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto

__all__ = ["communicator"]


def _aggregator(rank: int, world: int, *, aggregator: str | None = None, spec: JobSpec = DEFAULT,
                specs: Sequence[JobSpec] | None = None, local_ip: str | None = None, peers=None,
                fallback: str | None = None, failover: float | None = None, fallback_port: int | None = None,
                fallback_offload: bool | None = None, **kw) -> Collective:
    aggs = [a.strip() for a in (aggregator or "").split(",") if a.strip()]
    if not aggs:
        raise InputError("the aggregator mode needs the aggregator's address")
    if world > proto.MAX_WORKERS:
        from nicoffload.worker.hier import HierCommunicator

        if len(aggs) > 1:
            raise InputError(f"a job of {world} ranks (two levels of aggregator jobs) takes one aggregator")
        if fallback not in (None, "none") or failover is not None:
            raise InputError(f"a job of {world} ranks (two levels of aggregator jobs) has no failover: "
                             f"leave fallback and failover out")
        return HierCommunicator(rank, world, aggs[0], spec, local_ip=local_ip, **kw)
    from nicoffload.fallback import FALLBACK_PORT_OFFSET, with_fallback
    from nicoffload.worker.comm import Communicator

    ring_port = fallback_port or (spec.local_port or spec.port) + FALLBACK_PORT_OFFSET

    def one(k: int, agg: str, s: JobSpec):
        if fallback is None and failover is None:
            return Communicator.from_spec(rank, world, agg, s, local_ip=local_ip, **kw)
        return with_fallback(lambda **more: Communicator.from_spec(rank, world, agg, s, local_ip=local_ip,
                                                                   **kw, **more),
                             rank, world, fallback=fallback, failover=_failover_s(failover), peers=peers, spec=s,
                             port=ring_port + k, offload=fallback_offload, name=f"aggregator {agg}")

    if len(aggs) > 1:
        from nicoffload.worker.shards import ShardedCommunicator, shard_specs

        each = list(specs) if specs else shard_specs(spec, len(aggs))
        return ShardedCommunicator(rank, world, aggs, each, local_ip=local_ip, layout=spec.layout,
                                   make=None if fallback is None and failover is None else one, **kw)
    return one(0, aggs[0], specs[0] if specs else spec)


def _failover_s(failover: float | None) -> float:
    """``failover`` seconds, else NICOFFLOAD_FAILOVER's, else 3 (the torch backend's default)."""
    if failover is not None:
        return float(failover)
    env = os.environ.get("NICOFFLOAD_FAILOVER", "").strip()
    try:
        return float(env) if env else 3.0
    except ValueError:
        raise InputError(f"NICOFFLOAD_FAILOVER must be a number of seconds, not {env!r}") from None


def _ring(rank: int, world: int, *, peers=None, spec: JobSpec = DEFAULT, aggregator: str | None = None,
          local_ip: str | None = None, specs=None, fallback: str | None = None, failover: float | None = None,
          **kw) -> Collective:
    from nicoffload.ring.comm import RingCommunicator

    if fallback not in (None, "none") or failover is not None:
        raise InputError("the ring mode has no aggregator to lose: fallback and failover go with the "
                         "aggregator mode")

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
    aggregator).

    ``fallback="ring"`` (aggregator mode, up to 32 ranks; ``peers`` needed): when the aggregator
    falls silent for ``failover`` seconds (default NICOFFLOAD_FAILOVER, else 3) or no longer runs
    the job, the call and the following ones finish on the ring of ``peers`` (port
    ``fallback_port``, default the job's + 1000; the ring offload where a ring program for it is
    loaded, or ``fallback_offload=True``), bit for bit: :mod:`nicoffload.fallback`. A sharded
    job's shards fail over one by one. ``fallback="none"``: the lost aggregator raises
    AggregatorLost after ``failover`` seconds."""
    return collective.builder(mode or spec.mode)(rank, world, aggregator=aggregator, peers=peers, spec=spec,
                                                 local_ip=local_ip, **kw)
