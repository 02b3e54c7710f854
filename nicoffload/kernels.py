"""Fused numeric kernels of the worker's hot path (numba, compiled once and cached on disk).

Each kernel makes one pass over its data and writes straight into the buffer that goes on the
wire or into the caller's output: no temporaries, no gathers, no Python per block.

    block_meta      per block: exponent of the largest magnitude (float) and whether it is
                    non-zero; NaN/Inf found on the way
    encode_*        records (header + payload) of this rank's rounds into the send buffer:
                    float -> offset-binary fixed point (op SUM64), int32 copied (op SUM), or
                    metadata words (ops MAX / OR)
    decode_results  every record of a batch of received datagrams: results dequantized (or
                    copied) into the output, STATUS records noted, everything else skipped

The wire layout comes from nicoffload.proto (offsets of the C header); records are
proto.record_size(elems) bytes; header fields are big endian, payloads little endian.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
from numba import njit, types

from . import proto

_O = proto.FIELD_OFFSETS
O_TYPE, O_FLAGS, O_SET, O_RANK = _O["type"], _O["flags"], _O["set"], _O["rank"]
O_JOB, O_EPOCH, O_SLOT, O_ROUND = _O["job"], _O["epoch"], _O["slot"], _O["round"]
O_MASK, O_ACK, O_COUNT, O_EXP = _O["mask"], _O["ack"], _O["count"], _O["exp"]
O_OP, O_DETAIL = _O["op"], _O["detail"]
HDR = proto.HDR_LEN
T_RESULT, T_STATUS, T_ACK = proto.TYPE_RESULT, proto.TYPE_STATUS, proto.TYPE_ACK
RANK_AGG = proto.RANK_AGG
ZERO_EXP = np.iinfo(np.int32).min
#: shifts whose 2^s and 2^-s are normal float32 numbers: the float32 path is exact there
F32_SHIFT_LIMIT = 100

# decode_results kinds: what a result's payload becomes
KIND_INT32 = 0    # copied (int32 data, metadata)
KIND_FLOAT32 = 1  # offset-binary fixed point -> float32
KIND_FLOAT64 = 2  # offset-binary fixed point -> float64

# libc's batch calls, called from the kernels by symbol name (so the compiled code caches on disk;
# a ctypes pointer would be baked in); pointers are passed as integers (the x86-64 ABI is the same)
_recvmmsg = types.ExternalFunction("recvmmsg", types.int32(types.int32, types.intp, types.uint32, types.int32,
                                                           types.intp))
_sendmmsg = types.ExternalFunction("sendmmsg", types.int32(types.int32, types.intp, types.uint32, types.int32))
MSG_DONTWAIT = 0x40
SOL_UDP, UDP_GRO = 17, 104
#: bytes before a control message's data (struct cmsghdr: len, level, type)
CMSG_HDR = ctypes.sizeof(ctypes.c_size_t) + 8

# decode_results return codes (besides the count of new results)
EV_STALE_EPOCH = 1  # a STATUS said this rank's epoch is over
D_EPOCH, D_WAITING = proto.DETAIL["epoch"], proto.DETAIL["waiting"]


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

@njit(cache=True, boundscheck=False)
def block_meta_f32(x, elems, exps):
    """exps[b] = E with max|x| < 2^E in block b (math.frexp's exponent of the largest magnitude),
    ZERO_EXP for an all-zero block. Returns the index of the first non-finite element, or -1.

    Works on the exponent fields: the largest magnitude has the largest exponent field, and for
    a normal number frexp's exponent is that field - 126; an all-ones field is Inf or NaN. One
    32-bit max per element (this vectorises); blocks without a normal number (zero or subnormal
    only) take an exact slow path."""
    u = x.view(np.int32)
    n = u.size
    for b in range(exps.size):
        lo = b * elems
        hi = min(lo + elems, n)
        s = u[lo:hi]
        m = np.int32(0)
        for i in range(hi - lo):
            v = s[i] & np.int32(0x7F800000)
            m = v if v > m else m
        field = m >> 23
        if field == 0xFF:
            for i in range(hi - lo):
                if s[i] & np.int32(0x7F800000) == np.int32(0x7F800000):
                    return lo + i
        if field == 0:  # zero or subnormal only: the largest mantissa decides
            mm = np.int32(0)
            for i in range(hi - lo):
                v = s[i] & np.int32(0x7FFFFFFF)
                mm = v if v > mm else mm
            exps[b] = ZERO_EXP if mm == 0 else math.frexp(float(mm) * 2.0 ** -149)[1]
        else:
            exps[b] = field - 126
    return -1


@njit(cache=True, boundscheck=False)
def block_meta_f64(x, elems, exps):
    """As block_meta_f32 for float64 (exponent field 11 bits, frexp's exponent = field - 1022)."""
    u = x.view(np.int64)
    n = u.size
    mask = np.int64(0x7FF0000000000000)
    for b in range(exps.size):
        lo = b * elems
        hi = min(lo + elems, n)
        s = u[lo:hi]
        m = np.int64(0)
        for i in range(hi - lo):
            v = s[i] & mask
            m = v if v > m else m
        field = np.int32(m >> 52)
        if field == 0x7FF:
            for i in range(hi - lo):
                if s[i] & mask == mask:
                    return lo + i
        if field == 0:
            mm = np.int64(0)
            for i in range(hi - lo):
                v = s[i] & np.int64(0x7FFFFFFFFFFFFFFF)
                mm = v if v > mm else mm
            exps[b] = ZERO_EXP if mm == 0 else math.frexp(float(mm) * 2.0 ** -1074)[1]
        else:
            exps[b] = field - 1022
    return -1


@njit(cache=True, boundscheck=False)
def zero_blocks(out, active, elems):
    """Write zeros over every block of ``out`` (viewed as int32 words, ``elems`` words per block)
    whose ``active`` flag is 0: blocks zero on every rank get no round."""
    n = out.size
    for b in range(active.size):
        if not active[b]:
            lo = b * elems
            s = out[lo:min(lo + elems, n)]
            for k in range(s.size):
                s[k] = 0


@njit(cache=True, boundscheck=False)
def block_nonzero_i32(x, elems, out):
    """out[b] = 1 if block b of int32 x has a non-zero element, else 0."""
    n = x.size
    for b in range(out.size):
        lo = b * elems
        hi = min(lo + elems, n)
        s = x[lo:hi]
        m = np.int32(0)
        for i in range(hi - lo):
            m |= s[i]
        out[b] = 1 if m != 0 else 0


# --- encoding --------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _header(buf, off, tmpl, r, nslots, mask, count, exp, op):
    """Header of round ``r`` (unwrapped round number of the epoch: slot r mod S, set (r div S)
    mod 2, wire round r mod 2^32) from the 40-byte template (magic, version, type, flags, rank,
    job, epoch, ack)."""
    for k in range(HDR):
        buf[off + k] = tmpl[k]
    buf[off + O_SET] = (r // nslots) & 1
    _put32(buf, off + O_SLOT, r % nslots)
    _put32(buf, off + O_ROUND, r & 0xFFFFFFFF)
    _put32(buf, off + O_MASK, mask)
    _put16(buf, off + O_COUNT, count)
    _put16(buf, off + O_EXP, exp & 0xFFFF)
    buf[off + O_OP] = op


@njit(cache=True, boundscheck=False)
def encode_float(buf, rec, elems, tmpl, x, mine, base, nslots, blocks, masks, shifts, bias, single, first):
    """Record first + j of ``buf`` for this rank's round ``mine[j]`` (round base + mine[j]): header, then
    rint(x * 2^shift) + bias as unsigned 32-bit lanes (op SUM64: with |q| <= bias and
    2 * bias * ranks <= 2^31, the aggregator's 64-bit adds never carry from one lane into the
    next). Elements beyond the tensor are 0. ``single``: x is float32, scaled in float32 where
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
        _header(buf, off, tmpl, base + i, nslots, masks[i], cnt, s, proto.OP_SUM64)
        p = off // 4 + HDR // 4
        o = w[p:p + elems]  # slices, not computed indices: LLVM vectorises these loops
        xs = x[lo:lo + cnt]
        if single and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
            f = np.float32(math.ldexp(1.0, s))
            for k in range(cnt):
                o[k] = np.int32(np.rint(np.float32(xs[k]) * f)) + b32
        else:
            d = math.ldexp(1.0, s)
            for k in range(cnt):
                o[k] = np.int32(np.rint(np.float64(xs[k]) * d)) + b32
        for k in range(cnt, elems):
            o[k] = 0


@njit(cache=True, boundscheck=False)
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
        p = off // 4 + HDR // 4
        o = w[p:p + elems]
        xs = x[lo:lo + cnt]
        for k in range(cnt):
            o[k] = xs[k]
        for k in range(cnt, elems):
            o[k] = 0


@njit(cache=True, boundscheck=False)
def encode_pulls(buf, rec, tmpl, which, base, nslots, masks):
    """PULL records (full size, count 0, payload ignored) for rounds base + which[j]."""
    for j in range(which.size):
        i = which[j]
        off = j * rec
        _header(buf, off, tmpl, base + i, nslots, masks[i], 0, 0, 0)


# --- decoding --------------------------------------------------------------------------------

@njit(cache=True, boundscheck=False)
def decode_results(buf, stride, lens, segs, nmsg, rec, elems, job, epoch, rank, base, nrounds, nslots,
                   blocks, shifts, bias, kind, out_i, out_f32, out_f64, done, status, newly, stash, stash_round,
                   gate):
    """Every record of ``nmsg`` received datagrams (message m at buf[m * stride:], ``lens[m]``
    bytes, records of ``segs[m]`` bytes; 0: one record). A RESULT of this job, epoch and call
    (round base + i, i < nrounds, on the slot and set that round maps to) that is not yet
    ``done`` becomes output: int32 copied, or (float kinds) (lane - contributors * bias) * 2^-shift
    with one rounding. STATUS records for this rank store the contributors of a waiting round in
    ``status`` or raise an event. Returns (new results, event); their indices are newly[:new].
    A RESULT of a later round (up to stash_round.size rounds beyond this call: a round this rank
    does not contribute to can complete before the rank gets there) is kept in ``stash`` at
    round mod stash_round.size; the stream that owns it replays it (replay_stash).
    Every RESULT, and the aggregator's answer to an ACK, carries the job's gate; gate[0] keeps the
    latest (unwrapped, relative to ``base``)."""
    new = 0
    event = 0
    wi = buf.view(np.int32)
    for m in range(nmsg):
        seg = segs[m]
        ln = lens[m]
        if seg <= 0:
            seg = ln
        start = m * stride
        off = 0
        while off + HDR <= ln:
            o = start + off
            here = off
            off += seg
            t = buf[o + O_TYPE]
            if t != T_RESULT and t != T_STATUS and t != T_ACK:
                continue
            if _be32(buf, o + O_JOB) != job or _be32(buf, o + O_EPOCH) != epoch:
                continue
            if t != T_STATUS and gate.size:
                if t == T_ACK and _be16(buf, o + O_RANK) != RANK_AGG:
                    continue
                g = _be32(buf, o + O_ACK)
                d = (g - base) & 0xFFFFFFFF
                ga = base + (d - 0x100000000 if d >= 0x80000000 else d)
                if ga > gate[0]:
                    gate[0] = ga
                if t == T_ACK:
                    continue
            i = (_be32(buf, o + O_ROUND) - base) & 0xFFFFFFFF
            if i >= nrounds:
                h = stash_round.size
                if t == T_RESULT and i < nrounds + h and seg >= rec and here + rec <= ln:
                    r = base + i
                    at = (r % h) * rec
                    for k in range(rec):
                        stash[at + k] = buf[o + k]
                    stash_round[r % h] = r
                continue
            if t == T_STATUS:
                if _be16(buf, o + O_RANK) != rank:
                    continue
                d = buf[o + O_DETAIL]
                if d == D_EPOCH:
                    event = EV_STALE_EPOCH
                elif d == D_WAITING:
                    status[i] = _be32(buf, o + O_MASK)
                continue
            if done[i] or seg < rec or here + rec > ln:
                continue
            r = base + i
            if _be32(buf, o + O_SLOT) != r % nslots or buf[o + O_SET] != (r // nslots) & 1:
                continue
            cnt = _be16(buf, o + O_COUNT)
            if cnt > elems:
                continue
            lo = blocks[i] * elems
            p = (o + HDR) // 4
            lanes = wi[p:p + cnt]  # slices, not computed indices: LLVM vectorises these loops
            if kind == KIND_INT32:
                dst = out_i[lo:lo + cnt]
                for k in range(cnt):
                    dst[k] = lanes[k]
            else:
                mask = _be32(buf, o + O_MASK)
                c = 0
                while mask:
                    mask &= mask - 1
                    c += 1
                # lane - contributors * bias in int32 arithmetic: exact, |sum| <= 2^30
                nb32 = np.int32(np.int64(c) * bias)
                s = shifts[i]
                if kind == KIND_FLOAT32 and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
                    f = np.float32(math.ldexp(1.0, -s))
                    d32 = out_f32[lo:lo + cnt]
                    for k in range(cnt):
                        d32[k] = np.float32(np.int32(lanes[k] - nb32)) * f
                elif kind == KIND_FLOAT32:
                    d = math.ldexp(1.0, -s)
                    d32 = out_f32[lo:lo + cnt]
                    for k in range(cnt):
                        d32[k] = np.float32(np.float64(np.int32(lanes[k] - nb32)) * d)
                else:
                    d = math.ldexp(1.0, -s)
                    d64 = out_f64[lo:lo + cnt]
                    for k in range(cnt):
                        d64[k] = np.float64(np.int32(lanes[k] - nb32)) * d
            done[i] = 1
            newly[new] = i
            new += 1
    return new, event


_warm: set = set()


def warm_up(elems: int) -> None:
    """Compile (or load from the on-disk cache) every kernel for the argument types the worker
    uses, so that a communicator's first collective does not pay for it."""
    if elems in _warm:
        return
    rec = proto.record_size(elems)
    buf = np.zeros(2 * rec, np.uint8)
    tmpl = np.zeros(HDR, np.uint8)
    one = np.zeros(1, np.int64)
    masks = np.ones(1, np.int64)
    shifts = np.zeros(1, np.int32)
    for x in (np.zeros(2, np.float32), np.zeros(2, np.float64)):
        exps = np.zeros(1, np.int32)
        (block_meta_f32 if x.dtype == np.float32 else block_meta_f64)(x, elems, exps)
        encode_float(buf, rec, elems, tmpl, x, one, 0, 1, one, masks, shifts, 1, x.dtype == np.float32, 0)
    block_nonzero_i32(np.zeros(2, np.int32), elems, np.zeros(1, np.uint8))
    for w in (np.zeros(2, np.int32), np.zeros(2, np.int64)):
        zero_blocks(w, np.zeros(1, np.bool_), elems)
    encode_int(buf, rec, elems, tmpl, np.zeros(2, np.int32), one, 0, 1, one, masks, proto.OP_SUM, 0)
    encode_pulls(buf, rec, tmpl, one, 0, 1, masks)
    lens = np.zeros(1, np.uint32)
    segs = np.zeros(1, np.int64)
    stash, stash_round = np.zeros(rec, np.uint8), np.full(1, -1, np.int64)
    for kind in (KIND_INT32, KIND_FLOAT32, KIND_FLOAT64):
        args = (rec, elems, 0, 0, 0, 0, 1, 1, one, shifts, 1, kind, np.zeros(1, np.int32), np.zeros(1, np.float32),
                np.zeros(1, np.float64), np.zeros(1, np.uint8), np.zeros(1, np.int64), np.zeros(1, np.int64))
        gate = np.zeros(1, np.int64)
        decode_results(buf, rec, lens, segs, 1, *args, stash, stash_round, gate)
        replay_stash(stash, stash_round, *args, lens.astype(np.uint32), segs, gate)
    advance(np.zeros(1, np.uint8), 0, 1)
    _warm.add(elems)


# --- batch system calls ---------------------------------------------------------------------

@njit(cache=True, boundscheck=False)
def pump_send(fd, msgs, iov_base, iov_len, nmsgs, addr, first, count, per, size):
    """Send records [first, first + count) of the buffer at ``addr`` with sendmmsg: datagrams of
    up to ``per`` records (one UDP_SEGMENT batch each), up to ``nmsgs`` datagrams per call.
    Returns how many records went out (fewer when the socket pushed back: the caller waits)."""
    sent = 0
    while sent < count:
        left = count - sent
        k = min(nmsgs, (left + per - 1) // per)
        for m in range(k):
            r = min(per, left - m * per)
            iov_base[m] = addr + (first + sent + m * per) * size
            iov_len[m] = r * size
        got = _sendmmsg(fd, msgs, k, 0)
        if got <= 0:
            return sent
        for m in range(got):
            sent += min(per, count - sent)
    return sent


@njit(cache=True, boundscheck=False)
def pump_recv(fd, msgs, nmsgs, clen, cm_level, cm_type, cm_data, lens, segs, cspace,
              buf, stride, rec, elems, job, epoch, rank, base, nrounds, nslots, blocks, shifts, bias, kind,
              out_i, out_f32, out_f64, done, status, newly, stash, stash_round, gate):
    """Receive everything queued (recvmmsg, never blocking) and decode every record as it comes
    (decode_results). Returns (datagrams, new results, event); the new rounds are newly[:new]."""
    total = 0
    new = 0
    event = 0
    while True:
        for m in range(nmsgs):
            clen[m] = cspace
        n = _recvmmsg(fd, msgs, nmsgs, MSG_DONTWAIT, 0)
        if n <= 0:
            break
        for m in range(n):
            ok = clen[m] >= CMSG_HDR + 4 and cm_level[m] == SOL_UDP and cm_type[m] == UDP_GRO
            segs[m] = cm_data[m] if ok else 0
        got, ev = decode_results(buf, stride, lens, segs, n, rec, elems, job, epoch, rank, base, nrounds,
                                 nslots, blocks, shifts, bias, kind, out_i, out_f32, out_f64, done, status,
                                 newly[new:], stash, stash_round, gate)
        new += got
        if ev:
            event = ev
        total += n
        if n < nmsgs:
            break
    return total, new, event


@njit(cache=True, boundscheck=False)
def replay_stash(stash, stash_round, rec, elems, job, epoch, rank, base, nrounds, nslots, blocks, shifts, bias,
                 kind, out_i, out_f32, out_f64, done, status, newly, lens, segs, gate):
    """Decode the stashed results that belong to rounds base .. base + nrounds - 1 (and forget
    them). ``lens`` and ``segs``: scratch of stash_round.size entries. Returns the new results."""
    h = stash_round.size
    any_ = False
    for m in range(h):
        r = stash_round[m]
        if base <= r < base + nrounds:
            lens[m] = rec
            stash_round[m] = -1
            any_ = True
        else:
            lens[m] = 0
        segs[m] = 0
    if not any_:
        return 0
    new, _ev = decode_results(stash, rec, lens, segs, h, rec, elems, job, epoch, rank, base, nrounds, nslots,
                              blocks, shifts, bias, kind, out_i, out_f32, out_f64, done, status, newly,
                              stash[:0], stash_round[:0], gate)
    return new


@njit(cache=True, boundscheck=False)
def advance(done, head, hi):
    """The lowest round at or after ``head`` without a result (``hi`` if all up to it have one)."""
    while head < hi and done[head]:
        head += 1
    return head
