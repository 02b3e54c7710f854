"""``communicator(..., fallback="ring")``'s agreement on the call that was cut
(nicoffload.fallback.FailoverCommunicator), with three ranks as threads and stand-ins for the
aggregator and for the ring's exact int32 SUM and MAX: every rank ends each call with the same
bits, whichever call each lost and whatever part of it each held; and the wrong settings are
refused with a reason."""
from __future__ import annotations

import numpy as np
import pytest

from nicoffload.communicators import communicator
from nicoffload.errors import InputError
from nicoffload.fallback import FailoverCommunicator
from nicoffload.jobspec import DEFAULT

from failover_standins import W, LosingAggregator, ThreadSum, run_ranks, shared_state

N = 1000


def run(plans, calls=4):
    rng = np.random.default_rng(7)
    inputs = [[rng.integers(-2 ** 31, 2 ** 31 - 1, N, dtype=np.int64).astype(np.int32) for _ in range(calls)]
              for _ in range(W)]
    want = [np.sum([inputs[r][n] for r in range(W)], axis=0, dtype=np.int64).astype(np.int32) for n in range(calls)]
    shared = shared_state()

    def rank(r):
        f = FailoverCommunicator(LosingAggregator(r, want, *plans[r]), ThreadSum(r, shared))
        return [f.allreduce(inputs[r][n], out=inputs[r][n].copy() if n % 2 else inputs[r][n])
                for n in range(calls)] + [f.summary()]

    got = run_ranks(rank)
    for r in range(W):
        for n in range(calls):
            assert np.array_equal(got[r][n], want[n]), (r, n)
        assert got[r][calls]["failovers"] == 1 and got[r][calls]["on_fallback"], got[r][calls]
    return got


def test_every_rank_lost_the_same_call_holding_different_blocks():
    """Call 1 (in place: the blocks not back still hold the input): rank 0 holds blocks 0 and 2,
    rank 1 none, rank 2 block 3; blocks 1 comes from nobody and is summed again."""
    run({0: (1, [0, 2]), 1: (1, []), 2: (1, [3])})


def test_a_rank_a_call_behind_returns_and_joins_the_agreement_on_the_next_call():
    """Ranks 1 and 2 returned from call 1 (so every rank holds it) and lost call 2; rank 0 lost
    call 1 waiting for its gate, holding all of it."""
    run({0: (1, [0, 1, 2, 3]), 1: (2, [1]), 2: (2, [])})


def test_the_fallback_needs_the_ranks_and_a_known_path():
    base = dict(aggregator="10.0.0.1", spec=DEFAULT)
    with pytest.raises(InputError, match="fallback must be 'none' or 'ring'"):
        communicator(0, 2, fallback="gloo", peers=["10.0.0.2", "10.0.0.3"], **base)
    with pytest.raises(InputError, match="needs every rank's address"):
        communicator(0, 2, fallback="ring", **base)
    with pytest.raises(InputError, match="no failover"):
        communicator(0, 40, fallback="ring", peers=[f"10.0.1.{i}" for i in range(40)], **base)
    with pytest.raises(InputError, match="the ring mode has no aggregator to lose"):
        communicator(0, 2, mode="ring", fallback="ring", peers=["10.0.0.2", "10.0.0.3"], **base)
    with pytest.raises(InputError, match="positive number of seconds"):
        communicator(0, 2, fallback="ring", failover=0, peers=["10.0.0.2", "10.0.0.3"], **base)
