"""Metrics from every rank, and the dashboard over them. One live two-rank torchrun job (the
backend, NICOFFLOAD_METRICS_PORT set, the service on the aggregator host) makes known calls on
each path; every rank then scrapes every rank's /metrics at its address, and rank 0 the
service's, while all ranks are still up (tests/netns/torchrun_job.py, phase ``metrics``).

- the counters moved by exactly what the job did, seen from this rank and from the other;
- every metric examples/grafana/nicoffload.json queries is one the service or a rank exported."""
from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from nicoffload.lab.launcher import Launch  # noqa: E402
from nicoffload.lab.train.torchrun import ServiceProcess, torchrun_specs, write_token  # noqa: E402

JOB = Path(__file__).with_name("torchrun_job.py")
DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "nicoffload.json"
PORT = 9470


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The job's reports by rank, and its ranks' stderr (the testbed and the service are gone
    when the tests run: everything was scraped while the job was up)."""
    from nicoffload.agg import control as aggregator
    from nicoffload.testbed import Testbed, Topology, clean

    tmp = tmp_path_factory.mktemp("rank-metrics")
    uid = uuid.uuid4().hex[:5]
    tb = Testbed(Topology.star(f"t{uid}", 2))
    svc, stopped = None, 0
    try:
        tb.up()
        svc = ServiceProcess(tb, write_token(tmp / "tok")).start()
        out = tmp / "out"
        out.mkdir()
        specs = torchrun_specs(tb, JOB, ["--out", str(out), "--phases", "metrics"],
                               env={**svc.env(), "NICOFFLOAD_METRICS_PORT": str(PORT)})
        with Launch(tb, specs) as launch:
            outcomes = launch.wait(time.monotonic() + 180)
        reports = {d["rank"]: d for d in (json.loads(f.read_text()) for f in sorted(out.glob("rank*.json")))}
        assert sorted(reports) == [0, 1], [o.describe() + o.stderr[-2000:] for o in outcomes]
        assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
        assert all(o.ok for o in outcomes), [o.describe() for o in outcomes]
        yield reports, "\n".join(o.stderr for o in outcomes), tb
    finally:
        try:
            stopped = svc.stop() if svc is not None else 0
            for ns, iface in aggregator.loaded(f"nco-t{uid}"):
                aggregator.unload(ns, iface, missing_ok=True)
        finally:
            try:
                tb.down()
            finally:
                clean(f"t{uid}")
    assert stopped == 0, svc.log[-10:]


def samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


def exported(text: str) -> set[str]:
    """Every series name a /metrics text offers: its samples', and each family's (a family with
    no sample yet, such as refusals before any refusal, is still declared)."""
    names = set()
    for fam in text_string_to_metric_families(text):
        names |= {s.name for s in fam.samples}
        names |= {fam.name + "_total"} if fam.type == "counter" else \
            {fam.name + x for x in ("_bucket", "_sum", "_count")} if fam.type == "histogram" else {fam.name}
    return names


def test_every_rank_serves_counters_that_moved_by_what_the_job_did(live):
    reports, stderr, tb = live
    job = str(reports[0]["job"])
    assert job != "None" and reports[1]["job"] == reports[0]["job"]
    for w in tb.workers:  # each rank said where it serves them: its address, P + its local rank (0)
        assert f"serves its metrics at http://{w.ip}:{PORT}/metrics" in stderr, stderr[-2000:]
    for scraper, d in reports.items():
        for r, text in d["rank_metrics"].items():
            me = {"job": job, "group": "0", "rank": r}
            offload = dict(me, collective="allreduce", path="offload")
            # 7 all-reduces of 1000 float32, seen by this rank and by the other one
            assert value(text, "nicoffload_rank_calls_total", **offload) == 7, (scraper, r, text)
            assert value(text, "nicoffload_rank_bytes_total", **offload) == 7 * 4000
            assert value(text, "nicoffload_rank_call_seconds_count", **offload) == 7
            assert value(text, "nicoffload_rank_records_sent_total", **me) >= 7
            # the int64 all-reduce took the gloo fallback (its dtype), the broadcast took gloo
            fallback = dict(me, collective="allreduce")
            assert value(text, "nicoffload_rank_calls_total", **fallback, path="fallback") == 1
            assert value(text, "nicoffload_rank_fallbacks_total", **fallback, reason="dtype") == 1
            assert value(text, "nicoffload_rank_calls_total", **me, collective="broadcast", path="gloo") == 1
            assert value(text, "nicoffload_rank_bytes_total", **me, collective="broadcast", path="gloo") == 40
            assert value(text, "nicoffload_rank_info", **me, world="2", path="aggregator") == 1
            assert value(text, "nicoffload_rank_timeouts_total") == value(text, "nicoffload_rank_errors_total") == 0
            if r == str(scraper):  # its own barrier is done before it scrapes; the other's may not be yet
                assert value(text, "nicoffload_rank_calls_total", **me, collective="barrier", path="offload") == 1
                assert value(text, "nicoffload_rank_call_cpu_seconds_total", **offload) > 0
            calls = "nicoffload_rank_calls_total"
            assert value(text, calls, **me) == value(text, calls, rank=r)  # every call in group 0, job labelled


def dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    exprs = []
    panels = list(d["panels"])
    while panels:
        p = panels.pop()
        panels += p.get("panels", [])
        exprs += [t["expr"] for t in p.get("targets", [])]
        assert p["type"] == "row" or p.get("targets"), f"panel {p.get('title')!r} queries nothing"
    for v in d["templating"]["list"]:
        q = v.get("query")
        exprs.append(q.get("query", "") if isinstance(q, dict) else q or "")
    return exprs


def test_the_dashboard_queries_only_metrics_the_service_and_the_ranks_export(live):
    reports, _stderr, _tb = live
    service, rank = reports[0]["service_metrics"], reports[0]["rank_metrics"]["0"]
    have = exported(service) | exported(rank)
    used = {n for e in dashboard_queries() for n in re.findall(r"\bnicoffload_[a-z0-9_]+", e)}
    assert any(n.startswith("nicoffload_rank_") for n in used) and any(n in exported(service) for n in used)
    assert used - have == set(), f"the dashboard queries metrics nothing exports: {sorted(used - have)}"
    # the panels the dashboard promises
    titles = " | ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"])
    for what in ("Pool occupancy", "Jobs", "Goodput per job", "Retransmissions", "latency p99 per rank", "Fallbacks"):
        assert what in titles, titles
