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


def rank_bit(rank: int) -> np.int32:
    """Rank ``rank``'s bit in an int32 contributor word (bit 31: the sign bit)."""
    return np.int32(1 << rank) if rank < 31 else np.int32(-(1 << 31))


def float_meta(flat: np.ndarray, elems: int, rank: int, refuse: bool, exps: np.ndarray,
               bits: np.ndarray | None) -> int:
    """One rank's metadata of the float blocks of ``flat``: their exponents into ``exps`` (a
    refusal code where a block holds a NaN or an Inf; every block with ``refuse``: the rank
    takes part only to refuse), and where ``bits`` is given, the rank's bit for every block that
    has an exponent (sparse jobs). Returns the first non-finite value's index, or -1."""
    bad = block_exponents(flat, elems, exps, rank)
    if refuse:
        exps[:], bad = quant.refusal_code(quant.REFUSE_ABORT, rank), -1
    if bits is not None:
        kernels.contributor_bits(exps, quant.ZERO_EXP, rank_bit(rank), bits)
    return bad


def refusal(who: int | None, kind: str, *, index: int | None = None, span: tuple[int, int] | None = None,
            more: int = 0) -> RefusedError:
    """The RefusedError every rank raises for a refused call: ``who`` refused it for ``kind``
    ("NaN", "Inf", or "range": an optimizer step's gradient out of range); ``index``: the flat
    index of the value (on the rank that holds it), else ``span``: the elements (lo, hi) of the
    first refused block and ``more`` blocks after it."""
    extra = f" and {more} more block(s)" if more else ""
    if kind == "abort":
        return RefusedError(f"rank {who} could not take part in this call and refused it for every rank", who,
                            kind=kind, span=span, more=more)
    if kind == "range":
        lo, hi = span
        return RefusedError(f"rank {who}'s gradients in elements {lo}..{hi - 1}{extra} are out of the optimizer's "
                            f"range; every rank refuses this step", who, kind=kind, span=span, more=more)
    if index is not None:
        what = f"({kind} at flat index {index})"
        return RefusedError(f"rank {who}'s input holds a non-finite value {what}; "
                            f"refusing to sum it (every rank refuses this call)", who, what, kind=kind, index=index)
    what = f"({kind}) in elements {span[0]}..{span[1] - 1}{extra}"
    return RefusedError(f"rank {who}'s input holds a non-finite value {what}; every rank refuses this call", who, what,
                        kind=kind, span=span, more=more)


def refuse_together(gexp: np.ndarray, rank: int, flat: np.ndarray, bad: int, elems: int) -> None:
    """After the metadata round: raise RefusedError, on every rank alike, if some rank's block
    exponent refused the call (``gexp``, the round's MAX). ``bad`` is this rank's first
    non-finite value (-1: none); the message names the rank that refused and why."""
    if not len(gexp) or int(gexp.max()) < quant.REFUSE_EXP:
        return
    if bad >= 0:
        raise refusal(rank, "NaN" if np.isnan(flat[bad]) else "Inf", index=int(bad))
    hit = np.flatnonzero(gexp >= quant.REFUSE_EXP)
    b = int(hit[0])
    reason, who = quant.refusal(int(gexp[b]))
    kind = {quant.REFUSE_RANGE: "range", quant.REFUSE_ABORT: "abort"}.get(reason) or quant.REFUSE_WHAT.get(reason, "?")
    raise refusal(who, kind, span=(b * elems, min((b + 1) * elems, flat.size)), more=len(hit) - 1)
