"""Fixed-point quantization that can never overflow the int32 sum of N workers.

Per block b, every rank sends the exponent E_b of its largest magnitude (2^E_b > max|x|, from
frexp) in a small max-reduction round; the global E_b is the max over ranks. Each rank then
sends q = rint(x * 2^s_b) with s_b = 30 - L - E_b, L = ceil(log2 N). Since |x| < 2^E_b,
|q| <= 2^(30-L) and the sum of N <= 2^L terms is at most 2^30 < 2^31: no overflow, whatever the
inputs. Error bound of the sum, per element of block b (before the final cast to the dtype):
    |sum_hat - sum| <= N * 2^-(s_b+1) = N * 2^(E_b + L - 31)
i.e. at most N * 2^(L-30) relative to the block's largest input magnitude; the cast back to
float32 adds at most half an ulp of the result.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import InputError

#: exponent sent for an all-zero block: loses every max, so max == ZERO_EXP means zero everywhere
ZERO_EXP = np.iinfo(np.int32).min


def headroom_bits(world: int) -> int:
    return max(0, math.ceil(math.log2(world))) if world > 1 else 0


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


def shifts_for(exps: np.ndarray, world: int) -> np.ndarray:
    """s_b = 30 - L - E_b (active blocks only: exps must not be ZERO_EXP)."""
    return (30 - headroom_bits(world) - exps.astype(np.int64)).astype(np.int64)


def quantize(blocks: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """rint(x * 2^s) per row, as int32 (exact power-of-two scaling in float64)."""
    scaled = np.ldexp(blocks.astype(np.float64, copy=False), shifts[:, None].astype(np.int32))
    return np.rint(scaled, out=scaled).astype(np.int32)


def dequantize(sums: np.ndarray, shifts: np.ndarray, dtype) -> np.ndarray:
    return np.ldexp(sums.astype(np.float64), (-shifts)[:, None].astype(np.int32)).astype(dtype)


def error_bound(exps: np.ndarray, world: int) -> np.ndarray:
    """Per-block bound on |sum_hat - sum| before the final cast (see module docstring)."""
    e = np.where(exps == ZERO_EXP, -1100, exps).astype(np.float64)
    return world * np.ldexp(1.0, (e + headroom_bits(world) - 31).astype(np.int32))
