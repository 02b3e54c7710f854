"""The one reference of expected results and error bounds, and how the launcher classifies a
rank's failure by its exit code (no root, no sockets)."""
from __future__ import annotations

import numpy as np
import pytest

from nicoffload.errors import InputError, NicoffloadError, ProtocolError, TimeoutError_
from nicoffload.lab import reference
from nicoffload.lab.launcher import Outcome, error_class, failure
from nicoffload.wire import quant

E = 16


def fixed_point_sum(arrays, elems=E):
    """What the workers compute: per block the agreed exponent, int32 fixed point, summed, back."""
    n, world = arrays[0].size, len(arrays)
    nb = -(-n // elems)
    pads = [np.pad(a, (0, nb * elems - n)).reshape(nb, elems) for a in arrays]
    exps = np.max([quant.block_exponents(p) for p in pads], axis=0)
    active = exps != quant.ZERO_EXP
    shifts = quant.shifts_for(np.where(active, exps, 0), world)
    total = np.sum([quant.quantize(p, shifts) for p in pads], axis=0, dtype=np.int64).astype(np.int32)
    out = quant.dequantize(total, shifts, arrays[0].dtype)
    out[~active] = 0
    return out.reshape(-1)[:n]


def inputs(world=4, n=10 * E + 3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(dtype) for _ in range(world)]
    xs[0][:E] = 0  # a block zero on one rank
    for x in xs:
        x[E:2 * E] = 0  # and one zero on every rank
    return xs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_fixed_point_sum_is_within_the_bound_and_a_nudge_is_not(dtype):
    xs = inputs(dtype=dtype)
    want = reference.quantized(xs, E)
    got = fixed_point_sum(xs)
    check = want.check(got)
    assert check.within_bound, check.reason
    assert check.max_abs_err > 0  # fixed point does round: the bound is doing work
    bad = got.copy()
    i = 5 * E + 1
    bad[i] += dtype(3 * want.bound[i])
    check = want.check(bad)
    assert not check.within_bound and f"element {i}" in check.reason
    assert (want.bound[E:2 * E] <= np.spacing(np.float32(0))).all()  # a block zero everywhere is exact


def test_host_float32_sums_are_within_their_bound_in_any_order():
    xs = inputs(world=5, seed=1)
    want = reference.host_sum(xs)
    rng = np.random.default_rng(2)
    for _ in range(5):
        acc = np.zeros_like(xs[0])
        for r in rng.permutation(len(xs)):
            acc += xs[r]  # float32 rounding at every step
        assert want.check(acc).within_bound
    assert not want.check(acc + np.float32(1e3) * want.bound.astype(np.float32)).within_bound


def test_integers_are_exact_modulo_their_width():
    xs = [np.full(7, 2**30, np.int32) for _ in range(4)]  # the sum, 2^32, wraps to 0 in int32
    want = reference.quantized(xs)
    assert want.bound is None and want.exact.dtype == np.int64 and want.exact[0] == 2**32
    assert want.check(np.zeros(7, np.int32)).within_bound
    assert reference.host_sum(xs).check(np.zeros(7, np.int32)).max_abs_err == 0
    off = np.zeros(7, np.int32)
    off[3] = 1
    check = want.check(off)
    assert not check.within_bound and check.reason == "int32 sum not exact at 1 elements (first 3)"
    assert not want.check(np.zeros(6, np.int32)).within_bound  # a short result


def test_quantized_or_host_by_system():
    xs = inputs(world=2)
    assert np.array_equal(reference.expected(xs, True, E).bound, reference.quantized(xs, E).bound)
    assert np.array_equal(reference.expected(xs, False, E).bound, reference.host_sum(xs).bound)


@pytest.mark.parametrize("code,cls", [(None, TimeoutError_), (9, TimeoutError_), (8, ProtocolError), (2, InputError),
                                      (1, NicoffloadError), (-9, NicoffloadError), (42, NicoffloadError)])
def test_exit_codes_name_the_error_class(code, cls):
    assert error_class(code) is cls


def test_failure_names_every_rank_once_and_takes_their_class():
    ok = Outcome("rank 0", 0)
    t1 = Outcome("rank 1", 9, stderr="nicoffload: error: rank 1: allreduce timed out: no JOIN from rank(s) 2\n")
    t2 = Outcome("rank 2", None, waited=30.2)
    assert failure([ok]) is None
    err = failure([ok, t1, t2], "job: ")
    assert type(err) is TimeoutError_
    assert str(err) == ("job: rank 1: allreduce timed out: no JOIN from rank(s) 2; "
                        "rank 2: did not finish within 30s (killed)")
    p = Outcome("rank 3", 8, stderr="[W noise]\nanother run of the job has started\n[W more noise]\n")
    mixed = failure([t1, p])
    assert type(mixed) is NicoffloadError and "rank 3: another run of the job has started" in str(mixed)
    assert "rank 4: killed by signal 9" in failure([Outcome("rank 4", -9)]).args[0]
