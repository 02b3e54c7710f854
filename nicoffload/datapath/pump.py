"""The worker's receive and send pumps (numba, cached on disk): batch system calls made from
compiled code, and the decoding of every received record straight into the caller's output.

    pump_send       sendmmsg of this rank's records, up to one UDP_SEGMENT batch per datagram
    pump_recv       recvmmsg of everything queued (with the UDP_GRO segment size), decoded as
                    it comes
    decode_results  every record of a batch of datagrams: results dequantized (or copied) into
                    the output, results of later streams stashed, STATUS records noted,
                    everything else skipped
    replay_stash    the stashed results that belong to a new stream
    advance         the stream's head: the lowest round without a result
    recv_batch, gro_segment, unfix
                    one recvmmsg, a datagram's GRO segment size, fixed point into floats:
                    inlined here and in the ring's kernels (nicoffload.ring.kernels)
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
from numba import njit, types

from nicoffload.datapath.kernels import (
    F32_SHIFT_LIMIT,
    HDR,
    O_ACK,
    O_COUNT,
    O_DETAIL,
    O_EPOCH,
    O_EXP,
    O_FLAGS,
    O_JOB,
    O_MASK,
    O_RANK,
    O_ROUND,
    O_SET,
    O_SLOT,
    O_TYPE,
    RANK_AGG,
    T_ACK,
    T_RESULT,
    T_STATUS,
    U,
    keyed,
    _be16,
    _be32,
    pow2_split,
)
from nicoffload.wire import proto

# libc's batch calls, called from the kernels by symbol name (so the compiled code caches on disk;
# a ctypes pointer would be baked in); pointers are passed as integers (the x86-64 ABI is the same)
_recvmmsg = types.ExternalFunction("recvmmsg", types.int32(types.int32, types.intp, types.uint32, types.int32,
                                                           types.intp))
_sendmmsg = types.ExternalFunction("sendmmsg", types.int32(types.int32, types.intp, types.uint32, types.int32))
MSG_DONTWAIT = 0x40
SOL_UDP, UDP_GRO = 17, 104
#: bytes of a struct sockaddr_in (the sender's address of a received datagram)
SOCKADDR_IN = 16
#: bytes before a control message's data (struct cmsghdr: len, level, type)
CMSG_HDR = ctypes.sizeof(ctypes.c_size_t) + 8

# decode_results kinds: what a result's payload becomes
KIND_INT32 = 0    # copied (int32 data, metadata)
KIND_FLOAT32 = 1  # offset-binary fixed point -> float32
KIND_FLOAT64 = 2  # offset-binary fixed point -> float64
KIND_PARAMS32 = 3  # an optimizer's parameters: int32 lane * 2^exp of the record -> float32
KIND_PARAMS64 = 4  # ... -> float64
KIND_HALF32 = 5  # 16-bit offset-binary lanes (op SUM16, 2 * elems per record) -> float32
KIND_HALF64 = 6  # ... -> float64

#: a round's shift that says: an int32 metadata round (copied into out_i) in a run of float
#: rounds (a speculative call sends its exponents and its data in one run; no real shift is this)
META_SHIFT = -(1 << 30)

# decode_results return codes (besides the count of new results)
EV_STALE_EPOCH = 1  # a STATUS said this rank's epoch is over
EV_MISMATCH = 2     # a STATUS said the ranks disagree on a round (status[i] = MISMATCHED)
D_EPOCH, D_WAITING, D_MISMATCH = proto.DETAIL["epoch"], proto.DETAIL["waiting"], proto.DETAIL["mismatch"]
D_DONE = proto.DETAIL["done"]
#: status[i] of a round the ranks disagree on (not a contributor bitmap, which is >= 0)
MISMATCHED = -2
#: status[i] of a round a probe found complete: its result was lost on the way to this rank
DONE = -3
F_ANSWER = proto.FLAG_ANSWER  # an answer to a retransmission or a pull, not a first delivery


# --- decoding --------------------------------------------------------------------------------

#: Records a call of unfix converts: a call of a compiled function increments the reference
#: counts of its array arguments on entry and decrements them on exit, with locked instructions
#: that wait for every store before them to drain. Called per record, the decrement after each
#: record's stores (1 KiB into a block anywhere in the output) was the hottest instruction of a
#: rank (perf, 16 MiB at 75% sparsity: 16% of rank 0's samples). Queued, it is paid per batch.
UNFIX_BATCH = 64


@njit(cache=True, boundscheck=False, nogil=True)
def unfix(buf, half, todo, n, kind, out_f32, out_f64):
    """The fixed-point lanes of ``n`` records of ``buf`` (16-bit lanes if ``half``, else 32-bit)
    into out_f32 (kind KIND_FLOAT32) or out_f64. Record j is todo[j] = (first lane, lanes,
    nb32, shift s, first element): (lane - nb32) * 2^-s, nb32 the contributors' offset-binary
    bias (the int32 difference is exact: |sum| <= 2^30), with one rounding. Whole arrays and
    unsigned indices, no slices (see kernels.U). Shared with the ring's decode."""
    if half:
        _unfix(buf.view(np.uint16), todo, n, kind, out_f32, out_f64)
    else:
        _unfix(buf.view(np.int32), todo, n, kind, out_f32, out_f64)


@njit(cache=True, inline="always")
def _unfix(lanes, todo, n, kind, out_f32, out_f64):
    for j in range(n):
        a = U(todo[j, 0])
        cnt = todo[j, 1]
        nb32 = np.int32(todo[j, 2])
        s = todo[j, 3]
        d = U(todo[j, 4])
        if kind == KIND_FLOAT32 and -F32_SHIFT_LIMIT < s < F32_SHIFT_LIMIT:
            f = np.float32(math.ldexp(1.0, -s))
            for k in range(cnt):
                out_f32[d + U(k)] = np.float32(np.int32(lanes[a + U(k)] - nb32)) * f
        elif kind == KIND_FLOAT32:
            g = math.ldexp(1.0, -s)
            for k in range(cnt):
                out_f32[d + U(k)] = np.float32(np.float64(np.int32(lanes[a + U(k)] - nb32)) * g)
        else:
            d1, d2 = pow2_split(-s)  # float64 subnormal sums: 2^-s alone would underflow to 0
            for k in range(cnt):
                out_f64[d + U(k)] = np.float64(np.int32(lanes[a + U(k)] - nb32)) * d1 * d2


# Long on purpose: one fused loop; per-record calls with array arguments cost numba reference counts (UNFIX_BATCH).
@njit(cache=True, boundscheck=False, nogil=True)
def decode_results(buf, stride, lens, segs, nmsg, rec, elems, job, epoch, rank, base, nrounds, nslots,
                   blocks, shifts, bias, kind, out_i, out_f32, out_f64, done, status, newly, stash, stash_round,
                   gate):
    """Every record of ``nmsg`` received datagrams (message m at buf[m * stride:], ``lens[m]``
    bytes, records of ``segs[m]`` bytes; 0: one record). A RESULT of this job, epoch and call
    (round base + i, i < nrounds, on the slot and set that round maps to) that is not yet
    ``done`` becomes output: int32 copied, or (float kinds) (lane - contributors * bias) * 2^-shift
    with one rounding. STATUS records for this rank store the contributors of a waiting round in
    ``status`` (DONE: a probe found it complete) or raise an event. Returns (new results, event);
    their indices are newly[:new].
    A RESULT of a later round (up to stash_round.size rounds beyond this call: a round this rank
    does not contribute to can complete before the rank gets there) is kept in ``stash`` at
    round mod stash_round.size; the stream that owns it replays it (replay_stash).
    Every RESULT, and the aggregator's answer to an ACK, carries the job's gate; gate[0] keeps the
    latest (unwrapped, relative to ``base``). With gate.size >= 3, gate[1] and gate[2] count the
    results taken: first deliveries, and answers (FLAG_ANSWER: a retransmission's or a pull's)."""
    new = 0
    event = 0
    wi = buf.view(np.int32)
    half = kind == KIND_HALF32 or kind == KIND_HALF64
    per = 2 * elems if half else elems  # elements per block (and per record)
    fk = KIND_FLOAT32 if kind == KIND_FLOAT32 or kind == KIND_HALF32 else KIND_FLOAT64  # unfix's output
    todo = np.empty((UNFIX_BATCH, 5), np.int64)  # fixed-point records queued for unfix
    nt = 0
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
                elif d == D_MISMATCH:
                    if event != EV_STALE_EPOCH:
                        event = EV_MISMATCH
                    status[i] = MISMATCHED
                elif d == D_WAITING:
                    status[i] = _be32(buf, o + O_MASK)
                elif d == D_DONE:
                    status[i] = DONE
                continue
            if done[i] or seg < rec or here + rec > ln:
                continue
            r = base + i
            if _be32(buf, o + O_SLOT) != r % nslots or buf[o + O_SET] != (r // nslots) & 1:
                continue
            cnt = _be16(buf, o + O_COUNT)
            if cnt > per:
                continue
            lo = blocks[i] * per
            dl = U(lo)
            p = U((o + HDR) // 4)
            if shifts[i] == META_SHIFT or kind == KIND_INT32:
                for k in range(cnt):  # int32 data or metadata: copied
                    out_i[dl + U(k)] = wi[p + U(k)]
            elif kind == KIND_PARAMS32 or kind == KIND_PARAMS64:
                e = _be16(buf, o + O_EXP)
                g = math.ldexp(1.0, e - 0x10000 if e >= 0x8000 else e)
                if kind == KIND_PARAMS32:
                    for k in range(cnt):
                        out_f32[dl + U(k)] = np.float32(np.float64(wi[p + U(k)]) * g)
                else:
                    for k in range(cnt):
                        out_f64[dl + U(k)] = np.float64(wi[p + U(k)]) * g
            else:  # fixed point, 32- or 16-bit lanes: queued for unfix
                mask = _be32(buf, o + O_MASK)
                c = 0
                while mask:
                    mask &= mask - 1
                    c += 1
                # lane - contributors * bias in int32 arithmetic: exact (|sum| <= 2^30; 16-bit
                # lanes: <= 2^15)
                # written out, as in ring.kernels.decode: a helper with array arguments,
                # called per record, would bring back the per-record reference counts (UNFIX_BATCH)
                todo[nt, 0] = (o + HDR) // 2 if half else (o + HDR) // 4
                todo[nt, 1] = cnt
                todo[nt, 2] = np.int32(np.int64(c) * bias)
                todo[nt, 3] = shifts[i]
                todo[nt, 4] = lo
                nt += 1
                if nt == UNFIX_BATCH:
                    unfix(buf, half, todo, nt, fk, out_f32, out_f64)
                    nt = 0
            done[i] = 1
            newly[new] = i
            new += 1
            if gate.size >= 3:
                if buf[o + O_FLAGS] & F_ANSWER:
                    gate[2] += 1
                else:
                    gate[1] += 1
    if nt:
        unfix(buf, half, todo, nt, fk, out_f32, out_f64)
    return new, event


# --- batch system calls ---------------------------------------------------------------------

@njit(cache=True, inline="always")
def recv_batch(fd, msgs, nmsgs, clen, namelen, cspace):
    """One recvmmsg of up to ``nmsgs`` datagrams, never blocking (their control and address
    lengths reset first). Returns how many came (<= 0: none). Shared with the ring's receive."""
    for m in range(nmsgs):
        clen[m] = cspace
        namelen[m] = SOCKADDR_IN
    return _recvmmsg(fd, msgs, nmsgs, MSG_DONTWAIT, 0)


@njit(cache=True, inline="always")
def gro_segment(clen, cm_level, cm_type, cm_data, m):
    """The UDP_GRO segment size datagram ``m`` came with (0: none, a single datagram)."""
    ok = clen[m] >= CMSG_HDR + 4 and cm_level[m] == SOL_UDP and cm_type[m] == UDP_GRO
    return cm_data[m] if ok else 0


@njit(cache=True, boundscheck=False, nogil=True)
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


@njit(cache=True, boundscheck=False, nogil=True)
def pump_recv(fd, msgs, nmsgs, clen, cm_level, cm_type, cm_data, lens, segs, cspace, namelen, src_addr, src_port,
              peer, foreign, buf, stride, rec, elems, job, epoch, rank, base, nrounds, nslots, blocks, shifts, bias, kind,
              out_i, out_f32, out_f64, done, status, newly, stash, stash_round, gate):
    """Receive everything queued (recvmmsg, never blocking) and decode every record as it comes
    (decode_results). Returns (datagrams, new results, event); the new rounds are newly[:new].
    With ``peer`` set (address, port as stored in a sockaddr_in, the job's key as its high and low
    32 bits; address 0: anyone), datagrams from any other sender, or with a record of another key,
    are skipped and counted in ``foreign[0]``."""
    total = 0
    new = 0
    event = 0
    while True:
        n = recv_batch(fd, msgs, nmsgs, clen, namelen, cspace)
        if n <= 0:
            break
        for m in range(n):
            segs[m] = gro_segment(clen, cm_level, cm_type, cm_data, m)
            if peer[0] and (src_addr[m] != peer[0] or src_port[m] != peer[1]
                            or not keyed(buf, m * stride, lens[m], segs[m], peer[2], peer[3])):
                lens[m] = 0  # not from the aggregator, or not with the job's key: decode_results skips it
                foreign[0] += 1
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


@njit(cache=True, boundscheck=False, nogil=True)
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


@njit(cache=True, boundscheck=False, nogil=True)
def advance(done, head, hi):
    """The lowest round at or after ``head`` without a result (``hi`` if all up to it have one)."""
    while head < hi and done[head]:
        head += 1
    return head


_warm: set = set()


def warm_up(elems: int) -> None:
    """Compile (or load from the on-disk cache) the decoding kernels for the argument types the
    worker uses, so that a communicator's first collective does not pay for it."""
    if elems in _warm:
        return
    rec = proto.record_size(elems)
    buf = np.zeros(2 * rec, np.uint8)
    one = np.zeros(1, np.int64)
    shifts = np.zeros(1, np.int32)
    lens = np.zeros(1, np.uint32)
    segs = np.zeros(1, np.int64)
    stash, stash_round = np.zeros(rec, np.uint8), np.full(1, -1, np.int64)
    for kind in (KIND_INT32, KIND_FLOAT32, KIND_FLOAT64, KIND_PARAMS32, KIND_PARAMS64, KIND_HALF32, KIND_HALF64):
        args = (rec, elems, 0, 0, 0, 0, 1, 1, one, shifts, 1, kind, np.zeros(1, np.int32), np.zeros(1, np.float32),
                np.zeros(1, np.float64), np.zeros(1, np.uint8), np.zeros(1, np.int64), np.zeros(1, np.int64))
        gate = np.zeros(3, np.int64)
        decode_results(buf, rec, lens, segs, 1, *args, stash, stash_round, gate)
        replay_stash(stash, stash_round, *args, lens.astype(np.uint32), segs, gate)
    advance(np.zeros(1, np.uint8), 0, 1)
    _warm.add(elems)
