"""Sums in the aggregator's own fixed point over any exact int32 collective: the failover's
paths (the torch backend's gloo group, a bare communicator's ring). Every offload path sums the
same integers (the block exponents of every rank, then rint(x * 2^s) + bias, added as integers
in any order), so a call summed here returns the bits the aggregator would have: the exponents'
MAX and the lanes' SUM are int32 collectives, exact; the decode is the aggregator's
(pump.unfix). MAX/MIN go through the aggregator's order-preserving int32 keys (its NaN order
included). A subclass says how an int32 array is reduced over the group (:meth:`reduce_int32`).
"""
from __future__ import annotations

import numpy as np

from nicoffload import collective
from nicoffload.datapath.tensors import DTYPES, block_exponents, call_arrays, refuse_together
from nicoffload.errors import InputError
from nicoffload.local import fixed
from nicoffload.wire import quant


class FixedSum:
    """Group rank ``rank`` of ``world`` (the fixed point makes room for ``world`` contributions, as
    the aggregator's job of those ranks does); ``elems``: the job's record size (its blocks)."""

    capabilities = collective.Capabilities(ops=frozenset({"sum", "max", "min"}),
                                           extreme_dtypes=collective.EXTREME_DTYPES, lanes=(32, 16))
    mode = "fixed point"  # the path, as logs and summaries name it

    def __init__(self, rank: int, world: int, elems: int):
        if not 0 <= rank < world:
            raise InputError(f"rank {rank} of {world} ranks")
        self.rank, self.world, self.elems = rank, world, elems
        fixed.warm_up()

    def reduce_int32(self, a: np.ndarray, op: str) -> None:
        """``a`` (int32, contiguous) reduced over the group in place: ``op`` "sum" (wrapping
        modulo 2^32) or "max"; every rank calls it with arrays of the same size."""
        raise NotImplementedError

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        if op not in ("sum", "max", "min"):
            raise InputError(f"op must be sum, max or min, not {op!r}")
        if lanes is not None and lanes not in quant.LANES:
            raise InputError(f"lanes must be 16 or 32, not {lanes!r}")
        dtypes = DTYPES if op == "sum" else (np.dtype(np.int32), np.dtype(np.float32))
        x, out = call_arrays(array, out, dtypes)
        flat, res = x.reshape(-1), out.reshape(-1)
        if op != "sum":
            keys = np.empty(flat.size, np.int32)
            fixed.to_keys(flat, op, keys)
            self._reduce(keys, "max")
            fixed.from_keys(keys, op, x.dtype, res)
        elif x.dtype == np.int32:
            total = flat.copy()
            self._reduce(total, "sum")
            res[:] = total
        else:
            self._sum_float(flat, res, 16 if lanes == 16 else 32)
        return out

    def _reduce(self, a: np.ndarray, op: str) -> None:
        if a.size:
            self.reduce_int32(a, op)

    def _sum_float(self, x: np.ndarray, out: np.ndarray, bits: int) -> None:
        n = x.size
        if not n:
            return
        E = quant.block_elems(self.elems, bits)
        nb = -(-n // E)
        gexp = np.empty(nb, np.int32)
        bad = block_exponents(x, E, gexp, self.rank)
        self._reduce(gexp, "max")
        refuse_together(gexp, self.rank, x, bad, E)
        top = quant.top_bits(bits) - quant.headroom_bits(self.world)
        bias = quant.bias(self.world, bits)
        words = np.zeros(nb * E * bits // 32, np.int32)
        fixed.quantize(x, E, gexp, top, bias, x.dtype == np.float32, words if bits == 32 else words.view(np.int16))
        self._reduce(words, "sum")
        fixed.decode(words, E, gexp, top, self.world * bias, bits == 16, 0, nb, n, out)

    def settle(self, array: np.ndarray, out: np.ndarray, op: str, lanes: int | None, E: int,
               owner: np.ndarray) -> None:
        """A cut call's output on every rank (the failovers' last step): block b (E elements)
        from rank ``owner[b]``, which holds its final result (an int32 SUM of its bits and
        everyone else's zeros is a broadcast), and the blocks nobody holds (``owner`` = world)
        summed anew from the inputs, which are still there."""
        flat, res = array.reshape(-1), out.reshape(-1)
        owned, lost = np.flatnonzero(owner < self.world), np.flatnonzero(owner >= self.world)
        if len(owned):
            idx = block_elements(owned, E, flat.size)
            words = res.view(np.int32).reshape(-1, res.dtype.itemsize // 4)
            mine = np.zeros((len(idx), words.shape[1]), np.int32)
            sel = owner[owned] == self.rank
            if sel.any():
                own_idx = block_elements(owned[sel], E, flat.size)
                mine[np.searchsorted(idx, own_idx)] = words[own_idx]
            self.reduce_int32(mine.reshape(-1), "sum")
            words[idx] = mine
        if len(lost):
            idx = block_elements(lost, E, flat.size)
            part = np.ascontiguousarray(flat[idx])
            self.allreduce(part, out=part, op=op, lanes=lanes)
            res[idx] = part

    def barrier(self) -> None:
        self._reduce(np.zeros(1, np.int32), "max")

    def abort(self, error: BaseException) -> None:
        """Nothing of its own to interrupt (a subclass over a collective that can be, says so)."""

    def close(self) -> None:
        """Nothing of its own to release."""

    def __enter__(self) -> "FixedSum":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def block_elements(blocks: np.ndarray, E: int, n: int) -> np.ndarray:
    """The flat indices of the elements of ``blocks`` (E elements each; the last may be short)."""
    idx = (blocks[:, None] * E + np.arange(E)[None, :]).reshape(-1)
    return idx[idx < n]
