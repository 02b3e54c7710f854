"""The kernel's integer square roots (xdp/fixed.h, compiled on its own into a small XDP program
and run with BPF_PROG_TEST_RUN): isqrt62, AdamW's per-element square root, and isqrt64, the
once-per-block one, give floor(sqrt(t)) bit for bit as math.isqrt and the model
(nicoffload.optim.adamw.isqrt) do, on perfect squares and their neighbours, powers of two and
operands of every bit length up to 2^62 - 1 (tests/unit/test_isqrt_seed.py checks the
algorithm step by step); bit_length on any u64, and bitlen, by its de Bruijn table, which the seed
and the update use per element, on any below 2^63."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from nicoffload.ebpf import libbpf
from nicoffload.ebpf import loader as bpf
from nicoffload.optim import adamw

NV = 32
SRC = r"""
#include <uapi/linux/bpf.h>
#include "fixed.h"

/* each of the frame's first NV u64 operands t: isqrt62(t) in its place, isqrt64(t) NV further,
 * bit_length(t) 2 NV further, bitlen(t) 3 NV further, bitlen32(t >> 31) 4 NV further */
int isqrt_run(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    u64 *v = data;
    u64 tab[8];
    if ((void *)(v + 5 * NV) > end)
        return XDP_ABORTED;
    bitlen_table(tab);
#pragma unroll
    for (int j = 0; j < NV; j++) {
        u64 t = v[j];
        v[j] = isqrt62(t, (const u8 *)tab);
        v[NV + j] = isqrt64(t);
        v[2 * NV + j] = bit_length(t);
        v[3 * NV + j] = bitlen(t, (const u8 *)tab);
        v[4 * NV + j] = bitlen32(t >> 31, (const u8 *)tab);
    }
    return XDP_TX;
}
"""


@pytest.fixture(scope="module")
def prog():
    b = bpf.compile_bpf("isqrt_run.c", {"NV": NV}, text=SRC)
    try:
        yield bpf.load_func(b, "isqrt_run", source_name="isqrt_run.c")
    finally:
        b.cleanup()


def run(fn, t: list[int]) -> tuple[list[int], ...]:
    """The kernel's isqrt62, isqrt64, bit_length, bitlen and bitlen32(t >> 31) of each operand,
    NV per test run."""
    out: tuple[list[int], ...] = ([], [], [], [], [])
    for i in range(0, len(t), NV):
        chunk = t[i:i + NV]
        res = libbpf.test_run(fn.fd, struct.pack(f"<{NV}Q", *chunk, *[0] * (NV - len(chunk))) + bytes(32 * NV))
        assert res.verdict == libbpf.XDP_TX
        vals = struct.unpack(f"<{5 * NV}Q", res.data[:40 * NV])
        for k in range(5):
            out[k].extend(vals[k * NV:k * NV + len(chunk)])
    return out


def operands() -> list[int]:
    rng = np.random.default_rng(2 ** 31)
    k = ([1 << i for i in range(31)] + [(1 << i) - 1 for i in range(2, 32)] + list(range(1, 300))
         + [(1 << 31) - i for i in range(1, 300)] + [int(x) for x in rng.integers(2, 1 << 31, 2000)])
    squares = [x * x + d for x in k for d in (-1, 0, 1)]
    pow2 = [(1 << i) + d for i in range(63) for d in (-1, 0, 1)]
    spread = [int(x) >> int(b) for x, b in zip(rng.integers(0, 1 << 62, 4000, dtype=np.uint64),
                                               rng.integers(0, 63, 4000))]
    return sorted({v for v in squares + pow2 + spread + [0, 1, 2, 3, (1 << 62) - 1] if 0 <= v < 1 << 62})


def test_the_kernels_square_roots_are_exact_across_the_range(prog):
    t = operands()
    r62, r64 = run(prog, t)[:2]
    want = [math.isqrt(x) for x in t]
    bad = [(x, g, w) for x, g, w in zip(t, r62, want) if g != w]
    assert not bad, bad[:5]
    assert r64 == want
    assert adamw.isqrt(np.array(t, np.int64)).tolist() == want  # the model's, which the update follows


def test_isqrt64_takes_2_to_the_62_itself(prog):
    """The once-per-block root's operand bc2 << 30 reaches 2^62 (bc2 = 1); isqrt62's stops below."""
    r64 = run(prog, [1 << 62, (1 << 62) - 1])[1]
    assert r64 == [1 << 31, (1 << 31) - 1]


def test_bit_length_of_any_u64(prog):
    """(above 2^62 the square roots' results are not looked at: outside isqrt62's operands)"""
    v = [0, 1, 2, 3] + [(1 << i) + d for i in range(2, 64) for d in (-1, 0, 1)] + [(1 << 64) - 1]
    v += [int(x) for x in np.random.default_rng(64).integers(0, 1 << 63, 1000, dtype=np.uint64)]
    assert run(prog, v)[2] == [x.bit_length() for x in v]


def test_bitlen_by_its_table_below_2_to_the_63(prog):
    """the per-element bit length: every n from 0 to 63 must come back from its table entry"""
    v = [0, 1, 2, 3] + [(1 << i) + d for i in range(2, 63) for d in (-1, 0, 1)] + [(1 << 63) - 1]
    v += [int(x) >> int(b) for x, b in zip(np.random.default_rng(63).integers(0, 1 << 63, 1000, dtype=np.uint64),
                                           np.random.default_rng(62).integers(0, 63, 1000))]
    got = run(prog, v)
    assert got[3] == [x.bit_length() for x in v]
    # AdamW's normalising shift: the bits above 31 of an operand below 2^63
    assert got[4] == [max(0, x.bit_length() - 31) for x in v]
