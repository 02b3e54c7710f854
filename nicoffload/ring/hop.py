"""A ring node's work on ring records in user space (numba, cached on disk), exactly as
xdp/ring.c does it in the kernel: check each record, add the host's staged record into it, store
finals, forward or park, answer NACKs and PINGs. The user-space UDP ring does all of its hops with
these; the offloaded ring only the records its program parked for the host. Receiving with
recvmmsg (UDP_GRO batches split into their datagrams) and replaying the records kept for the
next call are here too. Buffers and tags are as :mod:`.kernels` describes them.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from nicoffload.datapath.kernels import (
    HDR,
    O_COUNT,
    O_EPOCH,
    O_EXP,
    O_FLAGS,
    O_JOB,
    O_MASK,
    O_OP,
    O_RANK,
    O_ROUND,
    O_SLOT,
    O_TYPE,
    _be16,
    _be32,
    _put16,
    _put32,
)
from nicoffload.datapath.pump import gro_segment, recv_batch
from nicoffload.ring.layout import (
    FLAG_RESTART,
    FLAG_SKIP,
    ST_HOST_OWN,
    ST_HOST_STORED,
    STAT,
    TYPE_GATHER,
    TYPE_NACK,
    TYPE_PING,
    TYPE_PONG,
    TYPE_REDUCE,
)
from nicoffload.wire import proto

O_MAGIC, O_VERSION = proto.FIELD_OFFSETS["magic"], proto.FIELD_OFFSETS["version"]
MAGIC, VERSION = proto.MAGIC, proto.VERSION
OP_SUM, OP_SUM64, OP_MAX = proto.OP_SUM, proto.OP_SUM64, proto.OP_MAX
T_NOP = proto.TYPE_NOP
S_RX, S_RECORDS, S_FORWARDED, S_PASSED = STAT["rx"], STAT["records"], STAT["forwarded"], STAT["passed"]
S_REDUCED, S_FINAL, S_GATHERED, S_DUP = STAT["reduced"], STAT["final"], STAT["gathered"], STAT["dup"]
S_PARKED, S_STALE, S_RESTARTED, S_RESENT = STAT["parked"], STAT["stale"], STAT["restarted"], STAT["resent"]
S_UNANSWERED, S_PING, S_RACE, S_MISMATCH = STAT["unanswered"], STAT["ping"], STAT["race"], STAT["mismatch"]
S_TRUNC, S_MAGIC, S_VERSION, S_FLAGS = (STAT["bad_truncated"], STAT["bad_magic"], STAT["bad_version"],
                                        STAT["bad_flags"])
S_JOB, S_RANK, S_SRC, S_HOP = STAT["bad_job"], STAT["bad_rank"], STAT["bad_src"], STAT["bad_hop"]
S_SLOT, S_ORIGIN, S_LEN, S_OP, S_MIXED = (STAT["bad_slot"], STAT["bad_origin"], STAT["bad_len"], STAT["bad_op"],
                                          STAT["bad_mixed"])

# io words of process_datagram / recv_process
IO_OUT = 0      # records in ``out`` (to the next node)
IO_STASH = 1    # records in ``stash`` (for the next call)
IO_PINGS = 2    # PINGs to answer (user-space ring: the host answers them)
IO_LATE = 3     # records in ``late`` (answers to NACKs of another call: a batch holds one call)
IO_WORDS = 4


# --- one record, as the program handles it --------------------------------------------------
@njit(cache=True, inline="always")
def _add(dst, d, src, s, op, elems):
    """Payload of the record at dst[d:] op= payload of the record at src[s:]."""
    if op == OP_SUM64:
        a = dst.view(np.uint64)
        b = src.view(np.uint64)
        pa = (d + HDR) // 8
        pb = (s + HDR) // 8
        for k in range(elems // 2):
            a[pa + k] += b[pb + k]
    elif op == OP_SUM:
        a = dst.view(np.uint32)
        b = src.view(np.uint32)
        pa = (d + HDR) // 4
        pb = (s + HDR) // 4
        for k in range(elems):
            a[pa + k] = np.uint32(a[pa + k] + b[pb + k])
    else:
        a = dst.view(np.int32)
        b = src.view(np.int32)
        pa = (d + HDR) // 4
        pb = (s + HDR) // 4
        for k in range(elems):
            if b[pb + k] > a[pa + k]:
                a[pa + k] = b[pb + k]


@njit(cache=True, inline="always")
def _store(src, s, result, k, rec, call, own, st):
    """Store the record at src[s:] as record k of ``result`` unless it holds it for ``call``
    already: data, header, the tag last. Counted in the host's state words."""
    r = k * rec
    if _be32(result, r + O_EPOCH) == call:
        return False
    result[r + HDR:r + rec] = src[s + HDR:s + rec]
    result[r:r + O_EPOCH] = src[s:s + O_EPOCH]
    result[r + O_EPOCH + 4:r + HDR] = src[s + O_EPOCH + 4:s + HDR]
    _put32(result, r + O_EPOCH, call)
    st[ST_HOST_STORED] += 1
    if own:
        st[ST_HOST_OWN] += 1
    return True


@njit(cache=True, inline="always")
def _check(buf, o, t, job, sender, call, cap, wmask, elems):
    """0 when the record may be processed, else the counter that rejects it (xdp/ring.c's
    check_record; ``t``: the frame's kind, TYPE_NACK or TYPE_REDUCE for REDUCEs and GATHERs)."""
    if _be16(buf, o + O_MAGIC) != MAGIC:
        return S_MAGIC
    if buf[o + O_VERSION] != VERSION:
        return S_VERSION
    rt = buf[o + O_TYPE]
    if (rt != TYPE_NACK) if t == TYPE_NACK else (rt != TYPE_REDUCE and rt != TYPE_GATHER):
        return S_MIXED
    if _be32(buf, o + O_JOB) != job or _be16(buf, o + O_RANK) != sender or _be32(buf, o + O_EPOCH) != call:
        return S_MIXED
    allowed = (FLAG_RESTART if t == TYPE_NACK else 0) | FLAG_SKIP
    if buf[o + O_FLAGS] & ~allowed:
        return S_FLAGS
    k = _be32(buf, o + O_SLOT)
    if k >= cap or _be32(buf, o + O_ROUND) != k:
        return S_SLOT
    m = _be32(buf, o + O_MASK)
    if m == 0 or (m & (m - 1)) != 0 or (m & ~wmask) != 0:
        return S_ORIGIN
    c = _be16(buf, o + O_COUNT)
    if c == 0 or c > elems:
        return S_LEN
    op = buf[o + O_OP]
    if op != OP_SUM and op != OP_SUM64 and op != OP_MAX:
        return S_OP
    return 0


# Long on purpose: one fused loop; per-record calls with array arguments cost numba reference counts (pump.UNFIX_BATCH).
@njit(cache=True, boundscheck=False, nogil=True)
def process_datagram(buf, start, ln, src, peer_addrs, rec, elems, me, world, job, cur, cap, local, result, out,
                     late, st, cnt, stash, stash_src, pongs, pings, io):
    """One received datagram of ``ln`` bytes at buf[start:] from address ``src`` (as stored in a
    sockaddr_in), handled as xdp/ring.c handles a frame: records that go on are appended to
    ``out`` (io[IO_OUT]: to the next node; answers to NACKs of another call to ``late``,
    io[IO_LATE]), finals stored in ``result``, counters in ``cnt``
    (index AR_RING_STAT_*). A frame of the next call is kept in ``stash`` (its records, with
    their sender's address in ``stash_src``), a PONG noted in ``pongs[rank] = (answers so far,
    call, stored, expected)``, a PING's sender in ``pings`` (the host answers it)."""
    if ln < HDR:
        cnt[S_RX] += 1
        cnt[S_RECORDS] += 1
        cnt[S_TRUNC] += 1
        return
    t = buf[start + O_TYPE]
    good = _be16(buf, start + O_MAGIC) == MAGIC and buf[start + O_VERSION] == VERSION
    if good and t == TYPE_PONG:
        r = _be16(buf, start + O_RANK)
        if r < world and src == peer_addrs[r]:
            pongs[r, 0] += 1  # answers so far: the host tells a fresh one from an earlier one
            pongs[r, 1] = _be32(buf, start + O_EPOCH)
            pongs[r, 2] = _be32(buf, start + O_SLOT)
            pongs[r, 3] = _be32(buf, start + O_ROUND)
        return
    if good and t != TYPE_REDUCE and t != TYPE_GATHER and t != TYPE_NACK and t != TYPE_PING:
        cnt[S_PASSED] += 1
        return
    cnt[S_RX] += 1
    why = 0
    sender = _be16(buf, start + O_RANK)
    if _be16(buf, start + O_MAGIC) != MAGIC:
        why = S_MAGIC
    elif buf[start + O_VERSION] != VERSION:
        why = S_VERSION
    elif _be32(buf, start + O_JOB) != job:
        why = S_JOB
    elif sender >= world:
        why = S_RANK
    elif src != peer_addrs[sender]:
        why = S_SRC
    if why:
        cnt[S_RECORDS] += 1
        cnt[why] += 1
        return
    flags = buf[start + O_FLAGS]
    if t == TYPE_PING:
        cnt[S_RECORDS] += 1
        if flags:
            cnt[S_FLAGS] += 1
        elif ln != HDR:
            cnt[S_LEN] += 1
        else:
            cnt[S_PING] += 1
            if io[IO_PINGS] < pings.size:
                pings[io[IO_PINGS]] = sender
                io[IO_PINGS] += 1
        return
    nxt = (me + 1) % world
    prv = (me + world - 1) % world
    frm = nxt if t == TYPE_NACK and not (flags & FLAG_RESTART) else prv
    if sender != frm:
        cnt[S_RECORDS] += 1
        cnt[S_HOP] += 1
        return
    if ln % rec:
        cnt[S_RECORDS] += 1
        cnt[S_LEN] += 1
        return
    n = ln // rec
    call = _be32(buf, start + O_EPOCH)
    if t == TYPE_GATHER:
        t = TYPE_REDUCE  # a data frame: REDUCEs and GATHERs
    dst = out
    di = IO_OUT
    if t == TYPE_NACK and call != cur:
        dst = late
        di = IO_LATE
    if t != TYPE_NACK:
        d = (call - cur) & 0xFFFFFFFF
        ahead = d - 0x100000000 if d >= 0x80000000 else d
        if ahead != 0:
            cnt[S_RECORDS] += n
            if ahead == 1 and io[IO_STASH] + n <= stash_src.size:
                s0 = io[IO_STASH]
                stash[s0 * rec:(s0 + n) * rec] = buf[start:start + n * rec]
                stash_src[s0:s0 + n] = src
                io[IO_STASH] += n
                cnt[S_PARKED] += n
            else:
                cnt[S_STALE] += n
            return
    bit_me = 1 << me
    bit_next = 1 << nxt
    bit_last = 1 << ((me + 2) % world)
    wmask = (1 << world) - 1
    for i in range(n):
        o = start + i * rec
        if buf[o + O_FLAGS] & FLAG_SKIP:
            continue  # dropped on the way, left in place
        cnt[S_RECORDS] += 1
        why = _check(buf, o, t, job, sender, call, cap, wmask, elems)
        consumed = False
        j = io[di]
        d = j * rec
        if why == 0:
            k = _be32(buf, o + O_SLOT)
            m = _be32(buf, o + O_MASK)
            if buf[o + O_TYPE] == TYPE_REDUCE:
                lo = k * rec
                if _be32(local, lo + O_EPOCH) != call:
                    why = S_RACE
                elif (_be16(local, lo + O_COUNT) != _be16(buf, o + O_COUNT) or local[lo + O_OP] != buf[o + O_OP]
                      or _be16(local, lo + O_EXP) != _be16(buf, o + O_EXP)):
                    why = S_MISMATCH
                else:
                    dst[d:d + rec] = buf[o:o + rec]
                    _add(dst, d, local, lo, buf[o + O_OP], elems)
                    if m != bit_next:
                        why = S_REDUCED
                    elif _store(dst, d, result, k, rec, call, m == bit_me, st):
                        dst[d + O_TYPE] = TYPE_GATHER
                        why = S_FINAL
                    else:
                        why = S_DUP
            elif buf[o + O_TYPE] == TYPE_GATHER:
                if _store(buf, o, result, k, rec, call, m == bit_me, st):
                    why = S_GATHERED
                    consumed = m == bit_last
                    if not consumed:
                        dst[d:d + rec] = buf[o:o + rec]
                else:
                    why = S_DUP
            else:
                restart = (flags & FLAG_RESTART) != 0
                if restart and m != bit_me:
                    why = S_UNANSWERED
                else:
                    sb = local if restart else result
                    s = k * rec
                    if _be32(sb, s + O_EPOCH) != call:
                        why = S_UNANSWERED
                    else:
                        dst[d:d + rec] = sb[s:s + rec]
                        dst[d + O_TYPE] = TYPE_REDUCE if restart else TYPE_GATHER
                        dst[d + O_FLAGS] = 0
                        _put32(dst, d + O_EPOCH, call)
                        why = S_RESTARTED if restart else S_RESENT
        cnt[why] += 1
        if (why == S_REDUCED or why == S_FINAL or why == S_GATHERED or why == S_RESTARTED or why == S_RESENT) \
                and not consumed:
            _put16(dst, d + O_RANK, me)
            io[di] = j + 1
            cnt[S_FORWARDED] += 1


@njit(cache=True, boundscheck=False, nogil=True)
def recv_process(fd, msgs, nmsgs, clen, cm_level, cm_type, cm_data, lens, segs, cspace, namelen, src_addr,
                 rxbuf, stride, peer_addrs, rec, elems, me, world, job, cur, cap, local, result, out, late, st, cnt,
                 stash, stash_src, pongs, pings, io, out_room):
    """Receive everything queued (recvmmsg with the UDP_GRO segment size, never blocking) and
    process every datagram (process_datagram); stops early once ``out`` has less than
    ``out_room`` records of room. Returns the datagrams received."""
    total = 0
    while io[IO_OUT] + out_room <= out.size // rec and io[IO_LATE] + out_room <= late.size // rec:
        n = recv_batch(fd, msgs, nmsgs, clen, namelen, cspace)
        if n <= 0:
            break
        for m in range(n):
            seg = gro_segment(clen, cm_level, cm_type, cm_data, m)
            ln = lens[m]
            start = m * stride
            if seg <= 0 or seg >= ln:
                process_datagram(rxbuf, start, ln, src_addr[m], peer_addrs, rec, elems, me, world, job, cur, cap,
                                 local, result, out, late, st, cnt, stash, stash_src, pongs, pings, io)
            else:  # a GRO batch: one datagram per segment (each a frame of its own on the wire)
                off = 0
                while off < ln:
                    sl = min(seg, ln - off)
                    process_datagram(rxbuf, start + off, sl, src_addr[m], peer_addrs, rec, elems, me, world, job,
                                     cur, cap, local, result, out, late, st, cnt, stash, stash_src, pongs, pings, io)
                    off += seg
        total += n
        if n < nmsgs:
            break
    return total


@njit(cache=True, boundscheck=False, nogil=True)
def replay(stash, stash_src, nrec, peer_addrs, rec, elems, me, world, job, cur, cap, local, result, out, late, st,
           cnt, pongs, pings, io):
    """Process the records kept for this call (one at a time, as one-record frames); nothing is
    stashed meanwhile."""
    io[IO_STASH] = stash_src.size
    for i in range(nrec):
        process_datagram(stash, i * rec, rec, stash_src[i], peer_addrs, rec, elems, me, world, job, cur, cap,
                         local, result, out, late, st, cnt, stash, stash_src, pongs, pings, io)
    io[IO_STASH] = 0
