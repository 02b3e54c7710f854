"""Jobs of more than 32 ranks (nicoffload.worker.hier): 40 ranks on the testbed, in two leaf
jobs of 20 and a root job of their leaders on one XDP aggregator; int32 exact, float32 within
the two-level bound (small tensors: 40 rank processes share the machine's 2 cores)."""
from __future__ import annotations

import time

import numpy as np
from e2ekit import run_ranks, save

from nicoffload.jobspec import DEFAULT
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job
from nicoffload.worker.hier import plan


def test_forty_ranks_in_two_levels(make_testbed, tmp_path):
    world = 40
    leaves, root = plan(DEFAULT, world)
    assert [len(lv.ranks) for lv in leaves] == [20, 20] and root.ranks == (0, 20)
    tb = make_testbed(world)
    rng = np.random.default_rng(40)
    n = 3 * DEFAULT.elems + 7
    ints = [rng.integers(-2 ** 31, 2 ** 31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(world)]
    floats = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(world)]
    for tag, xs in (("i", ints), ("f", floats)):
        (tmp_path / tag).mkdir()
        ins, outs = save(tmp_path / tag, xs)
        res = run_job(tb, ins, outs, "xdp", DEFAULT.replace(slots=64, timeout=60))
        want = reference.two_level(xs)
        for r in range(world):
            c = want.check(np.load(outs[r]))
            assert c.within_bound, (tag, r, c.reason)
        # three jobs on the aggregator: the two leaves' rounds and the root's
        assert res.agg_stats["epoch_formed"] == 3 and res.agg_stats["bad_src"] == 0


def test_a_nan_in_one_leaf_group_is_refused_by_every_rank_of_the_job(make_testbed):
    """Two levels with groups of two (width 2, four ranks): a NaN on rank 3 refuses the call in
    its group's leaf, its leader makes the root refuse, and the other group's leader hands its
    group a marker: every rank raises RefusedError at once (before: the other group waited at the
    root until its timeout). The next call is right on every rank."""
    from nicoffload.agg.control import Aggregator, AggSpec
    from nicoffload.errors import RefusedError
    from nicoffload.worker.hier import HierCommunicator

    world, spec = 4, DEFAULT.replace(slots=32, timeout=20)
    tb = make_testbed(world)
    spec = spec.replace(port=tb.port, group=tb.mcast_group)
    leaves, root = plan(spec, world, width=2)
    ips = [w.ip for w in tb.workers]
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, 0, spec.slots * 3, spec.elems, spec.port)) as agg:
        for lv in [*leaves, root]:
            agg.add_job(lv.job, len(lv.ranks), lv.group, [ips[r] for r in lv.ranks], slots=spec.slots)
        comms = []
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(HierCommunicator(r, world, tb.agg.ip, spec, local_ip=w.ip, width=2))
        rng = np.random.default_rng(3)
        calls = [[rng.standard_normal(3000).astype(np.float32) for _ in range(world)] for _ in range(2)]
        calls[0][3][1234] = np.nan

        def one(r):  # every call's result, or its error
            got = []
            for xs in calls:
                try:
                    got.append(comms[r].allreduce(xs[r]))
                except BaseException as e:
                    got.append(e)
            return got

        t0 = time.monotonic()
        try:
            by_rank, crashed = run_ranks(one, world, 60)
        finally:
            for c in comms:
                c.close()
    assert not crashed, crashed
    got = list(zip(*by_rank))  # by call, then rank
    assert time.monotonic() - t0 < 15
    errs = got[0]
    assert all(isinstance(e, RefusedError) for e in errs), errs
    assert "rank 3's input holds a non-finite value (NaN at flat index 1234); every rank of the job" in str(errs[3])
    assert "rank 3's input holds a non-finite value (NaN) in elements 1024..1279; every rank of" in str(errs[2])
    assert all("a rank of leaf group 1 (ranks 2..3) holds a non-finite value" in str(e) for e in errs[:2]), errs
    want = reference.two_level(calls[1], width=2)
    for r in range(world):
        assert want.check(got[1][r]).within_bound, (r, got[1][r])
