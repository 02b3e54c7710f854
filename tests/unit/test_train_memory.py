"""The demo's per-rank memory report counts what a rank holds: a sharded tensor (FSDP2's DTensor,
whose ``numel`` is the whole tensor's) by its local shard."""
from __future__ import annotations

import pytest

from nicoffload.lab.train.ddp_rank import _memory

torch = pytest.importorskip("torch")


class _Model:
    def __init__(self, params):
        self._p = params

    def parameters(self):
        return iter(self._p)


def _sharded(n: int, shards: int):
    """A tensor of ``n`` float32 standing for a DTensor: the whole tensor, ``to_local`` the shard."""
    t = torch.zeros(n)
    t.grad = torch.zeros(n)
    shard = torch.zeros(n // shards)
    t.to_local = lambda: shard
    t.grad.to_local = lambda: shard
    return t


def test_a_sharded_parameter_counts_its_local_shard():
    p = _sharded(1000, 4)
    opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
    opt.state = {p: {"momentum_buffer": _sharded(1000, 4)}}
    m = _memory(_Model([p, torch.zeros(10)]), opt)
    assert m["params"] == 4 * (250 + 10)
    assert m["grads"] == 4 * 250
    assert m["optimizer_state"] == 4 * 250
