"""16-bit lanes (op SUM16, ``--lanes 16``): floats summed in 16-bit offset-binary fixed point,
four lanes per 64-bit word of the aggregator's adds. Bit for bit the numpy model of the scheme
(nicoffload.wire.quant at 16 bits) on adversarial inputs, so within its error bound, with half
the data records of 32-bit lanes; through the XDP aggregator (where the lanes' sums reach their
ceiling of 2^15 exactly) and the user-space one under 2% drop and 2% duplication."""
from __future__ import annotations

import numpy as np
from e2ekit import save

from nicoffload.jobspec import DEFAULT
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job
from nicoffload.wire import proto, quant

E = proto.DEFAULT_ELEMS
H = 2 * E  # elements per 16-bit block
HALF = DEFAULT.replace(lanes=16, timeout=20)


def model(arrays, lanes: int = 16) -> np.ndarray:
    """What the workers and the aggregator compute, in numpy: per block of the largest exponent
    over the ranks, rint(x * 2^s) summed exactly, scaled back once."""
    world, n = len(arrays), arrays[0].size
    per = quant.block_elems(E, lanes)
    nb = -(-n // per)
    pads = []
    for a in arrays:
        p = np.zeros(nb * per, a.dtype)
        p[:n] = a
        pads.append(p.reshape(nb, per))
    exps = np.max([quant.block_exponents(p) for p in pads], axis=0)
    active = exps != quant.ZERO_EXP
    shifts = quant.shifts_for(np.where(active, exps, 0), world, lanes)
    total = np.sum([quant.quantize(p, shifts).astype(np.int64) for p in pads], axis=0)
    assert np.abs(total).max() <= 1 << quant.top_bits(lanes)  # the lanes never carry
    out = quant.dequantize(total.astype(np.int32), shifts, arrays[0].dtype)
    out[~active] = 0
    return out.reshape(-1)[:n]


def adversarial(world: int, n: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 7, n)).astype(dtype) for _ in range(world)]
    below_one = np.nextafter(dtype(1), dtype(0))
    for r, x in enumerate(xs):
        x[0:H] = below_one             # every rank at the top of its block, same sign: the lanes'
        x[H:2 * H] = -below_one        # sum reaches 2^15 (and 0) exactly at world 4
        x[2 * H:3 * H] = 0
        x[2 * H + r] = 5e37            # one huge element among zeros
        x[3 * H:4 * H] = np.finfo(dtype).smallest_subnormal * (r + 1)  # subnormals only
        x[4 * H:5 * H] *= 1e-30
        x[4 * H] = 1e6 * (-1) ** r     # a large element over tiny ones: those round to 0
        x[(5 + r) * H:(6 + r) * H] = 0  # a block zero on one rank (a sparse round)
        x[12 * H:13 * H] = 0           # a block zero on every rank: no round at all
    return xs


def test_sixteen_bit_lanes_are_the_model_bit_for_bit_with_half_the_records(make_testbed, tmp_path):
    world = 4
    tb = make_testbed(world)
    n = 20 * H + 77  # a partial last block
    for dtype in (np.float32, np.float64):
        xs = adversarial(world, n, dtype, seed=16)
        d = tmp_path / np.dtype(dtype).name
        d.mkdir()
        ins, outs = save(d, xs)
        res = run_job(tb, ins, outs, "xdp", HALF)
        want = model(xs)
        bound = reference.quantized(xs, E, lanes=16)
        for r in range(world):
            got = np.load(outs[r])
            assert got.tobytes() == want.tobytes(), (dtype, r, np.flatnonzero(got != want)[:5])
            c = bound.check(got)
            assert c.within_bound, (dtype, r, c.reason)
        # the lanes at their ceiling: each rank's value rounds up to 2^12 / 2^12, the sum to 4
        assert got[:H].tolist() == [world] * H and got[H:2 * H].tolist() == [-world] * H
        # 16-bit blocks: a record per 2 * elems elements, none for the block zero everywhere
        assert res.ranks[0]["stats"]["results"] == -(-n // H) - 1
        assert res.agg_stats["mismatch"] == 0 and res.agg_stats["bad_len"] == 0
    # the same inputs in 32-bit lanes: twice the records, and 2^16 times tighter
    res32 = run_job(tb, ins, outs, "xdp", HALF.replace(lanes=32))
    # (zero everywhere in 32-bit blocks: the one above, and the second half of the huge elements' block)
    assert res32.ranks[0]["stats"]["results"] == -(-n // E) - 3
    assert np.load(outs[0]).tobytes() == model(xs, 32).tobytes()


def test_sixteen_bit_lanes_under_drop_and_duplication_are_bit_identical(make_testbed, tmp_path):
    world = 3
    tb = make_testbed(world)
    xs = adversarial(world, 150 * H, np.float32, seed=3)
    ins, clean = save(tmp_path, xs)
    tb.faults.configure(drop=0.02, dup=0.02, seed=7)
    run_job(tb, ins, clean, "userspace", HALF, reps=2)
    # the faults bit: the links dropped and duplicated packets (a rank's report holds only its last
    # call's counters, and with few, batched packets per rep the drops can all land in the first)
    fs = [d for link in tb.faults.stats().values() for d in link.values()]
    assert sum(d["dropped"] for d in fs) > 0 and sum(d["duplicated"] for d in fs) > 0
    want = model(xs)
    for r in range(world):
        assert np.load(clean[r]).tobytes() == want.tobytes(), r
