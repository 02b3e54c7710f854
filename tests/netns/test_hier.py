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


def run_pairs(make_testbed, calls, world: int = 4, timeout: float = 20):
    """Two levels with groups of two (width 2): every rank makes the calls ``calls`` (by call,
    then rank: its input) through its HierCommunicator, new ones per list of calls. Returns, per
    list, the results or errors by call then rank, and the seconds the list took."""
    from nicoffload.agg.control import Aggregator, AggSpec
    from nicoffload.worker.hier import HierCommunicator

    spec = DEFAULT.replace(slots=32, timeout=timeout)
    tb = make_testbed(world)
    spec = spec.replace(port=tb.port, group=tb.mcast_group)
    leaves, root = plan(spec, world, width=2)
    ips = [w.ip for w in tb.workers]
    runs = []
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, 0, spec.slots * 3, spec.elems, spec.port)) as agg:
        for lv in [*leaves, root]:
            agg.add_job(lv.job, len(lv.ranks), lv.group, [ips[r] for r in lv.ranks], slots=spec.slots)
        for these in calls:
            comms = []
            try:
                for r, w in enumerate(tb.workers):
                    with tb.in_host(w):
                        comms.append(HierCommunicator(r, world, tb.agg.ip, spec, local_ip=w.ip, width=2))

                def one(r):  # every call's result, or its error
                    got = []
                    for xs in these:
                        try:
                            got.append(comms[r].allreduce(xs[r]))
                        except BaseException as e:
                            got.append(e)
                    return got

                t0 = time.monotonic()
                by_rank, crashed = run_ranks(one, world, 3 * timeout)
                assert not crashed, crashed
                runs.append((list(zip(*by_rank)), time.monotonic() - t0))  # by call, then rank
            finally:
                for c in comms:
                    c.close()
    return runs


def test_a_nan_in_one_leaf_group_is_refused_by_every_rank_of_the_job(make_testbed):
    """Two levels with groups of two (width 2, four ranks): a NaN on rank 3 refuses the call in
    its group's leaf, its leader makes the root refuse, and the other group's leader hands its
    group a marker: every rank raises RefusedError at once (before: the other group waited at the
    root until its timeout). The next call is right on every rank."""
    from nicoffload.errors import RefusedError

    world = 4
    rng = np.random.default_rng(3)
    calls = [[rng.standard_normal(3000).astype(np.float32) for _ in range(world)] for _ in range(2)]
    calls[0][3][1234] = np.nan
    [(got, took)] = run_pairs(make_testbed, [calls])
    assert took < 15
    errs = got[0]
    assert all(isinstance(e, RefusedError) for e in errs), errs
    assert "rank 3's input holds a non-finite value (NaN at flat index 1234); every rank of the job" in str(errs[3])
    assert (errs[3].rank, errs[3].kind, errs[3].index) == (3, "NaN", 1234)
    assert "rank 3's input holds a non-finite value (NaN) in elements 1024..1279; every rank of" in str(errs[2])
    assert all("a rank of leaf group 1 (ranks 2..3) holds a non-finite value" in str(e) for e in errs[:2]), errs
    want = reference.two_level(calls[1], width=2)
    for r in range(world):
        assert want.check(got[1][r]).within_bound, (r, got[1][r])


def test_a_failed_leaf_group_or_root_fails_every_rank_at_once(make_testbed):
    """Ranks of one leaf group given tensors of different sizes: that group fails (its ranks'
    shapes disagree) and its leader refuses the root's call for it, so the other group fails at
    once naming it, instead of waiting out its timeout at the root. Then (new communicators) the
    two groups given different sizes: the root fails on each leader, which hands its group a
    marker, so every rank fails at once. The failures stay: the next call fails as fast."""
    from nicoffload.errors import ProtocolError, RefusedError

    world, timeout = 4, 20
    rng = np.random.default_rng(5)
    x = [rng.standard_normal(3000).astype(np.float32) for _ in range(world)]
    in_group = [x[0], x[1], x[2], x[3][:2000]]   # rank 3's size differs from rank 2's
    across = [x[0], x[1], x[2][:2000], x[3][:2000]]  # group 1's size differs from group 0's
    (group, t1), (root, t2) = run_pairs(make_testbed, [[in_group] * 2, [across] * 2], world, timeout)
    assert t1 < timeout / 2 and t2 < timeout / 2, (t1, t2)
    for errs in group:
        assert all(isinstance(e, ProtocolError) and not isinstance(e, RefusedError) for e in errs), errs
        assert all("disagree" in str(e) for e in errs[2:]), errs
        assert all("leaf group 1 (ranks 2..3) failed in this call" in str(e) for e in errs[:2]), errs
    for errs in root:
        assert all(isinstance(e, ProtocolError) for e in errs), errs
        assert all("disagree" in str(e) for e in (errs[0], errs[2])), errs  # the leaders, at the root
        assert "root level failed in this call (the leaders, rank 0 of this group" in str(errs[1]), errs
        assert "root level failed in this call (the leaders, rank 2 of this group" in str(errs[3]), errs


def test_int32_a_failed_leaf_group_or_root_fails_every_rank_at_once(make_testbed):
    """The same failures with int32 tensors, which have no metadata round to refuse nor a NaN to
    mark: the failed level's leader contributes a MAX where the others sum (hier._poison), the
    aggregator answers every rank of that round STATUS MISMATCH, and every rank fails at once
    (before: the other group waited out its timeout at the root, and a leader's group in step 3)."""
    from nicoffload.errors import MismatchError, ProtocolError

    world, timeout = 4, 20
    rng = np.random.default_rng(6)
    x = [rng.integers(-1000, 1000, 3000, dtype=np.int32) for _ in range(world)]
    in_group = [x[0], x[1], x[2], x[3][:2000]]   # rank 3's size differs from rank 2's
    across = [x[0], x[1], x[2][:2000], x[3][:2000]]  # group 1's size differs from group 0's
    (group, t1), (root, t2) = run_pairs(make_testbed, [[in_group] * 2, [across] * 2], world, timeout)
    assert t1 < timeout / 2 and t2 < timeout / 2, (t1, t2)
    for errs in group + root:  # the second call fails as fast: every level is out of step
        assert all(isinstance(e, MismatchError) for e in errs), errs
    errs = group[0]
    assert all("disagree" in str(e) for e in errs[2:]), errs   # group 1, in its leaf
    assert "disagree" in str(errs[0]) and "in the root job" in str(errs[0]), errs  # group 0's leader
    assert "root level failed in this call (the leaders, rank 0 of this group" in str(errs[1]), errs
    errs = root[0]
    assert all("disagree" in str(e) and "in the root job" in str(e) for e in (errs[0], errs[2])), errs
    assert "root level failed in this call (the leaders, rank 0 of this group" in str(errs[1]), errs
    assert "root level failed in this call (the leaders, rank 2 of this group" in str(errs[3]), errs
    assert issubclass(MismatchError, ProtocolError)
