"""The failover's agreement on the call that was cut, with three ranks as threads, a real store
(torch's HashStore) and stand-ins for the aggregator and for gloo. The case CI found: ranks 1
and 2 returned from call 0 (so every rank holds its results) and lost the aggregator in call 1,
while rank 0 lost it waiting for call 0's gate. Rank 0 must take call 1 through the same
agreement, not as a plain fallback call that the others, waiting in the store, never join."""
from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nicoffload.errors import SilentAggregator  # noqa: E402
from nicoffload.local.fixedsum import FixedSum  # noqa: E402
from nicoffload.torch.failover import Failover  # noqa: E402
from nicoffload.torch.rendezvous import Rendezvous  # noqa: E402

W, N, ELEMS = 3, 1000, 256


class Gloo(FixedSum):
    """Rank ``rank``'s int32 SUM across the threads (what FixedGloo's gloo calls give); its
    int32 allreduce is that sum, as FixedSum's."""

    def __init__(self, rank, shared):
        super().__init__(rank, W, W, ELEMS)
        self.barrier, self.parts = shared

    def reduce_int32(self, a, _op):
        self.parts[self.rank] = a.copy()
        self.barrier.wait()
        total = sum(self.parts[r] for r in range(W))
        self.barrier.wait()
        a[...] = total


class Primary:
    """Rank ``rank``'s aggregator: calls below ``lost_at`` return the sum; call ``lost_at`` is
    lost after ``final`` blocks of it came back (True: all of them)."""

    def __init__(self, rank, want, lost_at, final):
        self.rank, self.want, self.lost_at, self.final, self.calls = rank, want, lost_at, final, 0
        self.capabilities = None

    def allreduce(self, array, out=None, op="sum", lanes=None):
        n, self.calls = self.calls, self.calls + 1
        if n < self.lost_at:
            out[...] = self.want[n]
            return out
        nb = -(-array.size // ELEMS)
        self.mask = np.zeros(nb, bool)
        self.mask[:self.final] = True
        for b in np.flatnonzero(self.mask):
            out[b * ELEMS:(b + 1) * ELEMS] = self.want[n][b * ELEMS:(b + 1) * ELEMS]
        raise SilentAggregator(f"rank {self.rank}: the aggregator has not answered anything")

    def final_blocks(self):
        return self.mask

    def close(self):
        pass

    def abort(self, error):
        pass


def test_a_rank_a_call_behind_joins_the_agreement_on_the_next_call():
    rng = np.random.default_rng(3)
    inputs = [[rng.integers(-1000, 1000, N).astype(np.int32) for _ in range(3)] for _ in range(W)]
    want = [sum(inputs[r][n] for r in range(W)) for n in range(3)]
    store, shared = torch.distributed.HashStore(), (threading.Barrier(W, timeout=10), {})
    # rank 0 lost call 0 holding all of it; ranks 1 and 2 returned from call 0 and lost call 1
    # with one and two of its four blocks back
    plans = {0: (0, 4), 1: (1, 1), 2: (1, 2)}
    got, errors = {}, []

    def rank(r):
        try:
            f = Failover(Primary(r, want, *plans[r]), Gloo(r, shared), Rendezvous(store, r, W, 10.0), "t", ELEMS,
                         wait_s=10.0)
            got[r] = [f.allreduce(inputs[r][n].copy(), out=inputs[r][n].copy()) for n in range(3)]
            got[r].append((f.failovers, f.on_fallback))
        except BaseException as e:  # noqa: BLE001  (reported below, by rank)
            errors.append((r, repr(e)))

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(got) == W, (errors, sorted(got))
    for r in range(W):
        for n in range(3):
            assert np.array_equal(got[r][n], want[n]), (r, n)
        assert got[r][3] == (1, True)
