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
FLOOR = 2
#: the first window of a stream (rounds): slow start from here up to the cap, or the first loss
INITIAL = 64
#: a loss is congestion when the recent round trips stand this far (seconds) above their floor ...
QUEUE_MIN = 0.002
#: ... and at least this many times the floor above it
QUEUE_FRAC = 1.0
#: the recent round trip: the shortest of this many batches of results (one sample each)
RECENT = 8


class Window:
    """One rank's congestion window over rounds (per aggregator: each stream has its own)."""

    def __init__(self, cap: int, initial: int = INITIAL, floor: int = FLOOR, increase: float = INCREASE,
                 decrease: float = DECREASE):
        if cap < 1:
            raise ValueError(f"a window's cap must be at least 1, not {cap}")
        if not 0.0 < decrease < 1.0 or increase <= 0:
            raise ValueError(f"need 0 < decrease < 1 and increase > 0, not {decrease}, {increase}")
        self.cap, self.increase, self.decrease = cap, increase, decrease
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

    def on_results(self, n: int, rtt: float | None = None) -> None:
        """``n`` rounds got their results; ``rtt``: the round trip of the latest of them, if it
        was measured (seconds)."""
        if rtt is not None:
            self.base_rtt = min(self.base_rtt, rtt)
            self._recent[self._k % RECENT] = rtt
            self._k += 1
        if not self.limited or n <= 0:
            return
        if self.cwnd < self.ssthresh:
            self.cwnd = min(self.cwnd + n, max(self.ssthresh, self.cwnd + 1.0))
        else:
            self.cwnd += self.increase * n / self.cwnd
        self.cwnd = min(self.cwnd, float(self.cap))

    def queued(self) -> bool:
        """Whether the recent round trips say a queue has built up on the way (True too while
        there is no measurement to judge by)."""
        recent = min(self._recent)
        if recent == float("inf"):
            return True
        return recent - self.base_rtt >= max(QUEUE_MIN, QUEUE_FRAC * self.base_rtt)

    def on_loss(self, latest_lost: int, sent_edge: int) -> bool:
        """Rounds were found lost, the latest of them ``latest_lost`` (absolute); ``sent_edge``
        is the first round not yet sent (absolute). Cuts the window unless this loss belongs to
        the episode already answered or no queue stands behind it; True if it cut. A recovery
        point beyond ``sent_edge`` means the numbering started again (a new epoch): the loss is
        a new episode."""
        if latest_lost < self.recover <= sent_edge:
            return False
        self.recover = sent_edge
        if not self.queued():
            self.random_losses += 1
            return False
        self.ssthresh = max(float(self.floor), self.cwnd * self.decrease)
        self.cwnd = self.ssthresh
        self.cuts += 1
        return True
