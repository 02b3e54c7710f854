"""A rank's metrics without root: a Communicator given ``metrics_port="auto"`` serves its calls
(a failed one too: a timeout by its cause) and stops serving on close; the causes, kinds and
ports the metrics are labelled and served by."""
from __future__ import annotations

import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nicoffload.errors import InputError, ProtocolError, RefusedError, TimeoutError_
from nicoffload.worker import Communicator
from nicoffload.worker.metrics import failure, parse_port, timeout_cause


def value(text: str, name: str, **labels) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_communicator_serves_its_calls_and_stops_on_close(capsys):
    c = Communicator(0, 2, "127.0.0.1", local_ip="127.0.0.1", delivery="unicast", timeout=0.2, job=3,
                     port=free_udp_port(), local_port=free_udp_port(), metrics_port="auto")
    try:
        assert c.metrics.url.startswith("http://127.0.0.1:") and c.metrics.url in capsys.readouterr().err
        with pytest.raises(TimeoutError_):  # nobody aggregates: the JOIN is never answered
            c.allreduce(np.ones(1000, np.float32))
        text = urllib.request.urlopen(c.metrics.url, timeout=5).read().decode()
    finally:
        c.close()
    me = {"job": "3", "group": "none", "rank": "0"}
    assert value(text, "nicoffload_rank_calls_total", **me, collective="allreduce", path="offload") == 1
    assert value(text, "nicoffload_rank_bytes_total", **me, collective="allreduce") == 4000
    assert value(text, "nicoffload_rank_call_seconds_count", **me, collective="allreduce") == 1
    assert value(text, "nicoffload_rank_timeouts_total", **me, collective="allreduce", reason="aggregator_silent") == 1
    assert value(text, "nicoffload_rank_info", **me, world="2") == 1
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(c.metrics.url, timeout=2)
    plain = Communicator(0, 2, "127.0.0.1", local_ip="127.0.0.1", delivery="unicast", port=free_udp_port(),
                         local_port=free_udp_port())
    assert plain.metrics.url is None
    plain.close()


@pytest.mark.parametrize("message,cause", [
    ("rank 0: allreduce timed out after 5s without progress; 3 round(s) incomplete at the aggregator 10.0.0.1:4791: "
     "no contribution from rank(s) 2", "ranks_silent"),
    ("rank 1: joining job 2 timed out after 5s; the aggregator 10.0.0.1:4791 has heard from rank(s) 0: no JOIN from "
     "rank(s) 1", "ranks_silent"),
    ("rank 0: summing job 1: the aggregator 10.0.0.1:4791 has not answered anything for 30s while asked again",
     "aggregator_silent"),
    ("[nicoffload] Timed out in allreduce of nicoffload group 0: rank 0: rank 2 (10.0.0.3) is gone: its heartbeat "
     "stopped 3.1s ago", "rank_gone"),
    ("rank 0: the rendezvous store is unreachable for 10s (x): rank 0's host or its torchrun agent is gone",
     "store_gone"),
    ("[nicoffload] Timed out: allreduce did not complete within the 2s given to wait()", "wait"),
    ("something else", "other"),
])
def test_timeout_causes(message, cause):
    assert timeout_cause(TimeoutError_(message)) == cause
    assert failure(TimeoutError_(message)) == ("timeout", cause)


def test_failures_and_ports():
    assert failure(RefusedError("NaN", 1, kind="NaN")) == ("refusal", "NaN")
    assert failure(ProtocolError("sizes differ")) == ("error", "ProtocolError")
    assert parse_port("auto") == 0 and parse_port("9470") == 9470 and parse_port(0) == 0
    for bad in ("x", "70000", -1):
        with pytest.raises(InputError):
            parse_port(bad)


def test_the_backends_port_rule():
    pytest.importorskip("torch")
    from nicoffload.torch.metrics import port_for, process_metrics

    assert port_for("9470", 0) == 9470 and port_for("9470", 3) == 9473 and port_for("auto", 3) == 0
    assert process_metrics("127.0.0.1", 0, env={}) is None  # unset: no server at all


class _Stats:
    def __init__(self, sent=0, retx=0, rto=0, probes=0):
        self.packets_sent, self.retransmissions, self.timeouts, self.probes = sent, retx, rto, probes


def _group(comm, error=None):
    from types import SimpleNamespace

    return SimpleNamespace(comm=comm, grant=SimpleNamespace(job=4), group_id="0", getRank=lambda: 1,
                           getSize=lambda: 2, path="aggregator", error=error, router=None)


def test_the_backends_meter_reads_what_each_kind_of_communicator_counts():
    """A call of several tensors counts them all (the growth of ``stats``); a failed one adds its
    own ``last`` (``stats`` leaves it out); a communicator without ``stats`` (a wrapper) its
    ``last``; a call refused at once for an earlier error adds nothing; a gloo call is timed until
    its future completes, and a reduction there is a fallback, by reason."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from nicoffload.torch.metrics import GroupMeter
    from nicoffload.worker.metrics import RankMetrics

    m = RankMetrics()
    comm = SimpleNamespace(stats=_Stats(), last=_Stats())
    meter = GroupMeter(m, _group(comm))
    with meter.call("allreduce", [torch.zeros(10), torch.zeros(5)]):
        comm.stats, comm.last = _Stats(sent=30, retx=2, rto=1, probes=6), _Stats(sent=10)
    with pytest.raises(TimeoutError_), meter.call("allreduce", [torch.zeros(10)]):
        comm.last = _Stats(sent=4, retx=3)  # the failed call's: not in stats
        raise TimeoutError_("rank 1: ... no contribution from rank(s) 0")
    wrapped = SimpleNamespace(last=_Stats())  # no cumulative stats
    meter2 = GroupMeter(m, _group(wrapped))
    with meter2.call("barrier", []):
        wrapped.last = _Stats(sent=1)
    meter3 = GroupMeter(m, _group(SimpleNamespace(stats=_Stats(), last=_Stats(sent=99)), error=RuntimeError("x")))
    with pytest.raises(RuntimeError), meter3.call("allreduce", []):
        raise RuntimeError("x")  # refused at once: the earlier error's
    text = m.text().decode()
    me = {"job": "4", "group": "0", "rank": "1"}
    assert value(text, "nicoffload_rank_calls_total", **me, collective="allreduce", path="offload") == 3
    assert value(text, "nicoffload_rank_bytes_total", **me, collective="allreduce") == (15 + 10) * 4
    assert value(text, "nicoffload_rank_records_sent_total", **me) == 30 + 4 + 1
    assert value(text, "nicoffload_rank_retransmissions_total", **me) == 2 + 3
    assert value(text, "nicoffload_rank_probes_total", **me) == 6
    assert value(text, "nicoffload_rank_timeouts_total", **me, reason="ranks_silent") == 1
    assert value(text, "nicoffload_rank_errors_total", **me, reason="RuntimeError") == 1

    gloo = GroupMeter(m, _group(None))  # a group on the gloo path
    fut = torch.futures.Future()
    gloo.gloo("allreduce", ([torch.zeros(4, dtype=torch.int64)],), fut)
    assert value(m.text().decode(), "nicoffload_rank_calls_total", path="fallback") == 0  # not done yet
    fut.set_result(None)
    b = torch.futures.Future()
    gloo.gloo("broadcast", ([torch.zeros(3)],), b)
    b.set_exception(RuntimeError("gloo"))
    text = m.text().decode()
    assert value(text, "nicoffload_rank_calls_total", **me, collective="allreduce", path="fallback") == 1
    assert value(text, "nicoffload_rank_fallbacks_total", **me, collective="allreduce", reason="group") == 1
    assert value(text, "nicoffload_rank_bytes_total", **me, collective="allreduce", path="fallback") == 32
    assert value(text, "nicoffload_rank_errors_total", **me, collective="broadcast", reason="RuntimeError") == 1

    # a failover during a call (the torch backend's Failover wrapper): counted once, by its cause
    fo = SimpleNamespace(stats=_Stats(), last=_Stats(), failovers=0, cause="", on_fallback=False)
    meter4 = GroupMeter(m, _group(fo))
    with meter4.call("allreduce", [torch.zeros(2)]):
        fo.failovers, fo.cause, fo.on_fallback = 1, "SilentAggregator: rank 1: ... not answered anything", True
    with meter4.call("allreduce", [torch.zeros(2)]):
        pass  # on the fallback already: no new failover
    text = m.text().decode()
    assert value(text, "nicoffload_rank_failovers_total", **me, collective="allreduce",
                 reason="SilentAggregator") == 1
