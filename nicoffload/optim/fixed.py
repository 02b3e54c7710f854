"""The fixed point both optimizers' models compute in (constants from xdp/nicoffload_proto.h):
values as integers with FRAC (or a given number of) fractional bits, and mulfrac, the product
the XDP program uses, exactly."""
from __future__ import annotations

import numpy as np

from nicoffload.wire import proto

FRAC = proto.C["AR_OPT_FRAC"]
ONE = 1 << FRAC


def returned_error(w_max: float, params_dtype=np.float64) -> float:
    """The rounding a parameter takes on its way back to a rank, at most: the result's block
    floating point (31-bit lanes, relative to the block's largest weight), then the cast into the
    rank's parameters (half an ulp: 2^-24 of the value in float32)."""
    return w_max * (2.0 ** -31 + float(np.finfo(params_dtype).eps) / 2)


def fixed(v: float, frac: int = FRAC) -> int:
    """round(v * 2^frac): a hyperparameter as the aggregator keeps it."""
    return int(round(v * (1 << frac)))


def mulfrac(x: np.ndarray, c: int) -> np.ndarray:
    """floor(x * c / 2^FRAC) for int64 x (|x| < 2^62) and 0 <= c <= 2^FRAC, exactly as the XDP
    program computes it: x = xh * 2^32 + xl, 0 <= xl < 2^32."""
    x = np.asarray(x, dtype=np.int64)
    xh = x >> 32
    xl = (x & 0xFFFFFFFF).astype(np.uint64)
    return xh * np.int64(c) + ((xl * np.uint64(c)) >> np.uint64(32)).astype(np.int64)


def mulfrac_int(x: int, c: int) -> int:
    """The same on Python integers (the per-block constants, computed once)."""
    return (x >> 32) * c + (((x & 0xFFFFFFFF) * c) >> 32)
