"""One rank of a job that spans several aggregators (OmniReduce spreads its slots over
aggregators, BytePS its partitions over servers): each aggregator holds its own job (slot pool,
epoch, counters) for a shard of every tensor, and the rank runs one :class:`Communicator` per
aggregator, all at once. One aggregator's NIC and bitmap no longer cap the job.

Layouts (``layout``):
- ``contiguous`` (the default): aggregator k sums blocks [k*B/K, (k+1)*B/K) of the B blocks of
  a tensor. Each shard is a slice of the input and of the output, so the shards need no copy.
- ``roundrobin``: block b goes to aggregator b mod K (OmniReduce's slot i mod K). The blocks of
  a shard are gathered into a buffer and scattered back: two copies of the tensor per call. It
  spreads clustered zero blocks (sparsity) evenly, where contiguous shards can be uneven.
``nicoffload bench`` measures both (README); contiguous wins on dense tensors by the copies it
avoids.

A shard whose aggregator fails fails the call with that communicator's error, which names the
aggregator; the other shards' rounds are their own aggregators' and cannot mix with it. Built
with a fallback (``communicator(..., fallback="ring")``), each shard fails over alone.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from nicoffload import collective
from nicoffload.datapath.tensors import DTYPES, call_arrays, refusal
from nicoffload.errors import InputError, RefusedError
from nicoffload.jobspec import JobSpec
from nicoffload.wire import quant
from nicoffload.worker.comm import Communicator

LAYOUTS = ("contiguous", "roundrobin")


def shard_specs(spec: JobSpec, k: int) -> list[JobSpec]:
    """The job of each of ``k`` aggregators: the same job, a port of its own on the ranks (so that
    one rank's sockets of several shards can coexist)."""
    base = spec.local_port or spec.port
    return [spec.replace(local_port=base + i) if i else spec for i in range(k)]


class ShardedCommunicator:
    """The API of :class:`Communicator` (``allreduce``, ``step``, ``barrier``, ``close``, context manager)
    over ``aggregators`` (one address each, the job ``specs[k]`` on aggregator k). ``make(k,
    aggregator, spec)``, where given, builds shard k's communicator (the factory's failover wraps
    each shard alone); else a :class:`Communicator` with ``kw``."""

    capabilities = collective.AGGREGATOR

    def __init__(self, rank: int, world: int, aggregators: Sequence[str], specs: Sequence[JobSpec] | JobSpec,
                 local_ip: str | None = None, layout: str = "contiguous", make=None, **kw):
        aggregators = list(aggregators)
        if not aggregators:
            raise InputError("a sharded job needs at least one aggregator")
        if len(set(aggregators)) != len(aggregators):
            raise InputError(f"aggregators repeat: {', '.join(aggregators)}")
        if isinstance(specs, JobSpec):
            specs = shard_specs(specs, len(aggregators))
        specs = list(specs)
        if len(specs) != len(aggregators):
            raise InputError(f"{len(specs)} job specs for {len(aggregators)} aggregators")
        if layout not in LAYOUTS:
            raise InputError(f"layout must be {' or '.join(LAYOUTS)}, not {layout!r}")
        if len({s.elems for s in specs}) != 1:
            raise InputError("every aggregator of a sharded job must use the same elements per record")
        self.rank, self.world, self.layout, self.aggregators = rank, world, layout, aggregators
        self.elems = specs[0].elems
        self.timeout = max(s.timeout for s in specs)
        self.comms: list[Communicator] = []
        try:
            for k, (a, s) in enumerate(zip(aggregators, specs)):
                self.comms.append(make(k, a, s) if make is not None else
                                  Communicator.from_spec(rank, world, a, s, local_ip=local_ip, **kw))
        except BaseException:
            self.close()
            raise
        self._bufs: dict[tuple[int, str], np.ndarray] = {}

    # --- the API ------------------------------------------------------------------------------
    @property
    def last(self):
        """The call statistics of the last call, summed over the shards."""
        from nicoffload.worker.calls import CallStats

        return CallStats.total(c.last for c in self.comms)

    @property
    def stats(self):
        from nicoffload.worker.calls import CallStats

        return CallStats.total(c.stats for c in self.comms)

    def join(self) -> None:
        self._each(lambda c: c.join())

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        dtypes = DTYPES if op == "sum" else (np.dtype(np.int32), np.dtype(np.float32))
        x, out = call_arrays(array, out, dtypes)
        n, K = x.size, len(self.comms)
        if n == 0:
            return out
        # a shard is whole blocks: 2 * elems elements of floats in 16-bit lanes
        half = op == "sum" and x.dtype.kind == "f" and (lanes or self.comms[0].lanes) == 16
        E = quant.block_elems(self.elems, 16 if half else 32)
        flat, res = x.reshape(-1), out.reshape(-1)
        nb = -(-n // E)
        if self.layout == "contiguous" or K == 1:
            cuts = [min(n, (k * nb // K) * E) for k in range(K + 1)]
            self._each(lambda c, k: c.allreduce(flat[cuts[k]:cuts[k + 1]], out=res[cuts[k]:cuts[k + 1]], op=op,
                                                lanes=lanes) if cuts[k + 1] > cuts[k] else None,
                       where=lambda k, i: cuts[k] + i, n=n)
            return out
        # round robin: shard k is blocks k, k + K, ... gathered into a buffer of its own
        pad = nb * E
        if pad != n:
            src = self._buf(0, pad, x.dtype)
            src[:n] = flat
            src[n:] = 0
        else:
            src = flat
        rows, dst = src.reshape(nb, E), self._buf(1, pad, x.dtype).reshape(nb, E)
        ins = [np.ascontiguousarray(rows[k::K]).reshape(-1) for k in range(K)]

        def one(c, k):
            if ins[k].size:
                dst[k::K] = c.allreduce(ins[k], op=op, lanes=lanes).reshape(-1, E)

        self._each(one, where=lambda k, i: (k + i // E * K) * E + i % E, n=n)
        res[:] = dst.reshape(-1)[:n]
        return out

    def step(self, grads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """One optimizer step of a job whose optimizer state is sharded over the aggregators:
        aggregator k holds parameters ``optim.shards(n, elems, K)[k]`` (register each shard's job
        with that slice), and the ranks' shards run at once (:meth:`Communicator.step`)."""
        from nicoffload import optim

        g, out = call_arrays(grads, out, DTYPES[1:], "optimizer steps take float32 or float64 gradients",
                             "the gradients'")
        flat, res = g.reshape(-1), out.reshape(-1)
        cuts = optim.shards(flat.size, self.elems, len(self.comms))
        for c, (a, b) in zip(self.comms, cuts):
            if b > a and c.slots != optim.share(b - a, self.elems):
                raise InputError(f"rank {self.rank}: the shard of aggregator {c.aggregator} is parameters {a}..{b} "
                                 f"({optim.share(b - a, self.elems)} slots, optim.shards), its job has {c.slots}")
        self._each(lambda c, k: c.step(flat[cuts[k][0]:cuts[k][1]], out=res[cuts[k][0]:cuts[k][1]])
                   if cuts[k][1] > cuts[k][0] else None, where=lambda k, i: cuts[k][0] + i, n=flat.size)
        return out

    def barrier(self) -> None:
        self._each(lambda c: c.barrier())

    def abort(self, error: BaseException) -> None:
        for c in self.comms:
            c.abort(error)

    def close(self) -> None:
        for c in self.comms:
            c.close()

    def __enter__(self) -> "ShardedCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing -----------------------------------------------------------------------------
    def _buf(self, which: int, n: int, dtype) -> np.ndarray:
        b = self._bufs.get((which, str(dtype)))
        if b is None or b.size < n:
            b = self._bufs[(which, str(dtype))] = np.empty(n, dtype)
        return b[:n]

    def _each(self, fn, where=None, n: int = 0) -> None:
        """``fn(comm[, k])`` for every shard at once (one thread each beyond the first); the first
        error, after every shard has ended, is raised. A refused call (RefusedError, on every rank
        alike) names its elements in the whole tensor: ``where(k, i)`` is the flat index of shard
        k's element i, ``n`` the tensor's size."""
        takes_k = fn.__code__.co_argcount == 2
        errors: list[BaseException | None] = [None] * len(self.comms)

        def run(k):
            try:
                fn(self.comms[k], k) if takes_k else fn(self.comms[k])
            except BaseException as e:
                errors[k] = e
                if not isinstance(e, RefusedError):  # (every shard refuses alike: still in step)
                    for j, c in enumerate(self.comms):  # the other shards' waits end with it
                        if j != k:
                            c.abort(e)

        threads = [threading.Thread(target=run, args=(k,), name=f"nicoffload-shard{k}")
                   for k in range(1, len(self.comms))]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None), None)
        if first is None:
            return
        if isinstance(first, RefusedError) and first.kind and where is not None:
            k = errors.index(first)
            more = first.more + sum(e.more + 1 for e in errors[k + 1:] if isinstance(e, RefusedError) and e.kind)
            if first.index is not None:
                raise refusal(first.rank, first.kind, index=where(k, first.index)) from first
            if first.span is not None:
                lo = where(k, first.span[0])
                raise refusal(first.rank, first.kind, span=(lo, min(n, lo + first.span[1] - first.span[0])),
                              more=more) from first
        raise first
