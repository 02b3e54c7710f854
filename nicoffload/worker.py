"""The worker library: one :class:`Communicator` per rank; ``allreduce(array)`` returns the
elementwise sum over all ranks, through the XDP aggregator or the user-space one (same protocol).

Before its first collective a communicator JOINs the job: the aggregator hands out a new epoch
once every rank of the job has joined with a fresh nonce, and every record carries that epoch,
so no round of this run can ever be taken for a round of an earlier run (or of a crashed
worker's), and a run that another run's JOIN has ended fails naming the cause.

One call on a tensor of B blocks of ``elems`` elements:
1. Local metadata in one pass (kernels.block_meta_*): per block the exponent of the largest
   magnitude (floats) and whether it is non-zero; NaN/Inf are refused on the way.
2. A metadata round, only when needed: MAX of the block exponents (floats: the fixed-point
   scale of each block) and OR of per-block contributor bits (sparse mode: who has data where).
   Dense int32 needs none. The metadata is 4 bytes per block and rank (0.4% of the data).
3. The data rounds: one per block that is non-zero somewhere, in block order; a rank sends a
   record only for the blocks where it has data (OmniReduce: its own zero blocks cost nothing),
   and the round's mask tells the aggregator exactly whom to wait for. Floats go as offset-binary
   fixed point (op SUM64: the aggregator adds two lanes per 64-bit word); int32 as it is (SUM).
Rounds are numbered over the epoch: round i uses slot i mod S, set (i div S) mod 2; a round enters
the window only when the round S before it has its result (window <= S), and each record carries
this rank's head (every round below it has its result) so the aggregator reuses a set only when
every rank holds its previous result; a rank that contributes to nothing for a while says so with
an ACK. Lost records are retransmitted (rounds this rank contributes to) or pulled (the others)
after a timeout that follows the measured round time; after ``timeout`` seconds without progress
the call fails naming the ranks the aggregator has not heard from.

The hot path allocates nothing per call: send buffer, receive buffer and per-round state are
kept by the communicator and grow only when a larger tensor comes along; results are written
straight into the output.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from . import kernels, proto, quant
from .errors import InputError, ProtocolError, TimeoutError_
from .jobspec import DEFAULT, JobSpec
from .transport import SLOT_BYTES, Transport

DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))
_KIND = {np.dtype(np.int32): kernels.KIND_INT32, np.dtype(np.float32): kernels.KIND_FLOAT32,
         np.dtype(np.float64): kernels.KIND_FLOAT64}


@dataclass
class CallStats:
    packets_sent: int = 0       # records sent (data, metadata, retransmissions, pulls)
    bytes_sent: int = 0
    retransmissions: int = 0
    pulls: int = 0
    acks: int = 0
    results: int = 0            # data rounds that produced output
    rounds: int = 0             # every round of the call (metadata included)
    meta_rounds: int = 0
    blocks_skipped: int = 0     # blocks zero on every rank: no round at all
    own_blocks: int = 0         # blocks this rank sent data for
    seconds: float = 0.0
    timeouts: int = 0
    loops: int = 0              # iterations of the send/receive loop
    syscalls: int = 0

    def add(self, other: "CallStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


class _Buffers:
    """Per-communicator memory, grown on demand and reused across calls."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype) -> np.ndarray:
        a = self.arrays.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = np.empty(max(n, 1), dtype=dtype)
            self.arrays[name] = a
        return a[:n]


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
    stats: CallStats = field(default_factory=CallStats)
    last: CallStats = field(default_factory=CallStats)

    GAP = 128  # rounds completed past an outstanding one before it is retransmitted early

    @classmethod
    def from_spec(cls, rank: int, world: int, aggregator: str, spec: JobSpec, local_ip: str | None = None,
                  **kw) -> "Communicator":
        """A rank of the job ``spec`` describes."""
        return cls(rank, world, aggregator, group=spec.group, local_ip=local_ip, job=spec.job, port=spec.port,
                   slots=spec.slots, window=spec.window, elems=spec.elems, timeout=spec.timeout,
                   sparse=spec.sparse, **kw)

    def __post_init__(self):
        if not 0 <= self.rank < self.world <= proto.MAX_WORKERS:
            raise InputError(f"rank {self.rank} / world {self.world}: need 0 <= rank < world <= {proto.MAX_WORKERS}")
        if self.elems < 2 or self.elems % 2 or proto.record_size(self.elems) > SLOT_BYTES:
            raise InputError(f"elems must be even, 2..{(SLOT_BYTES - proto.HDR_LEN) // 4}, not {self.elems}")
        if self.slots < 1:
            raise InputError(f"slots must be positive, not {self.slots}")
        self.window = self.slots if self.window is None else max(1, min(self.window, self.slots))
        self._rec = proto.record_size(self.elems)
        self._t = Transport(self.port, self.group, self.local_ip, self._rec)
        self._round = 0        # next round of the epoch (unwrapped)
        self._epoch = 0        # 0 until joined
        self._all = (1 << self.world) - 1
        self._bias = 1 << (30 - quant.headroom_bits(self.world))
        self._buf = _Buffers()
        self._srtt = self.rto
        self._acked = 0        # the last head this rank reported (unwrapped)
        self._templates: dict = {}
        # results of rounds beyond the current stream (see kernels.decode_results): up to 2S rounds
        h = 2 * self.slots
        self._stash = np.zeros(h * self._rec, np.uint8)
        self._stash_round = np.full(h, -1, np.int64)
        self._stash_lens = np.zeros(h, np.uint32)
        self._stash_segs = np.zeros(h, np.int64)
        # the job's gate (absolute round; from results): no round at or beyond gate + 2S is sent
        self._gate = np.zeros(1, np.int64)
        # this process's nonce: larger than any earlier process's (the clock), unique (random bits)
        self.nonce = (time.time_ns() & ~0xFFFF) | int.from_bytes(os.urandom(2), "little") | 1
        kernels.warm_up(self.elems)
        self._warm_pumps()

    def _warm_pumps(self) -> None:
        """Compile (or load) the system-call kernels for this transport's buffers."""
        one = np.zeros(1, np.int64)
        kernels.pump_recv(*self._t.recv_args(), self._rec, self.elems, self.job, 0, self.rank, 0, 0, 1, one,
                          np.zeros(1, np.int32), 1, kernels.KIND_INT32, np.zeros(1, np.int32),
                          np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(1, np.uint8),
                          np.zeros(1, np.int64), np.zeros(1, np.int64), self._stash, self._stash_round, self._gate)
        t = self._t
        kernels.pump_send(t.fd, t.tx_msgs_addr, t._tx_base, t._tx_len, 1, 0, 0, 0, t.per_datagram, self._rec)

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        """The epoch of this run (0 before :meth:`join`)."""
        return self._epoch

    # --- public -----------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Elementwise sum over all ranks. int32: exact, wrapping modulo 2^32 on overflow.
        float32/float64: through int32 fixed point (error bound in nicoffload.quant)."""
        x = np.ascontiguousarray(array)
        if x.dtype not in DTYPES:
            raise InputError(f"allreduce supports int32, float32 and float64, not {x.dtype}")
        if out is None:
            out = np.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise InputError("out must be a C-contiguous array with the input's shape and dtype")
        t0 = time.perf_counter()
        st = self.last = CallStats()
        sys0 = self._t.syscalls
        n = x.size
        if n == 0:
            return out
        flat, res = x.reshape(-1), out.reshape(-1)
        E, W = self.elems, self.world
        nb = -(-n // E)
        is_float = x.dtype.kind == "f"

        # 1. local metadata
        if is_float:
            exps = self._buf.get("exps", nb, np.int32)
            bad = (kernels.block_meta_f32 if x.dtype == np.float32 else kernels.block_meta_f64)(flat, E, exps)
            if bad >= 0:
                kind = "NaN" if np.isnan(flat[bad]) else "Inf"
                raise InputError(f"rank {self.rank}'s input holds a non-finite value ({kind} at flat index {bad}); "
                                 f"refusing to sum it")
            nonzero = exps != quant.ZERO_EXP
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
            bits[:] = 0
            bits[nonzero] = np.int32(1 << self.rank) if self.rank < 31 else np.int32(-(1 << 31))
        gexp, gbits = self._meta(exps if is_float else None, bits)
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
        K = len(blocks)
        st.blocks_skipped = nb - K
        mine = np.flatnonzero(masks >> self.rank & 1)
        st.own_blocks = len(mine)
        if K:
            base = self._round
            self._round += K
            send = self._buf.get("send", len(mine) * self._rec, np.uint8)
            tmpl = self._template(proto.TYPE_CONTRIB, 0)
            if is_float:
                shifts = (30 - quant.headroom_bits(W) - gexp[blocks]).astype(np.int32)
                single = x.dtype == np.float32

                def encode(j0: int, j1: int) -> None:
                    kernels.encode_float(send, self._rec, E, tmpl, flat, mine[j0:j1], base, self.slots, blocks,
                                         masks, shifts, self._bias, single, j0)
            else:
                shifts = self._buf.get("noshift", K, np.int32)

                def encode(j0: int, j1: int) -> None:
                    kernels.encode_int(send, self._rec, E, tmpl, flat, mine[j0:j1], base, self.slots, blocks,
                                       masks, proto.OP_SUM, j0)
            self._stream(base, K, blocks, masks, mine, shifts, send, _KIND[x.dtype], res, encode)
            st.results = K
        st.seconds = time.perf_counter() - t0
        st.syscalls = self._t.syscalls - sys0
        self.stats.add(st)
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it (one metadata round of one record)."""
        self.allreduce(np.zeros(1, dtype=np.int32))

    # --- joining ----------------------------------------------------------------------------
    def _template(self, type_: int, flags: int) -> np.ndarray:
        """A record header with this rank's constant fields (a fresh copy: callers patch it)."""
        key = (type_, flags, self._epoch)
        t = self._templates.get(key)
        if t is None:
            from . import codec

            t = np.frombuffer(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job,
                                                  epoch=self._epoch, slot=0, set=0, round=0, mask=0, count=0,
                                                  type=type_, flags=flags), dtype=np.uint8).copy()
            self._templates[key] = t
        return t.copy()

    def join(self) -> int:
        """Join the job: returns once every rank of it has joined this run (the aggregator then
        hands out the run's epoch). Called by the first collective; calling it again is free."""
        if self._epoch:
            return self._epoch
        from . import codec

        rec = codec.encode_blocks(
            np.zeros((1, proto.JOIN_PAYLOAD // 4), np.int32), rank=self.rank, job=self.job, slot=0, set=0,
            round=self.nonce & 0xFFFFFFFF, ack=self.nonce >> 32, mask=self._all, count=0, type=proto.TYPE_JOIN)
        dest = (self.aggregator, self.port)
        buf = bytearray(SLOT_BYTES)
        hdr_dt = codec.header_dtype()
        deadline = time.monotonic() + self.timeout
        rto, joined = self.rto, -1
        while True:
            self._t.send_one(rec, dest)
            # from the second send on, ask for the forming epoch's state (who has joined)
            rec[proto.FIELD_OFFSETS["flags"]] = proto.FLAG_RETX
            until = min(deadline, time.monotonic() + rto)
            while time.monotonic() < until:
                if not self._t.wait(until - time.monotonic()):
                    continue
                while True:
                    n, _seg, _addr = self._t.recv_into(buf)
                    if not n:
                        break
                    if n < proto.HDR_LEN:
                        continue
                    h = np.frombuffer(buf, dtype=hdr_dt, count=1)[0]
                    if int(h["magic"]) != proto.MAGIC or int(h["job"]) != self.job:
                        continue
                    t = int(h["type"])
                    if t == proto.TYPE_JOINED and n >= proto.HDR_LEN + proto.JOIN_PAYLOAD:
                        table = np.frombuffer(buf, dtype="<u8", count=proto.MAX_WORKERS, offset=proto.HDR_LEN)
                        if int(table[self.rank]) == self.nonce and int(h["epoch"]):
                            self._epoch = int(h["epoch"])
                            self._round = self._acked = 0
                            self._gate[0] = 0
                            return self._epoch
                    elif t == proto.TYPE_STATUS and int(h["rank"]) == self.rank:
                        detail = int(h["detail"])
                        if detail == proto.DETAIL["world"]:
                            n_agg = bin(int(h["mask"])).count("1")
                            raise InputError(
                                f"rank {self.rank}: job {self.job} on the aggregator has {n_agg} ranks, but this "
                                f"worker was started with world {self.world}")
                        if detail == proto.DETAIL["superseded"]:
                            raise ProtocolError(
                                f"rank {self.rank}: a newer process has joined job {self.job} as rank {self.rank}; "
                                f"this one gives way")
                        if detail == proto.DETAIL["joining"]:
                            joined = int(h["mask"])
            if time.monotonic() >= deadline:
                where = f"aggregator {self.aggregator}:{self.port}"
                if joined >= 0:
                    missing = [r for r in range(self.world) if not joined >> r & 1]
                    raise TimeoutError_(
                        f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s; the {where} "
                        f"has heard from rank(s) {', '.join(str(r) for r in range(self.world) if joined >> r & 1)}"
                        f": no JOIN from rank(s) {', '.join(map(str, missing))}")
                raise TimeoutError_(
                    f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s: the {where} did "
                    f"not answer; is the aggregator loaded with job {self.job} for {self.world} workers?")
            rto = min(rto * 2, self.max_rto)

    # --- metadata ---------------------------------------------------------------------------
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
        base = self._round
        self._round += k
        # one input array of k records: each part padded with its op's identity
        values = self._buf.get("meta_in", k * E, np.int32)
        for p, (v, op) in enumerate(parts):
            seg = values[p * per * E:(p + 1) * per * E]
            seg[:nb] = v
            seg[nb:] = quant.ZERO_EXP if op == proto.OP_MAX else 0
        blocks = np.arange(k, dtype=np.int64)
        masks = np.full(k, np.int64(self._all), dtype=np.int64)
        send = self._buf.get("meta_send", k * self._rec, np.uint8)
        tmpl = self._template(proto.TYPE_CONTRIB, 0)
        for p, (_v, op) in enumerate(parts):
            rounds = blocks[p * per:(p + 1) * per]
            kernels.encode_int(send, self._rec, E, tmpl, values, rounds, base, self.slots, blocks, masks, op,
                               p * per)
        res = self._buf.get("meta_out", k * E, np.int32)
        self._stream(base, k, blocks, masks, blocks, self._buf.get("noshift", k, np.int32), send,
                     kernels.KIND_INT32, res)
        self.last.meta_rounds += k
        out = [res[p * per * E:p * per * E + nb] for p in range(len(parts))]
        if exps is None:
            return None, out[0]
        return out[0], (out[1] if bits is not None else None)

    # --- the stream of rounds ---------------------------------------------------------------
    #: records encoded ahead of the sends at a time: the kernel copies them while they are in cache
    ENCODE_CHUNK = 256

    def _stream(self, base: int, K: int, blocks, masks, mine, shifts, send: np.ndarray, kind: int, res,
                encode=None) -> None:
        """Run rounds base .. base + K - 1 through the slot pool: send this rank's records
        (``mine``: indices of its rounds, its records in that order in ``send``, written by
        ``encode(j0, j1)`` just before they go out; None: already written), collect every
        round's result into ``res``, recover losses; return when every round has its result."""
        t, rec, S = self._t, self._rec, self.slots
        st = self.last
        dest = (self.aggregator, self.port)
        done = self._buf.get("done", K, np.uint8)
        done[:] = 0
        sent_at = self._buf.get("sent_at", K, np.float64)
        status = self._buf.get("status", K, np.int64)
        status[:] = -1
        newly = self._buf.get("newly", K, np.int64)
        pos = self._buf.get("pos", K, np.int64)  # this rank's record of round i, or -1
        pos[:] = -1
        pos[mine] = np.arange(len(mine))
        recs = send[:len(mine) * rec].reshape(-1, rec)
        ack_col = recs[:, proto.FIELD_OFFSETS["ack"]:proto.FIELD_OFFSETS["ack"] + 4].view(">u4")[:, 0] \
            if len(mine) else np.empty(0, ">u4")
        flags_col = recs[:, proto.FIELD_OFFSETS["flags"]] if len(mine) else np.empty(0, np.uint8)
        out_i = res.view(np.int32) if kind == kernels.KIND_INT32 else np.empty(0, np.int32)
        out_f32 = res if kind == kernels.KIND_FLOAT32 else np.empty(0, np.float32)
        out_f64 = res if kind == kernels.KIND_FLOAT64 else np.empty(0, np.float64)
        dense = len(mine) == K
        half = max(1, S // 2)
        rx_args = t.recv_args()
        stash = (self._stash, self._stash_round)
        gate = self._gate
        ndone = kernels.replay_stash(*stash, rec, self.elems, self.job, self._epoch, self.rank, base, K, S, blocks,
                                     shifts, self._bias, kind, out_i, out_f32, out_f64, done, status, newly,
                                     self._stash_lens, self._stash_segs, gate)

        head = kernels.advance(done, 0, K)  # lowest round without a result (the stash may have some)
        hi = 0        # rounds [0, hi) have entered the window
        j_sent = 0    # this rank's records [0, j_sent) have been sent
        j_enc = 0 if encode is not None else len(mine)  # ... and [0, j_enc) are written
        srtt = self._srtt
        base_rto = rto = max(self.rto, 3 * srtt)
        last_progress = time.monotonic()

        def report_ack() -> None:
            """Tell the aggregator this rank's head when its records have not for a while."""
            h = base + head
            if not dense and h - self._acked >= half:
                t.send_one(self._ack_record(h), dest)
                self._acked = h
                st.acks += 1

        asked = 0.0  # when this rank last asked for the gate
        while ndone < K:
            st.loops += 1
            # the window: S rounds past the head, and never a round whose set still holds a result
            # some rank has not acknowledged (the aggregator would drop it as early)
            lim = min(K, head + self.window, int(gate[0]) + 2 * S - base)
            if hi < lim:
                j_end = int(np.searchsorted(mine, lim)) if not dense else lim
                if j_end > j_sent:
                    while j_enc < j_end:
                        j1 = min(len(mine), j_enc + self.ENCODE_CHUNK)
                        encode(j_enc, j1)
                        j_enc = j1
                    ack_col[j_sent:j_end] = (base + head) & 0xFFFFFFFF
                    t.send_records(send, j_sent, j_end - j_sent, dest)
                    st.packets_sent += j_end - j_sent
                    self._acked = max(self._acked, base + head)
                    j_sent = j_end
                sent_at[hi:lim] = time.monotonic()
                hi = lim
            n, new, event = kernels.pump_recv(*rx_args, rec, self.elems, self.job, self._epoch, self.rank, base, K, S,
                                              blocks, shifts, self._bias, kind, out_i, out_f32, out_f64, done,
                                              status, newly, *stash, gate)
            now = time.monotonic()
            if event == kernels.EV_STALE_EPOCH:
                raise ProtocolError(
                    f"rank {self.rank}: the aggregator no longer runs epoch {self._epoch} of job {self.job}: "
                    f"another run of the job has started (a rank joined again, e.g. a restarted worker) or "
                    f"the aggregator was reloaded; this run's results are gone")
            if new:
                ndone += new
                last_progress = now
                # smoothed send -> result time; the timeout follows it, as TCP's RTO does. Only
                # rounds already in this rank's window have a send time: a round this rank does
                # not contribute to can complete before it gets there.
                last = int(newly[new - 1])
                if last < hi:
                    srtt = 0.875 * srtt + 0.125 * (now - float(sent_at[last]))
                base_rto = rto = max(self.rto, 3 * srtt)
                head = kernels.advance(done, head, K)
                report_ack()
                if head < hi:
                    self._fast_retransmit(head, hi, done, sent_at, now, base_rto, pos, flags_col, ack_col, send,
                                          base, masks, dest)
                continue
            # No progress (datagrams that brought nothing new do not count): the timers decide.
            if now - last_progress > self.timeout:
                self._fail(base, K, head, hi, done, status, masks)
            oldest = sent_at[head] if head < hi else now
            if head >= hi and hi < K and now - asked >= max(0.001, srtt):
                # everything sent has its result and the gate holds the window: ask for the gate
                # (and tell this rank's head), instead of waiting for a result that cannot come
                t.send_one(self._ack_record(base + head, ask=True), dest)
                self._acked = max(self._acked, base + head)
                asked = now
                st.acks += 1
            if head < hi and now - oldest >= rto:
                pending = np.flatnonzero(done[head:hi] == 0) + head
                pending = pending[now - sent_at[pending] >= rto]
                self._resend(pending, pos, flags_col, ack_col, send, base + head, base, masks, dest)
                sent_at[pending] = now
                st.timeouts += 1
                rto = min(rto * 2, max(self.max_rto, base_rto))
                continue
            if not n:
                t.wait(min(rto - (now - oldest), 0.05) if head < hi else 0.05)
        self._srtt = srtt
        st.rounds += K

    def _fast_retransmit(self, head, hi, done, sent_at, now, base_rto, pos, flags_col, ack_col, send, base, masks,
                         dest) -> None:
        """Rounds complete roughly in order: one left behind by GAP completed later rounds has
        lost a packet; resend it without waiting for the timeout."""
        window = done[head:hi]
        later = np.flatnonzero(window)
        if not len(later):
            return
        top = int(later[-1]) + head
        gap = np.flatnonzero(done[head:max(head, top - self.GAP)] == 0) + head
        gap = gap[now - sent_at[gap] > base_rto]
        if len(gap):
            self._resend(gap, pos, flags_col, ack_col, send, base + head, base, masks, dest)
            sent_at[gap] = now

    def _resend(self, rounds: np.ndarray, pos, flags_col, ack_col, send, head_abs: int, base: int, masks,
                dest) -> None:
        """Retransmit this rank's records of ``rounds`` (RETX: the aggregator answers from the
        Tx spot if the round is complete) and pull the others' results."""
        if not len(rounds):
            return
        st, rec = self.last, self._rec
        p = pos[rounds]
        own = p[p >= 0]
        if len(own):
            flags_col[own] |= proto.FLAG_RETX
            ack_col[own] = head_abs & 0xFFFFFFFF
            scratch = self._buf.get("retx", len(own) * rec, np.uint8)
            scratch.reshape(-1, rec)[:] = send.reshape(-1, rec)[own]
            self._t.send_records(scratch, 0, len(own), dest)
            st.retransmissions += len(own)
            st.packets_sent += len(own)
        others = rounds[p < 0]
        if len(others):
            buf = self._buf.get("pull", len(others) * rec, np.uint8)
            buf[:] = 0
            tmpl = self._template(proto.TYPE_CONTRIB, proto.FLAG_PULL | proto.FLAG_RETX)
            tmpl[proto.FIELD_OFFSETS["ack"]:proto.FIELD_OFFSETS["ack"] + 4] = np.frombuffer(
                (head_abs & 0xFFFFFFFF).to_bytes(4, "big"), np.uint8)
            kernels.encode_pulls(buf, rec, tmpl, others, base, self.slots, masks)
            self._t.send_records(buf, 0, len(others), dest)
            st.pulls += len(others)
            st.packets_sent += len(others)

    def _ack_record(self, head_abs: int, ask: bool = False) -> bytes:
        t = self._template(proto.TYPE_ACK, proto.FLAG_RETX if ask else 0)
        t[proto.FIELD_OFFSETS["ack"]:proto.FIELD_OFFSETS["ack"] + 4] = np.frombuffer(
            (head_abs & 0xFFFFFFFF).to_bytes(4, "big"), np.uint8)
        t[proto.FIELD_OFFSETS["mask"]:proto.FIELD_OFFSETS["mask"] + 4] = np.frombuffer(
            (1 << self.rank).to_bytes(4, "big"), np.uint8)
        return t.tobytes()

    def _fail(self, base, K, head, hi, done, status, masks) -> None:
        pending = np.flatnonzero(done[:hi] == 0)
        heard = status[pending]
        known = heard >= 0
        where = f"aggregator {self.aggregator}:{self.port}"
        if known.any():
            missing = 0
            for m, b in zip(masks[pending][known], heard[known]):
                missing |= int(m) & ~int(b)
            ranks = [r for r in range(self.world) if missing >> r & 1]
            raise TimeoutError_(
                f"rank {self.rank}: allreduce timed out after {self.timeout:g}s without progress; "
                f"{len(pending)} round(s) incomplete at the {where}: no contribution from rank(s) "
                f"{', '.join(map(str, ranks)) or '(none: results lost)'}")
        raise TimeoutError_(
            f"rank {self.rank}: allreduce timed out after {self.timeout:g}s: the {where} did not answer "
            f"({len(pending)} round(s) outstanding); is the aggregator loaded and the job configured "
            f"for {self.world} workers?")
