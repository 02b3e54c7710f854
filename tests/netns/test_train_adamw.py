"""train-demo's AdamW comparison end to end, shrunk: a tiny transformer (13.5k parameters) trained
by 2 ranks on a testbed with torch.optim.AdamW on every rank over gloo, then with AdamW in the
XDP aggregator (``--offload``), the same seeds and batches. The offloaded run must follow the
gloo run's losses, keep no optimizer state on the ranks (gloo's ranks hold AdamW's two moments,
8 bytes per parameter), and stay within nicoffload.optim.AdamWBound of float64 AdamW on its own
gradients (the ranks' ``--shadow``)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the training tests need the torch extra: pip install 'nicoffload[torch]'")

from nicoffload.lab.train import ddp_train  # noqa: E402

STEPS = 20
LR = 3e-3
TINY = ["--optimizer", "adamw", "--lr", str(LR), "--d-model", "32", "--layers", "1", "--heads", "2",
        "--seq", "8", "--vocab", "8"]
# Measured: every step's loss within 2.1e-7 (relative) of gloo's, the final loss +9e-8; the
# parameters within 2.5e-4 of gloo's (float32 torch) and 2.8e-5 of float64 AdamW (bound 4.0e-3).
# The issue asks for the final loss within 1% of torch's AdamW run; the test holds every step to
# 1e-4, which a wrong bias correction, eps or weight decay in the aggregator would break.
LOSS_REL = 1e-4


def test_adamw_in_the_xdp_aggregator_follows_torch_adamw(make_testbed, tmp_path):
    tb = make_testbed(2)
    gloo, off = ddp_train.compare(tb, tmp_path, steps=STEPS, offload=("xdp",), train_args=TINY)
    for run in (gloo, off):
        assert [r.rank for r in run.ranks] == [0, 1] and run.ok, [r.describe() for r in run.ranks if not r.ok]
        assert all(len(r.report["losses"]) == STEPS and r.report["optimizer"] == "adamw" for r in run.ranks)
    s = ddp_train.summarize(gloo, off)
    g, o = s["runs"]["gloo"], s["runs"][off.label]
    n = s["parameters"]
    assert s["model"] == "transformer" and n < 20_000

    # the loss curves: the aggregator's AdamW trains as torch's does
    assert abs(o["final_loss_rel"]) <= LOSS_REL, (o["final_loss"], g["final_loss"])
    np.testing.assert_allclose(o["losses"], g["losses"], rtol=LOSS_REL)
    assert o["final_loss"] < 0.95 * o["losses"][0], "it learns"

    # memory: AdamW's moments on every gloo rank (the scalar step counters left out), none offloaded
    assert g["memory"]["optimizer_state"] == 8 * n
    assert o["memory"]["optimizer_state"] == 0 and o["memory"]["params"] == 4 * n
    assert sum(o["aggregator_memory"].values()) == 24 * n  # w, m, sqrt(v): int64 each

    # against float64 AdamW on the same gradients, within the derived bound
    sh = o["shadow"]
    assert 0 < sh["max_diff"] <= sh["bound"] and sh["within_bound"], sh
    for a, b in zip(off.ranks, off.ranks[1:]):
        assert np.array_equal(a.params, b.params), "every rank holds the aggregator's parameters"
    assert s["param_diff"][off.label] < LR, "no parameter took a step (lr) that gloo's did not"
