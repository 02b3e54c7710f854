"""How many rounds one rank keeps in flight: the round stream's congestion control, kept apart
from the sockets so its decisions can be tested on their own.

The window counts rounds **in flight**: sent by this rank (or waited for) and still without a
result. It is Reno's AIMD, clocked by the aggregator's results:

- below ``ssthresh`` (slow start) every result opens the window by one round, so it doubles per
  round trip; above it (congestion avoidance) every result opens it by ``increase / cwnd``,
  ``increase`` rounds per round trip;
- a loss (a round that later results overtook, or a timeout) cuts the window to ``decrease``
  times itself, once per loss episode: a loss of a round sent before the last cut belongs to
  the episode already answered (NewReno's recovery point, in rounds); but only a loss behind a
  queue (TCP Veno's test): the shortest round trip of the last few batches of results stands
  at least ``QUEUE_MIN`` and its own floor above the floor of the stream's life. A full
  bottleneck queue delays every round (a shaper's queue holds 20 ms on the testbed), while a
  frame lost at random (a fault, a bad link) leaves the round trips as they were and the
  window where it was: random loss is what retransmission is for, not a reason to slow down;
- a queue that stands ``MARK_DELAY`` above the round trip's floor (and at least its floor again)
  cuts the window as a loss does, once per episode, just before the queue overflows: ECN's
  early signal, read from the delay. Behind one link that N ranks share, a loss costs N records
  (each rank resends its own, as none can tell whose was dropped), and the ranks find it only a
  gap of results later: at N=16 behind a link of R those resends had been 11% of the packets;
- the window grows only while it is what limits the sends (a call smaller than the window, or a
  stream held by the job's gate, does not inflate it);
- it never exceeds ``cap`` (the stream's own limit: round i waits for the result of round
  i - S, so at most S rounds are open) and never falls below ``floor``.

The state lives as long as the stream (the communicator): the next call starts where the last
one left off, as ``srtt`` does. Every method is O(1) and runs once per batch of results, never
per record.
"""
from __future__ import annotations

#: rounds the window opens by per round trip in congestion avoidance
INCREASE = 1.0
#: what a loss episode leaves of the window
DECREASE = 0.5
#: the smallest window (rounds)
FLOOR = 8
#: the first window of a stream (rounds): slow start from here up to the cap, or the first loss
INITIAL = 64
#: a loss is congestion when the recent round trips stand this far (seconds) above their floor ...
QUEUE_MIN = 0.002
#: ... and at least this many times the floor above it
QUEUE_FRAC = 1.0
#: the recent round trip: the shortest of this many batches of results (one sample each)
RECENT = 8
#: a queue standing this long (seconds) is congestion before a loss (a shaper's holds 20 ms)
MARK_DELAY = 0.016
#: ... in the latest round trip and in the shortest of this many latest batches' samples
MARK_SAMPLES = 3


class Window:
    """One rank's congestion window over rounds (per aggregator: each stream has its own).
    ``mark``: how long a standing queue (seconds) cuts it without a loss; None: only losses."""

    def __init__(self, cap: int, initial: int = INITIAL, floor: int = FLOOR, increase: float = INCREASE,
                 decrease: float = DECREASE, mark: float | None = MARK_DELAY):
        if cap < 1:
            raise ValueError(f"a window's cap must be at least 1, not {cap}")
        if not 0.0 < decrease < 1.0 or increase <= 0:
            raise ValueError(f"need 0 < decrease < 1 and increase > 0, not {decrease}, {increase}")
        self.cap, self.increase, self.decrease, self.mark = cap, increase, decrease, mark
        self.floor = max(1, min(floor, cap))
        self.cwnd = float(min(max(initial, self.floor), cap))
        self.ssthresh = float(cap)
        self.recover = 0        # losses of rounds below this (absolute) were answered by the last cut
        self.cuts = 0           # loss episodes answered over the stream's life
        self.limited = False    # whether the window held back the last fill (only then does it grow)
        self.base_rtt = float("inf")  # the shortest round trip over the stream's life (seconds)
        self._recent = [float("inf")] * RECENT  # the last RECENT samples, a ring
        self._k = 0
        self.random_losses = 0  # loss episodes without a queue: the window stayed
        self.marks = 0          # episodes answered for a standing queue, without a loss

    @property
    def size(self) -> int:
        """Rounds that may be in flight now."""
        return int(self.cwnd)

    @property
    def full(self) -> bool:
        """The window is at its cap: the stream behaves as with a fixed window of ``cap``."""
        return self.cwnd >= self.cap

    def room(self, inflight: int) -> int:
        """Rounds that may enter the window now, with ``inflight`` rounds outstanding."""
        return max(0, int(self.cwnd) - inflight)

    def on_results(self, n: int, rtt: float | None = None, latest: int | None = None,
                   sent_edge: int | None = None) -> bool:
        """``n`` rounds got their results; ``rtt``: the round trip of the latest of them, if it
        was measured (seconds), ``latest`` that round (absolute) and ``sent_edge`` the first round
        not yet sent: with both, a standing queue cuts the window (:meth:`on_loss`'s episodes).
        True if it cut."""
        if rtt is not None:
            self.base_rtt = min(self.base_rtt, rtt)
            self._recent[self._k % RECENT] = rtt
            self._k += 1
            if latest is not None and sent_edge is not None and self._standing(rtt):
                cut = self._cut(latest, sent_edge)
                self.marks += cut
                return cut  # a standing queue never opens the window
        if not self.limited or n <= 0:
            return False
        if self.cwnd < self.ssthresh:
            self.cwnd = min(self.cwnd + n, max(self.ssthresh, self.cwnd + 1.0))
        else:
            self.cwnd += self.increase * n / self.cwnd
        self.cwnd = min(self.cwnd, float(self.cap))
        return False

    def queued(self) -> bool:
        """Whether the recent round trips say a queue has built up on the way (True too while
        there is no measurement to judge by)."""
        recent = min(self._recent)
        if recent == float("inf"):
            return True
        return recent - self.base_rtt >= max(QUEUE_MIN, QUEUE_FRAC * self.base_rtt)

    def _standing(self, rtt: float) -> bool:
        """This round trip and the recent ones stand ``mark`` above the floor (and at least the
        floor again): a queue that has stood for a while, not one late batch."""
        if not self.mark:
            return False
        over = max(self.mark, QUEUE_FRAC * self.base_rtt)
        k = self._k
        return rtt - self.base_rtt >= over and \
            min(self._recent[(k - 1 - j) % RECENT] for j in range(MARK_SAMPLES)) - self.base_rtt >= over

    def on_loss(self, latest_lost: int, sent_edge: int) -> bool:
        """Rounds were found lost, the latest of them ``latest_lost`` (absolute); ``sent_edge``
        is the first round not yet sent (absolute). Cuts the window unless this loss belongs to
        the episode already answered or no queue stands behind it; True if it cut. A recovery
        point beyond ``sent_edge`` means the numbering started again (a new epoch): the loss is
        a new episode."""
        if latest_lost < self.recover <= sent_edge:
            return False
        if not self.queued():
            self.recover = sent_edge
            self.random_losses += 1
            return False
        return self._cut(latest_lost, sent_edge)

    def _cut(self, latest: int, sent_edge: int) -> bool:
        """One cut per episode: none for a round sent before the last cut (see :meth:`on_loss`)."""
        if latest < self.recover <= sent_edge:
            return False
        self.recover = sent_edge
        self.ssthresh = max(float(self.floor), self.cwnd * self.decrease)
        self.cwnd = self.ssthresh
        self.cuts += 1
        return True
