"""What a collective takes and gives, shared by the aggregator's :class:`~nicoffload.worker.Communicator`
and the ring's :class:`~nicoffload.ring.RingCommunicator`: the dtypes it sums (and the
kernels' kind of each), the input as a C-contiguous array with its output buffer, and the
blocks' exponents of a float input, NaN and Inf refused."""
from __future__ import annotations

import numpy as np

from nicoffload.datapath import kernels
from nicoffload.datapath.pump import KIND_FLOAT32, KIND_FLOAT64, KIND_INT32
from nicoffload.errors import InputError

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


def block_exponents(flat: np.ndarray, elems: int, exps: np.ndarray, rank: int) -> np.ndarray:
    """Fill ``exps`` with the exponent of each block of ``elems`` values of the float array
    ``flat`` (kernels.block_meta_*); a NaN or Inf is refused, naming ``rank`` and where it is."""
    bad = (kernels.block_meta_f32 if flat.dtype == np.float32 else kernels.block_meta_f64)(flat, elems, exps)
    if bad >= 0:
        kind = "NaN" if np.isnan(flat[bad]) else "Inf"
        raise InputError(f"rank {rank}'s input holds a non-finite value ({kind} at flat index {bad}); "
                         f"refusing to sum it")
    return exps
