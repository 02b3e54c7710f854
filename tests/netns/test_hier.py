"""Jobs of more than 32 ranks (nicoffload.worker.hier): 40 ranks on the testbed, in two leaf
jobs of 20 and a root job of their leaders on one XDP aggregator; int32 exact, float32 within
the two-level bound (small tensors: 40 rank processes share the machine's 2 cores)."""
from __future__ import annotations

import numpy as np
from e2ekit import save

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
