"""Fused numeric kernels of the worker's hot path (numba, compiled once and cached on disk).

Each kernel makes one pass over its data and writes straight into the buffer that goes on the
wire or into the caller's output: no temporaries, no gathers, no Python per block.

    block_meta      per block: exponent of the largest magnitude (float) and whether it is
                    non-zero; NaN/Inf found on the way
    encode_*        records (header + payload) of this rank's rounds into the send buffer:
                    :mod:`.encode` (re-exported here, where the communicators call them)
    spec_plan, spec_verdict
                    a speculative call's rounds, and what its guess got right, in one pass
                    each (small calls: numpy's cost per call was most of their CPU)
    overtaken       the rounds of a sparse job that a loss, not a slower rank, left behind
    contributor_bits, reset_rounds, zero_blocks
                    a float call's OR word per block, a stream's per-round state, the output
                    of blocks zero everywhere
    keyed           whether every record of a received datagram carries the job's key

Receiving and decoding are in nicoffload.datapath.pump.

The wire layout comes from nicoffload.wire.proto (offsets of the C header); records are
proto.record_size(elems) bytes; header fields are big endian, payloads little endian.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from nicoffload.wire import proto, quant

_O = proto.FIELD_OFFSETS
O_TYPE, O_FLAGS, O_SET, O_RANK = _O["type"], _O["flags"], _O["set"], _O["rank"]
O_JOB, O_EPOCH, O_SLOT, O_ROUND = _O["job"], _O["epoch"], _O["slot"], _O["round"]
O_MASK, O_ACK, O_COUNT, O_EXP = _O["mask"], _O["ack"], _O["count"], _O["exp"]
O_OP, O_DETAIL, O_KEY = _O["op"], _O["detail"], _O["key"]
OP_SUM16 = proto.OP_SUM16
HDR = proto.HDR_LEN
T_RESULT, T_STATUS, T_ACK = proto.TYPE_RESULT, proto.TYPE_STATUS, proto.TYPE_ACK
RANK_AGG = proto.RANK_AGG
ZERO_EXP = np.iinfo(np.int32).min
REFUSE_EXP, REFUSE_INF, REFUSE_NAN = quant.REFUSE_EXP, quant.REFUSE_INF, quant.REFUSE_NAN
#: shifts whose 2^s and 2^-s are normal float32 numbers: the float32 path is exact there
F32_SHIFT_LIMIT = 100
#: The kernels index whole arrays with unsigned indices (``a[U(at) + U(k)]``) instead of taking
#: a slice per block or record. A slice is a new array: numba increments and decrements its
#: reference count with locked instructions, and a locked instruction waits for every load and
#: store before it. Per 1 KiB block that stall was the single hottest instruction of a rank
#: (perf, 16 MiB at 75% sparsity). Unsigned indices also skip numba's negative-index
#: wraparound, so that LLVM still vectorises the loops.
U = np.uint64





@njit(cache=True, inline="always")
def _be16(b, off):
    return (np.int64(b[off]) << 8) | np.int64(b[off + 1])


@njit(cache=True, inline="always")
def _be32(b, off):
    return ((np.int64(b[off]) << 24) | (np.int64(b[off + 1]) << 16) | (np.int64(b[off + 2]) << 8)
            | np.int64(b[off + 3]))


@njit(cache=True, inline="always")
def _put16(b, off, v):
    b[off] = (v >> 8) & 0xFF
    b[off + 1] = v & 0xFF


@njit(cache=True, inline="always")
def _put32(b, off, v):
    b[off] = (v >> 24) & 0xFF
    b[off + 1] = (v >> 16) & 0xFF
    b[off + 2] = (v >> 8) & 0xFF
    b[off + 3] = v & 0xFF


# --- per-block metadata ----------------------------------------------------------------------

@njit(cache=True, inline="always")
def keyed(buf, start, ln, seg, key_hi, key_lo):
    """Whether every record of the datagram at buf[start:start + ln] (records of ``seg`` bytes; 0:
    one) carries the job's key, given as its high and low 32 bits (the receive pump's check)."""
    if ln < HDR:
        return False
    if seg <= 0:
        seg = ln
    off = 0
    while off + HDR <= ln:
        o = start + off + O_KEY
        if _be32(buf, o) != key_hi or _be32(buf, o + 4) != key_lo:
            return False
        off += seg
    return True


@njit(cache=True, inline="always")
def _block_meta(u, elems, exps, emask, amask, mbits, inf_field, bias, tiny):
    """block_meta_* on the float's bits ``u``: ``emask``/``amask`` the exponent and magnitude
    masks, ``mbits`` the mantissa bits, ``inf_field`` the exponent field of Inf/NaN, ``bias``
    what makes frexp's exponent of the field, ``tiny`` the smallest subnormal.

    One pass per block: the largest magnitude's bits (sign masked off, compared as integers:
    a larger magnitude has larger bits) give its exponent field and, where that field is 0
    (zero or subnormals only), its mantissa. Elements are indexed from the whole array with
    unsigned indices (see U), never through a slice per block."""
    n = u.size
    first = -1
    for b in range(exps.size):
        lo = b * elems
        cnt = min(elems, n - lo)
        at = U(lo)
        mm = amask & 0
        for i in range(cnt):
            v = u[at + U(i)] & amask
            mm = v if v > mm else mm
        field = np.int32(mm >> mbits)
        if field == inf_field:  # Inf or NaN: the block refuses the call (NaN if it holds one)
            why = REFUSE_INF
            for i in range(cnt):
                v = u[at + U(i)]
                if v & emask == emask:
                    if first < 0:
                        first = lo + i
                    if v & amask != emask:
                        why = REFUSE_NAN
            exps[b] = REFUSE_EXP + (why << 16)
        elif field == 0:  # zero or subnormal only: the largest mantissa decides
            exps[b] = ZERO_EXP if mm == 0 else math.frexp(float(mm) * tiny)[1]
        else:
            exps[b] = field - bias
    return first


@njit(cache=True, boundscheck=False, nogil=True)
def block_meta_f32(x, elems, exps):
    """exps[b] = E with max|x| < 2^E in block b (math.frexp's exponent of the largest magnitude),
    ZERO_EXP for an all-zero block, REFUSE_EXP + (REFUSE_NAN << 16) for a block holding a NaN,
    REFUSE_EXP + (REFUSE_INF << 16) for one holding an Inf and no NaN. Returns the index of the
    first non-finite element, or -1.

    Works on the exponent fields: the largest magnitude has the largest exponent field, and for
    a normal number frexp's exponent is that field - 126; an all-ones field is Inf or NaN. One
    32-bit max per element (this vectorises); blocks without a normal number (zero or subnormal
    only) take an exact slow path."""
    return _block_meta(x.view(np.int32), elems, exps, np.int32(0x7F800000), np.int32(0x7FFFFFFF), 23, 0xFF, 126,
                       2.0 ** -149)


@njit(cache=True, boundscheck=False, nogil=True)
def block_meta_f64(x, elems, exps):
    """As block_meta_f32 for float64 (exponent field 11 bits, frexp's exponent = field - 1022)."""
    return _block_meta(x.view(np.int64), elems, exps, np.int64(0x7FF0000000000000),
                       np.int64(0x7FFFFFFFFFFFFFFF), 52, 0x7FF, 1022, 2.0 ** -1074)


@njit(cache=True, boundscheck=False, nogil=True)
def reset_rounds(done, status, pos, mine):
    """A stream's per-round state before it starts: no result (done 0), no STATUS heard (-1),
    and pos[i] = this rank's record of round i (j where mine[j] == i; -1 for the others)."""
    for i in range(done.size):
        done[i] = 0
        status[i] = -1
        pos[i] = -1
    for j in range(mine.size):
        pos[mine[j]] = j


@njit(cache=True, boundscheck=False, nogil=True)
def contributor_bits(exps, zero_exp, bit, bits):
    """bits[b] = ``bit`` where block b has a non-zero value (its exponent is not ``zero_exp``),
    else 0: a rank's word of the OR round that says who contributes where."""
    for b in range(exps.size):
        bits[b] = bit if exps[b] != zero_exp else 0


@njit(cache=True, boundscheck=False, nogil=True)
def spec_plan(gexp0, gbits0, exps, zero_exp, full, rank, top, k, meta_shift, blocks, masks, shifts, mine, keep):
    """The rounds of a speculative call, in one pass: k metadata rounds (round i on block i, all
    ranks, ``meta_shift``), then a round per block the guess has non-zero (``gexp0`` not
    ``zero_exp``), with the guessed contributors (``gbits0`` & ``full``; no bits: ``full``) and
    the shift ``top - gexp0``. This rank's rounds go to ``mine``. ``keep[b]`` is False where this
    rank's exponent outgrows the guess (it must send zeros there). Returns (guessed blocks,
    rounds of this rank, blocks it outgrew); the arrays need room for k + gexp0.size rounds."""
    has_bits = gbits0.size > 0
    for i in range(k):
        blocks[i] = i
        masks[i] = full
        shifts[i] = meta_shift
        mine[i] = i
    n = k
    m = k
    over = 0
    for b in range(gexp0.size):
        keep[b] = True
        g = gexp0[b]
        if g == zero_exp:
            continue
        mk = (np.int64(gbits0[b]) & full) if has_bits else full
        blocks[n] = b
        masks[n] = mk
        shifts[n] = top - g  # quant.shifts_for, with top = its lanes' bits less the headroom
        if (mk >> rank) & 1:
            mine[m] = n
            m += 1
        if exps[b] > g:
            keep[b] = False
            over += 1
        n += 1
    return n - k, m, over


@njit(cache=True, boundscheck=False, nogil=True)
def spec_verdict(gexp, gbits, blocks, k, n, gexp0, gbits0, zero_exp, full, hit, cover, redo, masks_redo):
    """What a speculative call got: ``hit[b]`` where block b's exponent (and contributors) are
    the guessed ones (its round's result is the normal call's); ``cover[b]`` where it has a
    result or needs a round (``hit`` or non-zero somewhere); the blocks to redo (non-zero
    somewhere, not hit) with their contributors in ``redo``/``masks_redo``. Returns (hits,
    whether some block has neither, blocks to redo, blocks zero everywhere)."""
    has_bits = gbits.size > 0
    for b in range(gexp.size):
        hit[b] = False
    hits = 0
    for j in range(k, n):
        b = blocks[j]
        h = gexp[b] == gexp0[b]
        if has_bits and gbits[b] != gbits0[b]:
            h = False
        if h:
            hit[b] = True
            hits += 1
    hole = False
    nredo = 0
    skipped = 0
    for b in range(gexp.size):
        mk = (np.int64(gbits[b]) & full) if has_bits else full
        active = mk != 0 if has_bits else gexp[b] != zero_exp
        if gexp[b] == zero_exp:
            skipped += 1
        cover[b] = hit[b] or active
        if not hit[b]:
            if active:
                redo[nredo] = b
                masks_redo[nredo] = mk
                nredo += 1
            else:
                hole = True
    return hits, hole, nredo, skipped


@njit(cache=True, boundscheck=False, nogil=True)
def zero_blocks(out, active, elems):
    """Write zeros over every block of ``out`` (viewed as int32 words, ``elems`` words per block)
    whose ``active`` flag is 0: blocks zero on every rank get no round."""
    n = out.size
    for b in range(active.size):
        if not active[b]:
            lo = b * elems
            at = U(lo)
            for k in range(min(elems, n - lo)):
                out[at + U(k)] = 0


@njit(cache=True, boundscheck=False, nogil=True)
def block_nonzero_i32(x, elems, out):
    """out[b] = 1 if block b of int32 x has a non-zero element, else 0."""
    n = x.size
    for b in range(out.size):
        lo = b * elems
        at = U(lo)
        m = np.int32(0)
        for i in range(min(elems, n - lo)):
            m |= x[at + U(i)]
        out[b] = 1 if m != 0 else 0



@njit(cache=True, boundscheck=False, nogil=True)
def overtaken(done, masks, head, hi, gap, out):
    """out[r] = 1 for each round r in [head, hi) without a result every one of whose contributors
    (``masks[r]``) has at least ``gap`` later rounds with a result, else 0: each rank sends in
    order, so all of r's records went out before those; in a sparse job a round waiting for a
    slower rank is otherwise overtaken by rounds of faster ones without any loss."""
    cnt = np.zeros(64, np.int64)  # completed rounds above r that hold each rank
    for r in range(hi - 1, head - 1, -1):
        m = np.uint64(masks[r])
        c = 0
        if done[r]:
            out[r] = 0
            while m:
                if m & np.uint64(1):
                    cnt[c] += 1
                m >>= np.uint64(1)
                c += 1
            continue
        ok = m != 0
        while m and ok:
            if m & np.uint64(1) and cnt[c] < gap:
                ok = False
            m >>= np.uint64(1)
            c += 1
        out[r] = 1 if ok else 0

# --- encoding --------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def pow2_split(s):
    """2^s as two float64 factors whose successive products with a float64 are exact except for
    the final rounding: 2^s and 1 where 2^s is a normal float64, else two halves (a block of
    float64 subnormals has s near 1100, whose 2^s alone would be inf)."""
    if -1000 < s < 1000:
        return math.ldexp(1.0, s), 1.0
    h = s // 2
    return math.ldexp(1.0, h), math.ldexp(1.0, s - h)


_warm: set = set()


def warm_up(elems: int) -> None:
    """Compile (or load from the on-disk cache) the metadata kernels for the argument types the
    worker uses, so that a communicator's first collective does not pay (the encoders:
    :func:`nicoffload.datapath.encode.warm_up`, which calls this)."""
    if elems in _warm:
        return
    for x in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        exps = np.zeros(1, np.int32)
        (block_meta_f32 if x.dtype == np.float32 else block_meta_f64)(x, elems, exps)
    block_nonzero_i32(np.zeros(2, np.int32), elems, np.zeros(1, np.uint8))
    for w in (np.zeros(2, np.int32), np.zeros(2, np.int64)):
        zero_blocks(w, np.zeros(1, np.bool_), elems)
    # the speculative call's plan and verdict (types as Communicator._speculative passes them)
    reset_rounds(np.zeros(1, np.uint8), np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64))
    zero_exp, i32 = int(np.iinfo(np.int32).min), np.zeros(1, np.int32)
    overtaken(np.zeros(1, np.uint8), np.zeros(1, np.int64), 0, 1, 3, np.zeros(1, np.uint8))
    contributor_bits(i32, zero_exp, np.int32(1), np.zeros(1, np.int32))
    b = np.zeros(2, np.bool_)
    spec_plan(i32, i32, i32, zero_exp, np.int64(1), 0, 30, 1, -(1 << 30), np.zeros(2, np.int64), np.zeros(2, np.int64),
              np.zeros(2, np.int32), np.zeros(2, np.int64), b[:1])
    spec_verdict(i32, i32, np.zeros(2, np.int64), 1, 1, i32, i32, zero_exp, np.int64(1), b[:1], b[1:],
                 np.zeros(1, np.int64), np.zeros(1, np.int64))
    _warm.add(elems)
