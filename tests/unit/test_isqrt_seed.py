"""The per-element integer square root of the XDP AdamW update (isqrt62 in xdp/fixed.h), step by
step in numpy with the header's own constants: a quadratic seed on the operand normalised by a
power of four, two Newton steps and one correction must give floor(sqrt(t)) for every
0 <= t < 2^62, as the model (nicoffload.optim.adamw.isqrt) does. tests/bpf/test_isqrt.py runs the
compiled C on the same operands."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from nicoffload.optim import adamw
from nicoffload.wire import proto

U = np.uint64
LIMIT = 1 << 62
#: the seed's relative error bound the header states (0.503%)
SEED_BOUND = 0.00503


def constants() -> dict[str, int]:
    text = (proto.xdp_dir() / "fixed.h").read_text()
    found = dict(re.findall(r"^#define\s+(ISQRT_C[012])\s+\(?(-?\d+)LL\)?\s*$", text, re.M))
    assert sorted(found) == ["ISQRT_C0", "ISQRT_C1", "ISQRT_C2"], found
    return {k: int(v) for k, v in found.items()}


C = constants()


def bit_length(t: np.ndarray) -> np.ndarray:
    """fixed.h's bit_length: bits of each uint64 (0 for 0), the bits below the highest set and
    counted."""
    v = t.copy()
    for k in (1, 2, 4, 8, 16, 32):
        v |= v >> U(k)
    v -= (v >> U(1)) & U(0x5555555555555555)
    v = (v & U(0x3333333333333333)) + ((v >> U(2)) & U(0x3333333333333333))
    v = (v + (v >> U(4))) & U(0x0F0F0F0F0F0F0F0F)
    return (v * U(0x0101010101010101)) >> U(56)


def seed(u: np.ndarray) -> np.ndarray:
    """2^30 sqrt(u / 2^20) for u in [2^20, 2^22): the quadratic, in the C's integer steps."""
    u = u.astype(np.int64)
    p = np.int64(C["ISQRT_C1"]) + ((np.int64(C["ISQRT_C2"]) * u) >> np.int64(20))
    return (np.int64(C["ISQRT_C0"]) + ((p * u) >> np.int64(20))).astype(U)


def isqrt62(t, *, corrected: bool = True) -> np.ndarray:
    """isqrt62, line by line (uint64 wraps as the C's u64; corrected=False stops before the last
    line: floor(sqrt(t)) or one more)."""
    t = np.asarray(t, dtype=U)
    e = (bit_length(t) + U(1)) >> U(1)
    u = (t << (U(62) - U(2) * e)) >> U(40)
    r = (seed(u) >> (U(31) - e)) | U(2)
    r = (r + t // r) >> U(1)
    r = (r + t // r) >> U(1)
    if not corrected:
        return r
    return r - (r * r > t).astype(U)  # signmask(t - r * r): r * r <= 2^62


def edge_operands(rng) -> np.ndarray:
    """0 to 3, powers of two and their neighbours, perfect squares and squares +- 1 across the
    whole range, and operands of every bit length."""
    k = np.concatenate([np.arange(1, 1 << 12), (1 << 31) - np.arange(1, 1 << 12),
                        [1 << i for i in range(31)], [(1 << i) + 1 for i in range(31)],
                        [(1 << i) - 1 for i in range(1, 32)], rng.integers(1, 1 << 31, 1 << 16)]).astype(object)
    squares = np.concatenate([k * k + d for d in (-1, 0, 1)])
    pow2 = [(1 << i) + d for i in range(63) for d in (-1, 0, 1)]
    bits = rng.integers(0, 63, 1 << 16)
    spread = [int(x) >> (62 - int(b)) for x, b in zip(rng.integers(0, LIMIT, 1 << 16, dtype=np.uint64), bits)]
    vals = [int(v) for v in np.concatenate([squares, pow2, spread, [0, 1, 2, 3, LIMIT - 1]])]
    return np.array(sorted({v for v in vals if 0 <= v < LIMIT}), dtype=U)


def exact(t: np.ndarray) -> np.ndarray:
    return np.array([math.isqrt(int(x)) for x in t], dtype=U)


def test_the_seed_is_within_its_bound_for_every_normalised_operand():
    u = np.arange(1 << 20, 1 << 22, dtype=np.int64)
    y = seed(u).astype(np.float64)
    lo = y / np.sqrt(u.astype(np.float64) * 2.0 ** 40) - 1       # X = u / 2^20 exactly
    hi = y / np.sqrt((u + 1).astype(np.float64) * 2.0 ** 40) - 1  # the bottom 40 bits of x all ones
    assert max(np.abs(lo).max(), np.abs(hi).max()) < SEED_BOUND


def test_every_operand_below_2_to_the_24():
    """Where the seed's shift back loses too much for the bound of the header's argument."""
    for a in range(0, 1 << 24, 1 << 22):
        t = np.arange(a, a + (1 << 22), dtype=U)
        s = np.floor(np.sqrt(t.astype(np.float64))).astype(U)  # exact this far
        assert np.array_equal(isqrt62(t), s), a


def test_edge_operands_across_the_whole_range():
    t = edge_operands(np.random.default_rng(31))
    want = exact(t)
    got = isqrt62(t)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(int(t[i]), int(got[i]), int(want[i])) for i in bad[:5]]
    # the model the kernel is checked against bit for bit computes the same
    assert np.array_equal(adamw.isqrt(t.astype(np.int64)).astype(U), want)


@pytest.mark.parametrize("e", [1, 2, 7, 13, 20, 26, 31])
def test_newton_leaves_at_most_one_to_correct_at_the_ends_of_each_seed(e):
    """Within the operands of one normalised u the seed is one value: the error before the
    correction is largest at the ends of the range of t that maps to it."""
    sh = 62 - 2 * e
    u = np.random.default_rng(e).integers(1 << 20, 1 << 22, 1 << 16).astype(U)
    if sh >= 40:
        ends = [(u << U(40)) >> U(sh)]
    else:
        lo = u << U(40 - sh)
        ends = [lo, lo + U(1), ((u + U(1)) << U(40 - sh)) - U(1), ((u + U(1)) << U(40 - sh)) - U(2)]
    t = np.concatenate(ends)
    t = t[(t >= U(1) << U(2 * e - 2)) & (t < U(1) << U(2 * e))]
    s = exact(t)
    d = isqrt62(t, corrected=False).astype(np.int64) - s.astype(np.int64)
    assert d.min() >= 0 and d.max() <= 1
    assert np.array_equal(isqrt62(t), s)


def test_bit_length_of_any_u64():
    v = [0, 1, 2, 3] + [(1 << i) + d for i in range(2, 64) for d in (-1, 0, 1)] + [(1 << 64) - 1]
    v += [int(x) for x in np.random.default_rng(64).integers(0, 1 << 63, 1000, dtype=np.uint64)]
    got = bit_length(np.array(v, dtype=U))
    assert got.tolist() == [x.bit_length() for x in v]


def test_random_operands():
    rng = np.random.default_rng(62)
    t = rng.integers(0, LIMIT, 1 << 18, dtype=np.uint64) >> rng.integers(0, 63, 1 << 18).astype(U)
    assert np.array_equal(isqrt62(t), exact(t))


def test_bitlens_de_bruijn_table_maps_each_power_of_two_back_to_its_exponent():
    """fixed.h's bitlen: the top 6 bits of 2^n * BITLEN_DEBRUIJN index the table at n, for every
    n <= 63 (the table is the 8 little-endian u64 bitlen_table stores)."""
    text = (proto.xdp_dir() / "fixed.h").read_text()
    deb = int(re.search(r"#define BITLEN_DEBRUIJN (0x[0-9a-f]+)ULL", text).group(1), 16)
    body = text[text.index("void bitlen_table"):text.index("static __always_inline u64 bitlen(")]
    words = dict((int(i), int(v, 16)) for i, v in re.findall(r"tab\[(\d)\] = (0x[0-9a-f]+)ULL", body))
    assert sorted(words) == list(range(8))
    table = b"".join(words[i].to_bytes(8, "little") for i in range(8))
    assert [table[((1 << n) * deb % (1 << 64)) >> 58] for n in range(64)] == list(range(64))
