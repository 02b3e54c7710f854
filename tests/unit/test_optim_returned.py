"""The optimizer's error bound counts the parameters' way back into a float32 model: a rank casts
the aggregator's results into its float32 parameters (half an ulp, 2^-24 of the value), which
after a few steps is most of the difference from float64 SGD (optim.JobModel, no root)."""
from __future__ import annotations

import numpy as np

from nicoffload import optim
from nicoffload.optim import OptimizerSpec

SPEC = OptimizerSpec(lr=0.05, momentum=0.9)
W, E, N = 2, 256, 3000


def run(steps: int, seed: int = 5) -> tuple[float, float, float, float]:
    """(error of the float32 parameters, of the results in float64, and the bound for each)."""
    rng = np.random.default_rng(seed)
    init = rng.uniform(-0.5, 0.5, N).astype(np.float32)  # a float32 model's parameters
    job = optim.JobModel(SPEC, init.astype(np.float64), W, E)
    w, buf, gmax, wmax = init.astype(np.float64), None, 0.0, float(np.abs(init).max())
    for _ in range(steps):
        grads = [(rng.standard_normal(N) * 0.05 / W).astype(np.float32) for _ in range(W)]  # pre-averaged
        _, values = job.step(grads)
        g = np.sum([x.astype(np.float64) for x in grads], axis=0)
        gmax = max(gmax, float(np.abs(g).max()))
        buf = g if buf is None else SPEC.momentum * buf + g
        w = w - SPEC.lr * buf
        wmax = max(wmax, float(np.abs(w).max()))
    err32 = float(np.abs(values.astype(np.float32).astype(np.float64) - w).max())
    err64 = float(np.abs(values - w).max())
    b32 = optim.error_bound(SPEC, steps, grad_max=gmax, world=W, w_max=wmax, params_dtype=np.float32)
    b64 = optim.error_bound(SPEC, steps, grad_max=gmax, world=W, w_max=wmax)
    return err32, err64, b32, b64


def test_a_float32_model_is_within_the_bound_that_counts_its_cast():
    for steps in (1, 3, 10):
        err32, err64, b32, b64 = run(steps)
        assert err64 <= b64, (steps, err64, b64)   # the aggregator's results themselves
        assert err32 <= b32, (steps, err32, b32)   # as a float32 model holds them
    err32, _, _, b64 = run(1)
    assert err32 > b64, "after one step the float32 cast alone exceeds the bound without it"
