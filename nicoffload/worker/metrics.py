"""A rank's Prometheus metrics (``nicoffload_rank_*``), served as text by a small HTTP thread: its
calls by collective and path, their bytes and latency, what the communicator's statistics say of
them (records sent, retransmissions, probes, retransmission timeouts), the CPU time of the thread
that ran them (encoding, decoding, the system calls), and the calls that failed: refusals by kind,
timeouts by cause, other errors by class. One CollectorRegistry of its own; the habits of the
service's metrics (:mod:`nicoffload.service.metrics`): the unit in the name, ``_total`` for
counters, the job, the group and the reason as labels.

    Communicator(..., metrics_port=9470)      # or "auto" (any free port, printed on stderr)

The torch backend (:mod:`nicoffload.torch.metrics`, ``NICOFFLOAD_METRICS_PORT``) shares one
:class:`RankMetrics` between the groups of a process."""
from __future__ import annotations

import contextlib
import sys
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.exposition import generate_latest

from nicoffload.errors import InputError, RefusedError, SetupError, TimeoutError_

#: the paths a call takes: the offload (an aggregator or the ring), shared memory between the
#: ranks of a host, the gloo group (collectives the offload never takes), and fallback (a
#: reduction the offload could take in general, but not this one: its dtype, op or group)
PATHS = ("offload", "shared_memory", "gloo", "fallback")
#: seconds; a 4 KiB all-reduce takes ~100 us, 64 MiB at 1 Gbit/s ~1 s
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
           30.0, 120.0)
BASE = ("job", "group", "rank")
CALL = BASE + ("collective", "path")
WHY = BASE + ("collective", "reason")
#: a timeout's cause, by what its message says (first match)
CAUSES = (("store_gone", ("rendezvous store is unreachable",)), ("rank_gone", ("is gone", "left the group")),
          ("wait", ("given to wait()",)), ("ranks_silent", ("no contribution from", "no JOIN from")),
          ("aggregator_silent", ("has not answered", "did not answer")), ("local_rank", ("local rank",)),
          ("ring", ("never entered call", "ring program", "stored:")))


def timeout_cause(e: BaseException) -> str:
    text = str(e)
    for cause, marks in CAUSES:
        if any(m in text for m in marks):
            return cause
    return "other"


def failure(e: BaseException) -> tuple[str, str]:
    """(kind, reason) of a call's error: ("refusal", NaN|Inf|range|abort), ("timeout", its
    cause) or ("error", the exception's class)."""
    if isinstance(e, RefusedError):
        return "refusal", e.kind or "refused"
    if isinstance(e, TimeoutError_):
        return "timeout", timeout_cause(e)
    return "error", type(e).__name__


def parse_port(value) -> int:
    """A metrics port: ``auto`` (or 0) for any free one, else 1..65535."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise InputError(f"a metrics port is a number or auto, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise InputError(f"a metrics port is 1..65535 (or auto), not {port}")
    return port


class RankMetrics:
    """The metrics of one process's ranks, and the HTTP thread that serves them."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.calls = Counter("nicoffload_rank_calls", "collective calls completed or failed, by path", CALL,
                             registry=r)
        self.bytes = Counter("nicoffload_rank_bytes", "bytes of the calls' output tensors", CALL, registry=r)
        self.seconds = Histogram("nicoffload_rank_call_seconds", "a call's latency, from its start on the rank to "
                                 "its end", CALL, buckets=BUCKETS, registry=r)
        self.cpu = Counter("nicoffload_rank_call_cpu_seconds", "CPU time of the thread that ran the offloaded "
                           "calls: encoding, decoding, the system calls", CALL, registry=r)
        self.records = Counter("nicoffload_rank_records_sent", "records this rank sent (data, metadata, "
                               "retransmissions, pulls, probes)", BASE, registry=r)
        self.retx = Counter("nicoffload_rank_retransmissions", "records sent again after a loss", BASE, registry=r)
        self.probes = Counter("nicoffload_rank_probes", "probes sent: header-only pulls that ask the aggregator "
                              "what a lost round lacks", BASE, registry=r)
        self.rto = Counter("nicoffload_rank_retransmit_timeouts", "waits for results that ended in a "
                           "probe (the retransmission timer)", BASE, registry=r)
        self.refusals = Counter("nicoffload_rank_refusals", "calls every rank refused (a NaN or an Inf, a "
                                "gradient out of range), by kind", WHY, registry=r)
        self.timeouts = Counter("nicoffload_rank_timeouts", "calls that timed out, by cause (ranks_silent, "
                                "aggregator_silent, rank_gone, store_gone, wait, ...)", WHY, registry=r)
        self.errors = Counter("nicoffload_rank_errors", "calls that failed otherwise, by error", WHY, registry=r)
        self.fallbacks = Counter("nicoffload_rank_fallbacks", "reductions that took the gloo path, by reason "
                                 "(group, dtype, op, shape)", WHY, registry=r)
        self.failovers = Counter("nicoffload_rank_failovers", "times the group left a lost aggregator for its "
                                 "fallback (the torch backend's failover), by cause", WHY, registry=r)
        self.info = Gauge("nicoffload_rank_info", "1 per group of this process: its world size and path",
                          BASE + ("world", "path"), registry=r)
        self.server = None
        self.port: int | None = None

    # --- recording ----------------------------------------------------------------------------
    def observe(self, labels: tuple, collective: str, path: str, nbytes: int, seconds: float,
                cpu_s: float | None = None, error: BaseException | None = None, stats=None) -> None:
        """One call: ``labels`` (job, group, rank); ``stats``: what the communicator counted
        during it (attributes packets_sent, retransmissions, probes, timeouts; missing ones count 0)."""
        call = (*labels, collective, path)
        self.calls.labels(*call).inc()
        self.bytes.labels(*call).inc(nbytes)
        self.seconds.labels(*call).observe(seconds)
        if cpu_s is not None:
            self.cpu.labels(*call).inc(max(cpu_s, 0.0))
        if stats is not None:
            for counter, name in ((self.records, "packets_sent"), (self.retx, "retransmissions"),
                                  (self.probes, "probes"), (self.rto, "timeouts")):
                counter.labels(*labels).inc(max(getattr(stats, name, 0), 0))
        if error is not None:
            kind, reason = failure(error)
            family = {"refusal": self.refusals, "timeout": self.timeouts}.get(kind, self.errors)
            family.labels(*labels, collective, reason).inc()

    @contextlib.contextmanager
    def timed(self, labels: tuple, collective: str, path: str, nbytes: int, stats=None):
        """Time the body (wall and thread CPU) and :meth:`observe` it, failed or not; ``stats``:
        the communicator's statistics of the call (read when it ends)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        except BaseException as e:
            self.observe(labels, collective, path, nbytes, time.perf_counter() - t0, time.thread_time() - c0, e, stats)
            raise
        self.observe(labels, collective, path, nbytes, time.perf_counter() - t0, time.thread_time() - c0, None, stats)

    # --- serving ------------------------------------------------------------------------------
    def serve(self, port: int, addr: str) -> int:
        """Serve ``/metrics`` on ``addr``:``port`` (0: any free port) from a daemon thread;
        returns the port."""
        try:
            self.server, _thread = start_http_server(port, addr, registry=self.registry)
        except OSError as e:
            raise SetupError(f"serving metrics on {addr}:{port} failed: {e.strerror or e} (another process has the "
                             f"port? use another, or auto)") from None
        self.port = self.server.server_port
        return self.port

    def url(self, addr: str) -> str:
        return f"http://{addr}:{self.port}/metrics"

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class CommMetrics:
    """A :class:`~nicoffload.worker.comm.Communicator`'s own metrics server (``metrics_port=``):
    labels job (its job id), group ``none`` (it has no process group) and its rank."""

    def __init__(self, comm, port):
        self.metrics = RankMetrics()
        self.labels = (str(comm.job), "none", str(comm.rank))
        addr = comm.local_ip or "0.0.0.0"
        self.metrics.serve(parse_port(port), addr)
        self.metrics.info.labels(*self.labels, str(comm.world), "offload").set(1)
        self.url = self.metrics.url(addr)
        print(f"nicoffload: rank {comm.rank} serves its metrics at {self.url}", file=sys.stderr, flush=True)

    def call(self, what: str, array, stats):
        return self.metrics.timed(self.labels, what, "offload", getattr(array, "nbytes", 0), stats)

    def close(self) -> None:
        self.metrics.close()


class NoMetrics:
    """What a Communicator without ``metrics_port`` has: calls run as they are."""

    url = None

    def call(self, what: str, array, stats):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


NO_METRICS = NoMetrics()


def comm_metrics(comm, port) -> CommMetrics | NoMetrics:
    """A Communicator's metrics: a server of its own on ``port`` (or "auto"), or none (None)."""
    return NO_METRICS if port is None else CommMetrics(comm, port)
