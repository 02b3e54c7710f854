"""The host's side of the ring (numba, cached on disk): tagging staged records, asking for lost
ones (NACKs), and decoding the stored finals into the caller's output. A node's work on the
records themselves, in user space, is :mod:`.hop`.

Buffers are uint8 arrays of whole records (proto.record_size(elems) bytes, a multiple of 8):
``local`` (this node's staged records, index = record), ``result`` (the finals it stored), and
for the offloaded ring these are the program's mmap-ed maps themselves. A record's tag is its
header's ``epoch`` (the call): a host writes the data first and the tag last, and reads the tag
before the data (the program does the same; x86 keeps stores, and loads, in order).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from nicoffload.datapath.kernels import HDR, O_COUNT, O_EPOCH, O_FLAGS, O_RANK, O_TYPE, U, _be16, _be32, _put16, _put32
from nicoffload.datapath.pump import KIND_INT32, UNFIX_BATCH, unfix
# re-exported: nicoffload/ring/comm.py calls these as kernels.process_datagram, kernels.replay
from nicoffload.ring.hop import IO_WORDS, process_datagram, replay  # noqa: F401
from nicoffload.ring.layout import FLAG_RESTART, TYPE_NACK


# --- tags -------------------------------------------------------------------------------------
@njit(cache=True, boundscheck=False, nogil=True)
def set_tags(buf, rec, lo, hi, call):
    """Tag records lo .. hi-1 of ``buf`` with ``call`` (0: invalid)."""
    for k in range(lo, hi):
        _put32(buf, k * rec + O_EPOCH, call)


@njit(cache=True, boundscheck=False, nogil=True)
def untagged(buf, rec, lo, hi, call, out):
    """Records in lo .. hi-1 whose tag is not ``call``, into out; returns how many."""
    n = 0
    for k in range(lo, hi):
        if _be32(buf, k * rec + O_EPOCH) != call:
            out[n] = k
            n += 1
    return n


@njit(cache=True, boundscheck=False, nogil=True)
def count_tagged(buf, rec, n, call):
    c = 0
    for k in range(n):
        if _be32(buf, k * rec + O_EPOCH) == call:
            c += 1
    return c


# --- requests ---------------------------------------------------------------------------------
@njit(cache=True, boundscheck=False, nogil=True)
def build_nacks(local, rec, which, restart, me, buf):
    """NACK records for records ``which`` (full size: the answerer fills them in), from this
    node's own staged headers (they hold the record's count, exp, op and origin)."""
    for j in range(which.size):
        k = which[j]
        d = j * rec
        buf[d:d + HDR] = local[k * rec:k * rec + HDR]
        buf[d + O_TYPE] = TYPE_NACK
        buf[d + O_FLAGS] = FLAG_RESTART if restart else 0
        _put16(buf, d + O_RANK, me)


# --- results ----------------------------------------------------------------------------------
@njit(cache=True, boundscheck=False, nogil=True)
def decode(result, rec, elems, nrec, kind, shifts, bias_n, out_i, out_f32, out_f64, first):
    """Records 0 .. nrec-1 of ``result`` into the output from element ``first`` on: int32 copied,
    fixed point (kind float32/float64) as (lane - bias_n) * 2^-shift (bias_n: N times the
    offset-binary bias; |sum| <= 2^30, so the int32 difference is exact), with one rounding."""
    w = result.view(np.int32)
    nb32 = np.int32(bias_n)
    todo = np.empty((UNFIX_BATCH, 5), np.int64)  # records queued for unfix
    nt = 0
    for k in range(nrec):
        o = k * rec
        cnt = _be16(result, o + O_COUNT)
        if cnt > elems:
            cnt = elems
        lo = first + k * elems
        p = (o + HDR) // 4
        if kind == KIND_INT32:
            a, d = U(p), U(lo)
            for i in range(cnt):
                out_i[d + U(i)] = w[a + U(i)]
            continue
        # written out, as in pump.decode_results: a helper with array arguments,
        # called per record, would bring back the per-record reference counts (UNFIX_BATCH)
        todo[nt, 0] = p
        todo[nt, 1] = cnt
        todo[nt, 2] = nb32
        todo[nt, 3] = shifts[k]
        todo[nt, 4] = lo
        nt += 1
        if nt == UNFIX_BATCH:
            unfix(result, False, todo, nt, kind, out_f32, out_f64)
            nt = 0
    if nt:
        unfix(result, False, todo, nt, kind, out_f32, out_f64)


@njit(cache=True, boundscheck=False, nogil=True)
def copy_values(result, rec, elems, nrec, out):
    """The int32 lanes of records 0 .. nrec-1 (full records) into ``out`` (metadata passes)."""
    w = result.view(np.int32)
    for k in range(nrec):
        p = (k * rec + HDR) // 4
        n = min(elems, out.size - k * elems)
        for i in range(n):
            out[k * elems + i] = w[p + i]
