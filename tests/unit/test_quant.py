"""Quantization: never overflows for N workers, and the sum is within the documented bound of a
float64 reference on adversarial inputs (simulated: quantize per rank, int32 sum, dequantize)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nicoffload.errors import InputError
from nicoffload.wire import quant

E = 256


def simulate(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """What the aggregator and workers compute together, without a network."""
    n = arrays[0].size
    world = len(arrays)
    nb = -(-n // E)
    blocks = []
    for a in arrays:
        b = np.zeros((nb, E), dtype=a.dtype)
        b.reshape(-1)[:n] = a
        blocks.append(b)
    exps = np.max([quant.block_exponents(b) for b in blocks], axis=0)
    exps = np.where(exps == quant.ZERO_EXP, 0, exps)
    shifts = quant.shifts_for(exps, world)
    qs = [quant.quantize(b, shifts) for b in blocks]
    lim = 2 ** 30
    for q in qs:  # each rank's values leave room for the sum of all
        assert np.abs(q.astype(np.int64)).max() <= lim // (1 << quant.headroom_bits(world))
    total = np.sum(np.stack(qs).astype(np.int64), axis=0)
    assert np.abs(total).max() < 2 ** 31, "the int32 sum would overflow"
    out = quant.dequantize(total.astype(np.int32), shifts, arrays[0].dtype).reshape(-1)[:n]
    bound = np.repeat(quant.error_bound(exps, world), E)[:n]
    return out, bound


def check(arrays):
    out, bound = simulate(arrays)
    ref = np.sum(np.stack(arrays).astype(np.float64), axis=0)
    with np.errstate(over="ignore"):  # the spacing of float32's largest finite value is inf
        half_ulp = np.spacing(np.abs(ref).astype(arrays[0].dtype)).astype(np.float64) / 2
    err = np.abs(out.astype(np.float64) - ref)
    assert (err <= bound + half_ulp).all(), f"max excess {np.max(err - bound - half_ulp)}"


F32_MAX = np.finfo(np.float32).max


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 32])
def test_every_rank_at_the_maximum(world):
    check([np.full(1000, F32_MAX / 64, dtype=np.float32)] * world)
    check([np.full(999, -F32_MAX / 64, dtype=np.float32)] * world)


def test_huge_and_tiny_values_in_one_tensor_mixed_signs_denormals_odd_length():
    rng = np.random.default_rng(0)
    arrays = []
    for r in range(4):
        a = rng.standard_normal(E * 7 + 13).astype(np.float32)
        a[:E] *= 1e30          # huge block
        a[E:2 * E] *= 1e-30    # tiny block
        a[2 * E:2 * E + 5] = [1e-45, -1e-45, 3e-42, 0.0, -0.0]  # denormals in a normal block
        a[3 * E:4 * E] = 0     # a zero block
        a[4 * E] = 1e20 * (-1) ** r  # one huge value among small ones
        arrays.append(a)
    check(arrays)


def test_float64_inputs():
    rng = np.random.default_rng(1)
    check([rng.standard_normal(3 * E + 1) * 1e200 for _ in range(3)])
    check([rng.standard_normal(3 * E + 1) * 1e-300 for _ in range(3)])


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 8), n=st.integers(1, 700), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-40, 1e-20, 1e-3, 1.0, 1e10, 1e30, 1e37]))
def test_bound_holds_on_random_inputs(world, n, seed, scale):
    rng = np.random.default_rng(seed)
    lim = float(F32_MAX) / world  # finite inputs whose sum float32 can hold
    arrays = [np.clip(rng.standard_normal(n) * scale * rng.choice([1e-6, 1, 10], size=n), -lim, lim)
              .astype(np.float32) for _ in range(world)]
    check(arrays)


def test_f32_fast_path_equals_float64_path():
    rng = np.random.default_rng(2)
    b = rng.standard_normal((64, E)).astype(np.float32) * np.logspace(-30, 30, 64, dtype=np.float32)[:, None]
    s = quant.shifts_for(quant.block_exponents(b), 4)
    q64 = np.rint(np.ldexp(b.astype(np.float64), s[:, None].astype(np.int32))).astype(np.int32)
    assert np.array_equal(quant.quantize(b, s), q64)
    d64 = np.ldexp((q64 * 3).astype(np.float64), (-s)[:, None].astype(np.int32)).astype(np.float32)
    assert np.array_equal(quant.dequantize(q64 * 3, s, np.float32), d64)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused(bad):
    a = np.ones(10, dtype=np.float32)
    a[3] = bad
    with pytest.raises(InputError, match="non-finite"):
        quant.check_finite(a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_non_finite_block_sends_a_refusal_that_wins_the_max_and_names_the_rank(dtype):
    """A block holding a NaN or an Inf gets a refusal code (NaN over Inf) naming the rank; the
    other blocks keep their exponents. After the MAX of every rank's codes each rank refuses:
    the one that holds the value names its index, the others the rank, the kind and the block."""
    from nicoffload.datapath.tensors import block_exponents, refuse_together

    clean = np.linspace(-3, 5, 1000).astype(dtype)
    x = clean.copy()
    x[[300, 301, 700]] = [np.inf, np.nan, -np.inf]
    exps = np.empty(4, np.int32)
    assert block_exponents(x, E, exps, rank=5) == 300
    want = np.empty(4, np.int32)
    assert block_exponents(clean, E, want, rank=5) == -1 and int(want.max()) < quant.REFUSE_EXP
    assert list(exps[[0, 3]]) == list(want[[0, 3]])  # blocks after the first bad one still measured
    assert quant.refusal(int(exps[1])) == (quant.REFUSE_NAN, 5)  # the NaN wins over the Inf beside it
    assert quant.refusal(int(exps[2])) == (quant.REFUSE_INF, 5)
    assert quant.refusal(int(want[0])) is None
    gexp = np.maximum(exps, want)  # the metadata round's MAX with a clean rank
    with pytest.raises(InputError, match=r"rank 5's input holds a non-finite value \(Inf at flat index 300\)"):
        refuse_together(gexp, 5, x, 300, E)
    with pytest.raises(InputError, match=r"rank 5's input holds a non-finite value \(NaN\) in elements "
                                         r"256\.\.511 and 1 more block\(s\); every rank refuses") as e:
        refuse_together(gexp, 0, clean, -1, E)
    # what a call over part of a tensor (a shard) needs to name the place in the whole one
    assert (e.value.rank, e.value.kind, e.value.span, e.value.more, e.value.index) == (5, "NaN", (256, 512), 1, None)
    refuse_together(want, 0, clean, -1, E)  # nothing refused: no error
