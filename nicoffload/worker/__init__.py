"""The worker library: what a rank links to sum its tensors with the others'.

    from nicoffload.worker import Communicator
    with Communicator(rank, world, aggregator="10.200.7.1", group="239.77.7.1", local_ip=ip) as c:
        total = c.allreduce(grad)

    comm       :class:`Communicator` (the aggregator mode: JOIN, the metadata round, the data
               rounds)
    stream     :class:`~nicoffload.worker.stream.RoundStream`: rounds through the slot pool,
               window, results, loss recovery, timeouts naming the silent ranks
    confirm    the end of a call with ``confirm``: waiting for the job's gate to pass its rounds
    recovery   the decisions of loss recovery (RTO, fast retransmission, pulls, giving up), pure
    speculation  float calls whose data does not wait for the whole metadata round: small ones
               guess the last call's exponents, large ones run in a pipeline of chunks
    records    the records a rank sends besides its data (JOIN, ACK, pulls) and JOIN answers
    shards     :class:`ShardedCommunicator`: one job spread over several aggregators
    hier       :class:`HierCommunicator`: jobs of more than 32 ranks, two levels of aggregator jobs
    metrics    a rank's Prometheus metrics (``nicoffload_rank_*``) and their HTTP thread
               (``Communicator(..., metrics_port=)``; the torch backend's are built on them)

``communicator(mode=...)``, the factory of every mode's communicator, lives one floor up
(:mod:`nicoffload.communicators`); ``nicoffload.worker.communicator`` is that function, resolved
on first use (its documented old home).

Below it: the host data path (:mod:`nicoffload.datapath`) and the wire (:mod:`nicoffload.wire`).
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"Communicator": "comm", "CallStats": "comm", "DTYPES": "comm",
          "ShardedCommunicator": "shards", "HierCommunicator": "hier"}
__all__ = [*_NAMES, "communicator"]
_lazy, __dir__ = lazy_exports(__name__, _NAMES)


def __getattr__(name: str):
    if name == "communicator":  # the factory's old home (tests/unit/test_layers.py: ALIASES)
        from nicoffload.communicators import communicator

        return communicator
    return _lazy(name)
