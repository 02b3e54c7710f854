"""Several ranks per host when a lane loses the aggregator mid-call (the failover's contract,
nicoffload.torch.failover): the host's ranks all raise AggregatorLost, each holding in its
output every block its host's lanes got, and ``final_blocks()`` says which (the others still
hold the input of an in-place call). The case a link cut found: the lane lost the aggregator
waiting for the gate with all of the call's results in hand, while the other host returned
from the call; the host's ranks must then return every result too, not nothing.

Two hosts x two ranks as processes, and lanes (test_local_host.ShmLane) of which lane 0 is
lost at its lane call ``k``: on host 0 after the exchange (``confirm``: every result in hand)
or with only the first of its blocks (``partial``); host 1's lane 0 returns from call k and
loses the aggregator in the next one. Lane 1 runs on. Calls are chunked (CHUNK = 1024 elements:
three chunks, two lane calls each for floats, one for int32 and MAX)."""
from __future__ import annotations

import multiprocessing as mp
import uuid

import numpy as np
import pytest

from nicoffload.errors import SilentAggregator
from nicoffload.local.segment import HostGroup
from test_local_host import E, ShmLane, collect, model

HOSTS = [[0, 1], [2, 3]]
N, CHUNK = 3000, 1024


class LosingLane(ShmLane):
    """Lane ``j`` of host ``h``: lost at call ``k`` (on host 0 after the exchange, with the
    blocks ``mode`` says back; on host 1 one call later, with nothing)."""

    def __init__(self, name, host, hosts, lose: tuple[int, str] | None):
        super().__init__(name, host, hosts)
        self.lose, self.final = lose, None

    def allreduce(self, array, out=None, op="sum", lanes=None):
        n = self.calls
        if self.lose is None or n < self.lose[0] or (self.g.me == 1 and n == self.lose[0]):
            return super().allreduce(array, out, op, lanes)
        assert n == self.lose[0] + self.g.me, "a lane is asked again after it lost the aggregator"
        self.calls += 1
        nb = -(-array.size // E)
        self.final = np.zeros(nb, bool)
        if self.g.me == 0:
            keep = array.copy()
            super().allreduce(array, out, op, lanes)
            self.calls -= 1
            self.final[:] = True
            if self.lose[1] == "partial":
                self.final[1:] = False
                out[E:] = keep[E:]
        raise SilentAggregator(f"lane: the aggregator has not answered anything (call {n})")

    def final_blocks(self):
        return self.final


def _rank(rank, name, xs, op, lose, q):
    from nicoffload.local import host as hostmod

    hostmod.CHUNK = CHUNK
    try:
        h = 0 if rank in HOSTS[0] else 1
        me = HOSTS[h].index(rank)
        lane = LosingLane(f"{name}-lane{me}", h, 2, lose if me == 0 else None)
        c = hostmod.HostCommunicator(rank, 4, HostGroup(f"{name}-h{h}", me, HOSTS[h], 20.0), 2, h, 2, elems=E,
                                     lane=lane)
        x = xs[rank].copy()
        try:
            c.allreduce(x, out=x, op=op)
            q.put((rank, x, None, None))
        except Exception as e:
            q.put((rank, x, f"{type(e).__name__}: {e}", c.final_blocks()))
        c.close()
    except Exception as e:
        q.put((rank, None, f"set-up: {type(e).__name__}: {e}", None))


def run(xs, op, lose):
    name = "nicoffload-test" + uuid.uuid4().hex[:8]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, name, xs, op, lose, q)) for r in range(4)]
    return {r: rest for r, *rest in collect(ps, q, 4, 60, name)}


def blocks(*spans) -> np.ndarray:
    have = np.zeros(-(-N // E), bool)
    for a, b in spans:
        have[a:b] = True
    return have


# the call's blocks of E: chunks of 4 blocks (0-3, 4-7, 8-11), lane 0's share the first two
CASES = {
    # lost waiting for the gate of chunk 1's sum: chunks 0 and 1 whole, then lane 1's share only
    "float-confirm": ("sum", np.float32, (3, "confirm"), blocks((0, 8), (10, 12)), blocks((0, 8), (10, 12))),
    # lost in chunk 1's sum with one of lane 0's two blocks back
    "float-partial": ("sum", np.float32, (3, "partial"), blocks((0, 5), (6, 8), (10, 12)), blocks((0, 8), (10, 12))),
    # lost waiting for the gate of chunk 1's exponent round: its sum never ran
    "float-in-exponents": ("sum", np.float32, (2, "confirm"), blocks((0, 4), (6, 8), (10, 12)),
                           blocks((0, 4), (6, 8), (10, 12))),
    "int32-partial": ("sum", np.int32, (1, "partial"), blocks((0, 5), (6, 8), (10, 12)), blocks((0, 8), (10, 12))),
    "max-confirm": ("max", np.float32, (1, "confirm"), blocks((0, 8), (10, 12)), blocks((0, 8), (10, 12))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lane_that_loses_the_aggregator_leaves_its_host_every_result_it_got(case):
    op, dtype, lose, want0, want1 = CASES[case]
    rng = np.random.default_rng(11)
    if dtype == np.int32:
        xs = rng.integers(-2 ** 31, 2 ** 31, (4, N), dtype=np.int64).astype(np.int32)
        total = xs.sum(axis=0, dtype=np.int64).astype(np.int32)
    else:
        xs = (rng.standard_normal((4, N)) * 10.0 ** rng.integers(-3, 3, (4, 1))).astype(np.float32)
        total = xs.max(axis=0) if op == "max" else model(list(xs), 32)
    got = run(xs, op, lose)
    for r in range(4):
        out, err, final = got[r]
        want = want0 if r in HOSTS[0] else want1
        assert err is not None and err.split(":")[0] in ("AggregatorLost", "SilentAggregator"), (r, err)
        assert "has not answered anything" in err, (r, err)  # every rank says why
        assert final is not None and final.tolist() == want.tolist(), (r, err, final, want)
        fin = np.repeat(final, E)[:N]
        assert out[fin].tobytes() == total[fin].tobytes(), (r, "a final block is not the group's result")
        assert out[~fin].tobytes() == xs[r][~fin].tobytes(), (r, "a block that is not final lost its input")
