"""Several ranks per host (nicoffload.local) without a network: processes of this machine, one
HostGroup per simulated host, and for the lanes across hosts a stand-in collective of one rank
per host that sums int32 through shared memory too. The results must be the bits of the model
of an aggregator job of every rank (4 ranks: the same as 2 hosts x 2 ranks, 1 host x 4), the
segments gone afterwards, and a local rank that dies must fail the others naming it."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import numpy as np
import pytest

from nicoffload import collective
from nicoffload.local.segment import SHM, HostGroup
from nicoffload.wire import quant

E = 256


class ShmLane:
    """Lane j across the simulated hosts: a HostGroup of one rank per host, summing (or taking
    the MAX of) int32 arrays through its data segment."""

    capabilities = collective.Capabilities(ops=frozenset({"sum", "max"}), extreme_dtypes=frozenset({"int32"}))

    def __init__(self, name: str, host: int, hosts: int):
        self.g = HostGroup(name, host, list(range(hosts)), 20.0)
        self.calls = 0

    def allreduce(self, array, out=None, op="sum", lanes=None):
        n, H = array.size, self.g.K
        buf = self.g.ensure(max(1, H * n * 4)).array(0, np.int32, H * n).reshape(H, n)
        buf[self.g.me] = array
        self.g.barrier()
        tot = buf.max(axis=0) if op == "max" else buf.sum(axis=0, dtype=np.int64).astype(np.int32)
        self.g.barrier()
        out[:] = tot
        self.calls += 1
        return out

    def barrier(self):
        self.g.barrier()

    def abort(self, e):
        self.g.abort(e)

    def close(self):
        self.g.close()


def _rank(rank: int, hosts: list[list[int]], name: str, inputs, q, die_at: int | None):
    from nicoffload.local.host import HostCommunicator

    try:
        h = next(i for i, rs in enumerate(hosts) if rank in rs)
        me = hosts[h].index(rank)
        L = min(len(rs) for rs in hosts)
        lane = ShmLane(f"{name}-lane{me}", h, len(hosts)) if len(hosts) > 1 and me < L else None
        c = HostCommunicator(rank, sum(map(len, hosts)), HostGroup(f"{name}-h{h}", me, hosts[h], 20.0),
                             len(hosts), h, L, elems=E, lane=lane)
        outs = []
        for i, (x, op, lanes) in enumerate(inputs):
            if i == die_at:
                os._exit(3)
            if isinstance(x, dict):  # a size of its own per rank
                x = x[rank]
                try:
                    c.allreduce(x, op=op, lanes=lanes)
                    outs.append("")
                except Exception as e:
                    outs.append(f"{type(e).__name__}: {e}")
                continue
            outs.append(c.allreduce(x[rank], op=op, lanes=lanes))
        if not any(isinstance(x, dict) for x, _op, _lanes in inputs):
            c.barrier()
        c.close()
        q.put((rank, outs, None))
    except Exception as e:
        q.put((rank, None, (type(e).__name__, str(e), time.monotonic())))


def run(hosts: list[list[int]], inputs, die: tuple[int, int] | None = None, timeout: float = 120):
    name = "nicoffload-test" + uuid.uuid4().hex[:8]
    q = mp.get_context("fork").Queue()
    world = sum(map(len, hosts))
    ps = [mp.get_context("fork").Process(target=_rank, args=(r, hosts, name, inputs, q,
                                                              die[1] if die and die[0] == r else None))
          for r in range(world)]
    return {r: rest for r, *rest in collect(ps, q, world - (1 if die else 0), timeout, name)}


def collect(ps, q, count: int, timeout: float, name: str) -> list[tuple]:
    """Start the rank processes ``ps``, take ``count`` reports (rank first) from ``q``, and
    check that no shared memory segment of ``name`` is left."""
    for p in ps:
        p.start()
    got = []
    try:
        for _ in range(count):
            got.append(q.get(timeout=timeout))
    finally:
        for p in ps:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert not list(SHM.glob(name + "*")), "a shared memory segment was left behind"
    return got


def model(xs: list[np.ndarray], lanes: int) -> np.ndarray:
    """What an aggregator job of len(xs) ranks returns (quant's model of its fixed point)."""
    W, n = len(xs), xs[0].size
    Eb = quant.block_elems(E, lanes)
    nb = -(-n // Eb)
    blocks = [np.concatenate([x, np.zeros(nb * Eb - n, x.dtype)]).reshape(nb, Eb) for x in xs]
    exps = np.max([quant.block_exponents(b) for b in blocks], axis=0)
    active = exps != quant.ZERO_EXP
    sh = quant.shifts_for(np.where(active, exps, 0), W, lanes)
    tot = sum(quant.quantize(b, sh).astype(np.int64) for b in blocks)
    out = quant.dequantize(tot, sh, xs[0].dtype)
    out[~active] = 0
    return out.reshape(-1)[:n]


def cases(world: int):
    rng = np.random.default_rng(7)
    out = []
    for n in (1, 999, E * 37 + 5):
        f = (rng.standard_normal((world, n)) * 10.0 ** rng.integers(-4, 4, (world, 1))).astype(np.float32)
        f[:, : n // 3] = 0           # blocks zero on every rank
        f[1, n // 2: n // 2 + E] = 0  # ... and on one rank only
        out += [(f, "sum", None), (f, "sum", 16), (f.astype(np.float64), "sum", None),
                ((f * 1e-30).astype(np.float32), "sum", None),  # shifts past float32's: the float64 path
                (rng.integers(-2 ** 31, 2 ** 31, (world, n), dtype=np.int64).astype(np.int32), "sum", None),
                (f, "max", None), (f, "min", None)]
    return out


def expected(x: np.ndarray, op: str, lanes: int | None) -> np.ndarray:
    """What an aggregator job of the group's ranks (one per host) returns."""
    if op == "max":
        return x.max(axis=0)
    if op == "min":
        return x.min(axis=0)
    if x.dtype == np.int32:
        return x.sum(axis=0, dtype=np.int64).astype(np.int32)
    return model(list(x), lanes or 32)


@pytest.mark.parametrize("hosts", [[[0, 1], [2, 3]], [[0, 1, 2, 3]], [[0, 2], [1], [3]], [[0, 1, 3], [2]]],
                         ids=["2x2", "1x4", "2+1+1", "3+1"])
def test_every_placement_returns_the_bits_of_one_rank_per_host(hosts):
    world = 4
    inputs = cases(world)
    got = run(hosts, inputs)
    for r in range(world):
        outs, err = got[r]
        assert err is None, err
        for i, (x, op, lanes) in enumerate(inputs):
            want = expected(x, op, lanes)  # hosts of unequal rank counts too: the same bits
            assert outs[i].tobytes() == want.tobytes(), (r, i, op, x.dtype, lanes)


def test_a_local_rank_that_dies_fails_the_others_naming_it():
    inputs = cases(3)[:4]
    t0 = time.monotonic()
    got = run([[0, 1, 2]], inputs, die=(2, 2), timeout=60)
    for r in (0, 1):
        outs, err = got[r]
        assert err is not None and err[0] == "TimeoutError_", err
        assert "local rank 2 of this host (rank 2" in err[1] and "died" in err[1], err[1]
        assert err[2] - t0 < 15, err


def test_local_ranks_given_different_shapes_fail_together_and_so_do_later_calls():
    f = np.ones((3, 5000), np.float32)
    disagree = {0: np.ones(5000, np.float32), 1: np.ones(9000, np.float32), 2: np.ones(5000, np.float32)}
    got = run([[0, 1, 2]], [(disagree, "sum", None), ({r: f[r] for r in range(3)}, "sum", None)])
    for r in range(3):
        outs, err = got[r]
        assert err is None, err
        assert "not given tensors of the same shape" in outs[0] and "sum of 9000 float32" in outs[0], outs[0]
        assert "not given tensors of the same shape" in outs[1], outs[1]  # the group is out of step for good


def _staged_rank(rank: int, hosts: list[list[int]], name: str, xs: np.ndarray, chunk: int, q):
    """sum_staged: the rank's words written straight into its row, the sums read straight out of
    the segment, over several of the communicator's chunks (``chunk`` elements each)."""
    from nicoffload.local import host as hostmod

    try:
        hostmod.CHUNK = chunk
        h = next(i for i, rs in enumerate(hosts) if rank in rs)
        me, L = hosts[h].index(rank), min(len(rs) for rs in hosts)
        lane = ShmLane(f"{name}-lane{me}", h, len(hosts)) if len(hosts) > 1 and me < L else None
        c = hostmod.HostCommunicator(rank, sum(map(len, hosts)), HostGroup(f"{name}-h{h}", me, hosts[h], 20.0),
                                     len(hosts), h, L, elems=E, lane=lane)
        got = np.full(xs.shape[1], 7, np.int32)
        spans = []

        def fill(row, lo, hi):
            row[:] = xs[rank, lo:hi]

        def take(src, lo, hi):
            got[lo:hi] = src
            spans.append((lo, hi))

        c.sum_staged(xs.shape[1], fill, take)
        c.barrier()
        c.close()
        q.put((rank, got, spans, None))
    except Exception as e:
        q.put((rank, None, None, f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("hosts", [[[0, 1], [2, 3]], [[0, 1, 2, 3]]], ids=["2x2", "1x4"])
def test_a_staged_int32_sum_reads_and_writes_the_segment_in_place(hosts):
    n = E * 37 + 5
    xs = np.random.default_rng(3).integers(-2 ** 31, 2 ** 31, (4, n), dtype=np.int64).astype(np.int32)
    want = xs.sum(axis=0, dtype=np.int64).astype(np.int32)
    name = "nicoffload-test" + uuid.uuid4().hex[:8]
    q = mp.get_context("fork").Queue()
    ps = [mp.get_context("fork").Process(target=_staged_rank, args=(r, hosts, name, xs, E * 8, q)) for r in range(4)]
    for rank, got, spans, err in collect(ps, q, 4, 60, name):
        assert err is None, (rank, err)
        assert got.tobytes() == want.tobytes(), rank
        assert len(spans) == -(-n // (E * 8)) and spans[-1][1] == n, spans  # chunk by chunk, to the end
