"""Records of this rank's rounds straight into the send buffer (numba, compiled once and cached
on disk): header from the call's template, then the payload of the round's block in one pass.

    encode_float    float -> offset-binary fixed point in 32-bit lanes (op SUM64, op SGD)
    encode_half     the same in 16-bit lanes (op SUM16)
    encode_int      int32 data (op SUM) or metadata words (ops MAX / OR), copied
    encode_pulls    PULL records (ask the aggregator for a round's result)

The byte helpers, offsets and pow2_split are :mod:`.kernels`' (shared with decoding).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from nicoffload.datapath import kernels
from nicoffload.datapath.kernels import (
    F32_SHIFT_LIMIT,
    HDR,
    O_COUNT,
    O_EXP,
    O_MASK,
    O_OP,
    O_ROUND,
    O_SET,
    O_SLOT,
    OP_SUM16,
    U,
    _put16,
    _put32,
    pow2_split,
)
from nicoffload.wire import proto


@njit(cache=True, inline="always")
def _header(buf, off, tmpl, r, nslots, mask, count, exp, op):
    """Header of round ``r`` (unwrapped round number of the epoch: slot r mod S, set (r div S)
    mod 2, wire round r mod 2^32) from the header template (magic, version, type, flags, rank,
    job, epoch, ack, the job's key)."""
    for k in range(HDR):
        buf[off + k] = tmpl[k]
    buf[off + O_SET] = (r // nslots) & 1
    _put32(buf, off + O_SLOT, r % nslots)
    _put32(buf, off + O_ROUND, r & 0xFFFFFFFF)
    _put32(buf, off + O_MASK, mask)
    _put16(buf, off + O_COUNT, count)
    _put16(buf, off + O_EXP, exp & 0xFFFF)
    buf[off + O_OP] = op


@njit(cache=True, boundscheck=False, nogil=True)
def encode_float(buf, rec, elems, tmpl, x, mine, base, nslots, blocks, masks, shifts, bias, single, first, op):
    """Record first + j of ``buf`` for this rank's round ``mine[j]`` (round base + mine[j]): header, then
    rint(x * 2^shift) + bias as unsigned 32-bit lanes (op SUM64: with |q| <= bias and
    2 * bias * ranks <= 2^31, the aggregator's 64-bit adds never carry from one lane into the
    next; op SGD adds the same way and then applies the job's optimizer). Elements beyond the tensor are 0. ``single``: x is float32, scaled in float32 where
    2^shift is a normal float32 (exact there); float64 input is always scaled in float64.
    The lanes are computed in int32 arithmetic (wrapping modulo 2^32 gives the unsigned lane's
    bits) so that the loop vectorises."""
    n = x.size
    w = buf.view(np.int32)
    b32 = np.int32(bias)
    for j in range(mine.size):
        i = mine[j]
        b = blocks[i]
        off = (first + j) * rec
        lo = b * elems
        cnt = min(elems, n - lo)
        s = shifts[i]
        _header(buf, off, tmpl, base + i, nslots, masks[i], cnt, s, op)
        p = U(off // 4 + HDR // 4)
        q = U(lo)
        if single and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
            f = np.float32(math.ldexp(1.0, s))
            for k in range(cnt):
                w[p + U(k)] = np.int32(np.rint(np.float32(x[q + U(k)]) * f)) + b32
        else:
            d1, d2 = pow2_split(s)
            for k in range(cnt):
                w[p + U(k)] = np.int32(np.rint(np.float64(x[q + U(k)]) * d1 * d2)) + b32
        for k in range(cnt, elems):
            w[p + U(k)] = 0


@njit(cache=True, boundscheck=False, nogil=True)
def encode_half(buf, rec, elems, tmpl, x, mine, base, nslots, blocks, masks, shifts, bias, single, first):
    """As encode_float with 16-bit lanes (op SUM16): 2 * ``elems`` elements per record, each
    rint(x * 2^shift) + bias as an unsigned 16-bit lane (with |q| <= bias and 2 * bias * ranks
    <= 2^15 no lane ever carries into the next in the aggregator's 64-bit adds)."""
    n = x.size
    h = buf.view(np.int16)
    per = 2 * elems
    b32 = np.int32(bias)
    for j in range(mine.size):
        i = mine[j]
        b = blocks[i]
        off = (first + j) * rec
        lo = b * per
        cnt = min(per, n - lo)
        s = shifts[i]
        _header(buf, off, tmpl, base + i, nslots, masks[i], cnt, s, OP_SUM16)
        p = U(off // 2 + HDR // 2)
        q = U(lo)
        if single and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
            f = np.float32(math.ldexp(1.0, s))
            for k in range(cnt):
                h[p + U(k)] = np.int16(np.int32(np.rint(np.float32(x[q + U(k)]) * f)) + b32)
        else:
            d1, d2 = pow2_split(s)
            for k in range(cnt):
                h[p + U(k)] = np.int16(np.int32(np.rint(np.float64(x[q + U(k)]) * d1 * d2)) + b32)
        for k in range(cnt, per):
            h[p + U(k)] = 0


@njit(cache=True, boundscheck=False, nogil=True)
def encode_int(buf, rec, elems, tmpl, x, mine, base, nslots, blocks, masks, op, first):
    """As encode_float for int32 data (op SUM) or metadata words (ops MAX / OR), from record
    ``first`` of ``buf`` on: the payload is copied; elements beyond the array are 0."""
    n = x.size
    w = buf.view(np.int32)
    for j in range(mine.size):
        i = mine[j]
        b = blocks[i]
        off = (first + j) * rec
        lo = b * elems
        cnt = min(elems, n - lo)
        _header(buf, off, tmpl, base + i, nslots, masks[i], cnt, 0, op)
        p = U(off // 4 + HDR // 4)
        q = U(lo)
        for k in range(cnt):
            w[p + U(k)] = x[q + U(k)]
        for k in range(cnt, elems):
            w[p + U(k)] = 0


@njit(cache=True, boundscheck=False, nogil=True)
def encode_pulls(buf, rec, tmpl, which, base, nslots, masks):
    """PULL records (full size, count 0, payload ignored) for rounds base + which[j]."""
    for j in range(which.size):
        i = which[j]
        off = j * rec
        _header(buf, off, tmpl, base + i, nslots, masks[i], 0, 0, 0)


def warm_up(elems: int) -> None:
    """Compile (or load from the on-disk cache) the encoders and the metadata kernels for the
    argument types the communicators use, before their first collective."""
    kernels.warm_up(elems)
    rec = proto.record_size(elems)
    buf = np.zeros(2 * rec, np.uint8)
    tmpl = np.zeros(HDR, np.uint8)
    one = np.zeros(1, np.int64)
    masks = np.ones(1, np.int64)
    shifts = np.zeros(1, np.int32)
    for x in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        encode_float(buf, rec, elems, tmpl, x, one, 0, 1, one, masks, shifts, 1, x.dtype == np.float32, 0,
                     proto.OP_SUM64)
        encode_half(buf, rec, elems, tmpl, x, one, 0, 1, one, masks, shifts, 1, x.dtype == np.float32, 0)
    encode_int(buf, rec, elems, tmpl, np.zeros(2, np.int32), one, 0, 1, one, masks, proto.OP_SUM, 0)
    encode_pulls(buf, rec, tmpl, one, 0, 1, masks)
