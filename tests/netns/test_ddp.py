"""PyTorch DistributedDataParallel through nicoffload, end to end on a namespace testbed.

Two runs of the same job (2 ranks, STEPS steps, same seeds): DDP's default gloo all-reduce, and
the nicoffload hook with the XDP aggregator. Each rank is ``python -m nicoffload.lab.train.ddp_rank`` inside
its worker's namespace. Skipped without the torch extra.

Tolerance of the parameter comparison, derived from the quantization bound (nicoffload/wire/quant.py)
------------------------------------------------------------------------------------------
N ranks, L = ceil(log2 N). At step k let G_k be the largest |gradient| any rank hands the hook
(before DDP's division by N), P_k the largest |parameter| and M_k the largest momentum entry.
Both runs average g_r / N (DDP pre-divides; the hook does the same). Per element:
* nicoffload's sum of block b is within N * 2^(E_b + L - 31) of the exact sum, where
  2^(E_b - 1) <= max_r |g_r| / N, i.e. within 2^(L-30) * G_k; casting it to float32 adds half an
  ulp, <= 2^-24 * G_k;
* gloo's float32 sum of N terms is within (N - 1) half-ulps, <= (N - 1) * 2^-24 * G_k, of exact;
so the averaged gradients differ by at most eps * G_k with eps = 2^(L-30) + N * 2^-24.
SGD with momentum (v <- beta v + g, p <- p - lr v) carries a gradient difference into the
parameters with a weight of at most lr / (1 - beta) in total; the runs' own float32 roundings may
then go different ways: one ulp of the parameter (2^-23 * P_k) per update, and two of the momentum
buffer (2^-22 * M_k) weighted by lr / (1 - beta). First order, after K steps:
    B(K) = sum_k [ lr/(1-beta) * (eps * G_k + 2^-22 * M_k) + 2^-23 * P_k ]
and the test allows FEEDBACK * B(K): a factor for parameter differences feeding back into the
gradients over K steps (small for the smooth tanh MLP: the measured difference is far below
B(K); with ReLU a unit switching on in one run only would break any such bound).

Final accuracy: at most ACC_FLIPS of the test samples may be classified differently.
"""
from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the DDP tests need the torch extra: pip install 'nicoffload[torch]'")

from nicoffload.errors import NicoffloadError, TimeoutError_  # noqa: E402
from nicoffload.lab.train.ddp_train import launch  # noqa: E402

WORKERS = 2
STEPS = 20
FEEDBACK = 4.0
ACC_FLIPS = 2
HOOK_TIMEOUT = 2.0   # seconds without progress before a nicoffload all-reduce fails
DEADLINE = 60.0      # seconds for one whole run (start-up included) before ranks are killed
# 100 kB buckets: the 340 kB of gradients go as several buckets per step, so the hook's ordering
# and its overlap with backward are exercised (DDP's default would make one bucket)
SMALL_BUCKETS = ["--bucket-cap-mb", "0.1"]


@pytest.fixture(scope="module")
def tb():
    from nicoffload.testbed import Testbed, Topology, clean
    from nicoffload.testbed.netlink import list_netns

    name = f"t{uuid.uuid4().hex[:5]}"
    t = Testbed(Topology.star(name, WORKERS))
    try:
        yield t.up()
    finally:
        try:
            t.down()
        finally:
            clean(name)
    assert not [ns for ns in list_netns() if ns.startswith(f"nco-{name}-")], "namespaces left behind"


@pytest.fixture(scope="module")
def runs(tb, tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    gloo = launch(tb, "gloo", d, steps=STEPS, deadline=DEADLINE, master_port=29510, extra=SMALL_BUCKETS)
    nco = launch(tb, "nicoffload", d, aggregator="xdp", steps=STEPS, deadline=DEADLINE, master_port=29511,
                 timeout=HOOK_TIMEOUT, extra=SMALL_BUCKETS)
    return gloo.check(), nco.check()


def first_order_bound(nco) -> float:
    reps = [r.report for r in nco.ranks]
    n = len(reps)
    lr, beta = reps[0]["lr"], reps[0]["momentum"]
    L = math.ceil(math.log2(n)) if n > 1 else 0
    eps = 2.0 ** (L - 30) + n * 2.0 ** -24
    G = np.max([r["grad_max"] for r in reps], axis=0)
    P = np.max([r["param_max"] for r in reps], axis=0)
    M = np.max([r["momentum_max"] for r in reps], axis=0)
    return float(np.sum(lr / (1 - beta) * (eps * G + 2.0 ** -22 * M) + 2.0 ** -23 * P))


def test_parameters_match_gloo_within_quantization_bound(runs):
    gloo, nco = runs
    bound = first_order_bound(nco)
    diff = float(np.max(np.abs(gloo.ranks[0].params.astype(np.float64) - nco.ranks[0].params)))
    print(f"after {STEPS} steps: max |param diff| = {diff:.3g}, first-order bound B = {bound:.3g}, "
          f"tolerance {FEEDBACK:g} B = {FEEDBACK * bound:.3g}")
    assert bound < 1e-4  # the bound itself is meaningful (a real divergence is ~lr * gradient)
    assert diff <= FEEDBACK * bound


def test_every_rank_ends_with_the_same_parameters(runs):
    for run in runs:  # each rank received the same averaged gradients, bit for bit
        for r in run.ranks[1:]:
            assert np.array_equal(r.params, run.ranks[0].params), f"{run.label}: rank {r.rank} differs from rank 0"


def test_accuracy_and_loss_curves_match(runs):
    gloo, nco = runs
    n_test = gloo.ranks[0].report["test_samples"]
    assert abs(gloo.accuracy - nco.accuracy) * n_test <= ACC_FLIPS + 1e-9, (gloo.accuracy, nco.accuracy)
    assert gloo.accuracy > 0.5  # it did learn (10 classes: chance is 0.1)
    lg, ln = gloo.mean_losses(), nco.mean_losses()
    assert lg[-1] < lg[0] * 0.8
    np.testing.assert_allclose(ln, lg, rtol=1e-4)


def test_hook_counters_and_step_times(runs):
    gloo, nco = runs
    for r in nco.ranks:
        hook = r.report["hook"]
        assert hook["calls"] > STEPS  # several buckets per step (after DDP rebuilds them in step 1)
        assert hook["elements"] == STEPS * r.report["parameters"]
        assert hook["packets_sent"] > 0
        assert all(a is not None and 0 < a < s for a, s in zip(r.report["allreduce_seconds"], r.report["step_seconds"]))
    for run in runs:
        assert len(run.step_seconds()) == STEPS and (run.step_seconds() > 0).all()
    print(f"median step: gloo {np.median(gloo.step_seconds()[3:]) * 1e3:.2f} ms, nicoffload-xdp "
          f"{np.median(nco.step_seconds()[3:]) * 1e3:.2f} ms (all-reduce "
          f"{np.median(nco.allreduce_seconds()[3:]) * 1e3:.2f} ms)")


def test_a_rank_dying_mid_training_fails_the_others_with_a_clear_error(tb, tmp_path):
    t0 = time.monotonic()
    run = launch(tb, "nicoffload", tmp_path, aggregator="xdp", steps=STEPS, die={1: 3}, timeout=HOOK_TIMEOUT,
                 deadline=DEADLINE, master_port=29512)
    took = time.monotonic() - t0
    r0, r1 = run.ranks
    assert r1.returncode == -signal.SIGKILL and r1.report is None  # died abruptly in step 3
    assert r0.returncode is not None, "rank 0 hung until the deadline instead of failing"
    assert r0.returncode == TimeoutError_.exit_code and r0.error_class is TimeoutError_
    assert r0.report["failed_at_step"] == 3
    assert r0.report["error_type"] == "TimeoutError_"
    assert "no contribution from rank(s) 1" in r0.report["error"], r0.report["error"]
    assert len(r0.report["losses"]) == 3  # the steps before the crash completed
    assert took < DEADLINE - 10
    with pytest.raises(NicoffloadError, match=r"rank 0: TimeoutError_: .*rank\(s\) 1") as err:
        run.check()
    print(f"failed in {took:.1f}s: {err.value}")
    assert all(r.returncode is not None for r in run.ranks)  # nothing left running


def test_without_torch_the_demo_and_the_hook_fail_in_one_line():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n"
            "    import nicoffload.ddp\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e, file=sys.stderr)\n"
            "from nicoffload.cli import main\n"
            "sys.exit(main(['train-demo', '--steps', '1']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 78, p.stderr  # SetupError
    assert len(lines) == 2, p.stderr
    assert lines[0].startswith("SetupError nicoffload.ddp needs PyTorch")
    assert lines[1].startswith("nicoffload: error: train-demo needs PyTorch") and "nicoffload[torch]" in lines[1]


def test_training_with_the_optimizer_in_the_aggregator(tb, tmp_path, runs):
    """No optimizer on the ranks: the XDP aggregator holds the parameters and the momentum, and the
    ranks' parameters follow float64 SGD on their own gradients within the derived bound."""
    from nicoffload.lab.train.ddp_train import summarize

    gloo, _ = runs
    off = launch(tb, "offload", tmp_path, aggregator="xdp", steps=STEPS, deadline=DEADLINE, master_port=29512,
                 timeout=HOOK_TIMEOUT, extra=["--shadow"]).check()
    s = summarize(gloo, off)
    r = s["runs"][off.label]
    assert r["shadow"]["within_bound"], r["shadow"]
    assert r["memory"]["optimizer_state"] == 0 and s["runs"]["gloo"]["memory"]["optimizer_state"] == r["memory"]["params"]
    for a, b in zip(off.ranks, off.ranks[1:]):
        assert np.array_equal(a.params, b.params), "every rank holds the aggregator's parameters"
    assert abs(r["accuracy"] - gloo.accuracy) <= ACC_FLIPS / s["runs"]["gloo"].get("test_samples", 1024)
    assert s["param_diff"][off.label] < 1e-5
