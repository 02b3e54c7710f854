"""Liveness, beside the rendezvous whose heartbeats it reads: every rank beats once a second,
and when another rank's beat has not moved for ``liveness`` seconds (or the store itself is gone
that long) the watcher fails the group's offload naming that rank, so that a call in flight ends
within ``NICOFFLOAD_LIVENESS`` seconds instead of waiting for a rank that will never send."""
from __future__ import annotations

import threading
import time
from typing import Callable

from nicoffload.errors import TimeoutError_
from nicoffload.torch.rendezvous import Rendezvous


class Liveness:
    """The watcher thread of one group on one rank: ``on_dead(error)`` is called once, with a
    :class:`~nicoffload.errors.TimeoutError_` naming the rank that is gone (or the store)."""

    def __init__(self, rdv: Rendezvous, addresses: list[str], liveness: float,
                 on_dead: Callable[[BaseException], None], name: str):
        self.rdv, self.addresses, self.liveness, self.on_dead = rdv, addresses, liveness, on_dead
        self.rank, self.size = rdv.rank, rdv.size
        self.closed = False  # set when the group shuts down: a rank leaving is no failure then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        size, me = self.size, self.rank
        last_change = [time.monotonic()] * size
        last = [-1] * size
        store_down_since = None
        every = min(1.0, self.liveness / 4)
        while not self._stop.wait(every):
            now = time.monotonic()
            try:
                self.rdv.beat()
                beats = self.rdv.beats()
                store_down_since = None
            except Exception as e:
                store_down_since = store_down_since or now
                if now - store_down_since > self.liveness:
                    self._store_gone(e, now, store_down_since, last_change, every)
                    return
                continue
            for r, b in enumerate(beats):
                if b != last[r]:
                    last[r], last_change[r] = b, now
            dead = [r for r in range(size) if r != me and now - last_change[r] > self.liveness]
            if dead and not self.closed:
                r = dead[0]
                try:
                    left = self.rdv.has_left(r)
                except Exception:
                    left = False
                why = "left the group (destroy_process_group)" if left else \
                    f"is gone: its heartbeat stopped {now - last_change[r]:.1f}s ago (its process or host died)"
                self.on_dead(TimeoutError_(f"rank {me}: rank {r} ({self.addresses[r]}) {why}"))
                return

    def _store_gone(self, e: Exception, now: float, since: float, last_change: list, every: float) -> None:
        """The store has been unreachable for ``liveness`` seconds. A rank that stopped beating
        well before it went away is the cause: rank 0 (the store's host) saw it first and
        exited, taking the store along."""
        stale = {r: since - last_change[r] for r in range(self.size)
                 if r != self.rank and since - last_change[r] > 2 * every + 0.5}
        if stale and not self.closed:
            r = max(stale, key=lambda k: stale[k])
            self.on_dead(TimeoutError_(
                f"rank {self.rank}: rank {r} ({self.addresses[r]}) is gone: its heartbeat stopped "
                f"{stale[r]:.1f}s before the rendezvous store went away too (rank 0 saw it first)"))
        else:
            self.on_dead(TimeoutError_(
                f"rank {self.rank}: the rendezvous store is unreachable for {now - since:.0f}s "
                f"({str(e).splitlines()[0]}): rank 0's host or its torchrun agent is gone"))
