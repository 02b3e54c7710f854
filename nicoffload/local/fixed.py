"""The fixed point of the host's sums, bit for bit the aggregator's (:mod:`nicoffload.wire.quant`):
every rank's floats become offset-binary lanes with the exponents of the whole group (quantized
by the local rank that sums their share, as it sums them: :func:`quantize_sum`), the host adds
them as integers, the hosts add their sums as integers (through any collective that
sums int32 exactly), and the total decodes as the aggregator's result does (``pump.unfix``).
Integer sums do not depend on their order, so a job of H hosts with K ranks each returns the same
bits as one of H*K hosts with one rank each.

Lanes: 32-bit (one int32 word per element, rint(x * 2^s) + bias) or 16-bit (two per int32
word). With every one of the W contributions (the group's ranks) below 2 * bias, and W * 2 * bias <= 2^31
(2^15 for 16-bit lanes), no lane of a sum overflows, nor carries into its neighbour: the int32
sum of the words is the words of the lane sums.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from nicoffload.datapath import pump
from nicoffload.datapath.kernels import F32_SHIFT_LIMIT, U, pow2_split
from nicoffload.datapath.tensors import block_exponents
from nicoffload.wire import quant


@njit(cache=True, boundscheck=False, nogil=True)
def quantize_sum(xs, n, lo, hi, E, gexp, top, bias, single, pad, lanes):
    """The host's sum of blocks [lo, hi) straight from every local rank's floats ``xs`` (K rows
    of ``n``): per element k of block b, ``pad`` + the sum over the rows of rint(xs[r, k] * 2^s)
    + bias with s = top - gexp[b] (the aggregator's encode, kernels.encode_float / encode_half,
    element for element), int32 wrapping, into ``lanes`` (int32, or the int16 view of the
    words for 16-bit lanes: each lane's sum wraps to its 16 bits, which are the words' sum's, as
    no lane's sum carries into its neighbour). Blocks zero on every rank (gexp == ZERO_EXP) and
    the lanes past ``n`` hold ``pad`` (every rank's lanes there are 0). One pass over the K
    rows' share, whose quantized values never go to memory."""
    K = xs.shape[0]
    b32 = np.int32(bias)
    p = np.int32(pad)
    zero = np.int32(quant.ZERO_EXP)
    acc = np.empty(E, np.int32)
    for b in range(lo, hi):
        first = U(b * E)
        cnt = min(E, n - b * E)
        for k in range(E):
            acc[k] = p
        g = gexp[b]
        if g != zero:
            s = top - g
            if single and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
                f = np.float32(math.ldexp(1.0, s))
                for r in range(K):
                    for k in range(cnt):
                        acc[k] = np.int32(acc[k] + (np.int32(np.rint(np.float32(xs[r, first + U(k)]) * f)) + b32))
            else:
                d1, d2 = pow2_split(s)
                for r in range(K):
                    for k in range(cnt):
                        acc[k] = np.int32(acc[k] + (np.int32(np.rint(np.float64(xs[r, first + U(k)]) * d1 * d2))
                                                    + b32))
        for k in range(E):
            lanes[first + U(k)] = acc[k]


def quantize(x: np.ndarray, E: int, gexp: np.ndarray, top: int, bias: int, single: bool,
             lanes: np.ndarray) -> None:
    """One rank's lanes of ``x`` (every block of it): rint(x * 2^s) + bias per element, blocks
    zero everywhere and the tail 0 (:func:`quantize_sum` of a single row, no pad)."""
    quantize_sum(x.reshape(1, -1), x.size, 0, len(gexp), E, gexp, top, bias, single, 0, lanes)


def exponents_and_copy(x: np.ndarray, E: int, exps: np.ndarray, dst: np.ndarray, rank: int) -> int:
    """:func:`~nicoffload.datapath.tensors.block_exponents` of ``x`` into ``exps`` and ``x``
    copied into ``dst`` in one pass: a chunk at a time, the copy reads what the exponents just
    brought into the cache. Returns the flat index of the first non-finite value, or -1."""
    bad = -1
    step = max(1, EXP_CHUNK // E) * E
    for c in range(0, x.size, step):
        e = min(c + step, x.size)
        got = block_exponents(x[c:e], E, exps[c // E:-(-e // E)], rank)
        if got >= 0 and bad < 0:
            bad = c + got
        np.copyto(dst[c:e], x[c:e])
    return bad


#: elements of x the exponents and the copy take at a time (a chunk stays in the L2 cache)
EXP_CHUNK = 1 << 15
#: elements of a row the sums take at a time: K rows' chunks and the result stay in the L2 cache
ROW_CHUNK = 1 << 15


def sum_rows(rows: np.ndarray, lo: int, hi: int, pad: int, out: np.ndarray) -> None:
    """out[k] = sum over the rows of rows[:, k] + pad, k in [lo, hi), int32 wrapping (``out`` may
    be ``rows[0]``). A chunk at a time, a row at a time: whole-vector adds that the CPU does in
    SIMD, where a loop over the rows per element ran 4-6 times slower."""
    p = np.array([pad], np.int64).astype(np.int32)[0]  # two 16-bit pads in one word may pass 2^31: wrap
    for c in range(lo, hi, ROW_CHUNK):
        e = min(c + ROW_CHUNK, hi)
        o = out[c:e]
        np.add(rows[0, c:e], p, out=o)
        for r in range(1, rows.shape[0]):
            np.add(o, rows[r, c:e], out=o)


def max_rows(rows: np.ndarray, lo: int, hi: int, out: np.ndarray) -> None:
    """out[k] = max over the rows of rows[:, k], k in [lo, hi) (``out`` may be ``rows[0]``)."""
    for c in range(lo, hi, ROW_CHUNK):
        e = min(c + ROW_CHUNK, hi)
        o = out[c:e]
        if o.ctypes.data != rows[0, c:e].ctypes.data:
            o[:] = rows[0, c:e]
        for r in range(1, rows.shape[0]):
            np.maximum(o, rows[r, c:e], out=o)


def max_exps(rows, lo, hi, out):
    """The host's block exponents: out[b] = max over the rows (local ranks) of rows[:, b]."""
    max_rows(rows, lo, hi, out)


def decode(words: np.ndarray, E: int, gexp: np.ndarray, top: int, nb32: int, half: bool, lo_block: int,
           hi_block: int, n: int, out: np.ndarray) -> None:
    """Blocks [lo_block, hi_block) of the total ``words`` into ``out`` (float32/float64): per
    block (lane - nb32) * 2^-s (pump.unfix, the aggregator's decode: the same bits); blocks zero
    everywhere become 0."""
    blocks = np.arange(lo_block, hi_block, dtype=np.int64)
    g = gexp[lo_block:hi_block]
    active = g != quant.ZERO_EXP
    todo = np.empty((int(active.sum()), 5), np.int64)
    a = blocks[active]
    todo[:, 0] = a * E                                   # first lane
    todo[:, 1] = np.minimum(E, n - a * E)                # lanes
    todo[:, 2] = nb32
    todo[:, 3] = top - g[active].astype(np.int64)        # shift
    todo[:, 4] = a * E                                   # first element
    kind = pump.KIND_FLOAT32 if out.dtype == np.float32 else pump.KIND_FLOAT64
    f32 = out if kind == pump.KIND_FLOAT32 else np.empty(0, np.float32)
    f64 = out if kind == pump.KIND_FLOAT64 else np.empty(0, np.float64)
    pump.unfix(words.view(np.uint8), half, todo, len(todo), kind, f32, f64)
    for b in blocks[~active]:
        out[b * E:min(n, (b + 1) * E)] = 0


def to_keys(x: np.ndarray, op: str, keys: np.ndarray) -> None:
    """int32 keys whose signed order is the values' (worker.extremes: a float's bits with the
    magnitude bits of negatives flipped); MIN inverts every key."""
    bits = x.reshape(-1).view(np.int32)
    if x.dtype == np.float32:
        np.bitwise_xor(bits, (bits >> 31) & np.int32(0x7FFFFFFF), out=keys)
    else:
        keys[:] = bits
    if op == "min":
        np.invert(keys, out=keys)


def from_keys(keys: np.ndarray, op: str, dtype, out: np.ndarray) -> None:
    res = out.reshape(-1).view(np.int32)
    if op == "min":
        np.invert(keys, out=res)
    else:
        res[:] = keys
    if np.dtype(dtype) == np.float32:
        res ^= (res >> 31) & np.int32(0x7FFFFFFF)


def warm_up() -> None:
    """Compile (or load from the cache) the kernels before the first call."""
    w = np.zeros(4, np.int32)
    for x in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        xs = np.zeros((2, 2), x.dtype)
        quantize_sum(xs, 2, 0, 1, 2, np.zeros(1, np.int32), 28, 1, x.dtype == np.float32, 0, w)
        quantize_sum(xs, 2, 0, 1, 4, np.zeros(1, np.int32), 12, 1, x.dtype == np.float32, 0, w.view(np.int16))
