"""When a rank resends, pulls, acknowledges and gives up: the decisions of loss recovery, kept
apart from the sockets so they can be tested on their own.

A stream is K rounds; ``done[i]`` says whether round i has its result, ``sent_at[i]`` when it
entered the window (or was last resent). The window is rounds [head, hi): head is the lowest
round without a result, hi the first round not yet sent. Time is whatever clock the caller uses
(seconds, monotonic); every method takes ``now``.

- The retransmission timeout follows the smoothed time from send to result, as TCP's does:
  rto = max(rto_min, 3 * srtt), doubled after each timeout up to max(rto_max, that base).
- Rounds complete in order on FIFO paths (a round completes when its last contributor's
  record arrives, and every rank sends in order; in a rotated run, in order within each
  segment): a round left behind by ``gap`` rounds that
  completed after it (in a sparse job: ``gap`` of each of its contributors') has lost a packet
  and is probed at once (fast retransmit), once it is older than ``REORDER_RTTS`` smoothed round
  trips (a probed round gets a round trip to come back before it is probed again). Waiting for
  the whole timeout instead stalled the window behind the lost round once the slot rule let no
  later round in. A PROBE is a header-only pull;
  its answer names the round's contributors, and only a rank whose record is missing resends it
  (:func:`probe_answers`): behind a shared link, every rank resending its own record for each
  lost one multiplied the loss by the number of ranks. A round that times out is probed too.
- When everything sent has its result but the window cannot move (the job's gate holds it), the
  rank asks the aggregator for the gate, at most once per srtt.
- After ``timeout`` seconds without a new result the call fails; :func:`missing_ranks` names the
  ranks the aggregator has not heard from.
"""
from __future__ import annotations

import numpy as np

from nicoffload.datapath import kernels

#: the shortest wait for datagrams between decisions (seconds)
MAX_WAIT = 0.05
#: the shortest interval between two requests for the gate (seconds)
MIN_ASK_INTERVAL = 0.001
#: a round overtaken by ``gap`` later results is probed once it is this many srtt old
REORDER_RTTS = 1.5
#: ... where ``gap`` is a quarter of the window's span, at least MIN_GAP (as TCP's three
#: duplicate ACKs), at most the timer's ``gap``
MIN_GAP = 3


class RoundTimer:
    """Loss-recovery decisions for one rank. ``srtt`` carries over from stream to stream."""

    def __init__(self, rto_min: float, rto_max: float, timeout: float, gap: int = 128,
                 srtt: float | None = None):
        self.rto_min, self.rto_max, self.timeout, self.gap = rto_min, rto_max, timeout, gap
        self.srtt = rto_min if srtt is None else srtt
        self.start(0.0)

    def start(self, now: float) -> None:
        """A new stream begins: the timeout restarts from the current srtt."""
        self.base_rto = self.rto = max(self.rto_min, 3 * self.srtt)
        self.last_progress = now
        self.asked = float("-inf")

    # --- results ----------------------------------------------------------------------------
    def on_results(self, last_round: int, hi: int, sent_at: np.ndarray, now: float) -> None:
        """Results arrived, ``last_round`` the latest of them. Only a round already in the window
        has a send time: a round this rank does not contribute to can complete before it gets
        there, and must not feed the estimate."""
        self.last_progress = now
        if last_round < hi:
            self.srtt = 0.875 * self.srtt + 0.125 * (now - float(sent_at[last_round]))
        self.base_rto = self.rto = max(self.rto_min, 3 * self.srtt)

    def fast_retransmit(self, done: np.ndarray, head: int, hi: int, sent_at: np.ndarray, now: float,
                        masks: np.ndarray | None = None, flags: np.ndarray | None = None,
                        segments: list[int] | None = None) -> np.ndarray:
        """Rounds in [head, hi) without a result that ``gap`` later rounds have overtaken and that
        are older than REORDER_RTTS smoothed round trips; their send time is reset to ``now``.
        Where the rounds' contributors differ (``masks``, a sparse job), a round counts as
        overtaken only once each of its contributors has ``gap`` later results
        (kernels.overtaken, into ``flags``, one byte per round): a round that waits for a slower
        rank is not lost. A rotated run (``segments``: calls.rotation_starts) completes each
        segment in order but the segments side by side: a round is overtaken by later results of
        its own segment only."""
        if segments is not None:
            parts = [self.fast_retransmit(done, max(head, a), min(hi, b), sent_at, now, masks, flags)
                     for a, b in zip(segments, segments[1:]) if max(head, a) < min(hi, b)]
            return np.concatenate(parts) if parts else np.empty(0, np.int64)
        later = np.flatnonzero(done[head:hi])
        if not len(later):
            return later
        top = int(later[-1]) + head
        gap = min(self.gap, max(MIN_GAP, (hi - head) // 4))  # a small window never holds `gap` results
        lost = np.flatnonzero(done[head:max(head, top - gap)] == 0) + head
        if masks is not None and len(lost):
            kernels.overtaken(done, masks, head, hi, gap, flags)
            lost = lost[flags[lost] != 0]
        lost = lost[now - sent_at[lost] > REORDER_RTTS * self.srtt]
        sent_at[lost] = now
        return lost

    # --- no progress ------------------------------------------------------------------------
    def expired(self, now: float) -> bool:
        """True once ``timeout`` seconds have passed without a new result: the call fails."""
        return now - self.last_progress > self.timeout

    def timed_out(self, done: np.ndarray, head: int, hi: int, sent_at: np.ndarray, now: float,
                  limit: int | None = None) -> np.ndarray:
        """Rounds to probe now: those in the window without a result, sent at least one timeout
        ago, once the oldest of them has waited that long; the oldest ``limit`` of them at most
        (the congestion window). Each call that returns rounds backs the timeout off (doubling,
        capped); their send time is reset to ``now``."""
        if head >= hi or now - sent_at[head] < self.rto:
            return np.empty(0, np.int64)
        pending = np.flatnonzero(done[head:hi] == 0) + head
        pending = pending[now - sent_at[pending] >= self.rto][:limit]
        sent_at[pending] = now
        self.rto = min(self.rto * 2, max(self.rto_max, self.base_rto))
        return pending

    def ask_gate(self, head: int, hi: int, K: int, now: float) -> bool:
        """Everything sent has its result, rounds remain, and the window does not move: ask the
        aggregator for the job's gate (not more often than once per srtt)."""
        if head >= hi and hi < K and now - self.asked >= max(MIN_ASK_INTERVAL, self.srtt):
            self.asked = now
            return True
        return False

    def wait(self, head: int, hi: int, sent_at: np.ndarray, now: float) -> float:
        """How long to wait for datagrams before deciding again."""
        if head < hi:
            return max(0.0, min(self.rto - (now - float(sent_at[head])), MAX_WAIT))
        return MAX_WAIT


def probe_answers(rounds: np.ndarray, done: np.ndarray, status: np.ndarray, masks: np.ndarray, rank: int,
                  done_mark: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """What the answers to PROBEs of ``rounds`` say (``status[i]``: -1 until an answer came, the
    contributors of a waiting round, or ``done_mark``), as ``(answered, resend, lost)``: the rounds
    with an answer (or a result) by now; those to send again in full: this rank's record is not
    among the contributors, or the round is complete and its result never came here (a full pull
    fetches it); and whether some record or result of them was lost (the round is still open), which
    the congestion window answers. A rank whose record the aggregator holds sends nothing: one lost
    record costs one resend, not one per rank."""
    st = status[rounds]
    keep = (st != -1) | (done[rounds] != 0)
    a, st = rounds[keep], st[keep]
    open_ = done[a] == 0
    bit = 1 << rank
    waiting = open_ & (st >= 0)
    missing = waiting & ((masks[a] & bit) != 0) & ((st & bit) == 0)
    again = open_ & (st == done_mark)
    return a, a[missing | again], bool(np.any(waiting | again))


def ack_due(head_abs: int, acked_abs: int, window: int, dense: bool) -> bool:
    """A rank that contributes to every round reports its head in every record; one that skips
    rounds (sparse) sends an ACK once its head has moved half a window past the last report, so
    the aggregator can reuse sets without waiting for it."""
    return not dense and head_abs - acked_abs >= max(1, window // 2)


def missing_ranks(world: int, masks: np.ndarray, heard: np.ndarray) -> tuple[list[int], list[int]]:
    """Ranks that incomplete rounds expect (``masks``) and the aggregator has not heard from
    (``heard``: its contributor bitmap of each round, from a STATUS answer; -1 unknown), as
    ``(blocking, behind)``: those missing from the oldest such round (ranks in ascending round
    order), which hold every later round up; and those missing only from later rounds, which are
    usually alive and waiting with a full window (each rank's window is its own size)."""
    known = heard >= 0
    first = later = 0
    for m, b in zip(masks[known], heard[known]):
        gap = int(m) & ~int(b)
        if gap and not first:
            first = gap
        later |= gap
    later &= ~first
    return ([r for r in range(world) if first >> r & 1], [r for r in range(world) if later >> r & 1])


#: a loop that wakes this much later than it meant to was not running (descheduled, or another
#: thread of the process held the GIL): that time is not the aggregator's silence
LATE_S = 0.1


def unheard(heard_at: float, wake_by: float, now: float) -> float:
    """``heard_at`` moved forward by the time the loop woke late (over LATE_S past ``wake_by``),
    so that a rank starved of its CPU never takes that for a silent aggregator and fails over."""
    late = now - wake_by
    return heard_at + late if late > LATE_S else heard_at
