"""What a collective takes and gives, shared by the aggregator's :class:`~nicoffload.worker.Communicator`
and the ring's :class:`~nicoffload.ring.RingCommunicator`: the dtypes it sums (and the
kernels' kind of each), the input as a C-contiguous array with its output buffer, and the
blocks' exponents of a float input, NaN and Inf refused by every rank together."""
from __future__ import annotations

import numpy as np

from nicoffload.datapath import kernels
from nicoffload.datapath.pump import KIND_FLOAT32, KIND_FLOAT64, KIND_INT32
from nicoffload.errors import InputError, RefusedError
from nicoffload.wire import quant

DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))
#: the decode kernels' name of each dtype
KIND = {np.dtype(np.int32): KIND_INT32, np.dtype(np.float32): KIND_FLOAT32, np.dtype(np.float64): KIND_FLOAT64}


def call_arrays(array: np.ndarray, out: np.ndarray | None, dtypes=DTYPES,
                takes: str = "allreduce supports int32, float32 and float64",
                whose: str = "the input's") -> tuple[np.ndarray, np.ndarray]:
    """``array`` as a C-contiguous array and the output it goes to: ``out``, checked (shape,
    dtype, C order), or a new one. A dtype not in ``dtypes`` is refused (``takes``: what the
    message says is taken)."""
    x = np.ascontiguousarray(array)
    if x.dtype not in dtypes:
        raise InputError(f"{takes}, not {x.dtype}")
    if out is None:
        out = np.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise InputError(f"out must be a C-contiguous array with {whose} shape and dtype")
    return x, out


def block_exponents(flat: np.ndarray, elems: int, exps: np.ndarray, rank: int) -> int:
    """Fill ``exps`` with the exponent of each block of ``elems`` values of the float array
    ``flat`` (kernels.block_meta_*). A block holding a NaN or an Inf gets a refusal code that
    names ``rank`` (quant.refusal_code) instead: sent in the metadata round, it makes every rank
    refuse the call (:func:`refuse_together`). Returns the flat index of the first non-finite
    value, or -1."""
    bad = (kernels.block_meta_f32 if flat.dtype == np.float32 else kernels.block_meta_f64)(flat, elems, exps)
    if bad >= 0:
        exps[exps >= quant.REFUSE_EXP] += rank
    return bad


def refuse_together(gexp: np.ndarray, rank: int, flat: np.ndarray, bad: int, elems: int) -> None:
    """After the metadata round: raise RefusedError, on every rank alike, if some rank's block
    exponent refused the call (``gexp``, the round's MAX). ``bad`` is this rank's first
    non-finite value (-1: none); the message names the rank that refused and why."""
    if not len(gexp) or int(gexp.max()) < quant.REFUSE_EXP:
        return
    if bad >= 0:
        what = f"({'NaN' if np.isnan(flat[bad]) else 'Inf'} at flat index {bad})"
        raise RefusedError(f"rank {rank}'s input holds a non-finite value {what}; "
                           f"refusing to sum it (every rank refuses this call)", rank, what)
    hit = np.flatnonzero(gexp >= quant.REFUSE_EXP)
    b = int(hit[0])
    reason, who = quant.refusal(int(gexp[b]))
    lo, hi = b * elems, min((b + 1) * elems, flat.size)
    more = f" and {len(hit) - 1} more block(s)" if len(hit) > 1 else ""
    if reason == quant.REFUSE_RANGE:
        raise RefusedError(f"rank {who}'s gradients in elements {lo}..{hi - 1}{more} are out of the optimizer's "
                           f"range; every rank refuses this step", who)
    what = f"({quant.REFUSE_WHAT.get(reason, '?')}) in elements {lo}..{hi - 1}{more}"
    raise RefusedError(f"rank {who}'s input holds a non-finite value {what}; every rank refuses this call", who, what)
