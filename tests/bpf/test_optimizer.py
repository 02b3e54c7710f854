"""The optimizer in the XDP aggregator (BPF_PROG_TEST_RUN): each completed SGD round updates its
block's master weights and momentum exactly as nicoffload.optim computes (bit for bit), once per
step even under retransmissions and duplicates, and the parameters stay within the derived bound
of float64 SGD over many steps."""
from __future__ import annotations

import numpy as np
import pytest

from nicoffload import optim
from nicoffload.agg.control import Aggregator
from nicoffload.ebpf.libbpf import XDP_DROP, XDP_TX
from nicoffload.errors import InputError, NotFoundError
from nicoffload.optim import OptimizerSpec
from nicoffload.packets import generators as gen
from nicoffload.wire import codec, proto

E, W, N = 256, 3, 700          # 3 blocks, 1 exponent round: 4 slots per step
SPEC = OptimizerSpec(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)


@pytest.fixture(scope="module")
def agg():
    a = Aggregator.for_test(W, slots=optim.share(N, E), elems=E, optimizer=SPEC, params=N,
                            worker_ips=[gen.worker_ip(r) for r in range(W)])
    yield a
    a.close()


def frames_of(rank: int, rows: np.ndarray, *, epoch: int, first_round: int, P: int, op: int, exps=0,
              counts=None, flags: int = 0) -> list[bytes]:
    out = []
    for j in range(len(rows)):
        r = first_round + j
        rec = codec.encode_blocks(rows[j:j + 1], rank=rank, job=1, epoch=epoch, slot=r % P, set=(r // P) % 2,
                                  round=r, mask=(1 << W) - 1, count=E if counts is None else int(counts[j]),
                                  exp=int(exps[j]) if np.ndim(exps) else exps, op=op, flags=flags,
                                  ack=first_round, key=gen.KEY)  # it holds every result before these rounds
        out.append(gen.frame(bytes(rec), src_mac=gen.worker_mac(rank), dst_mac=gen.AGG_MAC,
                             src_ip=gen.worker_ip(rank), dst_ip=gen.AGG_IP))
    return out


def run_step(agg, epoch: int, step: int, grads: list[np.ndarray]):
    """Every rank's records of one step, rank by rank; returns the result records of the data rounds."""
    meta, data = gen.optimizer_contributions(grads, epoch=epoch, step=step, params=N, elems=E)
    results = []
    for frames_of_rank in (meta, data):
        for r in range(W):
            outs = [agg.run(f) for f in frames_of_rank[r]]
            assert [o.verdict for o in outs] == [XDP_TX if r == W - 1 else XDP_DROP] * len(outs)
            results = [record_of(o.data) for o in outs]
    return results


def record_of(frame: bytes) -> bytes:
    assert len(frame) == proto.L2L4_LEN + proto.record_size(E)
    return frame[proto.L2L4_LEN:]


def decode(rec: bytes) -> tuple[np.ndarray, int, int]:
    h = codec.decode_datagrams(np.frombuffer(rec, np.uint8).copy(), 1, E)
    return h.payload[0].copy(), int(h.fields["exp"][0]), int(h.fields["type"][0])


def assert_results(got: list[bytes], want: list[tuple[np.ndarray, int]], step: int) -> None:
    """Every result record of a step is the model's: a RESULT, its lanes and exponent."""
    assert len(got) == len(want), step
    for b, (rec, (lanes, e)) in enumerate(zip(got, want)):
        payload, exp, typ = decode(rec)
        assert typ == proto.TYPE_RESULT and exp == e, (step, b)
        assert np.array_equal(payload, lanes), (step, b)


def grads_for(rng, scale: float) -> list[np.ndarray]:
    # pre-averaged gradients of very different magnitudes per block, some blocks zero on one rank
    g = [rng.standard_normal(N).astype(np.float32) * np.float32(scale) / W for _ in range(W)]
    g[0][256:400] = 0
    return g


def test_updates_are_the_models_bit_for_bit(agg, joined):
    rng = np.random.default_rng(1)
    init = rng.uniform(-2, 2, N)
    agg.reset_slots()
    agg.reset_stats()
    agg.reset_jobs()
    agg.set_params(1, init)
    model = optim.JobModel(SPEC, init, W, E)
    ep = joined(agg, W)
    for step, scale in enumerate([1.0, 1e-3, 30.0, 1e-6, 0.5]):
        grads = grads_for(rng, scale)
        got = run_step(agg, ep, step, grads)
        want, values = model.step(grads)
        assert_results(got, want, step)
        assert np.array_equal(optim.to_fixed(agg.params(1)), model.w), step
    st = agg.stats(1)
    assert st["updated"] == 5 * optim.blocks(N, E) and st["completed"] == 5 * optim.share(N, E)
    state = agg.optimizer_state(1)
    assert state["steps"].tolist() == [5] * optim.blocks(N, E)


def test_retransmissions_get_the_update_of_their_step_never_a_second_one(agg, joined):
    rng = np.random.default_rng(2)
    agg.reset_slots()
    agg.reset_jobs()
    agg.set_params(1, np.zeros(N))
    ep = joined(agg, W)
    got = run_step(agg, ep, 0, grads_for(rng, 1.0))
    before = agg.optimizer_state(1)
    nb, meta = optim.blocks(N, E), optim.meta_slots(N, E)
    # rank 1 retransmits its data records and duplicates them: each is answered with the stored
    # result, the state does not move
    sh = np.zeros(nb, np.int64)  # the payload of a retransmission is not looked at again
    retx = frames_of(1, np.zeros((nb, E), np.int32), epoch=ep, first_round=meta, P=optim.share(N, E),
                     op=proto.OP_SGD, exps=sh, flags=proto.FLAG_RETX)
    for f in retx + retx:
        out = agg.run(f)
        assert out.verdict == XDP_TX
    answers = [record_of(agg.run(f).data) for f in retx]
    for a, g in zip(answers, got):
        assert decode(a)[:2][0].tobytes() == decode(g)[0].tobytes() and decode(a)[1] == decode(g)[1]
    after = agg.optimizer_state(1)
    assert np.array_equal(before["w_fixed"], after["w_fixed"]) and np.array_equal(before["m_fixed"], after["m_fixed"])
    assert after["steps"].tolist() == [1] * nb


def test_within_the_derived_bound_of_float64_sgd_over_many_steps(agg, joined):
    """K steps against torch.optim.SGD's update in float64 (written out: no torch needed here)."""
    rng = np.random.default_rng(3)
    init = rng.uniform(-1, 1, N)
    agg.reset_slots()
    agg.reset_jobs()
    agg.set_params(1, init)
    ep = joined(agg, W)
    w, buf = init.copy(), None
    K = 40
    for step in range(K):
        grads = grads_for(rng, 0.1)
        run_step(agg, ep, step, grads)
        g = np.sum([x.astype(np.float64) for x in grads], axis=0) + SPEC.weight_decay * w
        buf = g.copy() if buf is None else SPEC.momentum * buf + (1 - SPEC.dampening) * g
        d = g + SPEC.momentum * buf if SPEC.nesterov else buf
        w = w - SPEC.lr * d
    err = np.abs(agg.params(1) - w).max()
    bound = optim.error_bound(SPEC, K, grad_max=0.1 * 5 + SPEC.weight_decay * 3, world=W, w_max=3.0)
    print(f"\nerror after {K} steps {err:.3g}, bound {bound:.3g}")
    assert err <= bound, (err, bound)


def test_a_job_without_optimizer_state_cannot_ask_for_sgd(joined):
    with Aggregator.for_test(2, slots=8, elems=E) as plain:
        ep = joined(plain, 2)
        rec = gen.record(rank=0, round=0, slots=8, epoch=ep, mask=0b11, op=proto.OP_SGD)
        out = plain.run(gen.frame(rec, src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC, src_ip=gen.worker_ip(0),
                                  dst_ip=gen.AGG_IP))
        assert out.verdict == XDP_DROP and plain.stats()["bad_op"] == 1
        with pytest.raises(InputError, match="without optimizer state"):
            plain.add_job(2, 1, "239.77.0.9", optimizer=SPEC, params=10)


def test_a_job_whose_initial_parameters_are_refused_is_not_registered():
    """A NaN in --init: refused before the job reaches the kernel's maps, so no job is left half
    made (in the maps, not in the table: invisible, and its row handed to the next job)."""
    share = optim.share(N, E)
    with Aggregator.for_test(W, slots=3 * share, elems=E, optimizer=SPEC, params=N,
                             worker_ips=[gen.worker_ip(r) for r in range(W)]) as a:
        bad = np.linspace(-1, 1, N)
        bad[5] = np.nan
        with pytest.raises(InputError, match="finite"):
            a.add_job(2, W, "239.77.0.2", optimizer=SPEC, params=N, initial=bad)
        with pytest.raises(InputError, match="700 parameters, 699 initial values"):
            a.add_job(2, W, "239.77.0.2", optimizer=SPEC, params=N, initial=bad[:-1])
        assert sorted(a.table.entries) == [1]
        with pytest.raises(NotFoundError):
            a.maps.job_index(2)
        good = np.linspace(-1, 1, N)
        a.add_job(3, W, "239.77.0.3", optimizer=SPEC, params=N, initial=good)
        assert sorted(a.table.entries) == [1, 3]
        assert np.allclose(a.params(3), good, atol=2.0 ** -optim.FRAC)
