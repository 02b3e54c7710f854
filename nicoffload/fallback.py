"""A bare communicator that survives its aggregator: ``communicator(..., fallback="ring")``.

The torch backend and the DDP hook fail over through torch's store and a gloo group
(:mod:`nicoffload.torch.failover`); a communicator used directly has neither, so here the ring of
the job's ranks (``peers``: every rank's address) is both the way to agree and the way out:

- The aggregator Communicator runs with ``silence=failover`` (no answer to retransmissions for
  that long: :class:`~nicoffload.errors.AggregatorLost`) and ``confirm`` (a call returns only
  once every rank holds all of its results, so ranks are at most one call apart and no rank
  ever needs another's returned output).
- The fallback is :class:`RingFixed`: the aggregator's own fixed point
  (:class:`~nicoffload.local.fixedsum.FixedSum`) summed over the ring, whose int32 SUM and MAX
  are exact: a call summed on it returns the bits the aggregator would have (the same block
  exponents, the same integers added in another order). The ring is the ring offload where the
  rank's interface runs a ring program loaded for it (``nicoffload ring load`` with the
  fallback's port), else the user-space UDP ring, which needs nothing.
- The call that was cut (:class:`FailoverCommunicator`): every rank says through a ring MAX
  which call it lost. A rank a call behind (its call returned on the others, so it holds every
  result) returns and takes its next call through the same agreement; then, per block, the
  lowest rank that holds the block's final result gives it to the others (an int32 SUM of its
  bits and everyone else's zeros), and the blocks nobody holds are summed anew on the fallback
  from the inputs, which are still there. Every rank ends with the same bits, which are the
  aggregator's.

No rejoin: a bare communicator has no service to ask for a job again; the calls after a failover
stay on the ring. A sharded job wraps each shard's communicator alone (one aggregator of K gone:
its shard takes the ring, the others stay). An optimizer job cannot fail over (``step`` raises
the loss, naming the aggregator).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from nicoffload import collective
from nicoffload.datapath.tensors import DTYPES, call_arrays
from nicoffload.errors import AggregatorLost, InputError, NicoffloadError, NotFoundError
from nicoffload.local.fixedsum import FixedSum
from nicoffload.wire import quant

log = logging.getLogger("nicoffload.fallback")

#: the fallback ring's port, past the job's own (its shards' ports are the job's + k)
FALLBACK_PORT_OFFSET = 1000
#: fallback= values
FALLBACKS = ("none", "ring")


class RingFixed(FixedSum):
    """The aggregator's fixed point summed over ``ring`` (a RingCommunicator of the same ranks)."""

    def __init__(self, ring):
        super().__init__(ring.rank, ring.world, ring.elems)
        self.ring, self.mode = ring, f"ring ({ring.mode})"

    def reduce_int32(self, a: np.ndarray, op: str) -> None:
        self.ring.allreduce(a, out=a, op=op)

    def abort(self, error: BaseException) -> None:
        self.ring.abort(error)

    def close(self) -> None:
        self.ring.close()


class FailoverCommunicator:
    """``primary`` (an aggregator Communicator built with ``silence`` and ``confirm``) until its
    aggregator is lost, ``fallback`` (a :class:`FixedSum` of the same ranks) after."""

    def __init__(self, primary, fallback: FixedSum, name: str = ""):
        if (primary.rank, primary.world) != (fallback.rank, fallback.world):
            raise InputError(f"the fallback is rank {fallback.rank} of {fallback.world}, the aggregator's "
                             f"communicator rank {primary.rank} of {primary.world}")
        self.primary, self.fallback = primary, fallback
        self.name = name or f"aggregator {getattr(primary, 'aggregator', '?')}"
        self.rank, self.world, self.elems = primary.rank, primary.world, primary.elems
        self.calls = 0             # calls so far (every rank numbers them alike)
        self.on_fallback = False
        self.failovers = 0
        self.cause = ""            # why, the last time
        self.fallback_s = 0.0      # seconds of calls (and of the cut call's recovery) on the fallback
        self.recovered_at = 0.0    # when the cut call's result was in hand (time.time())
        self._follow = -1          # a call other ranks may have begun on the aggregator: agree on it

    @property
    def capabilities(self) -> collective.Capabilities:
        return self.primary.capabilities

    def summary(self) -> dict:
        """What the failover did."""
        return {"calls": self.calls, "failovers": self.failovers, "on_fallback": self.on_fallback,
                "cause": self.cause, "fallback_s": self.fallback_s, "recovered_at": self.recovered_at,
                "path": self.fallback.mode if self.on_fallback else "aggregator"}

    def __getattr__(self, name: str):
        # the aggregator communicator's own (stats, last, lanes, slots, aggregator, join, step, ...)
        if name in ("primary", "fallback"):
            raise AttributeError(name)
        return getattr(self.primary, name)

    # --- the Collective API ---------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        if op not in ("sum", "max", "min"):
            raise InputError(f"op must be sum, max or min, not {op!r}")
        x, out = call_arrays(array, out, DTYPES if op == "sum" else (np.dtype(np.int32), np.dtype(np.float32)))
        n = self.calls
        self.calls += 1
        if self.on_fallback:
            t = time.perf_counter()
            try:
                if n == self._follow:  # another rank may be in this call on the aggregator: agree on it
                    self._agree(n, x, out, op, lanes, None)
                    return out
                return self.fallback.allreduce(x, out=out, op=op, lanes=lanes)
            finally:
                self.fallback_s += time.perf_counter() - t
        try:
            return self.primary.allreduce(x, out=out, op=op, lanes=lanes)
        except AggregatorLost as e:
            return self._cut(n, e, x, out, op, lanes)

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, np.int32))

    def abort(self, error: BaseException) -> None:
        self.primary.abort(error)
        self.fallback.abort(error)

    def close(self) -> None:
        try:
            self.primary.close()
        finally:
            self.fallback.close()

    def __enter__(self) -> "FailoverCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the call that was cut ------------------------------------------------------------------
    def _cut(self, n: int, e: AggregatorLost, x: np.ndarray, out: np.ndarray, op: str,
             lanes: int | None) -> np.ndarray:
        final = self.primary.final_blocks() if op == "sum" else None
        self.on_fallback, self.cause = True, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        self.failovers += 1
        log.warning("rank %d: the %s is lost in call %d (%s); this call and the following ones take the "
                    "fallback path, %s (the aggregator's fixed point, the same bits)", self.rank, self.name, n,
                    self.cause, self.fallback.mode)
        t = time.perf_counter()
        try:
            self._agree(n, x, out, op, lanes, final)
        finally:
            self.fallback_s += time.perf_counter() - t
        self.recovered_at = time.time()
        return out

    def _agree(self, n: int, x: np.ndarray, out: np.ndarray, op: str, lanes: int | None,
               final: np.ndarray | None) -> None:
        """Call ``n`` on every rank from what each holds of it (``final``: this rank's final
        blocks of a sum; None: none)."""
        fb = self.fallback
        while True:
            calls = np.array([n, -n], np.int32)
            fb.reduce_int32(calls, "max")
            hi, lo = int(calls[0]), -int(calls[1])
            if hi > n:  # a rank returned from call n, so every rank holds all of it: this one too
                self._follow = n + 1
                return
            if lo == n:
                break
            # lo < n: a rank still in call n - 1; it returns from it (above) and comes to this one
        half = lanes == 16 and x.dtype.kind == "f"
        E = quant.block_elems(self.elems, 16 if half else 32) if op == "sum" else self.elems
        nb = -(-x.size // E)
        if not nb:
            return
        holds = np.zeros(nb, np.int32)  # world - the lowest rank holding the block's result; 0: nobody
        if final is not None:
            holds[final[:nb]] = self.world - self.rank
        fb.reduce_int32(holds, "max")
        fb.settle(x, out, op, lanes, E, self.world - holds)


def ring_fallback(rank: int, world: int, peers, spec, port: int, offload: bool | None) -> RingFixed:
    """The fallback ring of ``peers`` on ``port``: the ring offload when ``offload`` (None: when
    the rank's interface runs a ring program already), else the user-space ring."""
    from nicoffload.ring.comm import RingCommunicator

    if peers is None or len(peers) != world:
        raise InputError(f"fallback='ring' needs every rank's address (peers: {world} of them, by rank)")
    kw = dict(job=spec.job, port=port, elems=spec.elems, timeout=spec.timeout)
    if offload is None:
        offload = _ring_program_found(peers[rank])
    if offload:
        try:
            return RingFixed(RingCommunicator(rank, world, list(peers), offload=True, **kw))
        except NicoffloadError as e:
            log.warning("rank %d: no ring offload for the fallback (%s): the user-space ring takes it", rank,
                        str(e).splitlines()[0])
    return RingFixed(RingCommunicator(rank, world, list(peers), offload=False, **kw))


def _ring_program_found(ip: str) -> bool:
    from nicoffload.ebpf.iface import iface_holding
    from nicoffload.ring import node

    try:
        found = node.RingNode.open(node.current_netns(), iface_holding(ip))
    except (NotFoundError, NicoffloadError, OSError):
        return False
    found.close()
    return True


def with_fallback(build: Callable[..., object], rank: int, world: int, *, fallback: str | None, failover: float,
                  peers, spec, port: int, offload: bool | None = None, name: str = ""):
    """``build(**settings)``'s aggregator communicator, with the ``fallback`` path (None or
    "none": none; it is built with ``failover`` seconds of silence all the same, so a lost
    aggregator raises AggregatorLost that soon)."""
    fallback = fallback or "none"
    if fallback not in FALLBACKS:
        raise InputError(f"fallback must be {' or '.join(repr(f) for f in FALLBACKS)}, not {fallback!r}")
    if failover <= 0:
        raise InputError(f"failover must be a positive number of seconds, not {failover!r}")
    settings = {"silence": min(failover, spec.timeout)}
    if fallback == "none":
        return build(**settings)
    ring = ring_fallback(rank, world, peers, spec, port, offload)
    try:
        primary = build(**settings, confirm=True)
    except BaseException:
        ring.close()
        raise
    return FailoverCommunicator(primary, ring, name)
