"""The soak (nicoffload.lab.soak) end to end: 1,000 consecutive AllReduces by three ranks through
the XDP aggregator with 2% of frames dropped and 2% duplicated both ways on every link, three
sizes (4 KiB to 1 MiB) and int32, float32 and float64, every result exact or within its bound;
and a soak that cannot go on stops naming the call and the ranks instead of hanging."""
from __future__ import annotations

import time

import pytest

from nicoffload.ebpf import loader as bpf
from nicoffload.errors import TimeoutError_
from nicoffload.jobspec import DEFAULT
from nicoffload.lab import soak
from nicoffload.testbed.fault import DIRECTIONS

KiB, MiB = 1 << 10, 1 << 20


def assert_left_clean(tb) -> None:
    assert tb.faults.configured() == {}, "the fault injector is still configured"
    assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is None, "the aggregator is still attached"


def test_a_thousand_allreduces_under_drop_and_duplication_on_every_link(make_testbed):
    tb = make_testbed(3)
    cfg = soak.SoakConfig(calls=1000, sizes=(4 * KiB, 64 * KiB, MiB), dtypes=("int32", "float32", "float64"),
                          drop=0.02, dup=0.02, seed=11)
    t0 = time.monotonic()
    s = soak.run(tb, cfg)
    took = time.monotonic() - t0
    first = s.failures[0] if s.failures else None
    assert s.exact, f"{len(s.failures)} wrong result(s), the first: {first}"
    assert s.count == 1000 and not s.error
    pairs = {(b, d) for b in cfg.sizes for d in cfg.dtypes}
    assert {(r.bytes, r.dtype) for r in s.records} == pairs
    assert all(row["count"] in (111, 112) for row in soak.time_table(s.records) if row["dtype"] != "all")
    # the injector really dropped and duplicated, both ways on every link (the aggregator's too)
    assert set(s.faults) == {h.name for h in tb.hosts}
    for host, st in s.faults.items():
        for d in DIRECTIONS:
            assert st[d]["dropped"] > 0 and st[d]["duplicated"] > 0, (host, d, st[d])
    # ... and the protocol recovered from it: retransmissions and pulls answered, duplicates dropped
    t = s.totals()
    assert t["retransmissions"] > 0 and t["pulls"] > 0 and t["timeouts"] > 0, t
    a = s.aggregator
    assert a["retx_answered"] > 0 and a["pull_answered"] > 0 and a["dup_dropped"] > 0, a
    assert a["mismatch"] == 0 and a["stale_epoch"] == 0 and not any(v for k, v in a.items() if k.startswith("bad_")), a
    worst = soak.worst_call(s.records)
    assert worst.seconds < 5.0, f"the worst call took {worst.seconds:.2f} s: {worst}"
    assert_left_clean(tb)
    print(f"\n{soak.format_summary(s)}\n(test {took:.1f} s)")


def blackhole_w1_after(tb, calls: int):
    """A progress callback that drops every frame of w1's link once ``calls`` calls are done."""
    def progress(line: str) -> None:
        if line.startswith(f"[soak] {calls}/"):
            tb.faults.configure("w1", drop=1.0)
    return progress


def test_a_soak_that_cannot_go_on_stops_naming_the_call_and_the_ranks(make_testbed):
    """w1's link drops everything from call 100 on: first the ranks' own timeouts end the call
    (each rank's error is named), then a call limit below that timeout ends it (the ranks still
    inside are named); both times the testbed is left clean."""
    tb = make_testbed(3)
    cfg = soak.SoakConfig(calls=300, sizes=(4 * KiB,), drop=0.0, dup=0.0, spec=DEFAULT.replace(timeout=1.0))
    with pytest.raises(soak.SoakError) as ei:
        soak.run(tb, cfg, progress=blackhole_w1_after(tb, 100))
    e = ei.value
    msg = str(e)
    assert "call 100 (4KiB int32)" in msg, msg
    assert "rank 0:" in msg and "rank 2:" in msg and "no contribution from rank(s) 1" in msg, msg
    assert e.exit_code == TimeoutError_.exit_code
    assert e.summary.count == 100 and not e.summary.exact and e.summary.error
    assert_left_clean(tb)

    cfg = soak.SoakConfig(calls=300, sizes=(4 * KiB,), drop=0.0, dup=0.0, spec=DEFAULT.replace(timeout=3.0),
                          call_limit=0.5)
    t0 = time.monotonic()
    with pytest.raises(soak.SoakError) as ei:
        soak.run(tb, cfg, progress=blackhole_w1_after(tb, 100))
    msg = str(ei.value)
    assert "call 100 (4KiB int32)" in msg and "rank(s) 0, 1, 2 still running after 0.5 s" in msg, msg
    assert ei.value.exit_code == TimeoutError_.exit_code
    assert time.monotonic() - t0 < 30
    assert_left_clean(tb)
