"""The soak: many consecutive AllReduces through the XDP aggregator with frames dropped and
duplicated on every link of a testbed, each result checked; the call times' distribution, the
worst call, and what the fault injector and the aggregator counted (``nicoffload bench --soak``).

One communicator per rank lives for the whole soak, as in a training loop: the ranks are threads
of this process (each socket made in its host's namespace), one call per rank at a time. Call i
has a size and dtype from the cycle :meth:`SoakConfig.schedule` gives and fresh inputs drawn from
(seed, i): int32 over the whole range (sums wrap), floats at a random scale, a fraction of every
rank's blocks zero (so rounds have partial contributors and ranks pull results). Rank 0's result
is held against :mod:`nicoffload.lab.reference` (int32 exactly, floats within the documented
bound) and every other rank's must be the same bits.

No call can hang the soak: a rank that fails stops it with an error naming the call and every
rank's failure (the communicator gives up after ``timeout`` seconds without progress), a call
still running after ``call_limit`` seconds stops it naming the ranks still inside, and a watchdog
outside the interpreter ends the process, with every thread's traceback, if even that deadline
cannot be noticed (a compiled kernel that never returns keeps the GIL).

Percentiles are nearest-rank: every number in the distribution is a call time that happened.
The summary, its arithmetic and its table are :mod:`nicoffload.lab.soakreport`.
"""
from __future__ import annotations

import faulthandler
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError, NicoffloadError
from ..jobspec import DEFAULT, JobSpec
from ..wire import keys
from . import reference
from .inputs import format_size
from .soakreport import (
    DTYPES,
    CallRecord,
    SoakSummary,
    distribution,
    format_summary,
    percentile,
    time_table,
    worst_call,
)

__all__ = ["DTYPES", "WATCHDOG_GRACE", "CallRecord", "SoakConfig", "SoakError", "SoakSummary", "call_inputs",
           "check_call", "distribution", "format_summary", "percentile", "run", "time_table", "worst_call"]

#: seconds the watchdog adds to ``call_limit`` before it ends the process
WATCHDOG_GRACE = 60.0


@dataclass(frozen=True)
class SoakConfig:
    calls: int = 1000
    sizes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 4 << 20)  # bytes per rank
    dtypes: tuple[str, ...] = ("int32", "float32")
    drop: float = 0.02            # per frame, both directions of every link (the aggregator's too)
    dup: float = 0.02
    seed: int = 0                 # of the fault injector and of the inputs
    sparsity: float = 0.25        # fraction of each rank's blocks that are zero
    spec: JobSpec = DEFAULT       # the job; its timeout: seconds without progress before a rank fails
    mode: str = "auto"            # XDP attach mode of the aggregator
    call_limit: float | None = None  # seconds one call may take at most (default 3 x timeout)
    watchdog: bool = True         # end the process if a call outlives call_limit + WATCHDOG_GRACE

    def validate(self) -> "SoakConfig":
        if self.calls < 1:
            raise InputError(f"--soak needs at least 1 call, not {self.calls}")
        if not self.sizes or min(self.sizes) < 8:
            raise InputError("--soak needs sizes of at least 8 bytes (one float64)")
        if not self.dtypes or set(self.dtypes) - set(DTYPES):
            raise InputError(f"soak dtypes must be among {', '.join(DTYPES)}, not {', '.join(self.dtypes) or 'none'}")
        for name, p in (("drop", self.drop), ("dup", self.dup)):
            if not 0.0 <= p <= 1.0:
                raise InputError(f"--{name} is a probability in [0, 1], not {p}")
        if not 0.0 <= self.sparsity < 1.0:
            raise InputError(f"soak sparsity must be in [0, 1), not {self.sparsity}")
        if self.call_limit is not None and self.call_limit <= 0:
            raise InputError(f"the call limit must be positive, not {self.call_limit}")
        self.spec.validate()
        return self

    @property
    def limit(self) -> float:
        return self.call_limit if self.call_limit is not None else 3 * self.spec.timeout

    def schedule(self, i: int) -> tuple[int, str]:
        """(bytes, dtype) of call ``i``: the sizes in turn, the dtype changing after each round
        of them, so every pair comes once in every len(sizes) x len(dtypes) calls."""
        return self.sizes[i % len(self.sizes)], self.dtypes[i // len(self.sizes) % len(self.dtypes)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(sizes=list(self.sizes), dtypes=list(self.dtypes), spec=self.spec.public(), call_limit=self.limit)
        return d


# --- inputs and checks (pure) -----------------------------------------------------------------
def call_inputs(seed: int, i: int, world: int, nbytes: int, dtype: str, sparsity: float,
                elems: int = DEFAULT.elems) -> list[np.ndarray]:
    """The inputs of call ``i``, one per rank, the same for the same (seed, i)."""
    dt = np.dtype(dtype)
    n = max(1, nbytes // dt.itemsize)
    rng = np.random.default_rng((seed, i))
    full, nb = n // elems, -(-n // elems)
    out = []
    for _ in range(world):
        if dt.kind == "i":
            x = rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
        else:
            x = rng.standard_normal(n, dtype=dt)
            x *= dt.type(2.0 ** int(rng.integers(-30, 31)))
        zero = rng.random(nb) < sparsity
        x[:full * elems].reshape(full, elems)[zero[:full]] = 0
        if nb > full and zero[-1]:
            x[full * elems:] = 0
        out.append(x)
    return out


def check_call(inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], elems: int = DEFAULT.elems
               ) -> tuple[int, str, float]:
    """(-1, "", max_abs_err) when rank 0's result is what nicoffload must return for ``inputs``
    and every rank holds the same bits; else (the first bad rank, why, max_abs_err)."""
    check = reference.quantized(inputs, elems).check(outputs[0])
    if not check.within_bound:
        return 0, check.reason, check.max_abs_err
    first = np.ascontiguousarray(outputs[0]).view(np.uint8)
    for r, o in enumerate(outputs[1:], 1):
        if not np.array_equal(np.ascontiguousarray(o).view(np.uint8), first):
            bad = np.flatnonzero(np.asarray(o).reshape(-1) != np.asarray(outputs[0]).reshape(-1))
            where = f" (first at element {int(bad[0])})" if len(bad) else " (same values, other bits)"
            return r, f"rank {r}'s result differs from rank 0's at {len(bad)} elements{where}", check.max_abs_err
    return -1, "", check.max_abs_err


# --- running ----------------------------------------------------------------------------------
class SoakError(NicoffloadError):
    """The soak stopped: a rank failed or a call outlived its limit. ``summary`` holds the calls
    before it; the exit code is the ranks' error's (a timeout's, ...)."""

    def __init__(self, message: str, summary: SoakSummary, exit_code: int = 1):
        super().__init__(message)
        self.summary = summary
        self.exit_code = exit_code


class _Ranks:
    """One thread per communicator, each running the calls it is handed, one at a time."""

    def __init__(self, comms: Sequence):
        self.comms = comms
        self._inbox = [queue.SimpleQueue() for _ in comms]
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, args=(r,), name=f"soak rank {r}", daemon=True)
                         for r in range(len(comms))]
        for t in self._threads:
            t.start()

    def _serve(self, rank: int) -> None:
        c = self.comms[rank]
        while True:
            job = self._inbox[rank].get()
            if job is None:
                return
            i, x, out = job
            try:
                if x is None:
                    c.join()
                    st = None
                else:
                    c.allreduce(x, out)
                    st = c.last
            except BaseException as e:  # handed to the caller, naming this rank
                self._outbox.put((rank, i, e, None))
            else:
                self._outbox.put((rank, i, None, st))

    def call(self, i: int, xs: Sequence, outs: Sequence, limit: float) -> tuple[list, list, list[int]]:
        """Call ``i`` on every rank (x None: join the job). Returns (each rank's CallStats,
        [(rank, error)], ranks still running after ``limit`` seconds)."""
        for r in range(len(self.comms)):
            self._inbox[r].put((i, xs[r], outs[r]))
        deadline = time.monotonic() + limit
        stats: list = [None] * len(self.comms)
        errors, pending = [], set(range(len(self.comms)))
        while pending:
            try:
                rank, j, err, st = self._outbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if j != i:  # an answer to a call given up on (the soak stops then, so only ever defensive)
                continue
            pending.discard(rank)
            if err is not None:
                errors.append((rank, err))
            stats[rank] = st
        return stats, sorted(errors, key=lambda e: e[0]), sorted(pending)

    def stop(self, wait: float) -> list[int]:
        """End the threads, waiting up to ``wait`` seconds for ranks still inside a call (their
        own timeout ends them); the ranks whose thread is still running."""
        for q in self._inbox:
            q.put(None)
        deadline = time.monotonic() + wait
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [r for r, t in enumerate(self._threads) if t.is_alive()]


def _label(i: int, nbytes: int, dtype: str) -> str:
    return f"call {i} ({format_size(nbytes)} {dtype})"


def run(tb, cfg: SoakConfig, progress: Callable[[str], None] | None = None) -> SoakSummary:
    """``cfg.calls`` AllReduces by every worker of testbed ``tb`` through a fresh XDP aggregator,
    with ``cfg.drop``/``cfg.dup`` on every link. Returns the summary (``exact`` says whether every
    result was right); raises :class:`SoakError` if a rank fails or a call outlives its limit.
    ``progress`` gets a line after every 100th call, the last one and any wrong one. The
    aggregator and the fault injector are gone from the testbed afterwards."""
    from nicoffload.worker.comm import Communicator

    from .aggregators import AggregatorProcess
    from .links import enable_gro

    cfg.validate()
    world, E = len(tb.workers), cfg.spec.elems
    summary = SoakSummary(cfg.to_dict(), world)
    enable_gro(tb)
    comms, ranks = [], None
    spec = cfg.spec if cfg.spec.key else cfg.spec.replace(key=keys.new_key())  # the job's own key
    with AggregatorProcess(tb, "xdp", spec, mode=cfg.mode) as ap:
        summary.mode = ap.mode
        try:
            tb.faults.configure(None, drop=cfg.drop, dup=cfg.dup, seed=cfg.seed)
            for w in tb.workers:
                with tb.in_host(w):
                    comms.append(Communicator.from_spec(w.rank, world, tb.agg.ip, ap.spec, local_ip=w.ip))
            ranks = _Ranks(comms)
            _run_calls(ranks, cfg, summary, world, E, progress)
        finally:
            if cfg.watchdog:
                faulthandler.cancel_dump_traceback_later()
            # a rank still inside a call keeps its socket (closing it under the thread could hand
            # its descriptor to someone else's socket); the thread ends at its own timeout
            busy = ranks.stop(cfg.spec.timeout + 2.0) if ranks is not None else []
            for r, c in enumerate(comms):
                if r not in busy:
                    c.close()
            try:
                summary.faults = tb.faults.stats()
            finally:
                tb.faults.remove()
                summary.aggregator = ap.close()
    return summary


def _run_calls(ranks: _Ranks, cfg: SoakConfig, summary: SoakSummary, world: int, E: int, progress) -> None:
    outs: dict[tuple[int, str], list[np.ndarray]] = {}  # the ranks' output buffers, reused like a training loop's
    t0 = time.perf_counter()

    def stop(what: str, stats, errors, pending) -> None:
        parts = [str(e) if str(e).startswith(f"rank {r}:") else f"rank {r}: {e}" if isinstance(e, NicoffloadError)
                 else f"rank {r}: {type(e).__name__}" + (f": {e}" if str(e) else "") for r, e in errors]
        if pending:
            parts.append(f"rank(s) {', '.join(map(str, pending))} still running after {cfg.limit:g} s")
        summary.error = f"{what}: " + "; ".join(parts)
        summary.wall_s = time.perf_counter() - t0
        code = errors[0][1].exit_code if errors and isinstance(errors[0][1], NicoffloadError) else 9 if pending else 1
        raise SoakError(f"soak stopped at {summary.error}", summary, code)

    if cfg.watchdog:
        faulthandler.dump_traceback_later(cfg.limit + WATCHDOG_GRACE, exit=True, file=sys.stderr)
    stats, errors, pending = ranks.call(-1, [None] * world, [None] * world, cfg.limit)  # join, untimed
    if errors or pending:
        stop("joining the job", stats, errors, pending)
    for i in range(cfg.calls):
        nbytes, dtype = cfg.schedule(i)
        xs = call_inputs(cfg.seed, i, world, nbytes, dtype, cfg.sparsity, E)
        out = outs.get((nbytes, dtype))
        if out is None:
            out = outs[nbytes, dtype] = [np.empty_like(xs[0]) for _ in range(world)]
        if cfg.watchdog:
            faulthandler.dump_traceback_later(cfg.limit + WATCHDOG_GRACE, exit=True, file=sys.stderr)
        stats, errors, pending = ranks.call(i, xs, out, cfg.limit)
        if errors or pending:
            stop(_label(i, nbytes, dtype), stats, errors, pending)
        bad, reason, err = check_call(xs, out, E)
        summary.records.append(CallRecord(
            i, nbytes, dtype, max(s.seconds for s in stats), sum(s.retransmissions for s in stats),
            sum(s.pulls for s in stats), sum(s.timeouts for s in stats), err, bad < 0, bad, reason))
        if progress is not None and ((i + 1) % 100 == 0 or i + 1 == cfg.calls or bad >= 0):
            note = f"; WRONG: rank {bad}: {reason}" if bad >= 0 else ""
            progress(f"[soak] {i + 1}/{cfg.calls} calls, {time.perf_counter() - t0:.1f} s, "
                     f"{len(summary.failures)} wrong{note}")
    summary.wall_s = time.perf_counter() - t0
