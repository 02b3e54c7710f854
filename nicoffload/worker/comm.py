"""The worker library: one :class:`Communicator` per rank; ``allreduce(array)`` returns the
elementwise sum over all ranks, through the XDP aggregator or the user-space one (same protocol).

Before its first collective a communicator JOINs the job: the aggregator hands out a new epoch
once every rank of the job has joined with a fresh nonce, and every record carries that epoch,
so no round of this run can ever be taken for a round of an earlier run (or of a crashed
worker's), and a run that another run's JOIN has ended fails naming the cause.

One call on a tensor of B blocks of ``elems`` elements:
1. Local metadata in one pass (kernels.block_meta_*): per block the exponent of the largest
   magnitude (floats) and whether it is non-zero. A block holding a NaN or an Inf sends a
   refusal code instead of its exponent (quant.REFUSE_EXP): it wins the MAX of step 2, and
   every rank refuses the call there, instead of waiting for data that will never come.
2. A metadata round, only when needed: MAX of the block exponents (floats: the fixed-point
   scale of each block) and OR of per-block contributor bits (sparse mode: who has data where).
   Dense int32 needs none. The metadata is 4 bytes per block and rank (0.4% of the data).
   Speculation (small float tensors, up to SPECULATE_BLOCKS blocks): the data rounds go out in
   the same run as the metadata rounds, scaled by the exponents (and waiting for the
   contributors) the last call of the same size had; blocks whose metadata turns out the same
   have their exact result after one round trip, the others go again (step 3).
3. The data rounds: one per block that is non-zero somewhere, in block order; a rank sends a
   record only for the blocks where it has data (OmniReduce: its own zero blocks cost nothing),
   and the round's mask tells the aggregator exactly whom to wait for. Floats go as offset-binary
   fixed point (op SUM64: the aggregator adds two lanes per 64-bit word); int32 as it is (SUM).
The rounds run through :class:`nicoffload.worker.stream.RoundStream` (window, loss recovery, timeouts).

The hot path allocates no buffer per call: the send ring (the records in flight, a fixed size)
and the receive buffers are faulted in when the communicator is built, per-round state is kept
and grows only when a larger tensor comes along; results are written straight into the output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from nicoffload import collective, optim
from nicoffload.datapath import kernels, pump
from nicoffload.datapath.tensors import DTYPES, KIND, block_exponents, call_arrays, refuse_together
from nicoffload.datapath.transport import SLOT_BYTES
from nicoffload.errors import InputError, RefusedError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto, quant
from nicoffload.worker.stream import Buffers, CallStats, RoundStream

__all__ = ["Communicator", "CallStats", "DTYPES"]

#: float tensors of at most this many blocks are sent speculatively (Communicator.speculate)
SPECULATE_BLOCKS = 256
#: exponent vectors remembered for speculation (distinct tensor sizes of a training step)
SPECULATE_SIZES = 512
#: after a guess that missed, calls of that size without speculation: 1, 3, 7, ... up to this
#: (a miss costs the missed blocks' bytes twice; every rank sees the same misses, so all agree)
SPECULATE_BACKOFF = 63
#: the contributor words of a job without them (dense): the speculative kernels take an empty array
_NO_BITS = np.empty(0, np.int32)



@dataclass
class Communicator:
    """One rank of a job. ``aggregator`` is the aggregator's IPv4 address (where contributions
    go); results arrive by IP multicast on ``group`` (joined on ``local_ip``'s interface)."""

    rank: int
    world: int
    aggregator: str
    group: str = DEFAULT.group
    local_ip: str | None = None
    job: int = DEFAULT.job
    port: int = DEFAULT.port
    slots: int = DEFAULT.slots
    window: int | None = DEFAULT.window  # rounds in flight; default and maximum: slots
    elems: int = DEFAULT.elems
    timeout: float = DEFAULT.timeout
    rto: float = 0.02
    max_rto: float = 0.5
    sparse: bool = DEFAULT.sparse
    local_port: int | None = DEFAULT.local_port  # bound and sent from (None: port); results return to it
    silence: float | None = None   # seconds without any answer from the aggregator that mean it is gone
    delivery: str = DEFAULT.delivery  # multicast: results come to ``group``; unicast: to this rank's address
    lanes: int = DEFAULT.lanes     # bits per fixed-point lane of float sums (16: half the bytes); ints: 32
    # small float tensors (up to SPECULATE_BLOCKS blocks) go out scaled by the exponents the last
    # call of their size had, beside this call's exponent round: one round trip where those hold.
    # Every rank of a job must use the same setting.
    speculate: bool = True
    capabilities: ClassVar[collective.Capabilities] = collective.AGGREGATOR
    stats: CallStats = field(default_factory=CallStats)
    last: CallStats = field(default_factory=CallStats)

    @classmethod
    def from_spec(cls, rank: int, world: int, aggregator: str, spec: JobSpec, local_ip: str | None = None,
                  **kw) -> "Communicator":
        """A rank of the job ``spec`` describes."""
        return cls(rank, world, aggregator, group=spec.group, local_ip=local_ip, job=spec.job, port=spec.port,
                   slots=spec.slots, window=spec.window, elems=spec.elems, timeout=spec.timeout,
                   sparse=spec.sparse, local_port=spec.local_port, delivery=spec.delivery, lanes=spec.lanes, **kw)

    def __post_init__(self):
        if not 0 <= self.rank < self.world <= proto.MAX_WORKERS:
            raise InputError(f"rank {self.rank} / world {self.world}: need 0 <= rank < world <= {proto.MAX_WORKERS}")
        if self.elems < 2 or self.elems % 2 or proto.record_size(self.elems) > SLOT_BYTES:
            raise InputError(f"elems must be even, 2..{(SLOT_BYTES - proto.HDR_LEN) // 4}, not {self.elems}")
        if self.slots < 1:
            raise InputError(f"slots must be positive, not {self.slots}")
        if self.lanes not in quant.LANES:
            raise InputError(f"lanes must be 16 or 32, not {self.lanes!r}")
        self.window = self.slots if self.window is None else max(1, min(self.window, self.slots))
        self._all = (1 << self.world) - 1
        self._buf = Buffers()
        self._s = RoundStream(self.rank, self.world, self.aggregator, group=self.group, local_ip=self.local_ip,
                              job=self.job, port=self.port, local_port=self.local_port, slots=self.slots,
                              window=self.window, elems=self.elems,
                              timeout=self.timeout, rto=self.rto, max_rto=self.max_rto, buffers=self._buf,
                              silence=self.silence, delivery=self.delivery)
        self._rec = self._s.record_size
        self._guesses: dict = {}  # (blocks, dtype) -> the global block exponents of the last such call
        self._backoff: dict = {}  # (blocks, dtype) -> (calls left without speculating, current backoff)

    def close(self) -> None:
        self._s.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        """The epoch of this run (0 before :meth:`join`)."""
        return self._s.epoch

    @property
    def nonce(self) -> int:
        """This process's JOIN nonce (larger than any earlier process's of this rank)."""
        return self._s.nonce

    def join(self) -> int:
        """Join the job: returns once every rank of it has joined this run (the aggregator then
        hands out the run's epoch). Called by the first collective; calling it again is free."""
        return self._s.join()

    # --- public -----------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None, *, _refuse: bool = False) -> np.ndarray:
        """Elementwise sum over all ranks. int32: exact, wrapping modulo 2^32 on overflow.
        float32/float64: through fixed point in 32-bit lanes, or 16-bit ones (``lanes=16``, or the
        communicator's ``lanes``: half the bytes on the wire, the precision of half-precision
        training; error bounds in nicoffload.wire.quant). Every rank must pass the same ``lanes``.
        ``op="max"`` / ``"min"``: the elementwise maximum / minimum of int32 or float32 arrays,
        exact (the aggregator's MAX op on order-preserving int32 keys).

        A NaN or an Inf in any rank's float input: every rank raises RefusedError naming that
        rank, and the job's later calls go on. Ranks given tensors of different sizes (or
        lanes): every rank raises a ProtocolError saying so, and so does every later call.

        ``_refuse`` (floats; worker.hier): take part in the call only to refuse it, every block
        (quant.REFUSE_ABORT), so that every rank raises RefusedError(kind="abort") at once."""
        if lanes is not None and lanes not in quant.LANES:
            raise InputError(f"lanes must be 16 or 32, not {lanes!r}")
        if op != "sum":
            return self._extreme(array, out, op)
        x, out = call_arrays(array, out)
        if lanes == 16 and x.dtype.kind != "f":
            raise InputError("16-bit lanes carry floats (fixed point); int32 sums are exact only in 32-bit lanes")
        t0 = time.perf_counter()
        st = self.last = self._s.last = CallStats()
        sys0, foreign0 = self._s.syscalls, self._s.foreign
        n = x.size
        if n == 0:
            return out
        flat, res = x.reshape(-1), out.reshape(-1)
        W = self.world
        is_float = x.dtype.kind == "f"
        half = is_float and (lanes or self.lanes) == 16
        E = quant.block_elems(self.elems, 16 if half else 32)  # elements per block and record
        nb = -(-n // E)

        # 1. local metadata
        bad = -1
        if is_float:  # a NaN or an Inf refuses the call on every rank, after the metadata round
            exps = self._buf.get("exps", nb, np.int32)
            bad = block_exponents(flat, E, exps, self.rank)
            if _refuse:
                exps[:], bad = quant.refusal_code(quant.REFUSE_ABORT, self.rank), -1
        elif _refuse:
            raise InputError("only a call of floats can be refused (int32 has no metadata round)")
        elif self.sparse:
            nz8 = self._buf.get("nz8", nb, np.uint8)
            kernels.block_nonzero_i32(flat, E, nz8)
            nonzero = nz8.view(bool)
        self.join()

        # 2. metadata rounds (one stream: MAX of the exponents, OR of the contributor bits)
        full = np.int64(self._all)
        bits = None
        if self.sparse:
            bits = self._buf.get("bits", nb, np.int32)
            bit = np.int32(1 << self.rank) if self.rank < 31 else np.int32(-(1 << 31))
            if is_float:  # non-zero where the block has an exponent
                kernels.contributor_bits(exps, quant.ZERO_EXP, bit, bits)
            else:
                bits[:] = 0
                bits[nonzero] = bit
        key = (nb, x.dtype.str)
        speculative = is_float and not half and self.speculate and nb <= SPECULATE_BLOCKS
        guess = self._guesses.get(key) if speculative else None
        if guess is not None:
            left, backoff = self._backoff.get(key, (0, 0))
            if left:  # the last guess for this size missed: wait a while (every rank alike)
                self._backoff[key] = (left - 1, backoff)
                guess = None
        if guess is not None:  # metadata and data in one run; what the guess got wrong goes again
            gexp, gbits, blocks, masks = self._speculative(x, flat, res, exps, bits, guess)
            refuse_together(gexp, self.rank, flat, bad, E)
            self._remember(key, gexp, gbits)
            backoff = min(2 * backoff + 1, SPECULATE_BACKOFF) if st.spec_missed else 0
            self._backoff[key] = (backoff, backoff)
            mine = np.flatnonzero(masks >> self.rank & 1) if len(masks) else masks  # every guess hit: none
            return self._data(x, flat, out, res, blocks, masks, mine, gexp, W, False, E, t0, st, sys0, foreign0)
        gexp, gbits = self._meta(exps if is_float else None, bits)
        if is_float:
            refuse_together(gexp, self.rank, flat, bad, E)
        if speculative:
            self._remember(key, gexp, gbits)
        if is_float:
            active = gexp != quant.ZERO_EXP
        if self.sparse:
            masks_all = gbits.astype(np.int64) & full
            active = masks_all != 0
        elif not is_float:
            active = None  # dense int32: every block, every rank

        # 3. data rounds
        if active is None:
            blocks = np.arange(nb, dtype=np.int64)
            masks = np.full(nb, full, dtype=np.int64)
        else:
            blocks = np.flatnonzero(active)
            masks = masks_all[blocks] if self.sparse else np.full(len(blocks), full, dtype=np.int64)
            if len(blocks) < nb:  # blocks zero on every rank get no round: their output is zero
                words = res.view(np.int64) if res.dtype.itemsize == 8 else res.view(np.int32)
                kernels.zero_blocks(words, active, E)
        st.blocks_skipped = nb - len(blocks)
        mine = np.flatnonzero(masks >> self.rank & 1)
        return self._data(x, flat, out, res, blocks, masks, mine, gexp, W, half, E, t0, st, sys0, foreign0)

    def _data(self, x, flat, out, res, blocks, masks, mine, gexp, W, half, E, t0, st, sys0, foreign0) -> np.ndarray:
        """The data rounds of a sum into ``res`` (the flat view of ``out``, which it returns): one
        per block of ``blocks``, this rank's records those of ``mine``; floats scaled by the
        blocks' global exponents ``gexp``."""
        is_float = x.dtype.kind == "f"
        K = len(blocks)
        st.own_blocks = len(mine)
        if K:
            base = self._s.reserve(K)
            send = self._s.send_buffer(len(mine))
            tmpl = self._s.template(proto.TYPE_CONTRIB)
            if half:
                shifts = quant.shifts_for(gexp[blocks], W, 16).astype(np.int32)
                single = x.dtype == np.float32

                def encode(j0: int, j1: int, at: int) -> None:
                    kernels.encode_half(send, self._rec, self.elems, tmpl, flat, mine[j0:j1], base, self.slots,
                                        blocks, masks, shifts, self._s.bias16, single, at)
            elif is_float:
                shifts = quant.shifts_for(gexp[blocks], W, 32).astype(np.int32)
                single = x.dtype == np.float32

                def encode(j0: int, j1: int, at: int) -> None:
                    kernels.encode_float(send, self._rec, E, tmpl, flat, mine[j0:j1], base, self.slots, blocks,
                                         masks, shifts, self._s.bias, single, at, proto.OP_SUM64)
            else:
                shifts = self._buf.get("noshift", K, np.int32)

                def encode(j0: int, j1: int, at: int) -> None:
                    kernels.encode_int(send, self._rec, E, tmpl, flat, mine[j0:j1], base, self.slots, blocks,
                                       masks, proto.OP_SUM, at)
            kind = (pump.KIND_HALF32 if x.dtype == np.float32 else pump.KIND_HALF64) if half else KIND[x.dtype]
            self._s.run(base, K, blocks, masks, mine, shifts, send, kind, res, encode)
            st.results += K
        st.seconds = time.perf_counter() - t0
        st.syscalls = self._s.syscalls - sys0
        st.foreign = self._s.foreign - foreign0
        self.stats.add(st)
        return out

    def _remember(self, key, gexp: np.ndarray, gbits: np.ndarray | None) -> None:
        if len(self._guesses) >= SPECULATE_SIZES and key not in self._guesses:
            self._guesses.clear()
            self._backoff.clear()
        self._guesses[key] = (gexp.copy(), None if gbits is None else gbits.copy())

    def _speculative(self, x: np.ndarray, flat: np.ndarray, res: np.ndarray, exps: np.ndarray,
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
                kernels.encode_int(send, rec, E, tmpl, values, mine[j0:m1], base, S, blocks, masks, parts[p][1], at)
                at += m1 - j0
                j0 = m1
            if j0 < j1:
                kernels.encode_float(send, rec, E, tmpl, src, mine[j0:j1], base, S, blocks, masks, shifts, bias,
                                     single, at, proto.OP_SUM64)

        meta_out = self._buf.get("meta_out", k * E, np.int32)
        # an in-place call's results go to a scratch array: a block the guess got wrong must not
        # overwrite the input before its own round sends it again (elsewhere the redo overwrites it)
        inplace = np.may_share_memory(res, flat)
        got = self._buf.get("spec_out", res.size, res.dtype) if inplace else res
        self._s.run(base, n, blocks, masks, mine, shifts, send, KIND[x.dtype], got, encode, meta_out=meta_out)
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

    def _extreme(self, array: np.ndarray, out: np.ndarray | None, op: str) -> np.ndarray:
        """MAX or MIN over the ranks, exact: each element becomes an int32 key whose signed order
        is the values' (a float's bits with the magnitude bits of negatives flipped; MIN inverts
        every key), the aggregator takes the MAX of the keys (dense: every rank, every block), and
        the key of the result maps back to its value. A NaN whose sign bit is clear is larger
        than +inf here, one whose sign bit is set smaller than -inf."""
        if op not in ("max", "min"):
            raise InputError(f"op must be sum, max or min, not {op!r}")
        x, out = call_arrays(array, out, (np.dtype(np.int32), np.dtype(np.float32)),
                             f"allreduce op={op} takes int32 or float32 arrays")
        t0 = time.perf_counter()
        st = self.last = self._s.last = CallStats()
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
            kernels.encode_int(send, self._rec, E, tmpl, keys, blocks[j0:j1], base, self.slots, blocks, masks,
                               proto.OP_MAX, at)

        res = self._buf.get("xres", n, np.int32)
        self._s.run(base, nb, blocks, masks, blocks, self._buf.get("noshift", nb, np.int32), send, pump.KIND_INT32,
                    res, encode)
        if op == "min":
            np.invert(res, out=res)
        if x.dtype == np.float32:
            res ^= (res >> 31) & np.int32(0x7FFFFFFF)
        out.reshape(-1).view(np.int32)[:] = res
        st.results = nb
        st.own_blocks = nb
        st.seconds = time.perf_counter() - t0
        self.stats.add(st)
        return out

    def abort(self, error: BaseException) -> None:
        """Make the call in flight (from any thread) and every later one raise ``error`` (within
        about half a second: the stream looks at it whenever it waits)."""
        self._s.abort(error)

    def step(self, grads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """One optimizer step of a job the aggregator holds the optimizer of: send this rank's
        gradients (pre-averaged: divided by the world size, as DDP does) and return the updated
        parameters (float32/float64, the gradients' shape). Every rank calls it with gradients of
        the job's parameter count; the job's slots are its share (optim.share)."""
        g, out = call_arrays(grads, out, DTYPES[1:], "optimizer steps take float32 or float64 gradients",
                             "the gradients'")
        E, n = self.elems, g.size
        nb = -(-n // E)
        if self.slots != optim.share(n, E):
            raise InputError(f"rank {self.rank}: {n} gradients need a job of {optim.share(n, E)} slots "
                             f"(optim.share), this communicator has {self.slots}: register the job with --params {n}")
        t0 = time.perf_counter()
        st = self.last = self._s.last = CallStats()
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
            kernels.encode_float(send, self._rec, E, tmpl, flat, blocks[j0:j1], base, self.slots, blocks, masks,
                                 shifts, self._s.bias, single, at, proto.OP_SGD)

        kind = pump.KIND_PARAMS32 if single else pump.KIND_PARAMS64
        self._s.run(base, nb, blocks, masks, blocks, shifts, send, kind, res, encode)
        st.results = nb
        st.seconds = time.perf_counter() - t0
        self.stats.add(st)
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it (one metadata round of one record)."""
        self.allreduce(np.zeros(1, dtype=np.int32))

    # --- metadata ---------------------------------------------------------------------------
    def _meta_values(self, parts: list, nb: int, per: int) -> np.ndarray:
        """The metadata rounds' input: ``per`` records per part (values, op), each part padded
        with its op's identity."""
        E = self.elems
        values = self._buf.get("meta_in", per * len(parts) * E, np.int32)
        for p, (v, op) in enumerate(parts):
            seg = values[p * per * E:(p + 1) * per * E]
            seg[:nb] = v
            seg[nb:] = quant.ZERO_EXP if op == proto.OP_MAX else 0
        return values

    def _meta(self, exps: np.ndarray | None, bits: np.ndarray | None) -> tuple:
        """Combine one int32 per block over every rank, in one stream of rounds: MAX of the
        block exponents (``exps``) and OR of the contributor bits (``bits``), ``elems`` blocks
        per round, every rank contributing. Returns (max, or), each None when not asked."""
        if exps is None and bits is None:
            return None, None
        E = self.elems
        nb = len(exps if exps is not None else bits)
        per = -(-nb // E)
        parts = [(v, op) for v, op in ((exps, proto.OP_MAX), (bits, proto.OP_OR)) if v is not None]
        k = per * len(parts)
        base = self._s.reserve(k)
        values = self._meta_values(parts, nb, per)
        blocks = np.arange(k, dtype=np.int64)
        masks = np.full(k, np.int64(self._all), dtype=np.int64)
        send = self._buf.get("meta_send", k * self._rec, np.uint8)
        tmpl = self._s.template(proto.TYPE_CONTRIB)
        for p, (_v, op) in enumerate(parts):
            rounds = blocks[p * per:(p + 1) * per]
            kernels.encode_int(send, self._rec, E, tmpl, values, rounds, base, self.slots, blocks, masks, op,
                               p * per)
        res = self._buf.get("meta_out", k * E, np.int32)
        self._s.run(base, k, blocks, masks, blocks, self._buf.get("noshift", k, np.int32), send,
                     pump.KIND_INT32, res)
        self.last.meta_rounds += k
        out = [res[p * per * E:p * per * E + nb] for p in range(len(parts))]
        if exps is None:
            return None, out[0]
        return out[0], (out[1] if bits is not None else None)
