"""AdamW in the XDP aggregator (BPF_PROG_TEST_RUN): each completed round of a block applies
torch.optim.AdamW's update to its master weights and moments exactly as nicoffload.optim.adamw
computes it (bit for bit, with amsgrad and maximize, across a learning-rate change and a
checkpoint restored into a fresh job, from second moments of every size), and the parameters
stay within the derived bound of float64 AdamW on the same gradients over many steps, small
gradients near eps included."""
from __future__ import annotations

import numpy as np
import pytest
from test_optimizer import W, N, E, assert_results, run_step

from nicoffload import optim
from nicoffload.agg.control import Aggregator
from nicoffload.errors import InputError
from nicoffload.optim import OptimizerSpec
from nicoffload.packets import generators as gen
from nicoffload.wire import codec, proto

SPECS = {"plain": OptimizerSpec.adamw(lr=2e-3, weight_decay=0.05),
         "amsgrad-maximize": OptimizerSpec.adamw(lr=1e-3, betas=(0.8, 0.99), eps=1e-6, amsgrad=True, maximize=True)}


@pytest.fixture(scope="module", params=list(SPECS))
def adam(request):
    spec = SPECS[request.param]
    a = Aggregator.for_test(W, slots=optim.share(N, E), elems=E, optimizer=spec, params=N,
                            worker_ips=[gen.worker_ip(r) for r in range(W)])
    yield a, spec
    a.close()


def adversarial(rng, step: int) -> list[np.ndarray]:
    """Pre-averaged gradients: magnitudes from 1e-9 (far below eps) to 30 by block and element,
    a block zero on one rank, a block zero on every rank every third step."""
    scale = np.repeat(10.0 ** rng.integers(-9, 2, 3), E)[:N] * 10.0 ** rng.integers(-2, 1, N)
    g = [(rng.standard_normal(N) * scale / W).astype(np.float32) for _ in range(W)]
    g[0][256:400] = 0
    if step % 3 == 2:
        for x in g:
            x[512:] = 0
    return g


def fresh(agg, spec, init: np.ndarray) -> None:
    """The job from its first step: parameters, zero moments, the spec's learning rate."""
    agg.reset_slots()
    agg.reset_jobs()
    agg.set_params(1, init)
    agg.set_lr(1, spec.lr)


def test_updates_are_the_models_bit_for_bit(adam, joined):
    agg, spec = adam
    rng = np.random.default_rng(5)
    init = rng.uniform(-2, 2, N)
    fresh(agg, spec, init)
    model = optim.JobModel(spec, init, W, E)
    ep = joined(agg, W)
    for step in range(8):
        if step == 4:  # a schedule: the new rate from the next update on
            agg.set_lr(1, spec.lr / 3)
            model.spec = OptimizerSpec(**{**spec.to_dict(), "lr": spec.lr / 3})
        grads = adversarial(rng, step)
        got = run_step(agg, ep, step, grads)
        want, _ = model.step(grads)
        assert_results(got, want, step)
        st = agg.maps.read_state(agg.table.get(1), E, full=True)
        for name, arr in (("w", model.w), ("m", np.concatenate([s.m for s in model.states])[:N]),
                          ("s", np.concatenate([s.s for s in model.states])[:N]),
                          ("smax", np.concatenate([s.smax for s in model.states])[:N])):
            assert np.array_equal(st[name], arr), (step, name, np.flatnonzero(st[name] != arr)[:5])
    assert agg.stats(1)["updated"] == 8 * optim.blocks(N, E)


def test_second_moments_across_the_whole_range_are_the_models(adam, joined):
    """s restored from 0 to just below 2^62 (every bit length) with m of its size, then updates of
    adversarial gradients: the square root's operand spans [0, 2^62) (normalised from the
    largest s and |g| down to tiny ones) and every lane, w, m, s and s_max stay the model's."""
    agg, spec = adam
    rng = np.random.default_rng(8)
    init = rng.uniform(-1, 1, N)
    fresh(agg, spec, init)
    model = optim.JobModel(spec, init, W, E)
    nb = optim.blocks(N, E)
    bits = rng.permutation(np.arange(nb * E) % 63)
    s = (rng.integers(0, 1 << 62, nb * E, dtype=np.uint64) >> (62 - bits).astype(np.uint64)).astype(np.int64)
    s[N:] = 0  # the padding stays 0
    m = (s >> rng.integers(0, 4, nb * E)) * rng.choice([-1, 1], nb * E)
    for b, st in enumerate(model.states):
        blk = slice(b * E, (b + 1) * E)
        st.m, st.s, st.smax, st.steps = m[blk].copy(), s[blk].copy(), s[blk].copy(), 3
    agg.maps.write_state(agg.table.get(1), E, model.w, m, np.full(nb, 3), s, s)
    ep = joined(agg, W)
    for step in range(3):
        grads = adversarial(rng, step)
        assert_results(run_step(agg, ep, step, grads), model.step(grads)[0], step)
        st = agg.maps.read_state(agg.table.get(1), E, full=True)
        for name in ("w", "m", "s", "smax"):
            want = np.concatenate([getattr(x, name) for x in model.states])[:N]
            assert np.array_equal(st[name], want), (step, name, np.flatnonzero(st[name] != want)[:5])


def test_a_checkpoint_restores_every_moment(adam, joined, tmp_path):
    agg, spec = adam
    rng = np.random.default_rng(6)
    fresh(agg, spec, rng.uniform(-1, 1, N))
    ep = joined(agg, W)
    for step in range(3):
        run_step(agg, ep, step, adversarial(rng, step))
    before = agg.maps.read_state(agg.table.get(1), E, full=True)
    assert before["s"].any() and before["m"].any()
    ckpt = agg.save_optimizer(1, tmp_path / "ckpt")
    agg.set_params(1, np.zeros(N))  # wipes w and the moments
    agg.load_optimizer(1, ckpt)
    after = agg.maps.read_state(agg.table.get(1), E, full=True)
    for k in ("w", "m", "s", "smax", "steps"):
        assert np.array_equal(before[k], after[k]), k


def test_within_the_derived_bound_of_float64_adamw_over_many_steps(adam, joined):
    """torch.optim.AdamW in float64 on the same summed gradients, against the aggregator's
    parameters, each within its own bound (nicoffload.optim.AdamWBound)."""
    torch = pytest.importorskip("torch")
    agg, spec = adam
    rng = np.random.default_rng(7)
    init = rng.uniform(-1, 1, N)
    fresh(agg, spec, init)
    ep = joined(agg, W)
    p = torch.tensor(init, dtype=torch.float64, requires_grad=True)
    ref = torch.optim.AdamW([p], lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                            amsgrad=spec.amsgrad, maximize=spec.maximize)
    bound = optim.AdamWBound(spec, W)
    for step in range(40):
        grads = adversarial(rng, step) if step % 2 else [g * 1e-3 for g in adversarial(rng, step)]
        run_step(agg, ep, step, grads)
        g = np.sum([x.astype(np.float64) for x in grads], axis=0)
        p.grad = torch.from_numpy(g)
        ref.step()
        st = ref.state[p]
        bound.update(float(np.abs(g).max()), st["exp_avg"].numpy(), st["exp_avg_sq"].numpy(),
                     float(p.detach().abs().max()))
    err = np.abs(agg.params(1) - p.detach().numpy())
    finite = np.isfinite(bound.e_w)
    print(f"\nafter 40 steps: error {err.max():.3g}, bound {bound.e_w[finite].max():.3g} on {finite.sum()} of {N}")
    assert (err <= bound.e_w).all(), np.flatnonzero(err > bound.e_w)[:5]
    assert finite.mean() > 0.5  # the bound says something for most parameters
    assert err.max() < 10 * spec.lr  # and no parameter went its own way


@pytest.mark.parametrize("e,kind", [(2, "amsgrad-maximize"), (6, "amsgrad-maximize"), (6, "plain"), (12, "plain"),
                                    (6, "sgd")])
def test_records_of_any_even_size_take_the_update_bit_for_bit(joined, e, kind):
    """Records whose elements are not a multiple of 4 (2, 6) take AdamW's update two elements per
    callback (optim.h's ADAM_CHUNK), 12 four; every even size loads (before CHUNK_BASE the
    verifier refused all but the powers of two) and updates bit for bit as the model, with a
    partial last block; SGD too. Beyond 256 elements the aggregator is refused before it loads."""
    from test_optimizer import SPEC
    n = 2 * e + 1
    spec = SPEC if kind == "sgd" else SPECS[kind]
    ips = [gen.worker_ip(r) for r in range(W)]
    with pytest.raises(InputError, match="at most 256"):
        Aggregator.for_test(W, slots=optim.share(n, 258), elems=258, optimizer=spec, params=n, worker_ips=ips)
    agg = Aggregator.for_test(W, slots=optim.share(n, e), elems=e, optimizer=spec, params=n, worker_ips=ips)
    try:
        rng = np.random.default_rng(11)
        init = rng.uniform(-2, 2, n)
        agg.set_params(1, init)
        agg.set_lr(1, spec.lr)
        model = optim.JobModel(spec, init, W, e)
        ep = joined(agg, W)
        for step in range(4):
            grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n) / W).astype(np.float32)
                     for _ in range(W)]
            meta, data = gen.optimizer_contributions(grads, epoch=ep, step=step, params=n, elems=e)
            for frames in (meta, data):
                for r in range(W):
                    outs = [agg.run(f) for f in frames[r]]
            want, _ = model.step(grads)
            assert len(outs) == len(want)
            for o, (lanes, exp) in zip(outs, want):
                h = codec.decode_datagrams(np.frombuffer(o.data[proto.L2L4_LEN:], np.uint8).copy(), 1, e)
                assert int(h.fields["exp"][0]) == exp and np.array_equal(h.payload[0], lanes), step
            assert np.array_equal(agg.maps.read_state(agg.table.get(1), e, full=True)["w"], model.w), step
    finally:
        agg.close()
