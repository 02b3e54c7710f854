"""When the round stream's loop pauses before it looks again: interrupt moderation, kept apart
from the sockets so its decisions can be tested on their own.

Behind a shaped link the aggregator's results arrive at the link's pace, a few at a time, and
a loop that wakes for every few of them spends its CPU on the wake-ups (at 1 Gbit/s with 3.4
KiB records, some 1,500 passes per 64 MiB call, 13 results each), which on a busy host is the
CPU the other ranks need. When a pass found fewer than ``BATCH`` results and the window holds
plenty more in flight, the loop pauses for about the time the rest of a batch takes to arrive,
never more than ``MAX_PAUSE`` nor a quarter of the time the rounds in flight take to drain: the
link stays busy, and the results are taken in batches. Where results come fast (unshaped
links, the CPU the limit) the pause would be shorter than ``MIN_PAUSE`` and there is none; a
call's first results (no rate yet) and its tail (too little in flight) never wait.
"""
from __future__ import annotations

import time

#: results a pass should find when the window holds at least ``4 * BATCH`` rounds in flight
BATCH = 32
#: the longest pause (seconds)
MAX_PAUSE = 0.0005
#: a pause shorter than this is not taken (a sleep costs about as much as it saves)
MIN_PAUSE = 0.0001
#: the weight of the latest batch in the rate's moving average
GAIN = 0.125


class Moderation:
    """One stream's estimate of the results' arrival rate, and the pauses it decides."""

    def __init__(self):
        self.rate = 0.0          # results per second (0: not known yet)
        self._last: float | None = None

    def start(self) -> None:
        """A new call: the first batch's interval would include the time between calls."""
        self._last = None

    def on_results(self, n: int, now: float) -> None:
        """``n`` results arrived at ``now`` (seconds)."""
        if self._last is not None and now > self._last:
            r = n / (now - self._last)
            self.rate = r if self.rate == 0.0 else (1 - GAIN) * self.rate + GAIN * r
        self._last = now

    def rest(self, new: int, inflight: int, now: float, sleep=time.sleep) -> float:
        """A pass found ``new`` results at ``now`` with ``inflight`` rounds still without one:
        count them, pause as :meth:`pause` says; returns when the loop looks again."""
        self.on_results(new, now)
        p = self.pause(new, inflight)
        if p:
            sleep(p)
        return now + p

    def pause(self, new: int, inflight: int) -> float:
        """Seconds to pause after a pass that found ``new`` results with ``inflight`` rounds
        still without one (0: look again at once). The stream passes its window's width (head
        to edge), which counts a round that completed past a lost one as still in flight: then
        the pause is still at most MAX_PAUSE, and the loss's recovery waits that much longer."""
        if new >= BATCH or inflight < 4 * BATCH or self.rate <= 0.0:
            return 0.0
        p = min((BATCH - new) / self.rate, inflight / (4 * self.rate), MAX_PAUSE)
        return p if p >= MIN_PAUSE else 0.0
