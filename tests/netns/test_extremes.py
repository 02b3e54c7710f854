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
from nicoffload.wire import proto, quant


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


def test_a_nan_or_inf_on_one_rank_is_refused_by_every_rank_at_once_and_the_job_goes_on(make_testbed):
    """A NaN or an Inf in one rank's input: the metadata round carries its refusal, so every rank
    raises RefusedError naming that rank within the call (not a timeout blaming a silent rank), in
    a speculative call, a float64 call and one in 16-bit lanes; the calls after are right."""
    from nicoffload.errors import RefusedError
    from nicoffload.lab.reference import quantized

    world = 3
    tb = make_testbed(world)
    agg, comms = xdp_comms(tb, world, 64)
    rng = np.random.default_rng(6)
    cases = [(4096, np.float32, None, 32), (4096, np.float32, (1, 77, np.nan), 32),  # a guess exists: speculative
             (4096, np.float32, None, 32), (300_000, np.float64, (2, 123_456, -np.inf), 32),
             (300_000, np.float64, None, 32), (100_000, np.float32, (0, 5, np.inf), 16),
             (100_000, np.float32, None, 16)]
    try:
        for n, dtype, poison, lanes in cases:
            xs = [rng.standard_normal(n).astype(dtype) for _ in range(world)]
            if poison:
                r, i, v = poison
                xs[r][i] = v
            t0 = time.monotonic()
            outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r], lanes=lanes), world, 30)
            took = time.monotonic() - t0
            what = (n, np.dtype(dtype).name, poison, lanes)
            if poison is None:
                assert not errs, (what, errs)
                e = quantized(xs, lanes=lanes)
                assert all(e.check(o).within_bound for o in outs), what
                continue
            r, i, v = poison
            kind = "NaN" if np.isnan(v) else "Inf"
            assert took < 5 and sorted(k for k, _ in errs) == list(range(world)), (what, took, errs)
            block = quant.block_elems(proto.DEFAULT_ELEMS, lanes)
            lo = i // block * block
            for k, err in errs:
                assert isinstance(err, RefusedError), (what, k, err)
                says = f"({kind} at flat index {i})" if k == r else f"({kind}) in elements {lo}..{lo + block - 1}"
                assert f"rank {r}'s input holds a non-finite value {says}" in str(err), (what, k, err)
        assert agg.stats()["mismatch"] == 0
    finally:
        for c in comms:
            c.close()
        agg.close()
