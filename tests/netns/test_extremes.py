"""``Communicator.allreduce(op="max"|"min")`` through the XDP aggregator's MAX op is exact for
int32 and float32 (signed zeros, infinities, subnormals, extremes), and a communicator that is
told how long the aggregator may stay silent (``silence``) fails within that time, naming the
aggregator, when it is unloaded under a call, instead of waiting out the progress timeout."""
from __future__ import annotations

import time

import numpy as np
import pytest
from e2ekit import run_ranks, xdp_comms

from nicoffload.errors import TimeoutError_


def test_max_and_min_are_exact_and_a_silent_aggregator_is_named(make_testbed):
    world = 3
    tb = make_testbed(world)
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)
    xs = []
    for r in range(world):
        f = (rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)
        f[:8] = np.roll(special, r)
        xs.append((f, rng.integers(-2 ** 31, 2 ** 31 - 1, 3001, dtype=np.int64).astype(np.int32)))
    agg, comms = xdp_comms(tb, world, 64, silence=2.0)
    try:
        def extremes(r):
            f, i = xs[r]
            return [comms[r].allreduce(a, op=op) for op in ("max", "min") for a in (f, i)]

        outs, errs = run_ranks(extremes, world, 60)
        assert not errs, errs
        for which, (op, k) in enumerate([(np.maximum, 0), (np.maximum, 1), (np.minimum, 0), (np.minimum, 1)]):
            want = xs[0][k]
            for r in range(1, world):
                want = op(want, xs[r][k])
            for r in range(world):
                got = outs[r][which]
                assert got.dtype == want.dtype and np.array_equal(got.view(np.int32), want.view(np.int32)) or \
                    np.array_equal(got, want), (which, r)
        assert agg.stats()["bad_op"] == 0
        # the aggregator goes away while rank 0 waits in a call: named within the silence, not the
        # 60 s progress timeout
        agg.close()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError_, match=f"aggregator {tb.agg.ip}:{tb.port} has not answered"):
            comms[0].allreduce(np.ones(4096, np.float32))
        assert time.monotonic() - t0 < 15
    finally:
        for c in comms:
            c.close()
        agg.close()
