"""The worker library: one :class:`Communicator` per rank; ``allreduce(array)`` returns the
elementwise sum over all ranks, through the XDP aggregator or the user-space one (same protocol).

One call:
1. (floats, or sparse mode) a metadata round: per block, each rank's magnitude exponent (or
   ZERO_EXP for an all-zero block), max-reduced by the aggregator (OP_MAX). It yields the
   quantization exponent of every block and which blocks are zero on every rank.
2. the data round: blocks zero on every rank are skipped (no packet from anyone, no aggregator
   work). Every other block is one round on a slot; a rank whose block is zero sends a 32-byte
   null contribution instead of the payload (it keeps its claim to the result, so a lost result is
   recovered by retransmission like any other).
Rounds use slot (cursor + i) mod S with the set alternating per use of each slot over the job's
whole life; a slot is reused only after its previous result arrived (window = S rounds); lost
packets are retransmitted after a timeout with exponential backoff; after ``timeout`` seconds
without progress the call fails naming the ranks the aggregator has not heard from.
Block ids on the wire are a running counter over the job (never repeating), so a late duplicate of
an earlier call's result can never be taken for a current one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from . import codec, proto, quant
from .errors import InputError, ProtocolError, TimeoutError_
from .transport import UdpTransport

DEFAULT_WINDOW = 512


@dataclass
class CallStats:
    packets_sent: int = 0
    nulls_sent: int = 0
    retransmissions: int = 0
    results: int = 0
    duplicates: int = 0
    rounds: int = 0
    meta_rounds: int = 0
    blocks_skipped: int = 0
    seconds: float = 0.0
    timeouts: int = 0

    def add(self, other: "CallStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class Communicator:
    """One rank of a job. ``aggregator`` is the aggregator's IPv4 address (where contributions
    go); results arrive by IP multicast on ``group`` (joined on ``local_ip``'s interface)."""

    rank: int
    world: int
    aggregator: str
    group: str = "239.77.0.1"
    local_ip: str | None = None
    job: int = 1
    port: int = proto.DEFAULT_PORT
    slots: int = 1024
    window: int = DEFAULT_WINDOW
    elems: int = proto.DEFAULT_ELEMS
    timeout: float = 5.0
    rto: float = 0.02
    max_rto: float = 0.5
    sparse: bool = True
    stats: CallStats = field(default_factory=CallStats)
    last: CallStats = field(default_factory=CallStats)

    GAP = 128  # rounds completed past an outstanding one before it is retransmitted early

    def __post_init__(self):
        if not 0 <= self.rank < self.world <= proto.MAX_WORKERS:
            raise InputError(f"rank {self.rank} / world {self.world}: need 0 <= rank < world <= {proto.MAX_WORKERS}")
        if self.window > self.slots:
            self.window = self.slots
        self._t = UdpTransport(self.port, self.group, self.local_ip)
        self._uses = np.zeros(self.slots, dtype=np.int64)  # per-slot use counter -> set bit
        self._cursor = 0       # next slot
        self._block_id = 0     # running block id over the job
        self._all = (1 << self.world) - 1
        self._dsize = codec.datagram_size(self.elems)
        from .transport import SlotReceiver

        self._rx = SlotReceiver(self._t.sock, self._dsize, max(1024, 2 * self.window))
        self._srtt = self.rto

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public -----------------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Elementwise sum over all ranks. int32: exact, wrapping modulo 2^32 on overflow.
        float32/float64: through int32 fixed point (error bound in nicoffload.quant)."""
        x = np.ascontiguousarray(array)
        if x.dtype not in (np.int32, np.float32, np.float64):
            raise InputError(f"allreduce supports int32, float32 and float64, not {x.dtype}")
        quant.check_finite(x, f"rank {self.rank}'s input")
        if out is None:
            out = np.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise InputError("out must be a C-contiguous array with the input's shape and dtype")
        t0 = time.perf_counter()
        self.last = CallStats()
        n = x.size
        if n == 0:
            return out
        E = self.elems
        nb = -(-n // E)
        flat = x.reshape(-1)
        blocks = np.zeros((nb, E), dtype=x.dtype)
        blocks.reshape(-1)[:n] = flat
        counts = np.full(nb, E, dtype=np.int64)
        counts[-1] = n - (nb - 1) * E
        is_float = x.dtype.kind == "f"

        nonzero = np.any(blocks != 0, axis=1)
        if is_float or self.sparse:
            if is_float:
                local = quant.block_exponents(blocks)
            else:
                local = np.where(nonzero, 0, quant.ZERO_EXP).astype(np.int32)
            glob = self._meta_round(local)
            active = glob != quant.ZERO_EXP if self.sparse else np.ones(nb, dtype=bool)
        else:
            glob = None
            active = np.ones(nb, dtype=bool)
        idx = np.flatnonzero(active)
        self.last.blocks_skipped = int(nb - len(idx))
        res = np.zeros((nb, E), dtype=np.int32)
        if len(idx):
            if is_float:
                exps = glob[idx]
                exps = np.where(exps == quant.ZERO_EXP, 0, exps)  # dense mode, zero everywhere
                shifts = quant.shifts_for(exps, self.world)
                q = quant.quantize(blocks[idx], shifts)
                wire_exp = shifts.astype(np.int16)
            else:
                q = blocks[idx]
                wire_exp = np.zeros(len(idx), dtype=np.int16)
            has = nonzero[idx] if self.sparse else np.ones(len(idx), dtype=bool)
            sums = self._stream(q, counts[idx], has, wire_exp, op_max=False)
            if is_float:
                res_f = quant.dequantize(sums, shifts, x.dtype)
                outb = np.zeros((nb, E), dtype=x.dtype)
                outb[idx] = res_f
                out.reshape(-1)[:] = outb.reshape(-1)[:n]
            else:
                res[idx] = sums
                out.reshape(-1)[:] = res.reshape(-1)[:n]
        else:
            out[...] = 0
        self.last.seconds = time.perf_counter() - t0
        self.stats.add(self.last)
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it (a one-element allreduce)."""
        self.allreduce(np.zeros(1, dtype=np.int32))

    # --- rounds -----------------------------------------------------------------------------
    def _meta_round(self, local: np.ndarray) -> np.ndarray:
        E = self.elems
        k = -(-len(local) // E)
        vals = np.full((k, E), quant.ZERO_EXP, dtype=np.int32)
        vals.reshape(-1)[:len(local)] = local
        counts = np.full(k, E, dtype=np.int64)
        counts[-1] = len(local) - (k - 1) * E
        self.last.meta_rounds += k
        res = self._stream(vals, counts, np.ones(k, dtype=bool), np.zeros(k, dtype=np.int16),
                           op_max=True)
        return res.reshape(-1)[:len(local)].copy()

    def _stream(self, q: np.ndarray, counts: np.ndarray, has_data: np.ndarray, exps: np.ndarray,
                op_max: bool) -> np.ndarray:
        """Run K rounds (one per row of q) through the slot pool; return the (K, E) int32 sums."""
        K, E, S = len(q), self.elems, self.slots
        i = np.arange(K)
        slots = (self._cursor + i) % S
        sets = (self._uses[slots] + i // S) % 2
        self._uses += np.bincount(slots, minlength=S)
        self._cursor = (self._cursor + K) % S
        base = self._block_id
        ids = (base + i) & 0xFFFFFFFF
        self._block_id = (base + K) & 0xFFFFFFFF
        flags = proto.FLAG_OP_MAX if op_max else 0
        # id of this rank's next round that carries data (OmniReduce's pointer; the aggregator
        # returns the minimum over the contributors)
        data_idx = np.flatnonzero(has_data)
        next_nz = np.append((base + data_idx) & 0xFFFFFFFF, proto.NEXT_NZ_NONE)[
            np.searchsorted(data_idx, i, side="right")]

        # One buffer of K equal-sized datagrams: a rank whose block is all zero sends a null
        # (count 0, zero padding the aggregator does not add; see docs/protocol.md).
        buf = bytearray(K * self._dsize)
        codec.encode_blocks(q, rank=self.rank, job=self.job, mask=self._all, flags=flags, slot=slots,
                            set=sets, block=ids, next_nz=next_nz, count=np.where(has_data, counts, 0),
                            exp=exps, out=buf)
        rec_flags = np.frombuffer(buf, dtype=codec.datagram_dtype(E))["flags"]
        nulls_before = np.concatenate([[0], np.cumsum(~has_data)])

        out = np.zeros((K, E), dtype=np.int32)
        done = np.zeros(K, dtype=bool)
        status_bits = np.zeros(K, dtype=np.int64) - 1  # last STATUS bitmap per round, -1: none
        dest = (self.aggregator, self.port)
        head = 0      # lowest round without a result
        sent = 0      # rounds [0, sent) have been sent at least once
        ndone = 0
        rto = self.rto
        last_progress = time.monotonic()
        base_rto = rto
        view = memoryview(buf)
        st = self.last

        def send_range(a: int, b: int, retx: bool) -> None:
            if b <= a:
                return
            if retx:
                rec_flags[a:b] |= proto.FLAG_RETX
            self._t.send_batch(view[a * self._dsize:b * self._dsize], self._dsize, dest)
            st.packets_sent += b - a
            st.nulls_sent += int(nulls_before[b] - nulls_before[a])

        def send_rounds(items: np.ndarray) -> None:
            """Retransmit an arbitrary set of rounds, grouped in contiguous runs."""
            if not len(items):
                return
            breaks = np.flatnonzero(np.diff(items) != 1) + 1
            for run in np.split(items, breaks):
                send_range(int(run[0]), int(run[-1]) + 1, retx=True)

        hdr_dt = codec.header_dtype()
        sent_at = np.zeros(K)          # when each round was last sent
        srtt = self._srtt
        while ndone < K:
            limit = min(K, head + self.window)
            if sent < limit:
                send_range(sent, limit, retx=False)
                sent_at[sent:limit] = time.monotonic()
                sent = limit
            got, new = self._drain(base, K, slots, sets, out, done, status_bits, hdr_dt)
            now = time.monotonic()
            if got:
                if len(new):
                    ndone += len(new)
                    last_progress = now
                    # smoothed send->result time; the timeout follows it (as TCP's RTO does)
                    srtt = 0.875 * srtt + 0.125 * float(np.median(now - sent_at[new]))
                    base_rto = max(self.rto, 3 * srtt)
                    rto = base_rto
                while head < K and done[head]:
                    head += 1
                if head < sent:
                    # Fast retransmit: rounds complete in order per slot and roughly in order
                    # overall, so a round left behind by GAP later ones has lost a packet.
                    top = int(np.flatnonzero(done[head:sent])[-1]) + head if done[head:sent].any() else head
                    gap = np.flatnonzero(~done[head:max(head, top - self.GAP)]) + head
                    gap = gap[now - sent_at[gap] > base_rto]
                    if len(gap):
                        send_rounds(gap)
                        sent_at[gap] = now
                        st.retransmissions += len(gap)
                continue
            if now - last_progress > self.timeout:
                self._fail(done, sent, status_bits)
            oldest = sent_at[head] if head < sent else now
            if now - oldest >= rto:
                # timeout: retransmit every round outstanding for longer than rto, back off
                pending = np.flatnonzero(~done[head:sent]) + head
                pending = pending[now - sent_at[pending] >= rto]
                send_rounds(pending)
                sent_at[pending] = now
                st.retransmissions += len(pending)
                st.timeouts += 1
                rto = min(rto * 2, max(self.max_rto, base_rto))
                continue
            self._t.wait(min(rto - (now - oldest), 0.05))
        st.rounds += K
        self._srtt = srtt
        return out

    def _drain(self, base: int, K: int, slots, sets, out, done, status_bits,
               hdr_dt) -> tuple[int, np.ndarray]:
        """Receive everything queued with recvmmsg (results land back to back in fixed slots),
        then decode all results with one vectorised call. Returns (datagrams read, rounds that
        got their result just now)."""
        rx = self._rx
        none = np.empty(0, dtype=np.int64)
        n = rx.receive()
        if not n:
            return 0, none
        lens = rx.lengths(n)
        D, H = self._dsize, proto.HDR_LEN
        full = lens == D
        if full.all():
            dec = codec.decode_datagrams(rx.view[:n * D], n, self.elems)
            return n, self._take_results(dec, base, K, slots, sets, out, done)
        for j in np.flatnonzero(~full):
            if lens[j] == H:
                self._take_status(rx.view[j * D:j * D + H], base, K, status_bits, hdr_dt)
            else:
                self.last.duplicates += 1  # a datagram of a size we never use: not ours
        if full.any():
            dec = codec.decode_datagrams(rx.view[:n * D], n, self.elems)
            keep = np.flatnonzero(full)
            dec = codec.Decoded({k: v[keep] for k, v in dec.fields.items()}, dec.payload[keep])
            return n, self._take_results(dec, base, K, slots, sets, out, done)
        return n, none

    def _take_results(self, dec: codec.Decoded, base: int, K: int, slots, sets, out, done) -> np.ndarray:
        f = dec.fields
        idx = (f["block"].astype(np.int64) - base) & 0xFFFFFFFF
        ok = ((f["magic"] == proto.MAGIC) & (f["type"] == proto.TYPE_RESULT) & (f["job"] == self.job)
              & (idx < K))
        idx_ok = np.where(ok, idx, 0)
        ok &= (slots[idx_ok] == f["slot"]) & (sets[idx_ok] == f["set"])
        fresh = ok & ~done[idx_ok]
        sel = idx[fresh]
        # a round may appear twice in one batch (a duplicate): keep one
        sel, first = np.unique(sel, return_index=True)
        out[sel] = dec.payload[np.flatnonzero(fresh)[first]]
        done[sel] = True
        self.last.results += len(sel)
        self.last.duplicates += int(len(idx) - len(sel))
        return sel

    def _take_status(self, buf: memoryview, base: int, K: int, status_bits, hdr_dt) -> None:
        h = np.frombuffer(buf[:proto.HDR_LEN], dtype=hdr_dt)[0]
        if int(h["magic"]) != proto.MAGIC or int(h["type"]) != proto.TYPE_STATUS:
            return
        i = (int(h["block"]) - base) & 0xFFFFFFFF
        if i < K:
            status_bits[i] = int(h["mask"])

    def _fail(self, done, sent, status_bits) -> None:
        pending = np.flatnonzero(~done[:sent])
        heard = status_bits[pending]
        known = heard[heard >= 0]
        where = f"aggregator {self.aggregator}:{self.port}"
        if len(known):
            missing = 0
            for b in known:
                missing |= self._all & ~int(b)
            ranks = [r for r in range(self.world) if missing >> r & 1]
            raise TimeoutError_(
                f"rank {self.rank}: allreduce timed out after {self.timeout:g}s without progress; "
                f"{len(pending)} round(s) incomplete at the {where}: no contribution from rank(s) "
                f"{', '.join(map(str, ranks))}")
        raise TimeoutError_(
            f"rank {self.rank}: allreduce timed out after {self.timeout:g}s: the {where} did not answer "
            f"({len(pending)} round(s) outstanding); is the aggregator loaded and the job configured "
            f"for {self.world} workers?")
