"""The failover's agreement on the call that was cut, with three ranks as threads, a real store
(torch's HashStore) and stand-ins for the aggregator and for gloo. The case CI found: ranks 1
and 2 returned from call 0 (so every rank holds its results) and lost the aggregator in call 1,
while rank 0 lost it waiting for call 0's gate. Rank 0 must take call 1 through the same
agreement, not as a plain fallback call that the others, waiting in the store, never join."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nicoffload.torch.failover import Failover  # noqa: E402
from nicoffload.torch.rendezvous import Rendezvous  # noqa: E402

from failover_standins import ELEMS, W, LosingAggregator, ThreadSum, run_ranks, shared_state  # noqa: E402

N = 1000


def test_a_rank_a_call_behind_joins_the_agreement_on_the_next_call():
    rng = np.random.default_rng(3)
    inputs = [[rng.integers(-1000, 1000, N).astype(np.int32) for _ in range(3)] for _ in range(W)]
    want = [sum(inputs[r][n] for r in range(W)) for n in range(3)]
    store, shared = torch.distributed.HashStore(), shared_state()
    # rank 0 lost call 0 holding all of it; ranks 1 and 2 returned from call 0 and lost call 1
    # with one and two of its four blocks back
    plans = {0: (0, slice(0, 4)), 1: (1, slice(0, 1)), 2: (1, slice(0, 2))}

    def rank(r):
        f = Failover(LosingAggregator(r, want, *plans[r]), ThreadSum(r, shared), Rendezvous(store, r, W, 10.0), "t",
                     ELEMS, wait_s=10.0)
        return [f.allreduce(inputs[r][n].copy(), out=inputs[r][n].copy()) for n in range(3)] + \
            [(f.failovers, f.on_fallback)]

    got = run_ranks(rank)
    for r in range(W):
        for n in range(3):
            assert np.array_equal(got[r][n], want[n]), (r, n)
        assert got[r][3] == (1, True)


def test_a_rank_that_returned_and_waits_elsewhere_still_settles_the_call(monkeypatch):
    """The case FSDP found: ranks 1 and 2 returned from call 0 and then waited in a collective
    outside the offload (here an event) that needs rank 0, which lost the aggregator waiting for
    call 0's gate. They publish the call they returned from, so rank 0 learns that every rank
    holds call 0 and goes on, instead of waiting for them in the store until its timeout."""
    import threading

    from nicoffload.torch import failover

    monkeypatch.setattr(failover, "PUBLISH_S", 0.05)
    rng = np.random.default_rng(5)
    inputs = [[rng.integers(-1000, 1000, N).astype(np.int32) for _ in range(3)] for _ in range(W)]
    want = [sum(inputs[r][n] for r in range(W)) for n in range(3)]
    store, shared = torch.distributed.HashStore(), shared_state()
    plans = {0: (0, slice(0, 4)), 1: (1, slice(0, 1)), 2: (1, slice(0, 2))}
    elsewhere = threading.Event()  # the collective outside the offload: done once rank 0 is in it

    def rank(r):
        f = Failover(LosingAggregator(r, want, *plans[r]), ThreadSum(r, shared), Rendezvous(store, r, W, 10.0), "t",
                     ELEMS, wait_s=10.0)
        try:
            got = [f.allreduce(inputs[r][0].copy(), out=inputs[r][0].copy())]
            if r == 0:
                elsewhere.set()
            assert elsewhere.wait(8.0), f"rank {r}: rank 0 never left call 0"
            got += [f.allreduce(inputs[r][n].copy(), out=inputs[r][n].copy()) for n in (1, 2)]
            return got + [(f.failovers, f.on_fallback)]
        finally:
            f.close()

    got = run_ranks(rank)
    for r in range(W):
        for n in range(3):
            assert np.array_equal(got[r][n], want[n]), (r, n)
        assert got[r][3] == (1, True)
