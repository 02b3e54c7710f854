"""The stream of rounds one rank runs through the aggregator's slot pool: joining the job,
sending records inside the window, collecting results, recovering losses.

Rounds are numbered over the epoch: round i uses slot i mod S, set (i div S) mod 2; a round enters
the window only when the round S before it has its result (window <= S), and each record carries
this rank's head (every round below it has its result) so the aggregator reuses a set only when
every rank holds its previous result; a rank that contributes to nothing for a while says so with
an ACK. Results carry the job's gate (the lowest head of all ranks): no round at or beyond
gate + 2S is sent, and results that arrive before their stream are stashed and replayed. Lost
records are retransmitted (rounds this rank contributes to) or pulled (the others); when and
which is decided by :class:`nicoffload.worker.recovery.RoundTimer`. After ``timeout`` seconds without
progress the call fails naming the ranks the aggregator has not heard from.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from nicoffload.datapath import kernels, pump
from nicoffload.datapath.transport import SLOT_BYTES, Transport, faulted_in
from nicoffload.errors import InputError, MismatchError, ProtocolError, TimeoutError_
from nicoffload.wire import proto, quant
from nicoffload.worker.records import RankRecords, ack_column, flags_column, read_join_reply
from nicoffload.worker.recovery import RoundTimer, ack_due, missing_ranks


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
    spec_blocks: int = 0        # blocks sent speculatively, scaled by the last call's exponents
    spec_missed: int = 0        # ... whose exponent had changed: sent again at the right scale
    seconds: float = 0.0
    timeouts: int = 0
    loops: int = 0              # iterations of the send/receive loop
    syscalls: int = 0
    foreign: int = 0            # datagrams from someone other than the aggregator, skipped

    def add(self, other: "CallStats") -> None:
        mine, theirs = self.__dict__, other.__dict__
        for k in self.__dataclass_fields__:
            mine[k] += theirs[k]

    @classmethod
    def total(cls, many) -> "CallStats":
        """The sum of several communicators' statistics (shards, levels)."""
        st = cls()
        for other in many:
            st.add(other)
        return st


def ring_spans(j0: int, j1: int, cap: int):
    """Records j0 .. j1 - 1 of a stream kept in a ring of ``cap`` records, as (position, count)
    spans that do not cross the ring's end."""
    while j0 < j1:
        a = j0 % cap
        c = min(j1 - j0, cap - a)
        yield a, c
        j0 += c


#: the outputs a stream does not write (decode_results takes all three kinds)
_NONE_I32, _NONE_F32, _NONE_F64 = np.empty(0, np.int32), np.empty(0, np.float32), np.empty(0, np.float64)


class Buffers:
    """Per-communicator memory, grown on demand and reused across calls."""

    #: views kept at most (a view is a few hundred bytes; sizes that change every call must not grow it)
    MAX_VIEWS = 512

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        # the views handed out, by (name, length): a small call asks for some twenty per call,
        # and slicing anew each time was a measurable part of its CPU; a grown array drops its views
        self._views: dict[tuple, np.ndarray] = {}

    def get(self, name: str, n: int, dtype) -> np.ndarray:
        v = self._views.get((name, n))
        if v is not None and v.dtype == dtype:
            return v
        a = self.arrays.get(name)
        if a is None or a.size < n or a.dtype != dtype:
            a = np.empty(max(n, 1), dtype=dtype)
            self.arrays[name] = a
            self._views = {k: w for k, w in self._views.items() if k[0] != name}
        if len(self._views) >= self.MAX_VIEWS:  # calls of ever new sizes: keep the cache small
            self._views.clear()
        v = self._views[(name, n)] = a[:n]
        return v


#: this many results taken only as answers, none as a first delivery: the group's frames do not
#: arrive (no multicast on this network), and the job fails saying so instead of crawling on
NO_GROUP_AFTER = 8


class RoundStream:
    """One rank's transport, epoch, window and recovery state. The communicator reserves rounds
    (:meth:`reserve`) and runs them (:meth:`run`)."""

    #: rounds completed past an outstanding one before it is retransmitted early
    GAP = 128

    def __init__(self, rank: int, world: int, aggregator: str, *, group: str, local_ip: str | None, job: int,
                 port: int, local_port: int | None, slots: int, window: int, elems: int, timeout: float, rto: float,
                 max_rto: float,
                 buffers: Buffers, silence: float | None = None, delivery: str = "multicast"):
        self.rank, self.world, self.aggregator, self.job, self.port = rank, world, aggregator, job, port
        self.group = group
        self.slots, self.window, self.elems, self.timeout = slots, window, elems, timeout
        # a live aggregator answers every retransmission (a STATUS at least): this long without a
        # word from it while asking means it is gone (None: only the progress timeout applies)
        self.silence = silence
        self.rto, self.max_rto = rto, max_rto
        self.last = CallStats()
        self._rec = proto.record_size(elems)
        # unicast delivery: every result comes to this rank's own address, no group to join
        self.delivery = delivery
        self._t = Transport(port if local_port is None else local_port, group if delivery == "multicast" else None,
                            local_ip, self._rec)
        self._t.expect_from((aggregator, port))
        self._round = 0        # next round of the epoch (unwrapped)
        self._epoch = 0        # 0 until joined
        self._all = (1 << world) - 1
        self._bias = quant.bias(world, 32)
        self._bias16 = quant.bias(world, 16)  # 16-bit lanes (op SUM16)
        self._buf = buffers
        self._timer = RoundTimer(rto, max_rto, timeout, self.GAP)
        self._acked = 0        # the last head this rank reported (unwrapped)
        self._records = RankRecords(rank, job, world)
        # results of rounds beyond the current stream (see pump.decode_results): up to 2S rounds
        h = 2 * slots
        self._stash = faulted_in(h * self._rec, np.uint8)
        self._stash_round = np.full(h, -1, np.int64)
        self._stash_lens = np.zeros(h, np.uint32)
        self._stash_segs = np.zeros(h, np.int64)
        # this rank's records in flight: a ring of SEND_RING records, reused by every call (a record is
        # needed until its round has its result, and at most the window's rounds plus one encode
        # chunk are between the head and the last record written)
        self.send_ring = -(-(window + self.ENCODE_CHUNK) // self.ENCODE_CHUNK) * self.ENCODE_CHUNK
        self._send = faulted_in(self.send_ring * self._rec, np.uint8)
        # the job's gate (absolute round; from results): no round at or beyond gate + 2S is sent;
        # [1], [2]: results taken over this communicator's life as first deliveries, and as answers
        self._gate = np.zeros(3, np.int64)
        # this process's nonce: larger than any earlier process's (the clock), unique (random bits)
        self.nonce = (time.time_ns() & ~0xFFFF) | int.from_bytes(os.urandom(2), "little") | 1
        # set from another thread (abort): the call in flight and every later one raise it
        self._abort: BaseException | None = None
        kernels.warm_up(elems)
        pump.warm_up(elems)
        self._warm_pumps()

    def abort(self, error: BaseException) -> None:
        """Fail the call in flight and every later one with ``error`` (any thread may call it)."""
        self._abort = error

    def _check_abort(self) -> None:
        if self._abort is not None:
            raise self._abort

    def _warm_pumps(self) -> None:
        """Compile (or load) the system-call kernels for this transport's buffers."""
        one = np.zeros(1, np.int64)
        pump.pump_recv(*self._t.recv_args(), self._rec, self.elems, self.job, 0, self.rank, 0, 0, 1, one,
                       np.zeros(1, np.int32), 1, pump.KIND_INT32, np.zeros(1, np.int32),
                       np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(1, np.uint8),
                       np.zeros(1, np.int64), np.zeros(1, np.int64), self._stash, self._stash_round, self._gate)
        t = self._t
        pump.pump_send(t.fd, t.tx_msgs_addr, t._tx_base, t._tx_len, 1, 0, 0, 0, t.per_datagram, self._rec)

    def close(self) -> None:
        self._t.close()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def record_size(self) -> int:
        return self._rec

    @property
    def syscalls(self) -> int:
        return self._t.syscalls

    @property
    def foreign(self) -> int:
        """Datagrams received from someone other than the aggregator, and skipped."""
        return self._t.foreign

    @property
    def bias(self) -> int:
        """The offset of the offset-binary fixed point of this job's world size (32-bit lanes)."""
        return self._bias

    @property
    def bias16(self) -> int:
        """... and of 16-bit lanes."""
        return self._bias16

    def template(self, type_: int, flags: int = 0) -> np.ndarray:
        return self._records.template(type_, flags, self._epoch)

    def reserve(self, k: int) -> int:
        """The next ``k`` rounds of the epoch; returns the first."""
        base = self._round
        self._round += k
        return base

    # --- joining ----------------------------------------------------------------------------
    def join(self) -> int:
        """Join the job: returns once every rank of it has joined this run (the aggregator then
        hands out the run's epoch). Called by the first collective; calling it again is free."""
        self._check_abort()
        if self._epoch:
            return self._epoch
        rec = self._records.join(self.nonce)
        dest = (self.aggregator, self.port)
        buf = bytearray(SLOT_BYTES)
        deadline = time.monotonic() + self.timeout
        rto, joined = self.rto, -1
        heard_at = time.monotonic()
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
                    heard_at = time.monotonic()
                    kind, value = read_join_reply(buf, n, self.rank, self.job, self.nonce)
                    if kind == "joined":
                        self._gate[2 if buf[proto.FIELD_OFFSETS["flags"]] & proto.FLAG_ANSWER else 1] += 1
                        self._epoch = value
                        self._round = self._acked = 0
                        self._gate[0] = 0
                        return self._epoch
                    if kind == "world":
                        raise InputError(
                            f"rank {self.rank}: job {self.job} on the aggregator has {value} ranks, but this "
                            f"worker was started with world {self.world}")
                    if kind == "superseded":
                        raise ProtocolError(
                            f"rank {self.rank}: a newer process has joined job {self.job} as rank {self.rank}; "
                            f"this one gives way")
                    if kind == "joining":
                        joined = value
            self._check_abort()
            if time.monotonic() >= deadline:
                self._join_timeout(joined)
            self._check_silence(heard_at, "joining")
            rto = min(rto * 2, self.max_rto)

    def _no_group_delivery(self) -> None:
        raise ProtocolError(
            f"rank {self.rank}: results of job {self.job} do not arrive by multicast here: all {int(self._gate[2])} "
            f"so far came only as answers to retransmissions and pulls, none as the aggregator's first delivery "
            f"to group {self.group}. This network carries no multicast: register the job with unicast delivery "
            f"(agg load/job add --delivery unicast, allreduce/demo/bench --delivery unicast, or a service started "
            f"with --no-multicast)")

    def _check_silence(self, heard_at: float, doing: str) -> None:
        if self.silence is not None and time.monotonic() - heard_at > self.silence:
            raise TimeoutError_(
                f"rank {self.rank}: {doing} job {self.job}: the aggregator {self.aggregator}:{self.port} has not "
                f"answered anything for {self.silence:g}s while asked again and again: it is gone (unloaded, its "
                f"host down, or the network between cut)")

    def _join_timeout(self, joined: int) -> None:
        where = f"aggregator {self.aggregator}:{self.port}"
        if joined >= 0:
            have = [r for r in range(self.world) if joined >> r & 1]
            missing = [r for r in range(self.world) if not joined >> r & 1]
            raise TimeoutError_(
                f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s; the {where} "
                f"has heard from rank(s) {', '.join(map(str, have))}: no JOIN from rank(s) "
                f"{', '.join(map(str, missing))}")
        raise TimeoutError_(
            f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s: the {where} did "
            f"not answer; is the aggregator loaded with job {self.job} for {self.world} workers?")

    # --- the stream of rounds ---------------------------------------------------------------
    #: records encoded ahead of the sends at a time: the kernel copies them while they are in cache
    ENCODE_CHUNK = 256

    def send_buffer(self, records: int) -> np.ndarray:
        """The buffer ``encode`` writes this rank's records into: the send ring (at most
        ``send_ring`` records, whatever the tensor's size)."""
        return self._send[:min(records, self.send_ring) * self._rec]

    def run(self, base: int, K: int, blocks, masks, mine, shifts, send: np.ndarray, kind: int, res,
                encode=None, meta_out: np.ndarray | None = None) -> None:
        """Run rounds base .. base + K - 1 through the slot pool: send this rank's records
        (``mine``: indices of its rounds). With ``encode``, ``send`` is a ring
        (:meth:`send_buffer`): ``encode(j0, j1, at)`` writes records j0 .. j1 - 1 at record
        ``at`` of it just before they go out; without, ``send`` holds every record, in order.
        Collect every round's result into ``res`` (rounds whose shift is pump.META_SHIFT: int32
        into ``meta_out``, at their block's offset), recover losses; return when every round has
        its result."""
        t, rec, S = self._t, self._rec, self.slots
        cap = len(send) // rec if encode is not None else len(mine)  # records the buffer holds
        if encode is not None and cap < len(mine) and cap < self.window + self.ENCODE_CHUNK:
            raise ValueError(f"a send ring of {cap} records cannot hold a window of {self.window}")
        st = self.last
        dest = (self.aggregator, self.port)
        done = self._buf.get("done", K, np.uint8)
        sent_at = self._buf.get("sent_at", K, np.float64)
        status = self._buf.get("status", K, np.int64)
        newly = self._buf.get("newly", K, np.int64)
        pos = self._buf.get("pos", K, np.int64)  # this rank's record of round i, or -1
        kernels.reset_rounds(done, status, pos, mine)
        recs = send[:min(cap, len(mine)) * rec].reshape(-1, rec)
        ack_col, flags_col = ack_column(recs), flags_column(recs)
        out_i = res.view(np.int32) if kind == pump.KIND_INT32 else \
            meta_out if meta_out is not None else _NONE_I32
        out_f32 = res if res.dtype == np.float32 else _NONE_F32
        out_f64 = res if res.dtype == np.float64 else _NONE_F64
        dense = len(mine) == K
        rx_args = t.recv_args()
        stash = (self._stash, self._stash_round)
        gate = self._gate
        bias = self._bias16 if kind in (pump.KIND_HALF32, pump.KIND_HALF64) else self._bias
        ndone = pump.replay_stash(*stash, rec, self.elems, self.job, self._epoch, self.rank, base, K, S, blocks,
                                     shifts, bias, kind, out_i, out_f32, out_f64, done, status, newly,
                                     self._stash_lens, self._stash_segs, gate)

        head = pump.advance(done, 0, K)  # lowest round without a result (the stash may have some)
        hi = 0        # rounds [0, hi) have entered the window
        j_sent = 0    # this rank's records [0, j_sent) have been sent
        j_enc = 0 if encode is not None else len(mine)  # ... and [0, j_enc) are written
        timer = self._timer
        timer.start(time.monotonic())
        heard_at = time.monotonic()

        def resend(rounds: np.ndarray) -> None:
            self._resend(rounds, pos, cap, flags_col, ack_col, send, base + head, base, masks, dest)

        while ndone < K:
            st.loops += 1
            # the window: S rounds past the head, and never a round whose set still holds a result
            # some rank has not acknowledged (the aggregator would drop it as early)
            lim = min(K, head + self.window, int(gate[0]) + 2 * S - base)
            if hi < lim:
                j_end = int(np.searchsorted(mine, lim)) if not dense else lim
                if j_end > j_sent:
                    while j_enc < j_end:  # chunks that never cross the ring's end
                        j1 = min(len(mine), j_enc + self.ENCODE_CHUNK, (j_enc // cap + 1) * cap)
                        encode(j_enc, j1, j_enc % cap)
                        j_enc = j1
                    for a, c in ring_spans(j_sent, j_end, cap):
                        ack_col[a:a + c] = (base + head) & 0xFFFFFFFF
                        t.send_records(send, a, c, dest)
                    st.packets_sent += j_end - j_sent
                    self._acked = max(self._acked, base + head)
                    j_sent = j_end
                sent_at[hi:lim] = time.monotonic()
                hi = lim
            foreign0 = self._t.foreign
            n, new, event = pump.pump_recv(*rx_args, rec, self.elems, self.job, self._epoch, self.rank, base, K, S,
                                              blocks, shifts, bias, kind, out_i, out_f32, out_f64, done,
                                              status, newly, *stash, gate)
            now = time.monotonic()
            if n > self._t.foreign - foreign0:
                heard_at = now
                if gate[2] >= NO_GROUP_AFTER and not gate[1] and self.delivery == "multicast":
                    self._no_group_delivery()
            if event == pump.EV_STALE_EPOCH:
                raise ProtocolError(
                    f"rank {self.rank}: the aggregator no longer runs epoch {self._epoch} of job {self.job}: "
                    f"another run of the job has started (a rank joined again, e.g. a restarted worker) or "
                    f"the aggregator was reloaded; this run's results are gone")
            if event == pump.EV_MISMATCH:
                # the ranks' rounds are out of step from here on: every later call fails with this
                i = int(np.flatnonzero(status[:K] == pump.MISMATCHED)[0])
                self.abort(MismatchError(
                    f"rank {self.rank}: the ranks disagree on the round of block {int(blocks[i])} of this call: "
                    f"the aggregator refused a contribution that differs from the round's first (its size, scale, "
                    f"lanes or op): the ranks were not given tensors of the same shape and dtype; this job's "
                    f"rounds are out of step, build new communicators"))
                self._check_abort()
            if new:
                ndone += new
                timer.on_results(int(newly[new - 1]), hi, sent_at, now)
                head = pump.advance(done, head, K)
                if ack_due(base + head, self._acked, S, dense):
                    t.send_one(self._records.ack(self._epoch, base + head), dest)
                    self._acked = base + head
                    st.acks += 1
                if head < hi:
                    resend(timer.fast_retransmit(done, head, hi, sent_at, now))
                continue
            # No progress (datagrams that brought nothing new do not count): the timers decide.
            self._check_abort()
            self._check_silence(heard_at, "running")
            if timer.expired(now):
                self._fail(hi, done, status, masks)
            if timer.ask_gate(head, hi, K, now):
                # everything sent has its result and the gate holds the window: ask for the gate
                # (and tell this rank's head), instead of waiting for a result that cannot come
                t.send_one(self._records.ack(self._epoch, base + head, ask=True), dest)
                self._acked = max(self._acked, base + head)
                st.acks += 1
            late = timer.timed_out(done, head, hi, sent_at, now)
            if len(late):
                resend(late)
                st.timeouts += 1
                continue
            if not n:
                t.wait(timer.wait(head, hi, sent_at, now))
        st.rounds += K

    def _resend(self, rounds: np.ndarray, pos, cap: int, flags_col, ack_col, send, head_abs: int, base: int,
                masks, dest) -> None:
        """Retransmit this rank's records of ``rounds`` (RETX: the aggregator answers from the
        Tx spot if the round is complete) and pull the others' results."""
        if not len(rounds):
            return
        st, rec = self.last, self._rec
        p = pos[rounds]
        own = p[p >= 0] % cap  # where in the ring (rounds not yet done: their records are still there)
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
            kernels.encode_pulls(buf, rec, self._records.pull(self._epoch, head_abs), others, base, self.slots, masks)
            self._t.send_records(buf, 0, len(others), dest)
            st.pulls += len(others)
            st.packets_sent += len(others)

    def _fail(self, hi, done, status, masks) -> None:
        pending = np.flatnonzero(done[:hi] == 0)
        heard = status[pending]
        where = f"aggregator {self.aggregator}:{self.port}"
        if (heard >= 0).any():
            ranks = missing_ranks(self.world, masks[pending], heard)
            raise TimeoutError_(
                f"rank {self.rank}: allreduce timed out after {self.timeout:g}s without progress; "
                f"{len(pending)} round(s) incomplete at the {where}: no contribution from rank(s) "
                f"{', '.join(map(str, ranks)) or '(none: results lost)'}")
        raise TimeoutError_(
            f"rank {self.rank}: allreduce timed out after {self.timeout:g}s: the {where} did not answer "
            f"({len(pending)} round(s) outstanding); is the aggregator loaded and the job configured "
            f"for {self.world} workers?")
