"""Speculation (small float tensors, up to SPECULATE_BLOCKS blocks): the data rounds go out in
the same run as the metadata rounds, scaled by the exponents (and waiting for the contributors)
that the last call of the same size had; blocks whose metadata turns out the same have their
exact result after one round trip, the others go again. Every rank sees the same calls and the
same results, so every rank makes the same guesses and the same misses."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nicoffload.datapath import encode as enc
from nicoffload.datapath import kernels, pump
from nicoffload.datapath.tensors import KIND
from nicoffload.wire import proto, quant
from nicoffload.worker.calls import Rounds

if TYPE_CHECKING:
    from nicoffload.worker.comm import Communicator

#: float tensors of at most this many blocks are sent speculatively (Communicator.speculate)
SPECULATE_BLOCKS = 256
#: exponent vectors remembered for speculation (distinct tensor sizes of a training step)
SPECULATE_SIZES = 512
#: after a guess that missed, calls of that size without speculation: 1, 3, 7, ... up to this
#: (a miss costs the missed blocks' bytes twice; every rank sees the same misses, so all agree)
SPECULATE_BACKOFF = 63
#: the contributor words of a job without them (dense): the speculative kernels take an empty array
_NO_BITS = np.empty(0, np.int32)


class Guesses:
    """The global exponents (and contributor bits) of the last call of each size, and how many
    calls of a size wait before speculating again after a miss."""

    def __init__(self):
        self._guesses: dict = {}  # (blocks, dtype) -> the global block exponents of the last such call
        self._backoff: dict = {}  # (blocks, dtype) -> (calls left without speculating, current backoff)

    def take(self, key) -> tuple:
        """(the guess for a call of ``key``, or None if there is none or it waits; its backoff)."""
        guess = self._guesses.get(key)
        left, backoff = self._backoff.get(key, (0, 0))
        if guess is not None and left:  # the last guess for this size missed: wait a while (every rank alike)
            self._backoff[key] = (left - 1, backoff)
            guess = None
        return guess, backoff

    def remember(self, key, gexp: np.ndarray, gbits: np.ndarray | None) -> None:
        if len(self._guesses) >= SPECULATE_SIZES and key not in self._guesses:
            self._guesses.clear()
            self._backoff.clear()
        self._guesses[key] = (gexp.copy(), None if gbits is None else gbits.copy())

    def missed(self, key, backoff: int, missed: bool) -> None:
        """After a speculative call: double the wait (1, 3, 7, ...) if it missed, else none."""
        backoff = min(2 * backoff + 1, SPECULATE_BACKOFF) if missed else 0
        self._backoff[key] = (backoff, backoff)


def speculative_run(self: Communicator, x: np.ndarray, flat: np.ndarray, res: np.ndarray, exps: np.ndarray,
                    bits: np.ndarray | None, guess: tuple) -> tuple:
    """One run of rounds: this call's metadata rounds (MAX of the exponents; in sparse jobs
    OR of the contributor bits too), then a data round per block the last call of this size
    had non-zero, scaled by that call's global exponents and waiting for that call's
    contributors (``guess``). Every rank makes the same guess: the last call's results are
    the same everywhere. A block whose exponent and contributors are the guessed ones got
    exactly the result a normal call gives it (the same scale, the same round); the others
    are returned for data rounds of their own (those zero everywhere are zeroed here). A rank
    whose values outgrow the guessed scale, or that has none any more where it was guessed to
    contribute, sends zeros there: the metadata then differs from the guess, and the block
    goes again. Returns (exponents, contributor bits or None, blocks to redo, their masks)."""
    E, W, S, rec = self.elems, self.world, self.slots, self._rec
    st = self.last
    nb = len(exps)
    full = np.int64(self._all)
    gexp0, gbits0 = guess
    per = -(-nb // E)
    parts = [(exps, proto.OP_MAX)] + ([(bits, proto.OP_OR)] if bits is not None else [])
    k = per * len(parts)  # metadata rounds
    # the plan in one pass (kernels.spec_plan): at these sizes numpy's per-call cost is the CPU
    blocks = self._buf.get("spec_blocks", k + nb, np.int64)
    masks = self._buf.get("spec_masks", k + nb, np.int64)
    shifts = self._buf.get("spec_shifts", k + nb, np.int32)
    mine = self._buf.get("spec_mine", k + nb, np.int64)
    keep = self._buf.get("spec_keep", nb, np.bool_)
    no_bits = _NO_BITS
    K, nmine, nover = kernels.spec_plan(gexp0, no_bits if gbits0 is None else gbits0, exps, quant.ZERO_EXP, full,
                                        self.rank, quant.top_bits(32) - quant.headroom_bits(W), k,
                                        pump.META_SHIFT, blocks, masks, shifts, mine, keep)
    n = k + K
    blocks, masks, shifts, mine = blocks[:n], masks[:n], shifts[:n], mine[:nmine]
    base = self._s.reserve(n)
    values = self._meta_values(parts, nb, per)
    src = flat
    if nover:  # this rank's values there do not fit the guessed scale: zeros instead
        src = flat.copy()
        kernels.zero_blocks(src.view(np.int64) if src.dtype.itemsize == 8 else src.view(np.int32), keep, E)
    send = self._s.send_buffer(len(mine))
    tmpl = self._s.template(proto.TYPE_CONTRIB)
    single = x.dtype == np.float32
    bias = self._s.bias

    def encode(j0: int, j1: int, at: int) -> None:
        while j0 < j1 and j0 < k:  # metadata records, one op per part
            p = j0 // per
            m1 = min(j1, (p + 1) * per)
            enc.encode_int(send, rec, E, tmpl, values, mine[j0:m1], base, S, blocks, masks, parts[p][1], at)
            at += m1 - j0
            j0 = m1
        if j0 < j1:
            enc.encode_float(send, rec, E, tmpl, src, mine[j0:j1], base, S, blocks, masks, shifts, bias,
                                 single, at, proto.OP_SUM64)

    meta_out = self._buf.get("meta_out", k * E, np.int32)
    # an in-place call's results go to a scratch array: a block the guess got wrong must not
    # overwrite the input before its own round sends it again (elsewhere the redo overwrites it)
    inplace = np.may_share_memory(res, flat)
    got = self._buf.get("spec_out", res.size, res.dtype) if inplace else res
    self._s.run(base, Rounds(blocks, masks, mine, shifts, send, KIND[x.dtype], got, encode, meta_out))
    st.meta_rounds += k
    gexp = meta_out[:nb]
    gbits = meta_out[per * E:per * E + nb] if bits is not None else None
    hit = self._buf.get("spec_hit", nb, np.bool_)
    cover = self._buf.get("spec_cover", nb, np.bool_)
    redo = self._buf.get("spec_redo", nb, np.int64)
    masks_redo = self._buf.get("spec_masks_redo", nb, np.int64)
    hits, hole, nredo, skipped = kernels.spec_verdict(gexp, no_bits if gbits is None else gbits, blocks, k, n,
                                                      gexp0, no_bits if gbits0 is None else gbits0,
                                                      quant.ZERO_EXP, full, hit, cover, redo, masks_redo)
    if inplace and hits == nb:
        res[:] = got
    elif inplace and hits:
        take = np.repeat(hit, E)[:res.size]
        res[take] = got[take]
    st.spec_blocks += K
    st.spec_missed += K - hits
    st.results += hits
    st.blocks_skipped = skipped
    if hole:  # zero everywhere now, and no round gave it a result
        words = res.view(np.int64) if res.dtype.itemsize == 8 else res.view(np.int32)
        kernels.zero_blocks(words, cover, E)
    return gexp, gbits, redo[:nredo], masks_redo[:nredo]  # scratch: read before the next call
