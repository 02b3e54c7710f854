"""Several jobs on one XDP aggregator (BPF_PROG_TEST_RUN): each job's packets touch only its own
share of the pool, its results go to its own group, its counters are its own, a host of one
job cannot contribute to another, and a removed job's packets are counted as no job's."""
from __future__ import annotations

import pytest

from nicoffload.agg.control import Aggregator
from nicoffload.ebpf.libbpf import XDP_DROP, XDP_TX
from nicoffload.errors import CapacityError
from nicoffload.packets import generators as gen
from nicoffload.wire import proto

E = 16
IPS_A = ["10.0.0.1", "10.0.0.2"]
IPS_B = ["10.0.0.3", "10.0.0.4", "10.0.0.5"]
GROUP_A, GROUP_B = "239.77.0.1", "239.77.0.2"


@pytest.fixture(scope="module")
def agg():
    a = Aggregator.for_test(0, slots=32, elems=E)
    yield a
    a.close()


@pytest.fixture
def two_jobs(agg):
    for j in list(agg.table.entries):
        agg.remove_job(j)
    agg.reset_slots()
    agg.reset_stats()
    agg.add_job(1, 2, GROUP_A, IPS_A, slots=8, key=gen.KEY)  # the generators' key: job by job in test_keys
    agg.add_job(2, 3, GROUP_B, IPS_B, slots=16, key=gen.KEY)
    return agg


def join(agg, job, ips):
    n = len(ips)
    outs = [agg.run(gen.frame(gen.join_record(r, n, gen.nonce_of(r), job=job), src_mac=gen.worker_mac(r),
                              dst_mac=gen.AGG_MAC, src_ip=ips[r], dst_ip=gen.AGG_IP)) for r in range(n)]
    assert [o.verdict for o in outs] == [XDP_DROP] * (n - 1) + [XDP_TX]
    return agg.job_state(job)["epoch"]


def run_job(agg, job, ips, group, seed):
    ep = join(agg, job, ips)
    arrays = gen.sample_arrays(len(ips), E * 5, seed=seed, elems=E)
    slots = agg.job_state(job)["slots"]
    frames = gen.contributions(arrays, slots=slots, epoch=ep, elems=E, job=job, src_ips=ips)
    outs = [agg.run(f) for f in frames]
    got = [o.data for o in outs if o.verdict == XDP_TX]
    want = [gen.result_frame(w, dst_ip=group) for w in gen.expected_results(arrays, slots=slots, epoch=ep, elems=E,
                                                                           job=job)]
    return got, want


def test_each_job_is_exact_on_its_own_share_and_group(two_jobs):
    agg = two_jobs
    got_a, want_a = run_job(agg, 1, IPS_A, GROUP_A, seed=1)
    got_b, want_b = run_job(agg, 2, IPS_B, GROUP_B, seed=2)
    assert got_a == want_a and got_b == want_b
    # job 2's slot 0..4 are the pool's 8..12; job 1 used the pool's 0..4 and nothing of job 2's
    assert [agg.slot(i)["sets"][0]["used"] for i in range(16)] == [True] * 5 + [False] * 3 + [True] * 5 + [False] * 3
    sa, sb = agg.stats(1), agg.stats(2)
    assert (sa["completed"], sb["completed"]) == (5, 5)
    assert (sa["aggregated"], sb["aggregated"]) == (10, 15)
    assert agg.unattributed()["rx"] == 0


def test_a_job_cannot_reach_beyond_its_share(two_jobs):
    agg = two_jobs
    ep = join(agg, 1, IPS_A)
    rec = gen.record(rank=0, round=8, slots=64, epoch=ep, mask=0b11, elems=E, job=1)  # slot 8: job 2's
    out = agg.run(gen.frame(rec, src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC, src_ip=IPS_A[0], dst_ip=gen.AGG_IP))
    assert out.verdict == XDP_DROP
    assert agg.stats(1)["bad_slot"] == 1 and not agg.slot(8)["sets"][0]["used"]


def test_a_host_of_one_job_cannot_contribute_to_another(two_jobs):
    agg = two_jobs
    ep = join(agg, 1, IPS_A)
    rec = gen.record(rank=1, round=0, slots=8, epoch=ep, mask=0b11, elems=E, job=1)
    spoof = gen.frame(rec, src_mac=gen.worker_mac(2), dst_mac=gen.AGG_MAC, src_ip=IPS_B[0], dst_ip=gen.AGG_IP)
    assert agg.run(spoof).verdict == XDP_DROP
    assert agg.stats(1)["bad_src"] == 1 and agg.job_state(1)["epoch"] == ep
    assert not agg.slot(0)["sets"][0]["used"]


def test_a_removed_job_is_no_job(two_jobs):
    agg = two_jobs
    ep = join(agg, 2, IPS_B)
    agg.remove_job(2)
    rec = gen.record(rank=0, round=0, slots=16, epoch=ep, mask=0b111, elems=E, job=2)
    out = agg.run(gen.frame(rec, src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC, src_ip=IPS_B[0], dst_ip=gen.AGG_IP))
    assert out.verdict == XDP_DROP and agg.unattributed()["bad_job"] == 1
    # its share is free again, and a new job there starts clean (no slot state, no epoch)
    e = agg.add_job(3, 3, GROUP_B, IPS_B, slots=16, key=gen.KEY)
    assert (e.slot_base, e.slot_count) == (8, 16)
    assert agg.job_state(3)["epoch"] == 0 and agg.stats(3)["rx"] == 0
    assert not any(s["used"] for i in e.slots for s in agg.slot(i)["sets"])


def test_a_full_pool_refuses_a_job(two_jobs):
    with pytest.raises(CapacityError, match="largest free range of the pool holds 8"):
        two_jobs.add_job(3, 2, "239.77.0.3", slots=9)
    assert sorted(two_jobs.table.entries) == [1, 2]
    assert two_jobs.add_job(3, 2, "239.77.0.3").slot_count == 8
    assert proto.MAX_JOBS >= 3


def test_an_index_entry_that_names_another_jobs_row_reaches_no_job(two_jobs):
    """An index left behind (job 7 -> job 2's row, as a control plane killed half way could leave
    it): job 7's frames are no job's, and job 2's epoch and counters are untouched."""
    agg = two_jobs
    ep = join(agg, 2, IPS_B)
    index = agg.maps.b["ar_job_index"]
    index[index.Key(7)] = index.Leaf(agg.maps.job_index(2))
    before = agg.stats(2)
    outs = [agg.run(gen.frame(gen.join_record(r, 3, gen.nonce_of(r + 50), job=7), src_mac=gen.worker_mac(r),
                              dst_mac=gen.AGG_MAC, src_ip=IPS_B[r], dst_ip=gen.AGG_IP)) for r in range(3)]
    assert [o.verdict for o in outs] == [XDP_DROP] * 3
    assert agg.unattributed()["bad_job"] == 3 and agg.stats(2) == before
    assert agg.job_state(2)["epoch"] == ep
    del index[index.Key(7)]
