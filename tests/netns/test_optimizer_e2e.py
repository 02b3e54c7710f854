"""Optimizer offload end to end: workers send gradients and get parameters back from the XDP
aggregator (and from the user-space one), bit for bit what the fixed-point model computes, the
same under 2% loss and duplication, and the optimizer state survives a checkpoint and restore."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from e2ekit import run_ranks

from nicoffload import optim
from nicoffload.agg.control import Aggregator, AggSpec
from nicoffload.optim import OptimizerSpec
from nicoffload.wire import keys
from nicoffload.worker.comm import Communicator

SPEC = OptimizerSpec(lr=0.1, momentum=0.9, weight_decay=1e-4)
ADAMW = OptimizerSpec.adamw(lr=1e-2, weight_decay=1e-2, amsgrad=True)
N, E = 5000, 256


def run_steps(tb, ranks, grads_per_step, slots, timeout=20, key=0, watch=None):
    """Every rank does every step (threads, each rank's socket in its namespace): the parameters
    each rank got back, per step. ``watch(comms)`` is called before the first step."""
    comms = []
    for r, h in enumerate(ranks):
        with tb.in_host(h):
            comms.append(Communicator(r, len(ranks), tb.agg.ip, group=tb.mcast_group, local_ip=h.ip,
                                      slots=slots, timeout=timeout, sparse=False, key=key))
    if watch is not None:
        watch(comms)
    got = [[] for _ in ranks]
    errors = []

    def go(r):
        try:
            for grads in grads_per_step:
                got[r].append(comms[r].step(grads[r]).copy())
        except BaseException as e:
            errors.append((r, e))

    ts = [threading.Thread(target=go, args=(r,)) for r in range(len(ranks))]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
    finally:
        for c in comms:
            c.close()
    assert not errors, errors
    return got


def steps(rng, world, k):
    return [[(rng.standard_normal(N) * 0.01 / world).astype(np.float32) for _ in range(world)] for _ in range(k)]


@pytest.mark.parametrize("faults, spec", [(False, SPEC), (True, SPEC), (True, ADAMW)],
                         ids=["clean", "drop2-dup2", "adamw-drop2-dup2"])
def test_workers_get_the_models_parameters_from_xdp(make_testbed, faults, spec):
    tb = make_testbed(3)
    ranks = tb.workers
    rng = np.random.default_rng(5)
    init = rng.uniform(-0.5, 0.5, N)
    k = 30 if faults else 6
    grads = steps(rng, len(ranks), k)
    P = optim.share(N, E)
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, optimizer=True)) as agg:
        agg.add_job(1, len(ranks), tb.mcast_group, [h.ip for h in ranks], optimizer=spec, params=N, initial=init)
        if faults:
            tb.faults.configure(None, drop=0.02, dup=0.02, seed=11)
        got = run_steps(tb, ranks, grads, P)
        st = agg.stats(1)
        final = agg.params(1)
        hit = tb.faults.stats() if faults else {}
    model = optim.JobModel(spec, init, len(ranks), E)
    for i, g in enumerate(grads):
        _, want = model.step(g)
        for r in range(len(ranks)):
            assert np.array_equal(got[r][i], want.astype(np.float32)), f"step {i}, rank {r}"
    assert np.array_equal(optim.to_fixed(final), model.w)
    assert st["updated"] == k * optim.blocks(N, E), st
    if faults:  # frames were dropped and duplicated on the way, and each update still happened once
        dropped = sum(d["dropped"] for link in hit.values() for d in link.values())
        duplicated = sum(d["duplicated"] for link in hit.values() for d in link.values())
        assert dropped > 0 and duplicated > 0, hit


def test_each_rank_sends_a_step_rotated_and_the_parameters_stay_the_models(make_testbed):
    """A step's data rounds go out from rank * K / N on, wrapping (calls.rotation_starts), so that
    every rank completes a share of the rounds and the update runs on every rank's queue instead
    of the rank behind's alone; the parameters are still the model's, bit for bit."""
    tb = make_testbed(3)
    ranks = tb.workers
    rng = np.random.default_rng(7)
    init = rng.uniform(-0.5, 0.5, N)
    grads = steps(rng, len(ranks), 4)
    P, K = optim.share(N, E), optim.blocks(N, E)
    spans: list[list[tuple[int, int]]] = [[] for _ in ranks]

    def watch(comms):
        for r, c in enumerate(comms):
            t, ring = c._s._t, c._s._send
            send = t.send_records

            def logged(buf, a, n, *args, _r=r, _send=send, _ring=ring, **kw):
                if buf.base is _ring or buf is _ring:
                    spans[_r].append((a, n))
                return _send(buf, a, n, *args, **kw)
            t.send_records = logged

    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, optimizer=True)) as agg:
        agg.add_job(1, len(ranks), tb.mcast_group, [h.ip for h in ranks], optimizer=ADAMW, params=N, initial=init)
        got = run_steps(tb, ranks, grads, P, watch=watch)
    starts = [r * K // len(ranks) for r in range(len(ranks))]
    assert starts == [0, 6, 13]
    for r, first in enumerate(starts[1:], 1):  # the whole step at once: from its start, then the wrap
        pairs = list(zip(spans[r], spans[r][1:]))
        assert ((first, K - first), (0, first)) in pairs, (r, spans[r])
    model = optim.JobModel(ADAMW, init, len(ranks), E)
    for i, g in enumerate(grads):
        _, want = model.step(g)
        for r in range(len(ranks)):
            assert np.array_equal(got[r][i], want.astype(np.float32)), f"step {i}, rank {r}"


def test_checkpoint_and_restore_continue_the_same_run(make_testbed, tmp_path):
    tb = make_testbed(2)
    ranks = tb.workers
    rng = np.random.default_rng(6)
    init = rng.uniform(-0.5, 0.5, N)
    grads = steps(rng, 2, 4)
    P = optim.share(N, E)
    model = optim.JobModel(SPEC, init, 2, E)
    for g in grads:
        _, want = model.step(g)
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, optimizer=True)) as agg:
        agg.add_job(1, 2, tb.mcast_group, [h.ip for h in ranks], optimizer=SPEC, params=N, initial=init)
        run_steps(tb, ranks, grads[:2], P)
        ckpt = agg.save_optimizer(1, tmp_path / "opt")
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, optimizer=True)) as agg:
        agg.add_job(1, 2, tb.mcast_group, [h.ip for h in ranks], optimizer=SPEC, params=N)
        agg.load_optimizer(1, ckpt)
        got = run_steps(tb, ranks, grads[2:], P)
    assert np.array_equal(got[0][-1], want.astype(np.float32)) and np.array_equal(got[1][-1], got[0][-1])


@pytest.mark.parametrize("spec", [SPEC, ADAMW], ids=["sgd", "adamw"])
def test_the_userspace_aggregator_applies_the_same_optimizer(make_testbed, spec):
    from nicoffload.userspace.aggregator import UserspaceAggregator

    tb = make_testbed(2)
    ranks = tb.workers
    rng = np.random.default_rng(7)
    init = rng.uniform(-0.5, 0.5, N)
    grads = steps(rng, 2, 5)
    P = optim.share(N, E)
    with tb.in_host(tb.agg):
        ua = UserspaceAggregator(2, port=tb.port, elems=E, group=tb.mcast_group, local_ip=tb.agg.ip,
                                 worker_ips=[h.ip for h in ranks], optimizer=spec, params=init)
    with ua:
        got = run_steps(tb, ranks, grads, P)
    model = optim.JobModel(spec, init, 2, E)
    for i, g in enumerate(grads):
        _, want = model.step(g)
        assert np.array_equal(got[0][i], want.astype(np.float32)) and np.array_equal(got[1][i], got[0][i]), i
    assert np.array_equal(optim.to_fixed(ua.master_weights), model.w)
    assert ua.stats["updated"] == 5 * optim.blocks(N, E)


def test_the_optimizer_commands(make_testbed, tmp_path):
    import json
    import subprocess
    import sys

    from nicoffload.agg.control import unload

    tb = make_testbed(2)
    ranks = tb.workers
    cli = [sys.executable, "-m", "nicoffload.cli", "agg"]
    where = ["--netns", tb.agg.netns, "--iface", tb.agg.iface]
    init = np.linspace(-1, 1, N)
    np.save(tmp_path / "init.npy", init)

    def run(*argv):
        words = 1 if argv[0] == "load" else 2  # the subcommand's words, then its options
        return subprocess.run(cli + list(argv[:words]) + where + list(argv[words:]), capture_output=True, text=True,
                              timeout=120)

    P = optim.share(N, E)
    try:
        r = run("load", "--slots", str(2 * P), "--job-slots", str(P), "--workers", "2", "--group", tb.mcast_group, "--optimizer", "sgd",
                "--lr", "0.1", "--momentum", "0.9", "--params", str(N), "--init", str(tmp_path / "init.npy"),
                "--worker-ip", ranks[0].ip, "--worker-ip", ranks[1].ip)
        assert r.returncode == 0, r.stderr
        key = keys.parse(r.stdout.split(" key ")[1].split()[0])  # the key `agg load` drew and printed
        grads = steps(np.random.default_rng(8), 2, 2)
        run_steps(tb, ranks, grads[:1], P, key=key)
        r = run("opt", "show", "--job", "1", "--json")
        shown = json.loads(r.stdout)
        assert shown["updates"] == {"min": 1, "max": 1} and shown["optimizer"]["lr"] == 0.1
        assert run("opt", "set-lr", "--job", "1", "--lr", "0.01").returncode == 0
        assert run("opt", "save", "--job", "1", "--file", str(tmp_path / "ckpt.npz")).returncode == 0
        run_steps(tb, ranks, grads[1:], P, key=key)
        assert run("opt", "params", "--job", "1", "-o", str(tmp_path / "w.npy")).returncode == 0
        model = optim.JobModel(OptimizerSpec(lr=0.1, momentum=0.9), init, 2, E)
        model.step(grads[0])
        model.spec = OptimizerSpec(lr=0.01, momentum=0.9)  # the schedule: lr 0.01 from the second update
        model.step(grads[1])
        assert np.array_equal(optim.to_fixed(np.load(tmp_path / "w.npy")), model.w)
        r = run("opt", "restore", "--job", "1", "--file", str(tmp_path / "ckpt.npz"))
        assert r.returncode == 0, r.stderr
        assert json.loads(run("opt", "show", "--job", "1", "--json").stdout)["updates"]["max"] == 1
        r = run("job", "add", "--job", "2", "--workers", "1", "--optimizer", "sgd", "--lr", "2")
        assert r.returncode == 2 and "--lr must be in [0, 1]" in r.stderr, r.stderr
        r = run("job", "add", "--job", "2", "--workers", "1", "--optimizer", "adamw", "--lr", "0.5")
        assert r.returncode == 2 and "at most 1 - beta1" in r.stderr, r.stderr
        r = run("job", "add", "--job", "2", "--workers", "1", "--optimizer", "adamw", "--betas", "0.9")
        assert r.returncode == 2 and "--betas takes two numbers" in r.stderr, r.stderr
        r = run("job", "add", "--job", "2", "--workers", "1", "--group", "239.77.0.42", "--worker-ip", ranks[0].ip,
                "--optimizer", "adamw", "--betas", "0.8,0.99", "--amsgrad", "--params", str(N), "--slots", str(P))
        assert r.returncode == 0, r.stderr
        shown = json.loads(run("opt", "show", "--job", "2", "--json").stdout)["optimizer"]
        assert shown["kind"] == "adamw" and shown["betas"] == [0.8, 0.99] and shown["amsgrad"]
        assert shown["lr"] == 1e-3 and shown["weight_decay"] == 1e-2  # torch.optim.AdamW's defaults
    finally:
        unload(tb.agg.netns, tb.agg.iface, missing_ok=True)


def test_a_step_one_rank_cannot_take_is_refused_by_every_rank_and_changes_nothing(make_testbed):
    """A gradient out of the optimizer's range on one rank, then a NaN on another: every rank's
    step fails at once with a RefusedError naming that rank (the metadata round carries the
    refusal), the job's state stays as it was, and the next step is the model's second step."""
    from nicoffload.errors import RefusedError

    tb = make_testbed(3)
    ranks = tb.workers
    rng = np.random.default_rng(6)
    init = rng.uniform(-0.5, 0.5, N)
    good = steps(rng, len(ranks), 2)
    huge = [g.copy() for g in good[1]]
    huge[1][4321] = 2.0 ** (optim.RANGE + 3)
    nan = [g.copy() for g in good[1]]
    nan[2][17] = np.nan
    P = optim.share(N, E)
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=P, optimizer=True)) as agg:
        agg.add_job(1, len(ranks), tb.mcast_group, [h.ip for h in ranks], optimizer=SPEC, params=N, initial=init)
        comms = []
        for r, h in enumerate(ranks):
            with tb.in_host(h):
                comms.append(Communicator(r, len(ranks), tb.agg.ip, group=tb.mcast_group, local_ip=h.ip,
                                          slots=P, timeout=20, sparse=False))

        def go(r):  # every step's parameters, or its error
            got = []
            for grads in [good[0], huge, nan, good[1]]:
                try:
                    got.append(comms[r].step(grads[r]).copy())
                except BaseException as e:
                    got.append(e)
            return got

        try:  # refusals come at once; a rank that waited out its 20 s timeout fails below
            by_rank, crashed = run_ranks(go, len(ranks), 60)
        finally:
            for c in comms:
                c.close()
        assert not crashed, crashed
        outcome = list(zip(*by_rank))  # by step, then rank
        st = agg.stats(1)
    model = optim.JobModel(SPEC, init, len(ranks), E)
    for i, r_says in ((1, "rank 1's gradients in elements 4096..4351 are out of the optimizer's range"),
                      (2, "rank 2's input holds a non-finite value (NaN) in elements 0..255")):
        errs = outcome[i]
        assert all(isinstance(e, RefusedError) for e in errs), errs
        assert "a gradient reaches 2^" in str(errs[1]) if i == 1 else "NaN at flat index 17" in str(errs[2])
        assert all(r_says in str(e) for r, e in enumerate(errs) if r != i), errs
    for i, g in ((0, good[0]), (3, good[1])):
        _, want = model.step(g)
        for r in range(len(ranks)):
            assert np.array_equal(outcome[i][r], want.astype(np.float32)), f"step {i}, rank {r}: {outcome[i][r]}"
    assert st["updated"] == 2 * optim.blocks(N, E), st
