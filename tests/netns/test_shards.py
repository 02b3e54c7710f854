"""A job sharded over several aggregators (``testbed up --aggregators K``, ``--aggregator
IP1,IP2,...``): each aggregator sums its shard of every tensor in its own job, and the result is
the one a single aggregator gives, bit for bit (the shards cut at block boundaries, so every
block keeps its exponent), in both layouts; an aggregator that goes away is named by the call
that needed it."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from e2ekit import run_ranks, save

from nicoffload.agg import AggSpec, Aggregator
from nicoffload.errors import RefusedError, TimeoutError_
from nicoffload.jobspec import DEFAULT
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job
from nicoffload.wire import proto
from nicoffload.worker import ShardedCommunicator
from nicoffload.worker.shards import shard_specs

E = proto.DEFAULT_ELEMS


def arrays(world: int, seed: int):
    rng = np.random.default_rng(seed)
    n = 37 * E + 11
    f = [(rng.standard_normal(n) * 10.0 ** rng.integers(-4, 5, n)).astype(np.float32) for _ in range(world)]
    f[0][: 9 * E] = 0  # a run of zero blocks on one rank: uneven contiguous shards
    i = [rng.integers(-2 ** 31, 2 ** 31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(world)]
    return f, i


@pytest.mark.parametrize("k", [3])
def test_a_sharded_job_is_the_single_aggregators_bit_for_bit(make_testbed, tmp_path, k):
    world = 3
    one = make_testbed(world, suffix="a")
    many = make_testbed(world, suffix="b", aggregators=k)
    f, i = arrays(world, k)
    for data, tag in ((f, "f"), (i, "i")):
        (tmp_path / tag).mkdir()
        ins, ref = save(tmp_path / tag, data)
        run_job(one, ins, ref, "xdp", DEFAULT)
        want = reference.quantized(data, E)
        for layout in ("contiguous", "roundrobin"):
            d = tmp_path / tag / layout
            d.mkdir()
            _, outs = save(d, data)
            res = run_job(many, ins, outs, "xdp", DEFAULT.replace(layout=layout))
            for r in range(world):
                got = np.load(outs[r])
                assert want.check(got).within_bound, (tag, layout, r)
                assert got.tobytes() == np.load(ref[r]).tobytes(), (tag, layout, r)
            # every aggregator summed its shard
            assert res.agg_stats["completed"] > 0 and len(many.aggs) == k


def sharded_comms(tb, world: int, **kw) -> list:
    """A ShardedCommunicator per rank of ``tb`` over its aggregators (``kw``: the spec's fields,
    and silence); the caller closes them."""
    silence = kw.pop("silence", None)
    extra = {} if silence is None else {"silence": silence}
    spec = DEFAULT.replace(port=tb.port, group=tb.mcast_group, slots=64, **kw)
    comms = []
    try:
        for r, w in enumerate(tb.workers[:world]):
            with tb.in_host(w):
                comms.append(ShardedCommunicator(r, world, [a.ip for a in tb.aggs], spec, local_ip=w.ip, **extra))
    except BaseException:
        for c in comms:
            c.close()
        raise
    return comms


def test_an_aggregator_that_goes_away_is_named(make_testbed):
    world = 2
    tb = make_testbed(world, aggregators=2)
    aggs = [Aggregator.load(AggSpec(a.netns, a.iface, world, slots=64, port=tb.port, group=tb.mcast_group,
                                    worker_ips=[w.ip for w in tb.workers])) for a in tb.aggs]
    comms = []
    try:
        comms = sharded_comms(tb, world, timeout=60, silence=2.0)
        x = [np.arange(20 * E, dtype=np.int32) * (r + 1) for r in range(world)]
        outs, errs = [None] * world, []

        def run(r):
            try:
                outs[r] = comms[r].allreduce(x[r])
            except BaseException as e:
                errs.append(e)

        for round_ in range(2):
            ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            if round_ == 0:
                assert not errs and all(np.array_equal(o, x[0] * 3) for o in outs)
                aggs[1].close()  # the second aggregator goes away between two calls
        assert len(errs) == world
        for e in errs:
            assert isinstance(e, TimeoutError_) and f"aggregator {tb.aggs[1].ip}:{tb.port}" in str(e), e
            assert tb.aggs[0].ip not in str(e)
    finally:
        for c in comms:
            c.close()
        for a in aggs:
            a.close()


def test_a_nan_in_a_shard_is_refused_by_every_rank_naming_its_place_in_the_whole_tensor(make_testbed):
    """A NaN in the second shard of a call: every rank refuses the call, the rank that holds it
    naming its flat index in the whole tensor and the others its block's elements there (not the
    shard's), in both layouts; the next call is exact."""
    world, k, n = 2, 2, 10 * E + 7
    tb = make_testbed(world, aggregators=k)
    aggs = [Aggregator.load(AggSpec(a.netns, a.iface, world, slots=64, port=tb.port, group=tb.mcast_group,
                                    worker_ips=[w.ip for w in tb.workers])) for a in tb.aggs]
    rng = np.random.default_rng(9)
    x = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    try:
        # contiguous: blocks 0..4 go to aggregator 0, 5..10 to aggregator 1; round robin: odd blocks to 1
        for layout, at in (("contiguous", 7 * E + 3), ("roundrobin", 3 * E + 200)):
            comms = sharded_comms(tb, world, timeout=30, layout=layout)
            try:
                bad = [a.copy() for a in x]
                bad[1][at] = np.nan
                _, errs = run_ranks(lambda r: comms[r].allreduce(bad[r]), world)
                assert len(errs) == world, (layout, errs)
                lo = at // E * E
                for r, e in errs:
                    assert isinstance(e, RefusedError) and e.rank == 1 and e.kind == "NaN", (layout, r, e)
                    says = f"(NaN at flat index {at})" if r == 1 else f"(NaN) in elements {lo}..{lo + E - 1}"
                    assert says in str(e), (layout, r, str(e))
                    assert (e.index, e.span) == ((at, None) if r == 1 else (None, (lo, lo + E))), (layout, r)
                outs, errs = run_ranks(lambda r: comms[r].allreduce(x[r]), world)
                assert not errs, (layout, errs)
                want = reference.quantized(x, E)
                assert all(want.check(o).within_bound for o in outs), layout
            finally:
                for c in comms:
                    c.close()
    finally:
        for a in aggs:
            a.close()


def test_adamw_state_sharded_over_two_aggregators_is_one_aggregators_bit_for_bit(make_testbed):
    """The optimizer's state sharded like ZeRO's over the aggregators' NICs: each holds AdamW's
    weights and moments of its contiguous shard of the parameters (optim.shards), and the ranks'
    parameters after every step are the single-job model's."""
    from nicoffload import optim

    world, n = 2, 9 * E + 5
    tb = make_testbed(world, aggregators=2)
    spec = optim.OptimizerSpec.adamw(lr=1e-2, weight_decay=0.01)
    rng = np.random.default_rng(4)
    init = rng.uniform(-1, 1, n)
    cuts = optim.shards(n, E, 2)
    aggs, comms = [], []
    try:
        for a, (lo, hi) in zip(tb.aggs, cuts):
            agg = Aggregator.load(AggSpec(a.netns, a.iface, slots=optim.share(hi - lo, E), port=tb.port,
                                          optimizer=True))
            aggs.append(agg)
            agg.add_job(DEFAULT.job, world, tb.mcast_group, [w.ip for w in tb.workers], optimizer=spec,
                        params=hi - lo, initial=init[lo:hi])
        base = DEFAULT.replace(port=tb.port, group=tb.mcast_group, timeout=30, sparse=False)
        specs = [s.replace(slots=optim.share(hi - lo, E)) for s, (lo, hi) in zip(shard_specs(base, 2), cuts)]
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(ShardedCommunicator(r, world, [a.ip for a in tb.aggs], specs, local_ip=w.ip))
        model = optim.JobModel(spec, init, world, E)
        for step in range(3):
            grads = [(rng.standard_normal(n) * 0.01).astype(np.float32) for _ in range(world)]
            outs = [None] * world
            ts = [threading.Thread(target=lambda r=r: outs.__setitem__(r, comms[r].step(grads[r])))
                  for r in range(world)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            _, want = model.step(grads)
            for r in range(world):
                assert outs[r] is not None and outs[r].tobytes() == want.astype(np.float32).tobytes(), (step, r)
        assert [a.stats(DEFAULT.job)["updated"] for a in aggs] == [3 * optim.blocks(hi - lo, E) for lo, hi in cuts]
    finally:
        for c in comms:
            c.close()
        for a in aggs:
            a.close()
