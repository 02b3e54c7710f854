"""What one call of a communicator is made of: the rounds it runs (:class:`Rounds`), what it did
(:class:`CallStats`), and the memory the communicator reuses across calls (:class:`Buffers`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from nicoffload.datapath import kernels, pump
from nicoffload.worker.records import ack_column, flags_column

if TYPE_CHECKING:
    from nicoffload.worker.stream import RoundStream

#: the outputs a stream does not write (decode_results takes all three kinds)
_NONE_I32, _NONE_F32, _NONE_F64 = np.empty(0, np.int32), np.empty(0, np.float32), np.empty(0, np.float64)


@dataclass
class Rounds:
    """One run of rounds: round i sums block ``blocks[i]`` over the ranks of ``masks[i]``; this
    rank sends its records of rounds ``mine`` (indices, ascending), scaled by ``shifts``. With
    ``encode``, ``send`` is the send ring (RoundStream.send_buffer) and ``encode(j0, j1, at)``
    writes records j0 .. j1 - 1 at record ``at`` of it just before they go out; without, ``send``
    holds every record, in order. Results of ``kind`` (pump.KIND_*) go into ``res``; rounds
    whose shift is pump.META_SHIFT: int32 into ``meta_out``, at their block's offset. With
    ``ready``, no round at or beyond ``ready(done, head)`` enters the window (a pipelined call's data
    waits for its chunk's metadata). With ``rotate``, a run that enters the window whole goes out
    rotated (:func:`rotation_starts`)."""

    blocks: np.ndarray
    masks: np.ndarray
    mine: np.ndarray
    shifts: np.ndarray
    send: np.ndarray
    kind: int
    res: np.ndarray
    encode: Callable[[int, int, int], None] | None = None
    meta_out: np.ndarray | None = None
    ready: Callable[[np.ndarray, int], int] | None = None  # (done, head): how many leading rounds may go
    rotate: bool = False  # see rotation_starts


@dataclass
class CallStats:
    packets_sent: int = 0       # records sent (data, metadata, retransmissions, pulls, probes)
    bytes_sent: int = 0
    retransmissions: int = 0
    pulls: int = 0
    probes: int = 0             # header-only pulls asking what a round lacks (worker/recovery.py)
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
    window_cuts: int = 0        # loss episodes the congestion window answered (worker/congestion.py)
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


def rotation_starts(n: int, world: int) -> list[int]:
    """Where each rank starts a rotated run of ``n`` rounds: rank q sends rounds q n / world .. n - 1,
    then 0 .. q n / world - 1, so that segment q (from its start to the next) is completed by the
    rank after q, each rank completes a share, and an optimizer step's update runs on every
    rank's queue (in the softirq of its sends on the testbed) instead of the rank behind's alone.
    Each segment's results come in order; the segments' do not (RoundTimer.fast_retransmit)."""
    return [q * n // world for q in range(world)] + [n]


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

class RunState:
    """The state of one :meth:`RoundStream.run`: the rounds, where this rank's records are, which
    rounds have their results, the window's head and edge."""

    def __init__(self, s: RoundStream, base: int, r: Rounds):
        rec, K = s._rec, len(r.blocks)
        self.r, self.base, self.K = r, base, K
        mine = r.mine
        self.cap = cap = len(r.send) // rec if r.encode is not None else len(mine)  # records the buffer holds
        if r.encode is not None and cap < len(mine) and cap < s.window + s.ENCODE_CHUNK:
            raise ValueError(f"a send ring of {cap} records cannot hold a window of {s.window}")
        self.dest = (s.aggregator, s.port)
        self.done = s._buf.get("done", K, np.uint8)
        self.sent_at = s._buf.get("sent_at", K, np.float64)
        self.sent0 = s._buf.get("sent0", K, np.float64)  # when round i entered the window (never reset)
        self.status = s._buf.get("status", K, np.int64)
        self.newly = s._buf.get("newly", K, np.int64)
        self.pos = s._buf.get("pos", K, np.int64)  # this rank's record of round i, or -1
        self.probed = s._buf.get("probed", K, np.uint8)  # a PROBE of round i awaits its answer
        self.probed[:] = 0
        self.probing = 0   # how many
        kernels.reset_rounds(self.done, self.status, self.pos, mine)
        recs = r.send[:min(cap, len(mine)) * rec].reshape(-1, rec)
        self.ack_col, self.flags_col = ack_column(recs), flags_column(recs)
        self.out_i = r.res.view(np.int32) if r.kind == pump.KIND_INT32 else \
            r.meta_out if r.meta_out is not None else _NONE_I32
        self.out_f32 = r.res if r.res.dtype == np.float32 else _NONE_F32
        self.out_f64 = r.res if r.res.dtype == np.float64 else _NONE_F64
        self.dense = len(mine) == K
        # a rotated run's segment starts (rotation_starts): the other ranks may send rotated even
        # when this one cannot (its window not at its cap), so fast retransmit takes them always
        self.segments = rotation_starts(K, s.world) if r.rotate and self.dense else None
        # rounds whose contributors differ (sparse jobs): what fast retransmit needs to tell a
        # round lost from one waiting for a slower rank (RoundTimer.fast_retransmit)
        mixed = K and not bool((r.masks == s._all).all())
        self.contributors = (r.masks, s._buf.get("overtaken", K, np.uint8)) if mixed else ()
        self.rx_args = s._t.recv_args()
        self.stash = (s._stash, s._stash_round)
        self.bias = s._bias16 if r.kind in (pump.KIND_HALF32, pump.KIND_HALF64) else s._bias
        self.ndone = pump.replay_stash(*self.stash, rec, s.elems, s.job, s._epoch, s.rank, base, K, s.slots, r.blocks,
                                       r.shifts, self.bias, r.kind, self.out_i, self.out_f32, self.out_f64, self.done,
                                       self.status, self.newly, s._stash_lens, s._stash_segs, s._gate)
        self.head = pump.advance(self.done, 0, K)  # lowest round without a result (the stash may have some)
        self.hi = 0        # rounds [0, hi) have entered the window
        self.j_sent = 0    # this rank's records [0, j_sent) have been sent
        self.j_enc = 0 if r.encode is not None else len(mine)  # ... and [0, j_enc) are written
        s._timer.start(time.monotonic())
        self.heard_at = self.wake_by = time.monotonic()  # wake_by: when the loop meant to look again
