"""Sums through the group's internal gloo group in the aggregator's own fixed point: the
failover's path (:mod:`~nicoffload.torch.failover`). Every offload path sums the same integers
(the block exponents of every rank, then rint(x * 2^s) + bias, added as integers in any order),
so a call summed here returns the bits the aggregator would have: the exponents' MAX and the
lanes' SUM are int32 collectives of gloo, exact; the decode is the aggregator's (pump.unfix).
MAX/MIN go through the aggregator's order-preserving int32 keys (its NaN order included)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from nicoffload import collective
from nicoffload.datapath.tensors import DTYPES, block_exponents, call_arrays, refuse_together
from nicoffload.errors import InputError
from nicoffload.local import fixed
from nicoffload.wire import quant


class FixedGloo:
    """Group rank ``rank`` of ``world`` over the gloo process group ``pg``; ``W``: the
    contributions the fixed point makes room for (the aggregator job's world, or hosts x the
    most ranks a host runs), ``elems``: the job's record size (its blocks)."""

    capabilities = collective.Capabilities(ops=frozenset({"sum", "max", "min"}),
                                           extreme_dtypes=collective.EXTREME_DTYPES, lanes=(32, 16))

    def __init__(self, pg: dist.ProcessGroup, rank: int, world: int, W: int, elems: int):
        self.pg, self.rank, self.world, self.W, self.elems = pg, rank, world, W, elems
        fixed.warm_up()

    def _gloo(self, a: np.ndarray, op) -> None:
        """``a`` (int32, in place) reduced over the group by gloo."""
        if a.size:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            self.pg.allreduce([torch.from_numpy(a)], opts).wait()

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        if op not in ("sum", "max", "min"):
            raise InputError(f"op must be sum, max or min, not {op!r}")
        dtypes = DTYPES if op == "sum" else (np.dtype(np.int32), np.dtype(np.float32))
        x, out = call_arrays(array, out, dtypes)
        flat, res = x.reshape(-1), out.reshape(-1)
        if op != "sum":
            keys = np.empty(flat.size, np.int32)
            fixed.to_keys(flat, op, keys)
            self._gloo(keys, dist.ReduceOp.MAX)
            fixed.from_keys(keys, op, x.dtype, res)
        elif x.dtype == np.int32:
            total = flat.copy()
            self._gloo(total, dist.ReduceOp.SUM)
            res[:] = total
        else:
            self._sum_float(flat, res, 16 if lanes == 16 else 32)
        return out

    def _sum_float(self, x: np.ndarray, out: np.ndarray, bits: int) -> None:
        n = x.size
        if not n:
            return
        E = quant.block_elems(self.elems, bits)
        nb = -(-n // E)
        gexp = np.empty(nb, np.int32)
        bad = block_exponents(x, E, gexp, self.rank)
        self._gloo(gexp, dist.ReduceOp.MAX)
        refuse_together(gexp, self.rank, x, bad, E)
        top = quant.top_bits(bits) - quant.headroom_bits(self.W)
        bias = quant.bias(self.W, bits)
        words = np.zeros(nb * E * bits // 32, np.int32)
        fixed.quantize(x, E, gexp, top, bias, x.dtype == np.float32, words if bits == 32 else words.view(np.int16))
        # the ranks a host lacks (W > world) contribute their bias as the aggregator counts them
        pad = (self.W - self.world) * bias
        if pad and self.rank == 0:
            words += np.int32(pad | (pad << 16) if bits == 16 else pad)
        self._gloo(words, dist.ReduceOp.SUM)
        fixed.decode(words, E, gexp, top, self.W * bias, bits == 16, 0, nb, n, out)

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def abort(self, error: BaseException) -> None:
        pass  # gloo's own timeout ends a call whose peer is gone

    def close(self) -> None:
        pass  # the group's gloo group is the group's

    def __enter__(self) -> "FixedGloo":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
