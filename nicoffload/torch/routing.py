"""Which path a call takes: the offload where the group's communicator takes the op and the
dtype (its :class:`~nicoffload.collective.Capabilities` say so), the gloo path otherwise.

    offload   all_reduce SUM/AVG of float32, float64, int32, bfloat16/float16 (through float32;
              in 16-bit lanes where the communicator has them, unless NICOFFLOAD_LANES says
              otherwise); MAX/MIN of int32, float32, bfloat16, float16 where it takes them (exact:
              the aggregator's MAX op on order-preserving keys); reduce-scatter SUM/AVG of the
              same dtypes; barrier
    gloo      everything else
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from nicoffload.collective import Collective

R = dist.ReduceOp
#: dtypes the communicators take as they are; the half ones go through float32
NATIVE = (torch.float32, torch.float64, torch.int32)
HALF = (torch.bfloat16, torch.float16)
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32,
          torch.bfloat16: np.float32, torch.float16: np.float32}


def op_name(opts) -> str:
    """``opts.reduceOp`` as sum, avg, max, min or other (ReduceOp compares by ``==`` only:
    ``op in (ReduceOp.SUM, ...)`` is always False)."""
    if opts is None:
        return "sum"
    op = opts.reduceOp
    for name, k in (("sum", R.SUM), ("avg", R.AVG), ("max", R.MAX), ("min", R.MIN)):
        if op == k:
            return name
    return "other"


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is summed in (float32 for the half ones)."""
    return dtype if dtype in NATIVE else torch.float32


class Router:
    """The route of a group's calls over its communicator (None: every call takes gloo)."""

    def __init__(self, comm: Collective | None, lanes: str = "auto"):
        self.comm, self.lanes_setting = comm, lanes

    def route(self, op: str, dtype: torch.dtype) -> str | None:
        """The communicator's op for ``op`` (:func:`op_name`) on ``dtype``, or None: the gloo path."""
        if self.comm is None or dtype not in _NUMPY:
            return None
        how = "sum" if op in ("sum", "avg") else op if op in ("max", "min") else None
        if how is None or not self.comm.capabilities.supports(how, _NUMPY[dtype]):
            return None
        return how

    def lanes(self, dtype: torch.dtype) -> dict:
        """The lanes argument of a sum of ``dtype`` (NICOFFLOAD_LANES): 16-bit lanes for the half
        types unless told otherwise, where the communicator has them (the ring has not)."""
        if self.comm is None or 16 not in self.comm.capabilities.lanes or not dtype.is_floating_point:
            return {}
        if self.lanes_setting == "auto":
            return {"lanes": 16} if dtype in HALF else {}
        return {"lanes": int(self.lanes_setting)}
