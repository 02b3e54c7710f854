"""The service's Prometheus metrics, read from the aggregator's per-job counters at scrape time
(one registry, the standard client library; counters end in ``_total``, the job and the reason
are labels). Row ``job="none"`` counts traffic that named no registered job. A job handed to
the AF_XDP engine (``agg serve --fallback afxdp``) has the same counters, read from the engine's
counters file; ``nicoffload_job_engine`` says which engine serves each job."""
from __future__ import annotations

from typing import Callable

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from nicoffload.wire import proto

#: counter name -> (the aggregator's counter, help)
COUNTERS = {
    "frames": ("rx", "frames the aggregator's XDP program saw for the job"),
    "records": ("records", "records (one block on one slot) parsed"),
    "aggregations": ("aggregated", "contributions added into a slot"),
    "completions": ("completed", "rounds completed (every contributor counted)"),
    "results_sent": ("result_sent", "result frames sent"),
    "retransmissions_answered": ("retx_answered", "retransmissions answered from a stored result"),
    "pulls_answered": ("pull_answered", "pulls of a result answered"),
    "status_sent": ("status_sent", "STATUS answers (who has contributed) sent"),
    "duplicates": ("dup_dropped", "duplicate contributions dropped"),
    "joins": ("join", "JOIN records received"),
    "epochs_formed": ("epoch_formed", "epochs formed (every rank joined a run)"),
    "acks": ("ack", "ACK records received"),
    "optimizer_updates": ("updated", "optimizer updates applied"),
    "tx_failures": ("tx_failed", "frames the program could not send"),
}
#: every other counter of the program is a reason a frame was dropped or not used
DROPPED = [s for s in proto.STATS if s.startswith(("bad_", "stale_")) or s in ("early", "mismatch")]


class AggregatorCollector:
    """A prometheus_client collector over ``snapshot()``, which returns
    ``{"jobs": [{"job", "stats", "slots", "lease_remaining_s", "engine"}...], "unattributed": stats,
    "slots": int, "free_slots": int, "uptime_s": float, "leases_expired": int}`` (``engine``:
    "xdp", the default, or "afxdp")."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        s = self.snapshot()
        rows = [(str(j["job"]), j["stats"]) for j in s["jobs"]] + [("none", s["unattributed"])]
        for name, (key, text) in COUNTERS.items():
            c = CounterMetricFamily(f"nicoffload_{name}", text, labels=["job"])
            for job, st in rows:
                c.add_metric([job], st.get(key, 0))
            yield c
        c = CounterMetricFamily("nicoffload_dropped", "frames dropped, by reason (docs/protocol.md, counters)",
                                labels=["job", "reason"])
        for job, st in rows:
            for reason in DROPPED:
                c.add_metric([job, reason], st.get(reason, 0))
        yield c
        g = GaugeMetricFamily("nicoffload_pool_slots", "slots of the aggregator's pool", labels=["state"])
        g.add_metric(["used"], s["slots"] - s["free_slots"])
        g.add_metric(["free"], s["free_slots"])
        yield g
        g = GaugeMetricFamily("nicoffload_job_slots", "slots of each job (its share of the XDP pool, or the AF_XDP "
                                                      "engine's own)", labels=["job"])
        for j in s["jobs"]:
            g.add_metric([str(j["job"])], j["slots"])
        yield g
        g = GaugeMetricFamily("nicoffload_job_engine", "1 for the engine that aggregates each job: xdp (the XDP "
                                                       "program's pool) or afxdp (the AF_XDP engine, --fallback afxdp)",
                              labels=["job", "engine"])
        for j in s["jobs"]:
            g.add_metric([str(j["job"]), j.get("engine", "xdp")], 1)
        yield g
        g = GaugeMetricFamily("nicoffload_job_lease_remaining_seconds",
                              "seconds left before an idle job's lease expires", labels=["job"])
        for j in s["jobs"]:
            if j.get("lease_remaining_s") is not None:
                g.add_metric([str(j["job"])], j["lease_remaining_s"])
        yield g
        yield GaugeMetricFamily("nicoffload_jobs", "jobs served (the AF_XDP engine's included)",
                                value=len(s["jobs"]))
        yield CounterMetricFamily("nicoffload_leases_expired", "jobs removed because their lease expired",
                                  value=s["leases_expired"])
        yield CounterMetricFamily("nicoffload_failovers_reported",
                                  "failovers the groups that asked again reported (a group that lost its aggregator "
                                  "trains on its fallback, then reports them with its next request)",
                                  value=s.get("failovers_reported", 0))
        yield GaugeMetricFamily("nicoffload_service_uptime_seconds", "seconds since the service started",
                                value=s["uptime_s"])


def registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AggregatorCollector(snapshot))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """The text format of every metric (``/metrics``)."""
    return generate_latest(reg)
