"""The worker library: one :class:`Communicator` per rank; ``allreduce(array)`` returns the
elementwise sum over all ranks, through the XDP aggregator or the user-space one (same protocol).

Before its first collective a communicator JOINs the job (:mod:`~nicoffload.worker.join`): every
record carries the run's epoch, so no round of it can be taken for an earlier run's.

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
   The pipeline (large float tensors, at least PIPELINE_ELEMS elements; in sparse jobs where the
   last call of the size had every block on every rank): steps 1-3 chunk by chunk in one run,
   each chunk's data on the wire while the next chunk's exponents are computed and exchanged.
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

import contextlib
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from nicoffload import collective
from nicoffload.datapath import encode as enc, kernels, pump
from nicoffload.datapath.tensors import DTYPES, KIND, call_arrays, float_meta, rank_bit, refuse_together
from nicoffload.datapath.transport import SLOT_BYTES
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto, quant
from nicoffload.worker.extremes import extreme
from nicoffload.worker.optstep import optimizer_step
from nicoffload.worker import speculation
from nicoffload.worker.speculation import SPECULATE_BLOCKS, Dense, Guesses, pipelined_run, speculative_run
from nicoffload.worker.calls import Buffers, CallStats, Rounds
from nicoffload.worker.metrics import comm_metrics
from nicoffload.worker.stream import RoundStream

__all__ = ["Communicator", "CallStats", "DTYPES"]

@dataclass
class _Sum:
    """One sum's arrays: the input ``x`` and its flat view, ``out`` and its flat view ``res``;
    16-bit lanes or not, and ``E`` elements per block."""

    x: np.ndarray
    out: np.ndarray
    half: bool
    E: int

    def __post_init__(self):
        self.flat, self.res = self.x.reshape(-1), self.out.reshape(-1)
        self.is_float = self.x.dtype.kind == "f"
        self.blocks = -(-self.x.size // self.E)


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
    key: int = DEFAULT.key         # the job's key: in every record; results without it are foreign
    # small float tensors (up to SPECULATE_BLOCKS blocks) go out scaled by the exponents the last
    # call of their size had, beside this call's exponent round: one round trip where those hold.
    # Every rank of a job must use the same setting.
    speculate: bool = True
    # float tensors of PIPELINE_ELEMS elements or more send each chunk's data while the next
    # chunk's exponents are computed and exchanged (speculation.pipelined_run); the same bits.
    # Every rank of a job must use the same setting.
    pipeline: bool = True
    # return from a call only once every rank holds its results (the job's gate: one more round
    # trip per call): what failover needs, so that no rank ever needs another's returned result
    confirm: bool = False
    metrics_port: int | str | None = None  # serve this rank's calls as Prometheus text (worker.metrics); "auto"
    capabilities: ClassVar[collective.Capabilities] = collective.AGGREGATOR
    stats: CallStats = field(default_factory=CallStats)
    last: CallStats = field(default_factory=CallStats)

    @classmethod
    def from_spec(cls, rank: int, world: int, aggregator: str, spec: JobSpec, local_ip: str | None = None,
                  **kw) -> "Communicator":
        """A rank of the job ``spec`` describes."""
        return cls(rank, world, aggregator, group=spec.group, local_ip=local_ip, job=spec.job, port=spec.port,
                   slots=spec.slots, window=spec.window, elems=spec.elems, timeout=spec.timeout,
                   sparse=spec.sparse, local_port=spec.local_port, delivery=spec.delivery, lanes=spec.lanes,
                   key=spec.key, **kw)

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
                              silence=self.silence, delivery=self.delivery, key=self.key)
        self._rec = self._s.record_size
        self._guesses = Guesses()  # the last call of each size's metadata (speculation)
        self._dense = Dense()  # ... and whether it had every block on every rank (the pipeline)
        self._cut = None  # the data rounds of the call in flight, or a pipelined call's account (final_blocks)
        self.metrics = comm_metrics(self, self.metrics_port)  # a server of its own, or nothing

    def close(self) -> None:
        self._s.close()
        self.metrics.close()

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
            with self._call(f"allreduce_{op}", array):
                return extreme(self, array, out, op)
        x, out = call_arrays(array, out)
        if lanes == 16 and x.dtype.kind != "f":
            raise InputError("16-bit lanes carry floats (fixed point); int32 sums are exact only in 32-bit lanes")
        if _refuse and x.dtype.kind != "f":
            raise InputError("only a call of floats can be refused (int32 has no metadata round)")
        with self._call("allreduce", x):
            if x.size == 0:
                return out
            half = x.dtype.kind == "f" and (lanes or self.lanes) == 16
            c = _Sum(x, out, half, quant.block_elems(self.elems, 16 if half else 32))
            self._sum(c, _refuse)
            return out

    @contextlib.contextmanager
    def _call(self, what: str = "allreduce", array=None):
        """One call's statistics: ``last`` while it runs, added to ``stats`` when it returns;
        with ``confirm``, it returns only once every rank holds its results (the job's gate)."""
        st = self.last = self._s.last = CallStats()
        t0, sys0, foreign0 = time.perf_counter(), self._s.syscalls, self._s.foreign
        self._cut = None
        with self.metrics.call(what, array, st):
            yield st
            if self.confirm:
                self._s.confirm(self._s.next_round)
        st.seconds = time.perf_counter() - t0
        st.syscalls = self._s.syscalls - sys0
        st.foreign = self._s.foreign - foreign0
        self.stats.add(st)

    def _sum(self, c: "_Sum", refuse: bool) -> None:
        """1. local metadata, 2. the metadata rounds (or a speculative run), 3. the data rounds;
        large dense float tensors: the three chunk by chunk, overlapped (a pipelined run)."""
        nb = c.blocks
        key = (nb, c.x.dtype.str, c.half)
        big = c.is_float and self.pipeline and c.x.size >= speculation.PIPELINE_ELEMS
        if big and (not self.sparse or key in self._dense):
            self.join()
            pipelined_run(self, c.x, c.flat, c.res, c.half, c.E, refuse, key)
            return
        bad, exps, bits = self._local_meta(c, refuse)
        self.join()
        speculative = c.is_float and not c.half and self.speculate and nb <= SPECULATE_BLOCKS
        guess, backoff = self._guesses.take(key) if speculative else (None, 0)
        if guess is not None:  # metadata and data in one run; what the guess got wrong goes again
            gexp, gbits, blocks, masks = speculative_run(self, c.x, c.flat, c.res, exps, bits, guess)
            refuse_together(gexp, self.rank, c.flat, bad, c.E)
            self._guesses.remember(key, gexp, gbits)
            self._guesses.missed(key, backoff, self.last.spec_missed > 0)
            self._data(c, blocks, masks, gexp)
            return
        gexp, gbits = self._meta(exps, bits)
        if gbits is not None and c.is_float and c.x.size >= speculation.PIPELINE_ELEMS:
            self._dense.remember(key, gbits, self._all)  # every rank alike: may the next call pipeline?
        if c.is_float:
            refuse_together(gexp, self.rank, c.flat, bad, c.E)
        if speculative:
            self._guesses.remember(key, gexp, gbits)
        blocks, masks = self._active(c, gexp, gbits)
        self._data(c, blocks, masks, gexp)

    def _local_meta(self, c: "_Sum", refuse: bool) -> tuple:
        """Step 1, this rank's own: (the first block holding a NaN or an Inf or -1, the block
        exponents (floats; a refusal code where refused), the contributor bits (sparse jobs))."""
        nb, bad, exps = c.blocks, -1, None
        bits = self._buf.get("bits", nb, np.int32) if self.sparse else None
        if c.is_float:  # a NaN or an Inf refuses the call on every rank, after the metadata round
            exps = self._buf.get("exps", nb, np.int32)
            bad = float_meta(c.flat, c.E, self.rank, refuse, exps, bits)
        elif bits is not None:
            nz8 = self._buf.get("nz8", nb, np.uint8)
            kernels.block_nonzero_i32(c.flat, c.E, nz8)
            bits[:] = 0
            bits[nz8.view(bool)] = rank_bit(self.rank)
        return bad, exps, bits

    def _active(self, c: "_Sum", gexp: np.ndarray | None, gbits: np.ndarray | None) -> tuple:
        """Step 3's rounds: (blocks, their contributor masks): a block zero on every rank gets
        no round (its output is zeroed here); dense int32 sums every block of every rank."""
        nb, full = c.blocks, np.int64(self._all)
        if gbits is not None:
            masks_all = gbits.astype(np.int64) & full
            active = masks_all != 0
        elif c.is_float:
            active = gexp != quant.ZERO_EXP
        else:
            return np.arange(nb, dtype=np.int64), np.full(nb, full, dtype=np.int64)
        blocks = np.flatnonzero(active)
        masks = masks_all[blocks] if gbits is not None else np.full(len(blocks), full, dtype=np.int64)
        if len(blocks) < nb:  # blocks zero on every rank get no round: their output is zero
            words = c.res.view(np.int64) if c.res.dtype.itemsize == 8 else c.res.view(np.int32)
            kernels.zero_blocks(words, active, c.E)
        self.last.blocks_skipped = nb - len(blocks)
        return blocks, masks

    def _data(self, c: "_Sum", blocks: np.ndarray, masks: np.ndarray, gexp: np.ndarray | None) -> None:
        """The data rounds of a sum into ``c.res``: one per block of ``blocks``, this rank's
        records those its bit is set in ``masks`` for; floats scaled by the blocks' global
        exponents ``gexp``."""
        st, E, K = self.last, c.E, len(blocks)
        mine = np.flatnonzero(masks >> self.rank & 1) if K else masks
        st.own_blocks = len(mine)
        if not K:
            self._cut = (blocks, c.blocks)  # every block zero everywhere, its output zeroed: final
            return
        base = self._s.reserve(K)
        self._cut = (blocks, c.blocks)  # from here on, a block's output is final once its round is done
        send = self._s.send_buffer(len(mine))
        tmpl = self._s.template(proto.TYPE_CONTRIB)
        single = c.x.dtype == np.float32
        flat, rec, S = c.flat, self._rec, self.slots
        if c.half:
            shifts = quant.shifts_for(gexp[blocks], self.world, 16).astype(np.int32)
            bias16 = self._s.bias16

            def encode(j0: int, j1: int, at: int) -> None:
                enc.encode_half(send, rec, self.elems, tmpl, flat, mine[j0:j1], base, S, blocks, masks, shifts,
                                    bias16, single, at)
        elif c.is_float:
            shifts = quant.shifts_for(gexp[blocks], self.world, 32).astype(np.int32)
            bias = self._s.bias

            def encode(j0: int, j1: int, at: int) -> None:
                enc.encode_float(send, rec, E, tmpl, flat, mine[j0:j1], base, S, blocks, masks, shifts, bias,
                                     single, at, proto.OP_SUM64)
        else:
            shifts = self._buf.get("noshift", K, np.int32)

            def encode(j0: int, j1: int, at: int) -> None:
                enc.encode_int(send, rec, E, tmpl, flat, mine[j0:j1], base, S, blocks, masks, proto.OP_SUM, at)
        kind = (pump.KIND_HALF32 if single else pump.KIND_HALF64) if c.half else KIND[c.x.dtype]
        self._s.run(base, Rounds(blocks, masks, mine, shifts, send, kind, c.res, encode))
        st.results += K

    def final_blocks(self) -> np.ndarray | None:
        """After a sum that failed: which blocks of its output hold their final result (those
        zero on every rank included), the others still its input (in-place calls). None when
        the call failed before any output was written (its output is untouched)."""
        if self._cut is None:
            return None
        if callable(self._cut):  # a pipelined call's own account (speculation._Pipeline.final)
            return self._cut()
        blocks, nb = self._cut
        run = self._s.last_run
        have = np.ones(nb, bool)
        have[blocks] = False
        if run is not None and run.K == len(blocks):
            have[blocks[run.done[:run.K] != 0]] = True
        return have

    def abort(self, error: BaseException) -> None:
        """Make the call in flight (from any thread) and every later one raise ``error`` (within
        about half a second: the stream looks at it whenever it waits)."""
        self._s.abort(error)

    def step(self, grads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """One optimizer step of a job the aggregator holds the optimizer of: send this rank's
        gradients (pre-averaged: divided by the world size, as DDP does) and return the updated
        parameters (float32/float64, the gradients' shape). Every rank calls it with gradients of
        the job's parameter count; the job's slots are its share (optim.share)."""
        return optimizer_step(self, grads, out)

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
            enc.encode_int(send, self._rec, E, tmpl, values, rounds, base, self.slots, blocks, masks, op, p * per)
        res = self._buf.get("meta_out", k * E, np.int32)
        self._s.run(base, Rounds(blocks, masks, blocks, self._buf.get("noshift", k, np.int32), send,
                                 pump.KIND_INT32, res))
        self.last.meta_rounds += k
        out = [res[p * per * E:p * per * E + nb] for p in range(len(parts))]
        if exps is None:
            return None, out[0]
        return out[0], (out[1] if bits is not None else None)
