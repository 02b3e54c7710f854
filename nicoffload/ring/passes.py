"""One ring pass as a rank's host drives it (mixed into
:class:`nicoffload.ring.RingCommunicator`, uses its buffers, transport and state words):
stage this rank's records slice by slice, send its own chunk within the send window, wait for
the program's wake-up, take over what the program parks in the socket (or, in user space,
everything), replay what an earlier call kept, and ask again for records lost on the way.
Deciding when to ask, and what a stalled ring is waiting for, is :mod:`nicoffload.ring.diag`'s.
"""
from __future__ import annotations

import os
import select
import sys
import time

import numpy as np

from nicoffload.datapath.transport import MAX_MSGS
from nicoffload.ring import hop
from nicoffload.ring import kernels as rk
from nicoffload.ring.layout import (
    ST_CALL,
    ST_EXPECTED,
    ST_HOST_OWN,
    ST_HOST_STORED,
    ST_OWN_STORED,
    ST_OWN_WAKE,
    ST_STORED,
    STATS,
    chunk_bounds,
    nack_target,
    origin_masks,
    origins,
    staging_order,
)

#: records of its own chunk a rank has on the way at most (its send window)
WINDOW = 256
#: a rank stages its records in this many rounds (a slice of every chunk each, at least SLICE
#: records of each) and sends its own slice after each round: a quarter of the staging goes
#: before the first send, and the successor has a quarter's lead to stage what arrives
ROUNDS = 4
SLICE = 64
_NO_WAKE = 0xFFFFFFFF
_TRACE = bool(os.environ.get("NICOFFLOAD_RING_TRACE"))


def _trace(rank: int, msg: str) -> None:
    print(f"{time.monotonic():.6f} ring rank {rank}: {msg}", file=sys.stderr, flush=True)


class CallLayout:
    """The chunks of a call of K records: record indices, origins and their masks, this rank's
    own chunk, and the slices it stages them in: slice j of every chunk (in the order their
    reduces reach the rank, its own last) before slice j + 1 of any."""

    def __init__(self, K: int, world: int, rank: int):
        b = chunk_bounds(K, world)
        self.idx = np.arange(K, dtype=np.int64)
        self.origins = origins(K, world)
        self.masks = origin_masks(K, world)
        self.own = (int(b[rank]), int(b[rank + 1]))
        order = staging_order(K, world, rank)
        longest = max((hi - lo for lo, hi in order), default=0)
        step = max(SLICE, -(-longest // ROUNDS))
        self.slices = [(lo + j, min(hi, lo + j + step)) for j in range(0, longest, step)
                       for lo, hi in order if lo + j < hi]


class RingPasses:
    """The pass loop of :class:`~nicoffload.ring.RingCommunicator` and the host's share of
    its records."""

    def _layout(self, K: int) -> "CallLayout":
        """A call of K records as this rank sees it (cached: calls repeat their sizes)."""
        lay = self._layouts.get(K)
        if lay is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            lay = self._layouts[K] = CallLayout(K, self.world, self.rank)
        return lay

    def _next_call(self) -> int:
        self._call = (self._call + 1) & 0xFFFFFFFF or 1
        return self._call

    def _pass(self, K: int, stage) -> None:
        """One ring pass of K records: stage this rank's records (``stage(lo, hi, template)``),
        send its own chunk within the window, wait until every record's final is stored here,
        taking over what the program parks and asking again for what got lost."""
        c, lay = self._enter_call(K)
        own_lo, own_hi = lay.own
        nxt = (self.peers[(self.rank + 1) % self.world], self.port)
        slices, si, staged = lay.slices, 0, own_lo  # own records staged: [own_lo, staged)
        sent = own_lo
        deadline_idle = time.monotonic() + self.timeout
        rto = self.rto
        last_progress = self._stored()
        retry_at = time.monotonic() + rto
        poll = [self._t.sock, self._wake_r] + ([self._events] if self._events is not None else [])
        t1 = time.perf_counter()
        while True:
            # Stage one slice of every chunk (in the order their reduces arrive, this rank's own
            # last) at a time, and send the own part as soon as it is staged: the first records
            # go out long before the whole tensor is staged.
            staging = si < len(slices)
            if staging:
                lo, hi = slices[si]
                si += 1
                t1 = self._stage_slice(lo, hi, c, K, stage, si == len(slices))
                if own_lo <= lo < own_hi:
                    staged = hi
            if sent < staged:
                sent, crossed = self._send_own(sent, staged, own_lo, own_hi, nxt)
                if crossed:
                    continue  # the wake-up may have been crossed meanwhile: look again
            if staging:
                continue  # the host takes over parked records only once its own are all staged
            done = self._stored()
            if done >= K and rk.count_tagged(self._result, self._rec, K, c) == K:
                if _TRACE:
                    _trace(self.rank, f"done call {c}: stored {self._state[ST_STORED]} + host "
                                      f"{self._state[ST_HOST_STORED]}")
                break
            now = time.monotonic()
            if done != last_progress:
                last_progress = done
                deadline_idle = now + self.timeout
                rto = self.rto
                retry_at = now + rto
            elif now >= retry_at:
                self._stalled(c, K, now >= deadline_idle)
                rto = min(rto * 2, self.max_rto)
                retry_at = now + rto
            self._wait(poll, min(retry_at, deadline_idle), c, K)
        self.last.wait_s += time.perf_counter() - t1

    def _enter_call(self, K: int):
        """Enter the next call: the program stores this call's finals from now on, and adds into a
        record once its tag says it is staged. Returns (the call, the pass's layout)."""
        st = self._state
        c = self._next_call()
        self.last.passes += 1
        self.last.records += K
        st[ST_EXPECTED] = K
        st[ST_STORED] = st[ST_HOST_STORED] = st[ST_OWN_STORED] = st[ST_HOST_OWN] = 0
        st[ST_OWN_WAKE] = _NO_WAKE
        st[ST_CALL] = c
        if _TRACE:
            _trace(self.rank, f"enter call {c}, {K} records, stash {self._stash_n}")
        lay = self._layout(K)
        self._origin = lay.origins
        self._io[:] = 0
        return c, lay

    def _stage_slice(self, lo: int, hi: int, c: int, K: int, stage, last: bool) -> float:
        """Stage records lo .. hi-1 (untagged while written, then tagged with the call); after the
        last slice, the records of this call kept by the previous one. Returns when it ended."""
        t0 = time.perf_counter()
        rk.set_tags(self._local, self._rec, lo, hi, 0)
        stage(lo, hi, self._tmpl)
        rk.set_tags(self._local, self._rec, lo, hi, c)
        t1 = time.perf_counter()
        self.last.stage_s += t1 - t0
        if last and self._stash_n:
            # records of this call that arrived before it (kept by the previous call)
            nst, self._stash_n = self._stash_n, 0
            self._run_replay(nst, c, K)
        return t1

    def _send_own(self, sent: int, staged: int, own_lo: int, own_hi: int, nxt) -> tuple[int, bool]:
        """Send this rank's own staged records within the window (at most ``window`` without their
        final back). Returns (records sent so far, whether the wake-up word was set: the program
        may have crossed it meanwhile)."""
        st = self._state
        acked = int(st[ST_OWN_STORED]) + int(st[ST_HOST_OWN])
        upto = min(staged, own_lo + acked + self.window)
        if upto <= sent:
            return sent, False
        self._t.send_records(self._local, sent, upto - sent, nxt)
        self.last.packets_sent += upto - sent
        if upto < own_hi:
            st[ST_OWN_WAKE] = max(acked + 1, upto - own_lo - self.window // 2)
            return upto, True
        st[ST_OWN_WAKE] = _NO_WAKE
        return upto, False

    def _stalled(self, c: int, K: int, idle_over: bool) -> None:
        """No progress for an RTO: fail ranks that disagree about the call, or the call when idle
        for the whole timeout; else ask again for the missing records once the ring stands still."""
        self._check_agreement(c)  # ranks that disagree about the call fail now, naming it
        if idle_over:
            self._fail(c, K)
        # Ask for missing records again only when the whole ring stands still: a node
        # that has not entered the call yet stalls it (asking would only add traffic), and
        # while other nodes still store finals the records are on their way (a slow
        # ring, e.g. queues of shaped links, is not a lossy one).
        behind, moving = self._ring_state(c, K)
        if not behind and not moving:
            self._nack_missing(c, K, self.window)
        if _TRACE:
            st = self._state
            _trace(self.rank, f"timeout in call {c}: stored {st[ST_STORED]} + host {st[ST_HOST_STORED]} "
                              f"of {K}, missing {rk.untagged(self._result, self._rec, 0, K, c, self._missing)}: "
                              f"{self._missing[:8]}, " + (f"behind: {behind}" if behind else
                                                           "moving" if moving else "nacked"))
        self.last.timeouts += 1

    def _wait(self, poll: list, until: float, c: int, K: int) -> None:
        """Sleep until a datagram (taken over), a wake-up from the program, an abort, or ``until``."""
        self._check_abort()  # RingCommunicator.abort: a peer is gone (the torch backend's liveness)
        ready, _, _ = select.select(poll, [], [], max(0.0, until - time.monotonic()))
        if self._events is not None and self._events in ready:
            self.last.wakeups += len(self._events.drain())
        if self._t.sock in ready:
            self._take_over(c, K)

    def _stored(self) -> int:
        st = self._state
        return int(st[ST_STORED]) + int(st[ST_HOST_STORED])

    # --- the host's share -------------------------------------------------------------------
    _stash_n = 0

    def _take_over(self, c: int, K: int) -> None:
        """Process what the socket holds (offload: records the program parked; user space:
        everything) and send what goes on to the next node."""
        t, io = self._t, self._io
        args = t.recv_args()
        while True:
            io[:] = 0
            io[hop.IO_STASH] = self._stash_n
            got = hop.recv_process(*args[:12], args[15], args[16], self._peer_addrs, self._rec, self.elems, self.rank,
                                  self.world, self.job, c, self.capacity, self._local, self._result, self._out,
                                  self._late, self._state, self._cnt, self._stash, self._stash_src, self._pongs,
                                  self._pings, io, MAX_MSGS * t.per_datagram)
            t.syscalls += 1
            self._stash_n = int(io[hop.IO_STASH])
            n = self._send_taken()
            if _TRACE:
                _trace(self.rank, f"took over: {got} datagrams, sent {n}, stash {self._stash_n}, counters "
                                  f"{ {k: int(v) for k, v in zip(STATS, self._cnt) if v} }")
            if io[hop.IO_PINGS]:
                self._answer_pings(c, K)
            if not got or got < MAX_MSGS and not n:
                return

    def _send_taken(self) -> int:
        """Send the records the host processed (io[IO_OUT] in ``out``, io[IO_LATE] in ``late``)."""
        nxt = (self.peers[(self.rank + 1) % self.world], self.port)
        total = 0
        for buf, i in ((self._out, hop.IO_OUT), (self._late, hop.IO_LATE)):
            n = int(self._io[i])
            if n:
                self._t.send_records(buf, 0, n, nxt)
                total += n
        self.last.packets_sent += total
        self.last.taken_over += total
        return total

    def _run_replay(self, nst: int, c: int, K: int) -> None:
        """Process the records the previous call kept for this one, as many at a time as ``out``
        holds, sending what goes on."""
        rec, io = self._rec, self._io
        stash = self._stash[:nst * rec].copy()
        src = self._stash_src[:nst].copy()
        step = len(self._out) // rec
        for j in range(0, nst, step):
            m = min(step, nst - j)
            io[:] = 0
            hop.replay(stash[j * rec:(j + m) * rec], src[j:j + m], m, self._peer_addrs, rec, self.elems, self.rank,
                      self.world, self.job, c, self.capacity, self._local, self._result, self._out, self._late,
                      self._state, self._cnt, self._pongs, self._pings, io)
            self._send_taken()

    def _nack_missing(self, c: int, K: int, limit: int) -> None:
        """Ask again for the first ``limit`` records whose final this node has not stored: its
        predecessor sends its stored final again, or (for the records this node adds last) the
        origin restarts the reduce."""
        m = rk.untagged(self._result, self._rec, 0, K, c, self._missing)
        if not m:
            return
        miss = self._missing[:min(m, limit)]
        org = self._origin[miss]
        cap = len(self._nacks) // self._rec
        for o in np.unique(org):
            peer, restart = nack_target(int(o), self.rank, self.world)
            which = miss[org == o]
            for j0 in range(0, len(which), cap):
                part = which[j0:j0 + cap]
                rk.build_nacks(self._local, self._rec, part, restart, self.rank, self._nacks)
                self._t.send_records(self._nacks, 0, len(part), (self.peers[peer], self.port))
                self.last.retransmissions += len(part)
                self.last.packets_sent += len(part)

