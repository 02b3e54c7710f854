"""The backend's metrics: with ``NICOFFLOAD_METRICS_PORT=P`` every rank serves Prometheus text
(:class:`nicoffload.worker.metrics.RankMetrics`, ``nicoffload_rank_*``) on port P + LOCAL_RANK
(so that the ranks of one host each have their own), at its address (``NICOFFLOAD_LOCAL_IP`` or
the one that routes to the service; ``NICOFFLOAD_METRICS_ADDR`` overrides it, ``0.0.0.0`` for
every interface). ``auto``: any free port. Either way the rank says where on stderr:

    nicoffload: rank 3 serves its metrics at http://10.0.0.4:9470/metrics

One server per process; the groups of the process (the default group, every ``new_group``) are
told apart by the label ``group`` (the group's id, 0 for the default group), and ``job`` is the
group's job at the service (``none`` without one). Three hooks, kept small for the backend:
:func:`attach` (the backend's creator), :func:`call` (``_submit``: an offloaded call, on the
offload or shared-memory path) and :func:`gloo_call` (``GlooPath.call``: gloo, or fallback for a
reduction the offload did not take). A port that cannot be bound costs the rank its metrics, with
a warning, never its training."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

import torch

from nicoffload.local.host import HostCommunicator
from nicoffload.torch.routing import op_name
from nicoffload.worker.metrics import RankMetrics, parse_port

log = logging.getLogger("nicoffload.torch")

#: the calls GlooPath takes that the offload takes too, for some dtypes, ops and groups
REDUCTIONS = {"allreduce": "allreduce", "allreduce_coalesced": "allreduce", "_reduce_scatter_base": "reduce_scatter",
              "reduce_scatter": "reduce_scatter", "barrier": "barrier"}
_lock = threading.Lock()
_process: RankMetrics | None = None
_failed = False


def port_for(value: str, local_rank: int) -> int:
    """The port of local rank ``local_rank`` for ``NICOFFLOAD_METRICS_PORT=value``: P + local
    rank, or 0 (any free port) for ``auto``."""
    port = parse_port(value)
    return port + local_rank if port else 0


def process_metrics(addr: str, rank: int, env=None) -> RankMetrics | None:
    """This process's metrics server, started on first use; None when NICOFFLOAD_METRICS_PORT is
    unset or its port could not be bound (said once, at warning level)."""
    global _process, _failed
    env = os.environ if env is None else env
    value = (env.get("NICOFFLOAD_METRICS_PORT") or "").strip()
    if not value:
        return None
    with _lock:
        if _process is None and not _failed:
            where = (env.get("NICOFFLOAD_METRICS_ADDR") or "").strip() or addr
            port = port_for(value, int(env.get("LOCAL_RANK") or 0))
            m = RankMetrics()
            try:
                m.serve(port, where)
            except Exception as e:
                _failed = True
                log.warning("rank %s serves no metrics: %s (NICOFFLOAD_METRICS_PORT=%s)", rank, e, value)
                return None
            print(f"nicoffload: rank {rank} serves its metrics at {m.url(where)}", file=sys.stderr, flush=True)
            _process = m
        return _process


def _flat(x) -> list:
    """The tensors of a call's argument (a tensor, or lists of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _flat(x))


class GroupMeter:
    """One group's view of the process's metrics."""

    def __init__(self, metrics: RankMetrics, pg):
        self.metrics, self.pg = metrics, pg
        self.group, self.rank = str(pg.group_id), str(pg.getRank())
        metrics.info.labels(*self.labels, str(pg.getSize()), pg.path).set(1)

    @property
    def labels(self) -> tuple:
        grant = self.pg.grant
        return (str(grant.job) if grant is not None else "none", self.group, self.rank)

    def path(self) -> str:
        comm = self.pg.comm
        if getattr(comm, "on_fallback", False):  # the failover's: gloo in the aggregator's fixed point
            return "fallback"
        return "shared_memory" if isinstance(getattr(comm, "primary", comm), HostCommunicator) else "offload"

    @contextlib.contextmanager
    def call(self, what: str, result):
        """An offloaded call: timed, with what the communicator counted meanwhile (:meth:`_count`)."""
        comm = self.pg.comm
        before, last0 = _counts(getattr(comm, "stats", None)), getattr(comm, "last", None)
        failovers = getattr(comm, "failovers", 0)
        ran = self.pg.error is None  # else it is refused at once for the earlier error
        delta = _Delta()
        with self.metrics.timed(self.labels, what, self.path(), _nbytes(result), delta):
            try:
                yield
            except BaseException:
                _count(delta, comm, before, last0, failed=ran)
                raise
            finally:
                if getattr(comm, "failovers", 0) > failovers:  # this call went over to the fallback
                    cause = (getattr(comm, "cause", None) or "unknown").split(":")[0]
                    self.metrics.failovers.labels(*self.labels, what, cause).inc(comm.failovers - failovers)
            _count(delta, comm, before, last0, failed=False)

    def gloo(self, name: str, args: tuple, fut) -> None:
        """A call through the gloo group, from its start on the queue until ``fut`` completes."""
        collective = REDUCTIONS.get(name, name.lstrip("_"))
        path = "fallback" if name in REDUCTIONS else "gloo"
        labels, nbytes, t0 = self.labels, _nbytes(args[0]) if args else 0, time.perf_counter()
        if path == "fallback":
            self.metrics.fallbacks.labels(*labels, collective, self._why(args)).inc()

        def done(f):
            try:
                f.value()
                error = None
            except BaseException as e:
                error = e
            self.metrics.observe(labels, collective, path, nbytes, time.perf_counter() - t0, None, error)

        fut.add_done_callback(done)

    def _why(self, args: tuple) -> str:
        """Why a reduction took the gloo path: the whole group does (group), the offload does not
        take its op (op) or its dtype (dtype), or its tensors' sizes (shape)."""
        if self.pg.comm is None:
            return "group"
        opts = next((a for a in args if hasattr(a, "reduceOp")), None)
        op = op_name(opts)
        if op == "other":
            return "op"
        if any(self.pg.router.route(op, t.dtype) is None for t in _flat(args[0] if args else [])):
            return "dtype"
        return "shape"


def _count(delta: "_Delta", comm, before: tuple, last0, failed: bool) -> None:
    """What a call added to ``comm``'s counters: the growth of its cumulative ``stats`` (every
    tensor of the call), plus a failed call's own ``last``, which ``stats`` leaves out; for a
    communicator without ``stats``, its ``last`` call's (when there was one)."""
    stats, last = getattr(comm, "stats", None), getattr(comm, "last", None)
    if stats is not None:
        delta.set(_counts(stats), before)
        if failed and last is not last0:
            delta.add(_counts(last))
    elif last is not None and last is not last0:
        delta.add(_counts(last))


#: the communicator's counters a call's metrics read
FIELDS = ("packets_sent", "retransmissions", "probes", "timeouts")


def _counts(st) -> tuple:
    return tuple(getattr(st, k, 0) for k in FIELDS)


class _Delta:
    """What a call added to a communicator's counters (read by RankMetrics.observe)."""

    packets_sent = retransmissions = probes = timeouts = 0

    def set(self, now: tuple, before: tuple) -> None:
        for k, a, b in zip(FIELDS, now, before):
            setattr(self, k, a - b)

    def add(self, more: tuple) -> None:
        for k, a in zip(FIELDS, more):
            setattr(self, k, getattr(self, k) + a)


# --- the hooks -------------------------------------------------------------------------------
def attach(pg) -> None:
    """Give a new process group its metrics (the backend's creator calls this); nothing without
    NICOFFLOAD_METRICS_PORT."""
    m = process_metrics(pg.local_ip, pg.getRank())
    if m is not None:
        pg._metrics = pg.gloo._metrics = GroupMeter(m, pg)


def call(pg, what: str, result):
    """The context an offloaded call of ``pg`` runs in (``_submit``)."""
    meter = getattr(pg, "_metrics", None)
    return contextlib.nullcontext() if meter is None else meter.call(what, result)


def gloo_call(gloo, name: str, args: tuple, fut) -> None:
    """A call of the gloo path starts (``GlooPath.call``); ``fut``: the work's future."""
    meter = getattr(gloo, "_metrics", None)
    if meter is not None:
        meter.gloo(name, args, fut)
