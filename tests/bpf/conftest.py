from __future__ import annotations

import pytest

from nicoffload.agg.control import Aggregator
from nicoffload.ebpf import libbpf
from nicoffload.packets import generators as gen


@pytest.fixture(scope="session")
def _agg_cache():
    cache: dict = {}
    yield cache
    for a in cache.values():
        a.close()


@pytest.fixture
def make_agg(_agg_cache):
    """Test aggregators (loaded, not attached), compiled once per shape and returned with every
    slot, counter and the job entry reset (no epoch formed), so each test starts from a clean
    program."""

    def make(workers=4, slots=8, elems=256, **kw):
        kw.setdefault("worker_ips", [gen.worker_ip(r) for r in range(workers)])
        key = (workers, slots, elems, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                    for k, v in kw.items())))
        agg = _agg_cache.get(key)
        if agg is None:
            agg = Aggregator.for_test(workers, slots=slots, elems=elems, agg_ip=gen.AGG_IP,
                                      agg_mac=gen.AGG_MAC, group=gen.GROUP_IP, **kw)
            _agg_cache[key] = agg
        else:
            agg.reset_slots()
            agg.reset_stats()
            agg.reset_jobs()
        return agg

    return make


def form_epoch(agg, workers: int | None = None, run: int = 1, job: int | None = None) -> int:
    """Every rank JOINs with the nonces of process start ``run``; returns the epoch handed out."""
    workers = workers or agg.spec.workers
    job = agg.spec.job if job is None else job
    outs = [agg.run(f) for f in gen.join_frames(workers, [gen.nonce_of(r, run) for r in range(workers)], job=job)]
    assert [o.verdict for o in outs] == [libbpf.XDP_DROP] * (workers - 1) + [libbpf.XDP_TX]
    epoch = agg.job_state(job)["epoch"]
    assert epoch
    return epoch


@pytest.fixture
def joined():
    return form_epoch
