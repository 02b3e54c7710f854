"""Fixed-point quantization that can never overflow the int32 sum of N workers.

Per block b, every rank sends the exponent E_b of its largest magnitude (2^E_b > max|x|, from
frexp) in a small max-reduction round; the global E_b is the max over ranks. Each rank then
sends q = rint(x * 2^s_b) with s_b = 30 - L - E_b, L = ceil(log2 N). Since |x| < 2^E_b,
|q| <= 2^(30-L) and the sum of N <= 2^L terms is at most 2^30 < 2^31: no overflow, whatever the
inputs. Error bound of the sum, per element of block b (before the final cast to the dtype):
    |sum_hat - sum| <= N * 2^-(s_b+1) = N * 2^(E_b + L - 31)
i.e. at most N * 2^(L-30) relative to the block's largest input magnitude; the cast back to
float32 adds at most half an ulp of the result.

16-bit lanes (op SUM16, ``lanes=16``) are the same scheme with 14 in place of 30: blocks of
2 * elems elements, |q| <= 2^(14-L), sums at most 2^15, error at most N * 2^(E_b + L - 15).
"""
from __future__ import annotations

import math

import numpy as np

from nicoffload.errors import InputError

#: exponent sent for an all-zero block: loses every max, so max == ZERO_EXP means zero everywhere
ZERO_EXP = np.iinfo(np.int32).min
#: exponents from REFUSE_EXP up refuse the call: a block holding a NaN or an Inf (or, in an
#: optimizer step, a gradient out of range) sends REFUSE_EXP + (reason << 16) + rank instead of
#: its exponent. It wins the metadata round's MAX over every real exponent, so every rank learns
#: of it and refuses the call, instead of waiting for data the refusing rank will not send.
REFUSE_EXP = 1 << 30
#: REFUSE_ABORT: a rank that cannot take part refuses the call for it (a leader of a job of
#: more than 32 ranks whose group failed; worker.hier); it wins over the other reasons
REFUSE_INF, REFUSE_NAN, REFUSE_RANGE, REFUSE_ABORT = 1, 2, 3, 4
REFUSE_WHAT = {REFUSE_INF: "Inf", REFUSE_NAN: "NaN", REFUSE_RANGE: "out of range", REFUSE_ABORT: "abort"}


def refusal_code(reason: int, rank: int) -> int:
    return REFUSE_EXP + (reason << 16) + rank


def refusal(code: int) -> tuple[int, int] | None:
    """(reason, rank) of a metadata round's exponent that refuses the call, else None."""
    if code < REFUSE_EXP:
        return None
    return (code - REFUSE_EXP) >> 16, (code - REFUSE_EXP) & 0xFFFF


def headroom_bits(world: int) -> int:
    return max(0, math.ceil(math.log2(world))) if world > 1 else 0


#: lane widths of the fixed point: 32 (op SUM64, two lanes per 64-bit word) or 16 (op SUM16, four)
LANES = (32, 16)


def top_bits(lanes: int = 32) -> int:
    """log2 of the largest sum of N quantized values: 30 for 32-bit lanes, 14 for 16-bit ones."""
    if lanes not in LANES:
        raise InputError(f"lanes must be 16 or 32, not {lanes!r}")
    return lanes - 2


def bias(world: int, lanes: int = 32) -> int:
    """The offset of the offset-binary lanes: 2^(top - L)."""
    return 1 << (top_bits(lanes) - headroom_bits(world))


def block_elems(elems: int, lanes: int = 32) -> int:
    """Elements per block (and record) of ``elems`` 32-bit words: twice as many in 16-bit lanes."""
    return elems * 32 // lanes


def check_finite(x: np.ndarray, what: str = "input") -> None:
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x))
        kind = "NaN" if np.isnan(x.flat[bad[0]]) else "Inf"
        raise InputError(f"{what} holds {len(bad)} non-finite value(s) ({kind} at flat index {bad[0]}); "
                         f"refusing to sum them")


def block_exponents(blocks: np.ndarray) -> np.ndarray:
    """Per-row exponent E with max|row| < 2^E; ZERO_EXP for all-zero rows. Float rows only."""
    amax = np.abs(blocks).max(axis=1) if blocks.shape[1] else np.zeros(len(blocks))
    _, e = np.frexp(amax.astype(np.float64))
    e = e.astype(np.int32)
    e[amax == 0] = ZERO_EXP
    return e


def shifts_for(exps: np.ndarray, world: int, lanes: int = 32) -> np.ndarray:
    """s_b = 30 - L - E_b (14 - L - E_b for 16-bit lanes; active blocks only: exps must not be
    ZERO_EXP)."""
    return (top_bits(lanes) - headroom_bits(world) - exps.astype(np.int64)).astype(np.int64)


def _f32_ok(shifts: np.ndarray) -> np.ndarray:
    """Rows whose scale 2^s (and 2^-s) is a normal float32 with room for the results."""
    return (shifts > -100) & (shifts < 100)


def quantize(blocks: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """rint(x * 2^s) per row, as int32. Scaling by a power of two is exact, so float32 rows are
    scaled in float32 (fast); the rare rows whose 2^s leaves float32's range are redone in float64."""
    if blocks.dtype == np.float32:
        ok = _f32_ok(shifts)
        f = np.ldexp(np.float32(1), np.clip(shifts, -99, 99).astype(np.int32)).astype(np.float32)
        scaled = blocks * f[:, None]
        np.rint(scaled, out=scaled)
        out = scaled.astype(np.int32)
        if not ok.all():
            rest = np.flatnonzero(~ok)
            out[rest] = quantize(blocks[rest].astype(np.float64), shifts[rest])
        return out
    scaled = np.ldexp(blocks.astype(np.float64, copy=False), shifts[:, None].astype(np.int32))
    np.rint(scaled, out=scaled)
    return scaled.astype(np.int32)


def dequantize(sums: np.ndarray, shifts: np.ndarray, dtype) -> np.ndarray:
    """sum * 2^-s in ``dtype``. For float32 the int32 -> float32 conversion is the only rounding
    and the power-of-two scaling is exact, so the result equals the correctly rounded float64 path
    (rows whose scale leaves float32's normal range take that path)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        ok = _f32_ok(shifts)
        out = sums.astype(np.float32)
        with np.errstate(over="ignore"):  # rows out of range are redone below
            out *= np.ldexp(np.float32(1), np.clip(-shifts, -99, 99).astype(np.int32)).astype(np.float32)[:, None]
        if not ok.all():
            rest = np.flatnonzero(~ok)
            with np.errstate(over="ignore"):  # a sum beyond float32's range is +-inf, as in numpy
                out[rest] = np.ldexp(sums[rest].astype(np.float64), (-shifts[rest])[:, None].astype(np.int32))
        return out
    return np.ldexp(sums.astype(np.float64), (-shifts)[:, None].astype(np.int32)).astype(dtype)


def error_bound(exps: np.ndarray, world: int, lanes: int = 32) -> np.ndarray:
    """Per-block bound on |sum_hat - sum| before the final cast (see module docstring)."""
    e = np.where(exps == ZERO_EXP, -1100, exps).astype(np.float64)
    return world * np.ldexp(1.0, (e + headroom_bits(world) - top_bits(lanes) - 1).astype(np.int32))
