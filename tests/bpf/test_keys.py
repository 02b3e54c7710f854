"""The job's key in the XDP aggregator, on scapy-built packets through BPF_PROG_TEST_RUN: a record
without its job's key is ``bad_key``, counted in the job's row, and touches nothing (no slot, no
epoch, no head); the aggregator's answers carry the key; a job registered without a key takes
only key 0; and the test-only build without the check (what ``agg bench --key-cost`` measures
against) really lacks it."""
from __future__ import annotations

import numpy as np
from aggcheck import hdr_of, outcome_total, run_all

from nicoffload.agg.control import Aggregator
from nicoffload.ebpf.libbpf import XDP_DROP, XDP_TX
from nicoffload.packets import generators as gen
from nicoffload.packets.layers import AllReduce
from nicoffload.wire import proto

W, S, E = 3, 8, 256
WRONG = gen.KEY ^ 0x8000000000000001  # the first and the last bit of the key flipped


def _only(st: dict, **want) -> None:
    """Exactly these counters moved (besides rx and records)."""
    moved = {k: v for k, v in st.items() if v and k not in ("rx", "records")}
    assert moved == want, moved


def test_a_contribution_without_the_key_touches_no_slot(make_agg, joined):
    agg = make_agg(workers=W, slots=S)
    epoch = joined(agg, W)
    agg.reset_stats()
    arrays = gen.sample_arrays(W, E, seed=3)
    for k in (WRONG, 0, gen.KEY ^ 1 << 40):
        outs = run_all(agg, gen.contributions(arrays, slots=S, epoch=epoch, key=k))
        assert [o.verdict for o in outs] == [XDP_DROP] * W
    assert not agg.slot(0)["sets"][0]["used"]  # not even the first contribution opened the round
    st = agg.stats(1)
    _only(st, bad_key=3 * W)
    assert st["records"] == outcome_total(st) == 3 * W and agg.unattributed()["bad_key"] == 0
    # the same contributions with the key: the round completes, and its result carries the key
    outs = run_all(agg, gen.contributions(arrays, slots=S, epoch=epoch))
    assert outs[-1].verdict == XDP_TX
    assert outs[-1].data == gen.result_frame(gen.expected_results(arrays, slots=S, epoch=epoch)[0])
    assert hdr_of(outs[-1].data)["key"] == gen.KEY


def test_a_join_without_the_key_does_not_end_the_run(make_agg, joined):
    agg = make_agg(workers=W, slots=S)
    epoch = joined(agg, W)
    before = agg.job_state(1)
    newer = [gen.nonce_of(r, run=9) for r in range(W)]
    for retx in (False, True):
        outs = run_all(agg, gen.join_frames(W, newer, retx=retx, key=WRONG))
        assert [o.verdict for o in outs] == [XDP_DROP] * W  # not even a STATUS goes back
    after = agg.job_state(1)
    assert (after["epoch"], after["joined"], after["nonces"]) == (epoch, before["joined"], before["nonces"])
    # nor a JOIN of a world the job does not have (which a keyed one would get a STATUS for)
    assert agg.run(gen.frame(gen.join_record(0, W + 1, 1 << 62, key=WRONG), src_mac=gen.worker_mac(0),
                             dst_mac=gen.AGG_MAC, src_ip=gen.worker_ip(0), dst_ip=gen.AGG_IP)).verdict == XDP_DROP
    assert agg.stats(1)["bad_key"] == 2 * W + 1


def test_an_ack_without_the_key_moves_no_head(make_agg, joined):
    agg = make_agg(workers=W, slots=S)
    epoch = joined(agg, W)
    assert agg.run(gen.ack_frame(1, 0x1000, epoch=epoch, key=WRONG)).verdict == XDP_DROP
    ask = gen.ack_frame(1, 0x2000, epoch=epoch, key=WRONG)
    raw = bytearray(ask)
    raw[proto.L2L4_LEN + proto.FIELD_OFFSETS["flags"]] = proto.FLAG_RETX  # and asks for the gate
    assert agg.run(bytes(raw)).verdict == XDP_DROP
    assert agg.job_state(1)["acks"] == [0] * W and agg.stats(1)["bad_key"] == 2
    assert agg.run(gen.ack_frame(1, 0x10, epoch=epoch)).verdict == XDP_DROP  # with the key: taken
    assert agg.job_state(1)["acks"][1] == 0x10


def test_a_batch_whose_later_record_has_another_key(make_agg, joined):
    """Each record of a batch is checked: the good ones are taken, the one without the key is
    bad_key and its slot stays untouched."""
    agg = make_agg(workers=1, slots=S)
    epoch = joined(agg, 1)
    agg.reset_stats()
    x = gen.sample_arrays(1, 3 * E, seed=4)[0]
    recs = [gen.record(rank=0, round=r, slots=S, epoch=epoch, mask=1, payload=x[r * E:(r + 1) * E],
                       key=WRONG if r == 1 else gen.KEY) for r in range(3)]
    out = agg.run(gen.batch(recs, 0))
    assert out.verdict == XDP_TX
    st = agg.stats(1)
    _only(st, aggregated=2, completed=2, result_sent=1, bad_key=1)
    assert [agg.slot(s)["sets"][0]["used"] for s in range(3)] == [True, False, True]
    # the answer holds the two results, each with the job's key
    n = (len(out.data) - proto.L2L4_LEN) // proto.record_size(E)
    assert n == 2 and [hdr_of(out.data, i * proto.record_size(E))["key"] for i in range(n)] == [gen.KEY] * 2


def test_a_job_without_a_key_takes_key_zero_only(make_agg, joined):
    agg = make_agg(workers=2, slots=S, key=0)
    nonces = [gen.nonce_of(r) for r in range(2)]
    assert [agg.run(f).verdict for f in gen.join_frames(2, nonces, key=gen.KEY)] == [XDP_DROP] * 2
    assert agg.job_state(1)["joined"] == 0 and agg.stats(1)["bad_key"] == 2
    outs = run_all(agg, gen.join_frames(2, nonces, key=0))
    assert outs[-1].verdict == XDP_TX and AllReduce(outs[-1].data[proto.L2L4_LEN:]).key == 0
    epoch = agg.job_state(1)["epoch"]
    arrays = gen.sample_arrays(2, E, seed=5)
    outs = run_all(agg, gen.contributions(arrays, slots=S, epoch=epoch, key=0))
    assert outs[-1].data == gen.result_frame(gen.expected_results(arrays, slots=S, epoch=epoch, key=0)[0])


def test_the_build_without_the_check_lacks_it():
    """The test-only mutant that ``agg bench --key-cost`` measures the check against takes a
    record of any key: the two builds differ by the check."""
    agg = Aggregator.for_test(1, slots=S, elems=E, agg_ip=gen.AGG_IP, agg_mac=gen.AGG_MAC, group=gen.GROUP_IP,
                              worker_ips=[gen.worker_ip(0)], defines={"AR_MUTANT_NO_KEY_CHECK": 1})
    try:
        out = agg.run(gen.join_frames(1, key=WRONG)[0])
        assert out.verdict == XDP_TX and agg.job_state(1)["epoch"] and agg.stats(1)["bad_key"] == 0
        epoch = agg.job_state(1)["epoch"]
        out = agg.run(gen.contributions([np.arange(E, dtype=np.int32)], slots=S, epoch=epoch, key=WRONG)[0])
        assert out.verdict == XDP_TX and hdr_of(out.data)["key"] == WRONG
    finally:
        agg.close()


def test_one_jobs_key_opens_no_other_job():
    """Two jobs, two keys: a record of job 2 that carries job 1's key (a host of job 1 that spoofs a
    rank of job 2) is bad_key in job 2's row; with its own key it is taken."""
    ips = [gen.worker_ip(r) for r in range(2)]
    agg = Aggregator.for_test(0, slots=16, elems=E, agg_ip=gen.AGG_IP, agg_mac=gen.AGG_MAC)
    try:
        agg.add_job(1, 2, "239.77.0.1", ips, slots=8, key=gen.KEY)
        agg.add_job(2, 2, "239.77.0.2", ips, slots=8, key=WRONG)
        assert [agg.run(f).verdict for f in gen.join_frames(2, job=2)] == [XDP_DROP] * 2
        assert agg.stats(2)["bad_key"] == 2 and agg.stats(1)["bad_key"] == 0 and agg.job_state(2)["joined"] == 0
        assert [agg.run(f).verdict for f in gen.join_frames(2, job=2, key=WRONG)] == [XDP_DROP, XDP_TX]
        assert agg.job_state(2)["epoch"] and agg.job_state(1)["joined"] == 0
    finally:
        agg.close()
