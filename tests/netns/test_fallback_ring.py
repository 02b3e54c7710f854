"""``communicator(..., fallback="ring")`` (issue 32): a communicator used directly, without torch,
goes on when its aggregator's program is unloaded in the middle of a call, on the ring of its
ranks, and every call's result is the bits of a run without the failure; in a job sharded over
two aggregators only the lost aggregator's shard takes the ring."""
from __future__ import annotations

import threading
import time

import numpy as np
from e2ekit import run_ranks

from nicoffload.agg import AggSpec, Aggregator
from nicoffload.communicators import communicator
from nicoffload.jobspec import DEFAULT
from nicoffload.worker import speculation

WORLD = 3


def calls(seed: int) -> list[list[np.ndarray]]:
    """Per call, every rank's input: big float32 (the call that is cut), int32, float64, float32."""
    rng = np.random.default_rng(seed)
    shapes = [(np.float32, 3 << 18), (np.int32, 5000), (np.float64, 70000), (np.float32, 3 << 18),
              (np.float32, 1000)]
    out = []
    for dtype, n in shapes:
        if dtype == np.int32:
            out.append([rng.integers(-2 ** 31, 2 ** 31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(WORLD)])
        else:
            out.append([(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype) for _ in range(WORLD)])
    return out


def job(tb, data, cut_at: int | None = None, victim: int = 0, inplace: bool = False, armed=None):
    """Every call of ``data`` on comms with the ring fallback; with ``cut_at``, aggregator
    ``victim``'s program is unloaded while call ``cut_at`` is in flight (or, on a machine that
    finishes it first, before the next call begins); ``armed(aggs)`` instead lets the caller cut it
    at a point of its choosing. ``inplace``: every call writes its result into its input. Returns
    (outputs by rank, each rank's communicator summaries)."""
    aggs = [Aggregator.load(AggSpec(a.netns, a.iface, WORLD, slots=64, port=tb.port, group=tb.mcast_group,
                                    worker_ips=[w.ip for w in tb.workers])) for a in tb.aggs]
    spec = DEFAULT.replace(port=tb.port, group=tb.mcast_group, slots=64, timeout=30)
    peers = [w.ip for w in tb.workers]
    comms, started, killed = [], threading.Event(), threading.Event()
    try:
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(communicator(r, WORLD, aggregator=",".join(a.ip for a in tb.aggs), spec=spec,
                                          local_ip=w.ip, peers=peers, fallback="ring", failover=1.0))

        def rank(r):
            got = []
            for n, xs in enumerate(data):
                if r == 0 and n == cut_at:
                    started.set()
                x = xs[r].copy()
                got.append(comms[r].allreduce(x, out=x if inplace else None))
                if n == cut_at:  # the next call starts only once the program is gone: a fast machine
                    killed.wait(60)  # may finish this one first, and then the next one is cut
            return got

        killer = None
        if armed is not None:
            armed(aggs)
        elif cut_at is not None:
            def kill():
                started.wait(60)
                time.sleep(0.02)
                aggs[victim].close()
                killed.set()
            killer = threading.Thread(target=kill, daemon=True)
            killer.start()
        outs, errs = run_ranks(rank, WORLD, timeout=120)
        if killer is not None:
            killer.join(5)
        assert not errs, [(r, str(e)) for r, e in errs]
        shards = [getattr(c, "comms", [c]) for c in comms]
        return outs, [[s.summary() for s in each] for each in shards]
    finally:
        for c in comms:
            c.close()
        for a in aggs:
            a.close()


def test_a_communicator_fails_over_to_the_ring_bit_for_bit(make_testbed):
    tb = make_testbed(WORLD)
    data = calls(32)
    want, ok = job(tb, data)
    assert all(s[0]["failovers"] == 0 for s in ok), ok
    got, summaries = job(tb, data, cut_at=0)
    for r in range(WORLD):
        s = summaries[r][0]
        assert s["failovers"] == 1 and s["path"] == "ring (user)" and "SilentAggregator" in s["cause"], s
        for n in range(len(data)):
            assert got[r][n].tobytes() == want[r][n].tobytes(), (r, n)


def test_a_sharded_job_fails_over_only_the_lost_aggregators_shard(make_testbed):
    tb = make_testbed(WORLD, aggregators=2)
    data = calls(33)
    want, _ = job(tb, data)
    got, summaries = job(tb, data, cut_at=1, victim=1)
    for r in range(WORLD):
        first, second = summaries[r]
        assert first["failovers"] == 0 and first["path"] == "aggregator", first
        assert second["failovers"] == 1 and second["path"] == "ring (user)", second
        for n in range(len(data)):
            assert got[r][n].tobytes() == want[r][n].tobytes(), (r, n)


def test_a_pipelined_in_place_call_cut_between_its_chunks_fails_over_bit_for_bit(make_testbed, monkeypatch):
    """The aggregator unloaded while a pipelined call (results written in place as they come)
    waits for its third chunk's metadata: the chunks before it hold sums, the rest the input, and
    the ring completes the call to the bits of a run without the failure."""
    tb = make_testbed(WORLD)
    monkeypatch.setattr(speculation, "PIPELINE_ELEMS", 1 << 16)
    data = calls(34)
    want, _ = job(tb, data, inplace=True)
    cut = []
    scale0 = speculation._Pipeline._scale

    def arm(aggs):
        def scale1(self, i):
            if i == 2 and self.c.rank == 0 and not cut:
                cut.append(self.c.rank)
                aggs[0].close()
            return scale0(self, i)
        monkeypatch.setattr(speculation._Pipeline, "_scale", scale1)

    got, summaries = job(tb, data, inplace=True, armed=arm)
    assert cut, "no call was pipelined"
    for r in range(WORLD):
        s = summaries[r][0]
        assert s["failovers"] == 1 and s["path"] == "ring (user)", s
        for n in range(len(data)):
            assert got[r][n].tobytes() == want[r][n].tobytes(), (r, n)
