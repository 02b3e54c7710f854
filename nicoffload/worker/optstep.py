"""One optimizer step of a job whose aggregator holds the optimizer
(:meth:`nicoffload.worker.Communicator.step`): this rank's gradients out, the updated parameters
back (docs/optimizer.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nicoffload import optim
from nicoffload.datapath import encode as enc, pump
from nicoffload.datapath.tensors import DTYPES, block_exponents, call_arrays, refuse_together
from nicoffload.errors import InputError, RefusedError
from nicoffload.wire import proto, quant
from nicoffload.worker.calls import Rounds

if TYPE_CHECKING:
    from nicoffload.worker.comm import Communicator


def optimizer_step(self: Communicator, grads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """See :meth:`Communicator.step`."""
    g, out = call_arrays(grads, out, DTYPES[1:], "optimizer steps take float32 or float64 gradients",
                         "the gradients'")
    E, n = self.elems, g.size
    nb = -(-n // E)
    if self.slots != optim.share(n, E):
        raise InputError(f"rank {self.rank}: {n} gradients need a job of {optim.share(n, E)} slots "
                         f"(optim.share), this communicator has {self.slots}: register the job with --params {n}")
    with self._call("step", g) as st:
        _step(self, g, out, nb)
        st.results = nb
    return out


def _step(self: Communicator, g: np.ndarray, out: np.ndarray, nb: int) -> None:
    E = self.elems
    flat, res = g.reshape(-1), out.reshape(-1)
    exps = self._buf.get("exps", nb, np.int32)
    bad = block_exponents(flat, E, exps, self.rank)
    # a gradient out of range (or a NaN, an Inf) refuses the step on every rank, after the
    # metadata round: the others must not wait for data this rank will not send
    over = (exps > optim.RANGE) & (exps < quant.REFUSE_EXP)
    top = int(exps[over].max()) if over.any() else quant.ZERO_EXP
    exps[over] = quant.refusal_code(quant.REFUSE_RANGE, self.rank)
    self.join()
    gexp, _ = self._meta(exps, None)
    if nb and int(gexp.max()) >= quant.REFUSE_EXP:
        # a step takes every slot of the job in turn (metadata, then data): the refused
        # step's data rounds are skipped, so that the next step's rounds land on their slots
        self._s.reserve(nb)
        if bad < 0 and top > optim.RANGE:
            b = int(np.flatnonzero(over)[0])
            span = (b * E, min((b + 1) * E, flat.size))
            raise RefusedError(f"rank {self.rank}: a gradient reaches 2^{top - 1} (elements {span[0]}..{span[1] - 1}"
                               f"); the optimizer takes |g| < 2^{optim.RANGE} (every rank refuses this step)",
                               self.rank, kind="range", span=span, more=int(over.sum()) - 1)
        refuse_together(gexp, self.rank, flat, bad, E)
    blocks = np.arange(nb, dtype=np.int64)
    masks = np.full(nb, np.int64(self._all), dtype=np.int64)
    shifts = optim.step_shifts(gexp, self.world).astype(np.int32)
    base = self._s.reserve(nb)
    send = self._s.send_buffer(nb)
    tmpl = self._s.template(proto.TYPE_CONTRIB)
    single = g.dtype == np.float32

    def encode(j0: int, j1: int, at: int) -> None:
        enc.encode_float(send, self._rec, E, tmpl, flat, blocks[j0:j1], base, self.slots, blocks, masks,
                         shifts, self._s.bias, single, at, proto.OP_SGD)

    kind = pump.KIND_PARAMS32 if single else pump.KIND_PARAMS64
    # rotated: each rank completes a share of the rounds, so the update runs on every rank's queue
    self._s.run(base, Rounds(blocks, masks, blocks, shifts, send, kind, res, encode, rotate=True))

