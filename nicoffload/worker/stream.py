"""The stream of rounds one rank runs through the aggregator's slot pool: joining the job,
sending records inside the window, collecting results, recovering losses.

Rounds are numbered over the epoch: round i uses slot i mod S, set (i div S) mod 2; a round enters
the window only when the round S before it has its result (window <= S) and the congestion window
(:class:`nicoffload.worker.congestion.Window`: rounds in flight, AIMD on the aggregator's results
and on losses) has room for it, and each record carries
this rank's head (every round below it has its result) so the aggregator reuses a set only when
every rank holds its previous result; a rank that contributes to nothing for a while says so with
an ACK. Results carry the job's gate (the lowest head of all ranks): no round at or beyond
gate + 2S is sent, and results that arrive before their stream are stashed and replayed. A round
left behind or timed out is probed (a header-only pull: the answer names who has contributed)
and only a rank whose record is missing resends it (a round complete at the aggregator, whose
result never came, is pulled in full); when is decided by
:class:`nicoffload.worker.recovery.RoundTimer`. After ``timeout`` seconds without
progress the call fails naming the ranks the aggregator has not heard from. Behind a slow link
the loop takes results in batches (:class:`nicoffload.worker.moderation.Moderation`).
"""
from __future__ import annotations

import os
import time

import numpy as np

from nicoffload.datapath import encode as enc
from nicoffload.datapath import pump
from nicoffload.datapath.transport import Transport, faulted_in
from nicoffload.errors import AggregatorReset, MismatchError, ProtocolError, SilentAggregator, TimeoutError_
from nicoffload.wire import proto, quant
from nicoffload.worker.join import join_job
from nicoffload.worker.calls import Buffers, CallStats, Rounds, RunState, ring_spans
from nicoffload.worker.confirm import GateWait
from nicoffload.worker.congestion import Window
from nicoffload.worker.moderation import Moderation
from nicoffload.worker.records import RankRecords
from nicoffload.worker.recovery import RoundTimer, ack_due, missing_ranks, probe_answers, unheard


#: this many results taken only as answers, none as a first delivery: the group's frames do not
#: arrive (no multicast on this network), and the job fails saying so instead of crawling on
NO_GROUP_AFTER = 8


class RoundStream(GateWait):
    """One rank's transport, epoch, window and recovery state. The communicator reserves rounds
    (:meth:`reserve`) and runs them (:meth:`run`)."""

    #: rounds completed past an outstanding one before it is retransmitted early
    GAP = 128

    def __init__(self, rank: int, world: int, aggregator: str, *, group: str, local_ip: str | None, job: int,
                 port: int, local_port: int | None, slots: int, window: int, elems: int, timeout: float, rto: float,
                 max_rto: float,
                 buffers: Buffers, silence: float | None = None, delivery: str = "multicast", key: int = 0):
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
        self._t.expect_from((aggregator, port), key)  # results from the aggregator, with the job's key
        self._round = 0        # next round of the epoch (unwrapped)
        self._epoch = 0        # 0 until joined
        self._all = (1 << world) - 1
        self._bias = quant.bias(world, 32)
        self._bias16 = quant.bias(world, 16)  # 16-bit lanes (op SUM16)
        self._buf = buffers
        self._timer = RoundTimer(rto, max_rto, timeout, self.GAP)
        self._cc = Window(window)  # the congestion window: rounds in flight, at most ``window``
        self._mod = Moderation()  # the loop's pauses behind a slow link (results taken in batches)
        self._acked = 0        # the last head this rank reported (unwrapped)
        self._records = RankRecords(rank, job, world, key)  # every record carries the job's key
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
        self.last_run: RunState | None = None  # the last run's state (a failed call's completed rounds)
        enc.warm_up(elems)
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

    @property
    def next_round(self) -> int:
        """The epoch's next round (unwrapped): every round before it has been reserved."""
        return self._round

    def reserve(self, k: int) -> int:
        """The next ``k`` rounds of the epoch; returns the first."""
        base = self._round
        self._round += k
        return base

    # --- joining ----------------------------------------------------------------------------
    def join(self) -> int:
        """Join the job: returns once every rank of it has joined this run (the aggregator then
        hands out the run's epoch). Called by the first collective; calling it again is free."""
        return join_job(self)

    def _no_group_delivery(self) -> None:
        raise ProtocolError(
            f"rank {self.rank}: results of job {self.job} do not arrive by multicast here: all {int(self._gate[2])} "
            f"so far came only as answers to retransmissions and pulls, none as the aggregator's first delivery "
            f"to group {self.group}. This network carries no multicast: register the job with unicast delivery "
            f"(agg load/job add --delivery unicast, allreduce/demo/bench --delivery unicast, or a service started "
            f"with --no-multicast)")

    def _check_silence(self, heard_at: float, doing: str) -> None:
        """``silence`` s unanswered while asking (``heard_at`` skips unrun time: :func:`unheard`)."""
        if self.silence is not None and time.monotonic() - heard_at > self.silence:
            raise SilentAggregator(
                f"rank {self.rank}: {doing} job {self.job}: the aggregator {self.aggregator}:{self.port} has not "
                f"answered anything for {self.silence:g}s while asked again and again: it is gone (unloaded, its "
                f"host down, or the network between cut)")

    # --- the stream of rounds ---------------------------------------------------------------
    #: records encoded ahead of the sends at a time: the kernel copies them while they are in cache
    ENCODE_CHUNK = 256

    def send_buffer(self, records: int) -> np.ndarray:
        """The buffer ``encode`` writes this rank's records into: the send ring (at most
        ``send_ring`` records, whatever the tensor's size)."""
        return self._send[:min(records, self.send_ring) * self._rec]

    def run(self, base: int, r: Rounds) -> None:
        """Run rounds base .. base + len(r.blocks) - 1 through the slot pool (:class:`Rounds`
        says what each is): send this rank's records inside the window, collect every round's
        result, recover losses; return when every round has its result."""
        x = self.last_run = RunState(self, base, r)
        st, K = self.last, x.K
        self._mod.start()
        while x.ndone < K:
            st.loops += 1
            self._fill_window(x)
            foreign0 = self._t.foreign
            n, new, event = pump.pump_recv(*x.rx_args, self._rec, self.elems, self.job, self._epoch, self.rank, base,
                                           K, self.slots, r.blocks, r.shifts, x.bias, r.kind, x.out_i, x.out_f32,
                                           x.out_f64, x.done, x.status, x.newly, *x.stash, self._gate)
            now = time.monotonic()
            x.heard_at = unheard(x.heard_at, x.wake_by, now)
            x.wake_by = now
            if n > self._t.foreign - foreign0:
                x.heard_at = now
                if self._gate[2] >= NO_GROUP_AFTER and not self._gate[1] and self.delivery == "multicast":
                    self._no_group_delivery()
            if event:
                self._on_event(event, x)
            if x.probing:
                self._on_probe_answers(x, now)
            if new:
                self._on_results(x, new, now)
                x.wake_by = self._mod.rest(new, x.hi - x.head, now)  # behind a slow link: a short pause
                continue
            # No progress (datagrams that brought nothing new do not count): the timers decide.
            if self._on_idle(x, now) or n:
                continue
            x.wake_by = now + (wait := self._timer.wait(x.head, x.hi, x.sent_at, now))
            self._t.wait(wait)
        st.rounds += K

    def _fill_window(self, x: RunState) -> None:
        """Send this rank's records of the rounds that may enter the window: S rounds past the
        head at most, never a round whose set still holds a result some rank has not acknowledged
        (the aggregator would drop it as early), and no more rounds without a result than the
        congestion window holds (counted only while it is below its cap: at the cap the stream
        runs as with a fixed window of S)."""
        r, cap, cc = x.r, x.cap, self._cc
        edge = min(x.K, x.head + self.window, int(self._gate[0]) + 2 * self.slots - x.base)
        ready = x.K if r.ready is None else r.ready(x.done, x.head)  # nothing is encoded, or sent, beyond it
        edge = min(edge, ready)
        lim = edge if cc.full else min(edge, x.hi + cc.room(x.hi - x.head - int(np.count_nonzero(x.done[x.head:x.hi]))))
        cc.limited = lim < edge
        if x.hi >= lim:
            return
        j_end = int(np.searchsorted(r.mine, lim)) if not x.dense else lim
        if j_end > x.j_sent:
            while x.j_enc < j_end:  # chunks that never cross the ring's end
                j1 = min(len(r.mine) if ready == x.K else int(np.searchsorted(r.mine, ready)),
                         x.j_enc + self.ENCODE_CHUNK, (x.j_enc // cap + 1) * cap)
                r.encode(x.j_enc, j1, x.j_enc % cap)
                x.j_enc = j1
            rot = x.segments is not None and x.j_sent == 0 and j_end == x.K <= cap  # the whole run at once
            first = x.segments[self.rank] if rot else x.j_sent
            for j0, j1 in ((first, j_end), (x.j_sent, first)):  # rotated: then the wrap; else one span
                for a, c in ring_spans(j0, j1, cap):
                    x.ack_col[a:a + c] = (x.base + x.head) & 0xFFFFFFFF
                    self._t.send_records(r.send, a, c, x.dest)
            self.last.packets_sent += j_end - x.j_sent
            self._acked = max(self._acked, x.base + x.head)
            x.j_sent = j_end
        x.sent_at[x.hi:lim] = x.sent0[x.hi:lim] = time.monotonic()
        x.hi = lim

    def _on_event(self, event: int, x: RunState) -> None:
        if event == pump.EV_STALE_EPOCH:
            raise AggregatorReset(
                f"rank {self.rank}: the aggregator no longer runs epoch {self._epoch} of job {self.job}: "
                f"another run of the job has started (a rank joined again, e.g. a restarted worker) or "
                f"the aggregator was reloaded; this run's results are gone")
        if event == pump.EV_MISMATCH:
            # the ranks' rounds are out of step from here on: every later call fails with this
            i = int(np.flatnonzero(x.status[:x.K] == pump.MISMATCHED)[0])
            self.abort(MismatchError(
                f"rank {self.rank}: the ranks disagree on the round of block {int(x.r.blocks[i])} of this call: "
                f"the aggregator refused a contribution that differs from the round's first (its size, scale, "
                f"lanes or op): the ranks were not given tensors of the same shape and dtype; this job's "
                f"rounds are out of step, build new communicators"))
            self._check_abort()

    def _on_results(self, x: RunState, new: int, now: float) -> None:
        """``new`` rounds got their results: move the head, acknowledge, retransmit early what
        a gap of GAP results says is lost."""
        x.ndone += new
        last = int(x.newly[new - 1])
        self._timer.on_results(last, x.hi, x.sent_at, now)
        x.head = pump.advance(x.done, x.head, x.K)
        if ack_due(x.base + x.head, self._acked, self.slots, x.dense):
            self._t.send_one(self._records.ack(self._epoch, x.base + x.head), x.dest)
            self._acked = x.base + x.head
            self.last.acks += 1
        # the window's round trip counts from the first send (a resent round's is long, never short)
        self._cc.on_results(new, now - x.sent0[last] if last < x.hi else None)
        if x.head < x.hi:
            self._probe(x, self._timer.fast_retransmit(x.done, x.head, x.hi, x.sent_at, now, *x.contributors,
                                                       segments=x.segments))

    def _on_idle(self, x: RunState, now: float) -> bool:
        """No progress: fail on timeout or silence, ask for the gate, probe what timed out.
        True if it sent something (look again at once)."""
        self._check_abort()
        self._check_silence(x.heard_at, "running")
        timer = self._timer
        if timer.expired(now):
            self._fail(x.hi, x.done, x.status, x.r.masks)
        if timer.ask_gate(x.head, x.hi, x.K, now):
            # everything sent has its result and the gate holds the window: ask for the gate
            # (and tell this rank's head), instead of waiting for a result that cannot come
            self._t.send_one(self._records.ack(self._epoch, x.base + x.head, ask=True), x.dest)
            self._acked = max(self._acked, x.base + x.head)
            self.last.acks += 1
        late = timer.timed_out(x.done, x.head, x.hi, x.sent_at, now, limit=self._cc.size)
        if len(late):
            self._probe(x, late)
            self.last.timeouts += 1
            return True
        return False

    def _lost(self, x: RunState, rounds: np.ndarray) -> np.ndarray:
        """``rounds`` (ascending) are lost: the congestion window answers; returns them."""
        if len(rounds) and self._cc.on_loss(x.base + int(rounds[-1]), x.base + x.hi):
            self.last.window_cuts += 1
        return rounds

    def _probe(self, x: RunState, rounds: np.ndarray) -> None:
        """Ask the aggregator what ``rounds`` lack (PROBEs, one header each); their answers decide
        who resends (:meth:`_on_probe_answers`)."""
        if not len(rounds):
            return
        x.status[rounds] = -1
        x.probing += int(len(rounds) - np.count_nonzero(x.probed[rounds]))
        x.probed[rounds] = 1
        buf = self._buf.get("probe", len(rounds) * proto.HDR_LEN, np.uint8)
        enc.encode_pulls(buf, proto.HDR_LEN, self._records.pull(self._epoch, x.base + x.head), rounds, x.base,
                         self.slots, x.r.masks)
        self._t.send_records(buf, 0, len(rounds), x.dest, size=proto.HDR_LEN)
        self.last.probes += len(rounds)
        self.last.packets_sent += len(rounds)

    def _on_probe_answers(self, x: RunState, now: float) -> None:
        """Probed rounds whose answer came: resend what the aggregator lacks of this rank (or a
        result it holds that never came here); a round still open was a loss, which the
        congestion window answers."""
        rounds = np.flatnonzero(x.probed[:x.hi])
        answered, resend, lost = probe_answers(rounds, x.done, x.status, x.r.masks, self.rank, pump.DONE)
        if not len(answered):
            return
        x.probed[answered] = 0
        x.probing -= len(answered)
        if lost:
            self._lost(x, answered[x.done[answered] == 0])
        x.sent_at[resend] = now
        self._resend(x, resend)

    def _resend(self, x: RunState, rounds: np.ndarray) -> None:
        """Retransmit this rank's records of ``rounds`` (RETX: the aggregator answers from the
        Tx spot if the round is complete) and pull the others' results."""
        if not len(rounds):
            return
        st, rec = self.last, self._rec
        pos, cap, flags_col, ack_col, send = x.pos, x.cap, x.flags_col, x.ack_col, x.r.send
        head_abs, base, masks, dest = x.base + x.head, x.base, x.r.masks, x.dest
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
            enc.encode_pulls(buf, rec, self._records.pull(self._epoch, head_abs), others, base, self.slots, masks)
            self._t.send_records(buf, 0, len(others), dest)
            st.pulls += len(others)
            st.packets_sent += len(others)

    def _fail(self, hi, done, status, masks) -> None:
        pending = np.flatnonzero(done[:hi] == 0)
        heard = status[pending]
        where = f"aggregator {self.aggregator}:{self.port}"
        if (heard >= 0).any():
            ranks, behind = missing_ranks(self.world, masks[pending], heard)
            also = (f" (later rounds also lack rank(s) {', '.join(map(str, behind))}: "
                    f"behind, their windows held by those)") if behind else ""
            raise TimeoutError_(
                f"rank {self.rank}: allreduce timed out after {self.timeout:g}s without progress; "
                f"{len(pending)} round(s) incomplete at the {where}: no contribution from rank(s) "
                f"{', '.join(map(str, ranks)) or '(none: results lost)'}{also}")
        raise TimeoutError_(
            f"rank {self.rank}: allreduce timed out after {self.timeout:g}s: the {where} did not answer "
            f"({len(pending)} round(s) outstanding); is the aggregator loaded and the job configured "
            f"for {self.world} workers?")
