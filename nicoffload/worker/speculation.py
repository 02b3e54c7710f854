"""Float calls whose data does not wait for the whole metadata round.

Speculation (small float tensors, up to SPECULATE_BLOCKS blocks): the data rounds go out in
the same run as the metadata rounds, scaled by the exponents (and waiting for the contributors)
that the last call of the same size had; blocks whose metadata turns out the same have their
exact result after one round trip, the others go again. Every rank sees the same calls and the
same results, so every rank makes the same guesses and the same misses.

The pipeline (large float tensors, at least PIPELINE_ELEMS elements): the metadata and the data
run chunk by chunk in one stream, each chunk's data waiting only for its own chunk's metadata
(:func:`pipelined_run`; docs/protocol.md, "The pipeline")."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nicoffload.datapath import encode as enc
from nicoffload.datapath import kernels, pump
from nicoffload.datapath.tensors import KIND, float_meta, refuse_together
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


# --- the pipeline: large float tensors -------------------------------------------------------

#: float tensors of at least this many elements (32 MiB of float32) run their metadata in chunks,
#: each ahead of its chunk's data (pipelined_run); in sparse jobs only where the last call of the
#: size had every block on every rank (:class:`Dense`). Below it the metadata is a small part of
#: a link-bound call, and on busy cores the chunks' extra waits cost more than they save
PIPELINE_ELEMS = 8 << 20
#: ... in this many chunks (at most)
PIPELINE_CHUNKS = 8


class Dense:
    """Per tensor size, whether the last call had every block on every rank (the OR of the
    contributor bits full): every rank saw the same bits, so every rank decides alike whether
    a sparse job's next call of the size may be pipelined (every block a round from every rank)."""

    def __init__(self):
        self._last: dict = {}

    def __contains__(self, key) -> bool:
        return self._last.get(key, False)

    def remember(self, key, gbits: np.ndarray, full: int) -> None:
        if len(self._last) >= SPECULATE_SIZES and key not in self._last:
            self._last.clear()
        self._last[key] = bool(((gbits.astype(np.int64) & full) == full).all())


class _Pipeline:
    """One pipelined call's rounds: M0 M1 D0 M2 D1 ... M(C-1) D(C-2) D(C-1), where Mi are the
    metadata rounds of chunk i (MAX of its block exponents; sparse jobs: then OR of the
    contributor bits) and Di its data rounds; Di enters the window only once Mi is complete
    (:meth:`ready`), and chunk i's exponent pass runs when Mi is encoded, while the data before it
    is on the wire. Every block gets a data round from every rank: which blocks are zero is known
    only chunk by chunk, and the rounds are reserved up front."""

    def __init__(self, comm: Communicator, x, flat, res, half: bool, E: int, refuse: bool):
        self.c, self.x, self.flat, self.half, self.E, self.refuse = comm, x, flat, half, E, refuse
        W = comm.elems                                  # int32 words per record: exponents per meta record
        nb = self.nb = -(-flat.size // E)
        per_meta = self.per_meta = -(-nb // W)
        self.parts = ((proto.OP_MAX, 0), (proto.OP_OR, per_meta)) if comm.sparse else ((proto.OP_MAX, 0),)
        cm = -(-per_meta // PIPELINE_CHUNKS)            # meta records per chunk and part
        C = self.C = -(-per_meta // cm)
        self.meta = [(i * cm, min((i + 1) * cm, per_meta)) for i in range(C)]    # meta rounds of a part
        self.span = [(m0 * W, min(m1 * W, nb)) for m0, m1 in self.meta]          # blocks
        order = [("M", 0)] + [seg for i in range(C) for seg in ((("M", i + 1),) if i + 1 < C else ()) + (("D", i),)]
        nmeta = self.nmeta = per_meta * len(self.parts)
        K = self.K = nmeta + nb
        buf = comm._buf
        self.blocks = buf.get("pipe_blocks", K, np.int64)
        self.masks = buf.get("pipe_masks", K, np.int64)
        self.masks[:] = comm._all
        self.shifts = buf.get("pipe_shifts", K, np.int32)
        self.mine = buf.get("pipe_mine", K, np.int64)
        self.mine[:] = np.arange(K)
        self.segs, at = [], 0                           # (op or None: data, chunk, first round, rounds)
        for kind, i in order:
            if kind == "M":
                m0, m1 = self.meta[i]
                for op, off in self.parts:
                    self.blocks[at:at + m1 - m0] = np.arange(off + m0, off + m1)
                    self.shifts[at:at + m1 - m0] = pump.META_SHIFT
                    self.segs.append((op, i, at, m1 - m0))
                    at += m1 - m0
            else:
                b0, b1 = self.span[i]
                self.blocks[at:at + b1 - b0] = np.arange(b0, b1)
                self.shifts[at:at + b1 - b0] = 0
                self.segs.append((None, i, at, b1 - b0))
                at += b1 - b0
        self.d_first = {i: a for op, i, a, _n in self.segs if op is None}
        self.m_first = {}                               # chunk -> (first meta round, meta rounds)
        for op, i, a, n in self.segs:
            if op is not None:
                f, k = self.m_first.get(i, (a, 0))
                self.m_first[i] = (f, k + n)
        self.P = 2 * W if half else W                   # the pump's int32 words per meta round
        self.exps = buf.get("exps", nb, np.int32)
        self.bits = buf.get("bits", nb, np.int32) if comm.sparse else None
        self.values = buf.get("meta_in", nmeta * W, np.int32)
        self.meta_out = buf.get("meta_out", nmeta * self.P, np.int32)
        self.gexp = buf.get("pipe_gexp", nb, np.int32)
        self.gbits = buf.get("pipe_gbits", nb, np.int32) if comm.sparse else None
        self.passed = 0                                 # chunks whose exponents are computed
        self.scaled = 0                                 # chunks whose shifts are set
        self.open = 0                                   # chunks whose metadata rounds are complete
        self.bad = -1                                   # this rank's first non-finite value
        self.refused = False                            # a metadata round said so: zeros from here on
        self.zeros = None
        self.res = res                                  # results are written here as they come
        self.kept = None                                # a refused call's output from the refusing chunk on
        self.done = None                                # the run's per-round results (final)

    def _pass(self, i: int) -> None:
        """Chunk i's exponents (and contributor bits), when its metadata records are first encoded."""
        b0, b1 = self.span[i]
        E, W, rank = self.E, self.c.elems, self.c.rank
        exps = self.exps[b0:b1]
        bits = None if self.bits is None else self.bits[b0:b1]
        bad = float_meta(self.flat[b0 * E:b1 * E], E, rank, self.refuse, exps, bits)
        if bad >= 0 and self.bad < 0:
            self.bad = b0 * E + bad
        m0, m1 = self.meta[i]
        for (op, off), v in zip(self.parts, (exps, bits)):
            lo = (off + m0) * W
            self.values[lo:lo + b1 - b0] = v
            self.values[lo + b1 - b0:(off + m1) * W] = quant.ZERO_EXP if op == proto.OP_MAX else 0
        self.passed = i + 1

    def _global(self, off: int, i: int) -> np.ndarray:
        """Chunk i's results of the metadata part at meta round ``off``: one int32 per block."""
        b0, b1 = self.span[i]
        m0, m1 = self.meta[i]
        W, P = self.c.elems, self.P
        return self.meta_out[(off + m0) * P:(off + m1) * P].reshape(m1 - m0, P)[:, :W].reshape(-1)[:b1 - b0]

    def _scale(self, i: int) -> None:
        """Chunk i's global exponents and its data rounds' shifts, once Mi is complete."""
        b0, b1 = self.span[i]
        g = self.gexp[b0:b1] = self._global(0, i)
        if self.gbits is not None:
            self.gbits[b0:b1] = self._global(self.per_meta, i)
        if int(g.max()) >= quant.REFUSE_EXP and not self.refused:
            # no round of this chunk or a later one has been sent: keep what their output holds
            # (an in-place call's input), which the rounds of zeros would overwrite
            self.refused = True
            self.kept = (b0 * self.E, self.res[b0 * self.E:].copy())
        a = self.d_first[i]
        live = g != quant.ZERO_EXP
        s = np.zeros(b1 - b0, np.int64)
        if not self.refused:
            s[live] = quant.shifts_for(g[live], self.c.world, 16 if self.half else 32)
        self.shifts[a:a + b1 - b0] = s
        self.scaled = i + 1

    def ready(self, done: np.ndarray, head: int) -> int:
        """Rounds that may enter the window: up to the data of the first chunk whose metadata is
        not complete (every round below ``head`` has its result)."""
        self.done = done
        while self.open < self.C:
            a, n = self.m_first[self.open]
            if head < a + n and not done[a:a + n].all():
                break
            self.open += 1
        return self.K if self.open >= self.C else self.d_first[self.open]

    def final(self) -> np.ndarray:
        """After a failed or refused call (Communicator.final_blocks): the blocks whose data round
        has its result; the others still hold the input (in-place calls)."""
        have = np.zeros(self.nb, bool)
        if self.done is not None:
            for i in range(self.C):
                b0, b1 = self.span[i]
                a = self.d_first[i]
                have[b0:b1] = self.done[a:a + b1 - b0] != 0
        if self.kept is not None:  # refused: from the refusing chunk on, the output is what it was
            have[self.kept[0] // self.E:] = False
        return have

    def encode(self, j0: int, j1: int, at: int) -> None:
        c = self.c
        s = c._s
        rec, W, S = c._rec, c.elems, c.slots
        tmpl = s.template(proto.TYPE_CONTRIB)
        for op, i, a, n in self.segs:
            lo, hi = max(j0, a), min(j1, a + n)
            if lo >= hi:
                continue
            if op is not None:
                while self.passed <= i:
                    self._pass(self.passed)
                enc.encode_int(self.send, rec, W, tmpl, self.values, self.mine[lo:hi], self.base, S, self.blocks,
                               self.masks, op, at + lo - j0)
                continue
            if self.scaled <= i:
                self._scale(i)
            src = self.flat
            if self.refused:  # every rank sends zeros now: the rounds complete, the call is refused
                if self.zeros is None:
                    self.zeros = np.zeros_like(self.flat)
                src = self.zeros
            single = self.x.dtype == np.float32
            if self.half:
                enc.encode_half(self.send, rec, W, tmpl, src, self.mine[lo:hi], self.base, S, self.blocks,
                                self.masks, self.shifts, s.bias16, single, at + lo - j0)
            else:
                enc.encode_float(self.send, rec, self.E, tmpl, src, self.mine[lo:hi], self.base, S, self.blocks,
                                 self.masks, self.shifts, s.bias, single, at + lo - j0, proto.OP_SUM64)

    def run(self) -> np.ndarray | None:
        c = self.c
        st = c.last
        self.base = c._s.reserve(self.K)
        self.send = c._s.send_buffer(self.K)
        c._cut = self.final
        kind = (pump.KIND_HALF32 if self.x.dtype == np.float32 else pump.KIND_HALF64) if self.half \
            else KIND[self.x.dtype]
        c._s.run(self.base, Rounds(self.blocks, self.masks, self.mine, self.shifts, self.send, kind, self.res,
                                   self.encode, self.meta_out, self.ready))
        st.meta_rounds += self.nmeta
        st.own_blocks = self.nb
        st.results += self.nb
        if self.kept is not None:
            at, v = self.kept
            self.res[at:] = v
        return self.gbits


def pipelined_run(self: Communicator, x: np.ndarray, flat: np.ndarray, res: np.ndarray, half: bool, E: int,
                  refuse: bool, key) -> None:
    """A large float sum whose metadata runs ahead of its data chunk by chunk, in one run of
    rounds (:class:`_Pipeline`): the link carries chunk i's data while chunk i+1's exponents are
    computed and exchanged, where a plain call computes and exchanges every exponent before its
    first data record. The results are bit for bit a plain call's (the same exponents, the same
    scales; a rank's zero block adds zeros); a refused call completes its rounds with zeros and
    raises on every rank."""
    p = _Pipeline(self, x, flat, res, half, E, refuse)
    gbits = p.run()
    if gbits is not None:
        self._dense.remember(key, gbits, self._all)
    if p.refused:
        refuse_together(p.gexp, self.rank, flat, p.bad, E)
