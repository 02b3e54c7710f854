"""What one call of a communicator is made of: the rounds it runs (:class:`Rounds`), what it did
(:class:`CallStats`), and the memory the communicator reuses across calls (:class:`Buffers`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class Rounds:
    """One run of rounds: round i sums block ``blocks[i]`` over the ranks of ``masks[i]``; this
    rank sends its records of rounds ``mine`` (indices, ascending), scaled by ``shifts``. With
    ``encode``, ``send`` is the send ring (RoundStream.send_buffer) and ``encode(j0, j1, at)``
    writes records j0 .. j1 - 1 at record ``at`` of it just before they go out; without, ``send``
    holds every record, in order. Results of ``kind`` (pump.KIND_*) go into ``res``; rounds
    whose shift is pump.META_SHIFT: int32 into ``meta_out``, at their block's offset."""

    blocks: np.ndarray
    masks: np.ndarray
    mine: np.ndarray
    shifts: np.ndarray
    send: np.ndarray
    kind: int
    res: np.ndarray
    encode: Callable[[int, int, int], None] | None = None
    meta_out: np.ndarray | None = None


@dataclass
class CallStats:
    packets_sent: int = 0       # records sent (data, metadata, retransmissions, pulls)
    bytes_sent: int = 0
    retransmissions: int = 0
    pulls: int = 0
    acks: int = 0
    results: int = 0            # data rounds that produced output
    rounds: int = 0             # every round of the call (metadata included)
    meta_rounds: int = 0
    blocks_skipped: int = 0     # blocks zero on every rank: no round at all
    own_blocks: int = 0         # blocks this rank sent data for
    spec_blocks: int = 0        # blocks sent speculatively, scaled by the last call's exponents
    spec_missed: int = 0        # ... whose exponent had changed: sent again at the right scale
    seconds: float = 0.0
    timeouts: int = 0
    loops: int = 0              # iterations of the send/receive loop
    syscalls: int = 0
    foreign: int = 0            # datagrams from someone other than the aggregator, skipped

    def add(self, other: "CallStats") -> None:
        mine, theirs = self.__dict__, other.__dict__
        for k in self.__dataclass_fields__:
            mine[k] += theirs[k]

    @classmethod
    def total(cls, many) -> "CallStats":
        """The sum of several communicators' statistics (shards, levels)."""
        st = cls()
        for other in many:
            st.add(other)
        return st


def ring_spans(j0: int, j1: int, cap: int):
    """Records j0 .. j1 - 1 of a stream kept in a ring of ``cap`` records, as (position, count)
    spans that do not cross the ring's end."""
    while j0 < j1:
        a = j0 % cap
        c = min(j1 - j0, cap - a)
        yield a, c
        j0 += c


class Buffers:
    """Per-communicator memory, grown on demand and reused across calls."""

    #: views kept at most (a view is a few hundred bytes; sizes that change every call must not grow it)
    MAX_VIEWS = 512

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        # the views handed out, by (name, length): a small call asks for some twenty per call,
        # and slicing anew each time was a measurable part of its CPU; a grown array drops its views
        self._views: dict[tuple, np.ndarray] = {}

    def get(self, name: str, n: int, dtype) -> np.ndarray:
        v = self._views.get((name, n))
        if v is not None and v.dtype == dtype:
            return v
        a = self.arrays.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = np.empty(max(n, 1), dtype=dtype)
            self.arrays[name] = a
            self._views = {k: w for k, w in self._views.items() if k[0] != name}
        if len(self._views) >= self.MAX_VIEWS:  # calls of ever new sizes: keep the cache small
            self._views.clear()
        v = self._views[(name, n)] = a[:n]
        return v
