"""The pipelined call (``Communicator.pipeline``): a large dense float tensor sends each chunk's
data while the next chunk's exponents are computed and exchanged. Its results are the plain
call's bit for bit (float32 and float64, 32- and 16-bit lanes, blocks zero everywhere, a partial
last block, in place or not, under loss and duplication); a NaN in the last chunk refuses the
call on every rank (an in-place call's earlier chunks then hold their sums), and the next call
goes on."""
from __future__ import annotations

import numpy as np
import pytest
from e2ekit import run_ranks, xdp_comms

from nicoffload.errors import RefusedError
from nicoffload.wire import proto
from nicoffload.worker import speculation

E = proto.DEFAULT_ELEMS
NB = 1100  # blocks: 5 metadata records, so 5 chunks of one each (PIPELINE_CHUNKS 8)


def calls(world: int) -> list[tuple[list[np.ndarray], int]]:
    """Per call, each rank's tensor and the lanes: exponents over a wide range, blocks zero on
    every rank, a partial last block, float64, 16-bit lanes."""
    rng = np.random.default_rng(23)
    wide = []
    for _ in range(world):
        a = (rng.standard_normal(NB * E) * 10.0 ** rng.integers(-6, 7, NB * E)).astype(np.float32)
        a.reshape(NB, E)[[3, 400, 1099]] = 0  # zero on every rank: a round of zeros, a zero result
        wide.append(a)
    odd = [rng.standard_normal(NB * E - 99).astype(np.float32) for _ in range(world)]
    f64 = [(rng.standard_normal(NB * E) * 1e-300).astype(np.float64) for _ in range(world)]
    return [(wide, 32), (odd, 32), (f64, 32), (wide, 16), (odd, 16)]


def run(comms, seq, world):
    """Every call of ``seq`` on every rank, in place every other call: outputs by rank."""
    def calls_of(r):
        outs = []
        for i, (xs, lanes) in enumerate(seq):
            x = xs[r].copy()
            outs.append(comms[r].allreduce(x, out=x if i % 2 else None, lanes=lanes))
        return outs

    got, errs = run_ranks(calls_of, world)
    assert not errs, errs
    return got


@pytest.fixture
def counted(monkeypatch):
    """Small tensors pipelined (5 chunks of NB blocks), and the pipelined calls counted."""
    monkeypatch.setattr(speculation, "PIPELINE_ELEMS", 64 * E)
    n = []
    run0 = speculation._Pipeline.run

    def run1(self):
        n.append(self.c.rank)
        return run0(self)

    monkeypatch.setattr(speculation._Pipeline, "run", run1)
    return n


def test_pipelined_calls_are_the_plain_ones_bit_for_bit(make_testbed, counted):
    world = 3
    tb = make_testbed(world)
    seq = calls(world)
    agg, comms = xdp_comms(tb, world, 256, pipeline=False, sparse=False)
    try:
        plain = run(comms, seq, world)
        assert not counted
        for c in comms:
            c.pipeline = True
        tb.faults.configure(drop=0.01, dup=0.01, seed=5)
        piped = run(comms, seq, world)
        tb.faults.configure()
        assert len(counted) == world * len(seq)
        for i in range(len(seq)):
            for r in range(world):
                assert piped[r][i].tobytes() == plain[r][i].tobytes(), (i, r)
        assert agg.stats()["mismatch"] == 0
        st = comms[0].last  # 16-bit lanes, the partial last block: every block a round, 5 chunks of metadata
        nb = -(-(NB * E - 99) // (2 * E))
        assert st.results == nb and st.meta_rounds == -(-nb // E) and st.blocks_skipped == 0

        # a NaN in the last chunk of rank 1: every rank refuses, naming it; in place, the chunks
        # before it hold their sums (the stream ran to its end) and the rest is the input as it was
        xs = [a.copy() for a in seq[0][0]]
        xs[1][NB * E - 5] = np.nan
        before = [a.copy() for a in xs]
        last = 4 * E * E  # the fifth chunk's first element (a chunk: one metadata record of E blocks)

        def refused(r):
            with pytest.raises(RefusedError) as e:
                comms[r].allreduce(xs[r], out=xs[r])
            return str(e.value)

        msgs, errs = run_ranks(refused, world)
        assert not errs, errs
        assert all("rank 1" in m and "NaN" in m for m in msgs), msgs
        for r in range(world):
            assert xs[r][last:].tobytes() == before[r][last:].tobytes(), r
            assert xs[r][:last].tobytes() == plain[r][0][:last].tobytes(), r
            assert comms[r].final_blocks()[:4 * E].all() and not comms[r].final_blocks()[4 * E:].any()
        again = run(comms, seq[:1], world)  # the rounds stayed in step
        assert all(again[r][0].tobytes() == plain[r][0].tobytes() for r in range(world))
    finally:
        for c in comms:
            c.close()
        agg.close()


def test_a_sparse_job_pipelines_a_size_while_its_last_call_was_dense(make_testbed, counted):
    """Every rank sees the same contributor bits, so every rank decides alike: a call is
    pipelined when the last call of its size had every block on every rank. A pipelined call
    that meets a rank's zero block sends zeros there (the same sum); the next call is plain."""
    world = 3
    tb = make_testbed(world)
    rng = np.random.default_rng(29)
    dense = [rng.standard_normal(NB * E).astype(np.float32) for _ in range(world)]
    holey = [a.copy() for a in dense]
    holey[2].reshape(NB, E)[700] = 0  # rank 2 has nothing in block 700
    seq = [(dense, 32), (dense, 32), (holey, 32), (dense, 32), (dense, 32)]
    agg, comms = xdp_comms(tb, world, 256, pipeline=False)
    try:
        plain = run(comms, seq, world)
        for c in comms:
            c.pipeline = True
            c._dense = speculation.Dense()
        got = []
        for i in range(len(seq)):
            del counted[:]
            got.append(run(comms, seq[i:i + 1], world))
            assert len(counted) == (world if i in (1, 2, 4) else 0), i
            for r in range(world):
                assert got[i][r][0].tobytes() == plain[r][i].tobytes(), (i, r)
    finally:
        for c in comms:
            c.close()
        agg.close()
