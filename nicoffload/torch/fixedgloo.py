"""The failover's gloo path (:mod:`~nicoffload.torch.failover`): the aggregator's fixed point
(:class:`~nicoffload.local.fixedsum.FixedSum`, the same bits as the aggregator's) summed through
the group's internal gloo group, whose int32 SUM and MAX are exact."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from nicoffload.local.fixedsum import FixedSum

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class FixedGloo(FixedSum):
    """Group rank ``rank`` of ``world`` over the gloo process group ``pg``; ``elems`` as
    :class:`FixedSum` has it."""

    mode = "gloo"

    def __init__(self, pg: dist.ProcessGroup, rank: int, world: int, elems: int):
        super().__init__(rank, world, elems)
        self.pg = pg

    def reduce_int32(self, a: np.ndarray, op: str) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]  # type: ignore[assignment]  # (an enum member of the op)
        self.pg.allreduce([torch.from_numpy(a)], opts).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()
