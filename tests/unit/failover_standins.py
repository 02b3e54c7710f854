"""Stand-ins the failover agreements' unit tests share (test_failover_agreement.py: the torch
backend's, over a store and gloo; test_fallback_agreement.py: a bare communicator's, over the
ring): W ranks as threads, an aggregator that is lost in a chosen call after some of its blocks
came back, and the exact int32 SUM and MAX across the threads."""
from __future__ import annotations

import threading

import numpy as np

from nicoffload.errors import SilentAggregator
from nicoffload.local.fixedsum import FixedSum

W, ELEMS = 3, 256


class ThreadSum(FixedSum):
    """Rank ``rank``'s int32 SUM and MAX across the threads of one test (what the ring's or
    gloo's exact collectives give)."""

    def __init__(self, rank, shared):
        super().__init__(rank, W, ELEMS)
        self.shared, self.mode, self.calls = shared, "threads", 0

    def reduce_int32(self, a, op):
        barrier, parts = self.shared
        self.calls += 1
        parts[self.rank] = a.copy()
        barrier.wait()
        total = (np.sum if op == "sum" else np.max)(np.stack([parts[r] for r in range(W)]), axis=0)
        barrier.wait()
        a[...] = total.astype(np.int32)


def shared_state():
    """What the ranks' ThreadSums share: a barrier and each rank's part."""
    return threading.Barrier(W, timeout=10), {}


class LosingAggregator:
    """Rank ``rank``'s aggregator: calls below ``lost_at`` return the sum ``want[n]``; call
    ``lost_at`` is lost after the blocks ``final`` (indices or a slice) came back; it is never
    asked again after that."""

    def __init__(self, rank, want, lost_at, final):
        self.rank, self.world, self.elems, self.want = rank, W, ELEMS, want
        self.lost_at, self.final, self.calls, self.aggregator = lost_at, final, 0, "10.0.0.1"
        self.capabilities = None

    def allreduce(self, array, out=None, op="sum", lanes=None):
        n, self.calls = self.calls, self.calls + 1
        assert n <= self.lost_at, "the aggregator is asked again after it was lost"
        if n < self.lost_at:
            out[...] = self.want[n]
            return out
        self.mask = np.zeros(-(-array.size // ELEMS), bool)
        self.mask[self.final] = True
        for b in np.flatnonzero(self.mask):
            out[b * ELEMS:(b + 1) * ELEMS] = self.want[n][b * ELEMS:(b + 1) * ELEMS]
        raise SilentAggregator(f"rank {self.rank}: the aggregator has not answered anything")

    def final_blocks(self):
        return self.mask

    def close(self):
        pass

    def abort(self, error):
        pass


def run_ranks(rank_fn) -> dict:
    """``rank_fn(r)`` on W threads; returns {rank: what it returned}, failing with every rank's
    error if one raised or hung."""
    got, errors = {}, []

    def rank(r):
        try:
            got[r] = rank_fn(r)
        except BaseException as e:  # noqa: BLE001  (reported below, by rank)
            errors.append((r, repr(e)))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(got) == W, (errors, sorted(got))
    return got
