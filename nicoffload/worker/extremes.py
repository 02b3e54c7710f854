"""MAX and MIN over the ranks, exact, through the aggregator's MAX op on order-preserving int32
keys (:meth:`nicoffload.worker.Communicator.allreduce` with ``op="max"`` or ``"min"``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nicoffload.datapath import encode as enc
from nicoffload.datapath import pump
from nicoffload.datapath.tensors import call_arrays
from nicoffload.errors import InputError
from nicoffload.wire import proto
from nicoffload.worker.calls import Rounds

if TYPE_CHECKING:
    from nicoffload.worker.comm import Communicator


def extreme(self: Communicator, array: np.ndarray, out: np.ndarray | None, op: str) -> np.ndarray:
    """MAX or MIN over the ranks, exact: each element becomes an int32 key whose signed order
    is the values' (a float's bits with the magnitude bits of negatives flipped; MIN inverts
    every key), the aggregator takes the MAX of the keys (dense: every rank, every block), and
    the key of the result maps back to its value. A NaN whose sign bit is clear is larger
    than +inf here, one whose sign bit is set smaller than -inf."""
    if op not in ("max", "min"):
        raise InputError(f"op must be sum, max or min, not {op!r}")
    x, out = call_arrays(array, out, (np.dtype(np.int32), np.dtype(np.float32)),
                         f"allreduce op={op} takes int32 or float32 arrays")
    n, E = x.size, self.elems
    if n == 0:
        return out
    bits = x.reshape(-1).view(np.int32)
    keys = self._buf.get("xkeys", n, np.int32)
    if x.dtype == np.float32:
        np.bitwise_xor(bits, (bits >> 31) & np.int32(0x7FFFFFFF), out=keys)
    else:
        keys[:] = bits
    if op == "min":
        np.invert(keys, out=keys)
    nb = -(-n // E)
    self.join()
    blocks = np.arange(nb, dtype=np.int64)
    masks = np.full(nb, np.int64(self._all), dtype=np.int64)
    base = self._s.reserve(nb)
    send = self._s.send_buffer(nb)
    tmpl = self._s.template(proto.TYPE_CONTRIB)

    def encode(j0: int, j1: int, at: int) -> None:
        enc.encode_int(send, self._rec, E, tmpl, keys, blocks[j0:j1], base, self.slots, blocks, masks,
                           proto.OP_MAX, at)

    res = self._buf.get("xres", n, np.int32)
    self._s.run(base, Rounds(blocks, masks, blocks, self._buf.get("noshift", nb, np.int32), send, pump.KIND_INT32,
                             res, encode))
    if op == "min":
        np.invert(res, out=res)
    if x.dtype == np.float32:
        res ^= (res >> 31) & np.int32(0x7FFFFFFF)
    out.reshape(-1).view(np.int32)[:] = res
    self._cut = (blocks[:0], nb)  # every block final: a loss from here on (the gate's wait) leaves all of it
    self.last.results = nb
    self.last.own_blocks = nb
    return out
