"""Failover: a group goes on when its aggregator goes away, bit for bit.

When the aggregator falls silent in a call (no answer to retransmissions for
``NICOFFLOAD_FAILOVER`` seconds), or no longer runs the job's epoch (reloaded, the job removed
and made again), every rank of the group finishes that call, and the following ones, on the
fallback path: the group's internal gloo group summing the aggregator's own fixed-point integers
(:class:`~nicoffload.torch.fixedgloo.FixedGloo`), so the results are the bits the aggregator
would have returned. While on the fallback, rank 0 asks the service again every
``NICOFFLOAD_REJOIN`` seconds; a job granted, every rank goes back to the aggregator at the
same call (a one-integer gloo MAX at every fallback call says when).

The call that was cut. With failover on, a rank returns from a call only once the job's gate
says every rank holds every result of it (``Communicator.confirm``): so either every rank is
still in the call, or every rank holds all of its results. Each rank says in the rendezvous
store which blocks of its output are final (``final_blocks``; an in-place call's other blocks
still hold its input), or that it has already returned from the call. Then every rank takes
each block from the lowest rank that has it, and sums the blocks nobody has through the
fallback, from the inputs still there: every rank ends with the same bits. Ranks are at most
one call apart: when a rank had returned from the cut call, the others take the next call
through the same agreement too (the returned rank is in it on the primary until it is cut).

How a rank says it returned from a call: every rank publishes the last call it returned from
(``failover/returned/{rank}``), at once when it is cut in call n (it returned from n - 1), and
otherwise from a thread, every PUBLISH_S seconds when it changed. A rank that returned may not
come back to the primary soon: between two offloaded calls it may wait in a collective of the
gloo path, or of another group, that needs the ranks still agreeing on the call (FSDP's
all-gathers, a loss averaged over gloo); what it published tells the others that every rank
holds the call, wherever it waits.
"""
from __future__ import annotations

import atexit
import base64
import logging
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from nicoffload.collective import Collective
from nicoffload.errors import AggregatorLost, TimeoutError_
from nicoffload.torch.fixedgloo import FixedGloo
from nicoffload.torch.rendezvous import Rendezvous
from nicoffload.wire import quant

log = logging.getLogger("nicoffload.torch")

#: how often a rank publishes the last call it returned from on the primary (seconds)
PUBLISH_S = 0.5
#: how often a rank agreeing on a call looks at what the others published
LOOK_S = 0.1


def _pack(have: np.ndarray | None) -> str:
    return "none" if have is None else base64.b64encode(np.packbits(have).tobytes()).decode()


def _unpack(text: str, nb: int) -> np.ndarray:
    if text == "none":
        return np.zeros(nb, bool)
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))[:nb].astype(bool)


class Failover:
    """The group's communicator with a way out: ``primary`` until it is lost, ``fallback``
    after. ``make_primary(grant_json)`` builds a new primary from a job granted again (rank 0's
    ``rejoin`` thread publishes it); ``elems``: the blocks of the primary's fixed point."""

    def __init__(self, primary: Collective, fallback: FixedGloo, rdv: Rendezvous, group: str, elems: int,
                 make_primary=None, wait_s: float = 60.0):
        self.primary, self.fallback, self.rdv, self.group, self.elems = primary, fallback, rdv, group, elems
        self.make_primary, self.wait_s = make_primary, wait_s
        self.rank, self.world = rdv.rank, rdv.size
        self.calls = 0               # offloaded calls so far (every rank numbers them alike)
        self.on_fallback = False
        self.failovers = 0           # times this group went to the fallback
        self.rejoins = 0             # ... and back to an aggregator
        self.cause = ""              # why, the last time
        self.fallback_s = 0.0        # seconds of calls on the fallback
        self.recovered_at = 0.0      # when the last cut call was done (time.time())
        self.rejoin_ready = 0        # rank 0: the generation of a grant published for rejoining
        self._gen = 0                # the generation this rank runs
        self._aborted: BaseException | None = None  # the group's abort (liveness)
        self._follow = -1            # a call on the fallback that other ranks may have begun on the primary
        self.returned = -1           # the last call this rank returned from on the primary (all ranks held it)
        self._published = -1
        self._publish_lock = threading.Lock()  # the published value only grows
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_forever, name=f"nicoffload-returned-{group}",
                                           daemon=True)
        self._publisher.start()
        atexit.register(_stop_publishing, weakref.ref(self))  # no store call under the interpreter's exit

    @property
    def generation(self) -> int:
        """How many times the group took a job again (every rank alike)."""
        return self._gen

    @property
    def capabilities(self):
        return self.primary.capabilities

    def summary(self) -> dict:
        """What the failover did: the backend's ``stats()`` and the DDP hook's report carry it."""
        return {"offloaded_calls": self.calls, "failovers": self.failovers, "rejoins": self.rejoins,
                "on_fallback": self.on_fallback, "cause": self.cause, "fallback_s": self.fallback_s,
                "recovered_at": self.recovered_at}

    @property
    def stats(self):
        return getattr(self.primary, "stats", None)

    @property
    def last(self):
        return getattr(self.fallback if self.on_fallback else self.primary, "last", None)

    # --- the Collective API ---------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        n = self.calls
        self.calls += 1
        if self.on_fallback and n == self._follow:  # a rank may be in this call on the primary: agree on it
            if out is None:
                out = np.empty_like(array)
            self._agree(n, array, out, op, lanes, None)
            return out
        if self.on_fallback:
            self._maybe_rejoin()
        if self.on_fallback:
            t = time.perf_counter()
            try:
                return self.fallback.allreduce(array, out=out, op=op, lanes=lanes)
            finally:
                self.fallback_s += time.perf_counter() - t
        if out is None:
            out = np.empty_like(array)
        try:
            res = self.primary.allreduce(array, out=out, op=op, lanes=lanes)
        except AggregatorLost as e:
            return self._cut(n, e, array, out, op, lanes)
        self.returned = n
        return res

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, np.int32))

    def abort(self, error: BaseException) -> None:
        self._aborted = error
        self.primary.abort(error)

    def close(self) -> None:
        self.stop_publishing()
        self.primary.close()
        self.fallback.close()

    def __enter__(self) -> "Failover":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the call that was cut ------------------------------------------------------------------
    def _cut(self, n: int, e: AggregatorLost, array: np.ndarray, out: np.ndarray, op: str,
             lanes: int | None) -> np.ndarray:
        # this rank returned from call n - 1, where another rank may still be agreeing: every rank
        # holds its results (ranks are at most one call apart); say so before anything else
        self._publish(n - 1)
        final = getattr(self.primary, "final_blocks", lambda: None)()
        self.on_fallback, self.cause = True, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        self.failovers += 1
        log.warning("group %s, rank %d: the aggregator is lost in call %d (%s); this call and the following ones "
                    "take the fallback path (gloo summing the aggregator's fixed point, the same bits)",
                    self.group, self.rank, n, self.cause)
        self._agree(n, array, out, op, lanes, final)
        self.recovered_at = time.time()  # the cut call's result in hand (wall clock, for the logs and tests)
        return out

    def _agree(self, n: int, array: np.ndarray, out: np.ndarray, op: str, lanes: int | None,
               final: np.ndarray | None) -> None:
        """Call ``n`` on every rank from what each holds of it (``final``: this rank's final
        blocks; None: none). When a rank has already returned from it, every rank holds its
        results, and that rank is now in call n + 1 on the primary, where it will be cut: this
        rank takes call n + 1 through the same agreement (with nothing of it), not as a plain
        fallback call that the other would never join."""
        store, key = self.rdv.store, self.rdv.key
        E = quant.block_elems(self.elems, 16 if lanes == 16 else 32) if op == "sum" else self.elems
        nb = -(-array.size // E)
        store.set(key(f"failover/{n}/have/{self.rank}"), _pack(final))
        haves = self._haves(n, nb)
        if haves is None:
            self._follow = n + 1
        t = time.perf_counter()
        try:
            if haves is not None:
                self._recover(array, out, op, lanes, E, nb, haves)
        finally:
            self.fallback_s += time.perf_counter() - t

    def _haves(self, n: int, nb: int) -> list[np.ndarray] | None:
        """Every rank's final blocks of call ``n``, or None when a rank has returned from it (so
        every rank holds all of its results)."""
        store, key = self.rdv.store, self.rdv.key
        keys = [key(f"failover/{n}/have/{r}") for r in range(self.world)]
        deadline = time.monotonic() + self.wait_s
        look = 0.0
        while True:
            if self._aborted is not None:  # a rank gone or left the group (liveness): no agreement to wait for
                raise self._aborted
            if time.monotonic() >= look:
                look = time.monotonic() + LOOK_S
                if self._someone_returned(n):
                    return None
            if store.check(keys):
                return [_unpack(store.get(k).decode(), nb) for k in keys]
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                raise TimeoutError_(f"rank {self.rank}: failover of call {n}: rank(s) {missing} did not say within "
                                    f"{self.wait_s:g}s what they hold of it (their aggregator calls still wait?)")
            time.sleep(0.01)

    def _someone_returned(self, n: int) -> bool:
        """Whether a rank has published that it returned from call ``n`` or a later one."""
        store, key = self.rdv.store, self.rdv.key
        for r in range(self.world):
            k = key(f"failover/returned/{r}")
            if r != self.rank and store.check([k]) and int(store.get(k).decode()) >= n:
                return True
        return False

    def stop_publishing(self) -> None:
        """Stop the publishing thread and wait for it (a store call must not outlive the store)."""
        self._stop.set()
        if self._publisher is not threading.current_thread():
            self._publisher.join(timeout=5.0)

    def _publish(self, n: int) -> None:
        """Say in the store that this rank returned from call ``n`` (and so from every earlier one)."""
        with self._publish_lock:
            if n > self._published:
                self.rdv.store.set(self.rdv.key(f"failover/returned/{self.rank}"), str(n))
                self._published = n

    def _publish_forever(self) -> None:
        """The thread: the last call this rank returned from, into the store when it changed."""
        while not self._stop.wait(PUBLISH_S):
            try:
                self._publish(self.returned)
            except Exception:  # the store gone: the liveness watcher says so
                pass

    def _recover(self, array, out, op, lanes, E: int, nb: int, haves: list[np.ndarray]) -> None:
        """Every block from the lowest rank that holds it; the others summed by the fallback."""
        owner = np.full(nb, self.world, np.int64)
        for r in range(self.world - 1, -1, -1):
            owner[haves[r]] = r
        self.fallback.settle(array, out, op, lanes, E, owner)

    # --- back to an aggregator ------------------------------------------------------------------
    def publish_rejoin(self, grant_json: str) -> None:
        """Rank 0: a job granted again; the group takes it at the next call all ranks agree on."""
        gen = self._gen + 1
        self.rdv.store.set(self.rdv.key(f"failover/rejoin/{gen}"), grant_json)
        self.rejoin_ready = gen

    def _maybe_rejoin(self) -> None:
        if self.make_primary is None:
            return
        t = torch.tensor([self.rejoin_ready if self.rank == 0 else 0], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # (an enum member of the op)
        self.fallback.pg.allreduce([t], opts).wait()
        gen = int(t[0])
        if gen <= self._gen:
            return
        grant = self.rdv.store.get(self.rdv.key(f"failover/rejoin/{gen}")).decode()
        try:
            new = self.make_primary(grant)
        except Exception as e:  # every rank stays on the fallback; rank 0 asks again later
            log.warning("group %s, rank %d: rejoining the aggregator failed (%s); staying on the fallback",
                        self.group, self.rank, str(e).splitlines()[0])
            self._gen = gen
            return
        old, self.primary = self.primary, new
        old.close()
        self._gen, self.on_fallback = gen, False
        self.rejoins += 1
        log.warning("group %s, rank %d: back on the aggregator (job granted again) from call %d", self.group,
                    self.rank, self.calls - 1)


def _stop_publishing(ref) -> None:
    f = ref()
    if f is not None:
        f.stop_publishing()
