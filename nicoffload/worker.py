"""The worker library: one :class:`Communicator` per rank; ``allreduce(array)`` returns the
elementwise sum over all ranks, through the XDP aggregator or the user-space one (same protocol).

Before its first collective a communicator JOINs the job: the aggregator hands out a new epoch
once every rank of the job has joined with a fresh nonce, and every record carries that epoch,
so no round of this run can ever be taken for a round of an earlier run (or of a crashed
worker's), and a run that another run's JOIN has ended fails naming the cause.

One call:
1. (floats, or sparse mode) a metadata round: per block, each rank's magnitude exponent (or
   ZERO_EXP for an all-zero block), max-reduced by the aggregator (OP_MAX). It yields the
   quantization exponent of every block and which blocks are zero on every rank.
2. the data round: blocks zero on every rank are skipped (no packet from anyone, no aggregator
   work). Every other block is one round on a slot, with every rank contributing.
Rounds are numbered over the epoch; round i uses slot i mod S, set (i // S) mod 2; a slot is reused
only after its previous result arrived (window <= S rounds); lost packets are retransmitted after a
timeout with exponential backoff; after ``timeout`` seconds without progress the call fails naming
the ranks the aggregator has not heard from.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from . import codec, proto, quant
from .errors import InputError, ProtocolError, TimeoutError_
from .transport import SlotReceiver, UdpTransport

DEFAULT_WINDOW = 512


@dataclass
class CallStats:
    packets_sent: int = 0
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
        self._round = 0        # next round of the epoch
        self._epoch = 0        # 0 until joined
        self._all = (1 << self.world) - 1
        self._dsize = codec.datagram_size(self.elems)
        # this process's nonce: larger than any earlier process's (the clock), unique (random bits)
        self.nonce = (time.time_ns() & ~0xFFFF) | int.from_bytes(os.urandom(2), "little") | 1
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
        self.join()
        E = self.elems
        nb = -(-n // E)
        flat = x.reshape(-1)
        blocks = np.zeros((nb, E), dtype=x.dtype)
        blocks.reshape(-1)[:n] = flat
        counts = np.full(nb, E, dtype=np.int64)
        counts[-1] = n - (nb - 1) * E
        is_float = x.dtype.kind == "f"

        if is_float or self.sparse:
            if is_float:
                local = quant.block_exponents(blocks)
            else:
                local = np.where(np.any(blocks != 0, axis=1), 0, quant.ZERO_EXP).astype(np.int32)
            glob = self._meta_round(local)
            active = glob != quant.ZERO_EXP if self.sparse else np.ones(nb, dtype=bool)
        else:
            glob = None
            active = np.ones(nb, dtype=bool)
        idx = np.flatnonzero(active)
        self.last.blocks_skipped = int(nb - len(idx))
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
            sums = self._stream(q, counts[idx], wire_exp, proto.OP_SUM)
            if is_float:
                outb = np.zeros((nb, E), dtype=x.dtype)
                outb[idx] = quant.dequantize(sums, shifts, x.dtype)
            else:
                outb = np.zeros((nb, E), dtype=np.int32)
                outb[idx] = sums
            out.reshape(-1)[:] = outb.reshape(-1)[:n]
        else:
            out[...] = 0
        self.last.seconds = time.perf_counter() - t0
        self.stats.add(self.last)
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it (a one-element allreduce)."""
        self.allreduce(np.zeros(1, dtype=np.int32))

    @property
    def epoch(self) -> int:
        """The epoch of this run (0 before :meth:`join`)."""
        return self._epoch

    def join(self) -> int:
        """Join the job: returns once every rank of it has joined this run (the aggregator then
        hands out the run's epoch). Called by the first collective; calling it again is free."""
        if self._epoch:
            return self._epoch
        rec = codec.encode_blocks(
            np.zeros((1, proto.JOIN_PAYLOAD // 4), np.int32), rank=self.rank, job=self.job, slot=0, set=0,
            round=self.nonce & 0xFFFFFFFF, ack=self.nonce >> 32, mask=self._all, count=0, type=proto.TYPE_JOIN)
        dest = (self.aggregator, self.port)
        buf = bytearray(1 << 16)
        hdr_dt = codec.header_dtype()
        deadline = time.monotonic() + self.timeout
        rto, joined = self.rto, -1
        while True:
            self._t.sock.sendto(rec, dest)
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
                            self._round = 0
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

    # --- rounds -----------------------------------------------------------------------------
    def _meta_round(self, local: np.ndarray) -> np.ndarray:
        E = self.elems
        k = -(-len(local) // E)
        vals = np.full((k, E), quant.ZERO_EXP, dtype=np.int32)
        vals.reshape(-1)[:len(local)] = local
        counts = np.full(k, E, dtype=np.int64)
        counts[-1] = len(local) - (k - 1) * E
        self.last.meta_rounds += k
        res = self._stream(vals, counts, np.zeros(k, dtype=np.int16), proto.OP_MAX)
        return res.reshape(-1)[:len(local)].copy()

    def _stream(self, q: np.ndarray, counts: np.ndarray, exps: np.ndarray, op: int) -> np.ndarray:
        """Run K rounds (one per row of q) through the slot pool; return the (K, E) int32 results."""
        K, E, S = len(q), self.elems, self.slots
        base = self._round  # rounds count over the epoch, unwrapped: slot and set follow them
        rounds = base + np.arange(K, dtype=np.int64)
        slots = rounds % S
        sets = (rounds // S) % 2
        rounds &= 0xFFFFFFFF  # on the wire, serial numbers
        self._round = base + K

        buf = bytearray(K * self._dsize)
        codec.encode_blocks(q, rank=self.rank, job=self.job, epoch=self._epoch, mask=self._all, op=op,
                            slot=slots, set=sets, round=rounds, count=counts, exp=exps, ack=base & 0xFFFFFFFF,
                            out=buf)
        rec = np.frombuffer(buf, dtype=codec.datagram_dtype(E))
        rec_flags, rec_ack = rec["flags"], rec["ack"]

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
            rec_ack[a:b] = (base + head) & 0xFFFFFFFF  # this rank's head: its acknowledgement
            self._t.send_batch(view[a * self._dsize:b * self._dsize], self._dsize, dest)
            st.packets_sent += b - a

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
            return n, self._take_results(dec, base, K, slots, sets, out, done, status_bits)
        for j in np.flatnonzero(~full):
            self.last.duplicates += 1  # a datagram of a size we never use: not ours
        if full.any():
            dec = codec.decode_datagrams(rx.view[:n * D], n, self.elems)
            keep = np.flatnonzero(full)
            dec = codec.Decoded({k: v[keep] for k, v in dec.fields.items()}, dec.payload[keep])
            return n, self._take_results(dec, base, K, slots, sets, out, done, status_bits)
        return n, none

    def _take_results(self, dec: codec.Decoded, base: int, K: int, slots, sets, out, done,
                      status_bits=None) -> np.ndarray:
        f = dec.fields
        idx = (f["round"].astype(np.int64) - base) & 0xFFFFFFFF
        mine = (f["magic"] == proto.MAGIC) & (f["job"] == self.job) & (idx < K)
        status = mine & (f["type"] == proto.TYPE_STATUS) & (f["rank"] == self.rank)
        if status.any():
            self._take_status(f, idx, status, status_bits)
        ok = mine & (f["type"] == proto.TYPE_RESULT) & (f["epoch"] == self._epoch)
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

    def _take_status(self, f: dict, idx: np.ndarray, which: np.ndarray, status_bits) -> None:
        """STATUS records addressed to this rank: who has contributed to a waiting round, or why
        the aggregator cannot answer at all."""
        details = f["detail"][which]
        epochs = f["epoch"][which]
        if (details == proto.DETAIL["epoch"]).any():
            e = int(epochs[details == proto.DETAIL["epoch"]][0])
            raise ProtocolError(
                f"rank {self.rank}: the aggregator no longer runs epoch {e} of job {self.job}: another run "
                f"of the job has started (a rank joined again, e.g. a restarted worker) or the aggregator was "
                f"reloaded; this run's results are gone")
        wait = details == proto.DETAIL["waiting"]
        status_bits[idx[which][wait]] = f["mask"][which][wait]

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
