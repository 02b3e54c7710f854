"""The XDP aggregator on whole frames through BPF_PROG_TEST_RUN: batches of records, malformed,
foreign and unregistered traffic, record sizes (concurrency: test_concurrency.py)."""
from __future__ import annotations

import pytest
from aggcheck import outcome_total, run_all
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from nicoffload.ebpf.libbpf import XDP_DROP, XDP_PASS, XDP_TX
from nicoffload.packets import generators as gen
from nicoffload.packets import hostile
from nicoffload.packets.layers import AllReduce, split_records
from nicoffload.wire import proto

# --- batches: several records in one frame ------------------------------------------------------


def test_a_batch_is_one_frame_out(make_agg, joined):
    E = 16
    agg = make_agg(workers=2, slots=8, elems=E)
    ep = joined(agg, 2)
    a = gen.sample_arrays(2, E * 6, seed=11, elems=E)
    recs = {r: [gen.record(rank=r, round=b, slots=8, epoch=ep, mask=0b11, elems=E, payload=a[r][b * E:(b + 1) * E])
                for b in range(6)] for r in range(2)}
    # rank 0's batch completes nothing: dropped
    assert agg.run(gen.batch(recs[0], 0)).verdict == XDP_DROP
    # rank 1's batch completes every round: one multicast frame with six results
    out = agg.run(gen.batch(recs[1], 1))
    assert out.verdict == XDP_TX
    want = gen.expected_results(a, slots=8, epoch=ep, elems=E)
    p = Ether(out.data)
    assert p[IP].dst == gen.GROUP_IP and p[UDP].chksum != 0  # a GSO batch keeps a partial checksum
    assert bytes(p[UDP].payload) == b"".join(want)
    st = agg.stats()
    assert st["completed"] == 6 and st["result_sent"] == 2 and st["records"] == outcome_total(st) == 14


def test_a_batch_that_completes_some_rounds_carries_only_its_answers(make_agg, joined):
    """Records that need no answer are dropped from the frame: the answers move to the front and
    the frame is cut after them (every receiver would only skip the others)."""
    E = 16
    agg = make_agg(workers=2, slots=8, elems=E)
    ep = joined(agg, 2)
    a = gen.sample_arrays(2, E * 4, seed=12, elems=E)
    rec = lambda r, b, **kw: gen.record(rank=r, round=b, slots=8, epoch=ep, mask=0b11, elems=E,  # noqa: E731
                                        payload=a[r][b * E:(b + 1) * E], **kw)
    agg.run(gen.batch([rec(0, 0), rec(0, 2)], 0))
    out = agg.run(gen.batch([rec(1, 0), rec(1, 1), rec(1, 2), rec(1, 3)], 1))
    p = Ether(out.data)
    assert out.verdict == XDP_TX and p[IP].dst == gen.GROUP_IP
    recs = split_records(bytes(p[UDP].payload), proto.record_size(E))
    assert [(r.type, r.round) for r in recs] == [(proto.TYPE_RESULT, 0), (proto.TYPE_RESULT, 2)]
    want = gen.expected_results(a, slots=8, epoch=ep, elems=E)
    assert bytes(p[UDP].payload) == want[0] + want[2]
    assert p[IP].len == len(out.data) - 14 and p[UDP].len == len(out.data) - 34
    ip = bytes(p[IP])[:20]
    assert sum(int.from_bytes(ip[i:i + 2], "big") for i in range(0, 20, 2)) % 0xFFFF == 0  # IP checksum holds
    # a batch of retransmissions and new contributions: answers go back to the sender only
    out = agg.run(gen.batch([rec(0, 0, flags=proto.FLAG_RETX), rec(0, 1), rec(0, 4 - 1)], 0))
    assert out.verdict == XDP_TX and Ether(out.data)[IP].dst == gen.GROUP_IP  # round 1 and 3 completed
    out = agg.run(gen.batch([rec(0, 0, flags=proto.FLAG_RETX), rec(0, 2, flags=proto.FLAG_RETX)], 0))
    p = Ether(out.data)
    assert out.verdict == XDP_TX and p[IP].dst == gen.worker_ip(0) and p[Ether].dst == gen.worker_mac(0)
    assert [r.type for r in split_records(bytes(p[UDP].payload), proto.record_size(E))] == [proto.TYPE_RESULT] * 2


def test_a_batch_mixing_ranks_or_jobs_only_loses_the_odd_records(make_agg, joined):
    E = 16
    agg = make_agg(workers=2, slots=8, elems=E)
    ep = joined(agg, 2)
    good = gen.record(rank=0, round=0, slots=8, epoch=ep, mask=0b11, elems=E)
    other_rank = gen.record(rank=1, round=1, slots=8, epoch=ep, mask=0b11, elems=E)
    other_job = gen.record(rank=0, round=2, slots=8, epoch=ep, mask=0b11, elems=E, job=2)
    assert agg.run(gen.batch([good, other_rank, other_job], 0)).verdict == XDP_DROP
    st = agg.stats()
    assert st["aggregated"] == 1 and st["bad_mixed"] == 2 and not agg.slot(1)["sets"][0]["used"]


# --- malformed, foreign, unconfigured -------------------------------------------------------------


@pytest.mark.parametrize("case", hostile.malformed_cases(epoch=7), ids=lambda c: f"{c.reason}:{c.what}")
def test_every_malformed_reason_is_counted_and_dropped(make_agg, joined, case):
    agg = make_agg(workers=4, slots=8)
    joined(agg, 4)
    out = agg.run(case.frame)
    assert out.verdict == XDP_DROP, case.what
    st = agg.stats()
    assert st[case.reason] == 1, (case.what, {k: v for k, v in st.items() if v})
    assert st["records"] == outcome_total(st)
    for i in range(8):
        for s in agg.slot(i)["sets"]:
            assert not s["used"], f"{case.what} touched slot {i}"


def test_malformed_cases_cover_every_bad_counter():
    covered = {c.reason for c in hostile.malformed_cases()}
    assert covered == {s for s in proto.STATS if s.startswith("bad_")}


@pytest.mark.parametrize("name,frame", hostile.foreign(), ids=lambda x: x if isinstance(x, str) else "")
def test_foreign_traffic_passes_untouched(make_agg, joined, name, frame):
    agg = make_agg()
    out = agg.run(frame)
    assert out.verdict == XDP_PASS and out.data == frame
    st = agg.stats()
    assert st["passed"] == 1 and st["rx"] == 0


def test_an_unregistered_job_is_counted_in_row_zero(make_agg, joined):
    agg = make_agg(workers=2)
    ep = joined(agg, 2)
    arrays = gen.sample_arrays(2, 256, seed=13)
    assert agg.run(gen.contributions(arrays, slots=8, epoch=ep, job=99)[0]).verdict == XDP_DROP
    assert agg.stats()["bad_job"] == 1 and agg.stats(job=1)["bad_job"] == 0


# --- sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("elems", [2, 856])
def test_record_sizes_up_to_the_mtu(make_agg, joined, elems):
    agg = make_agg(workers=2, slots=4, elems=elems)
    ep = joined(agg, 2)
    arrays = gen.sample_arrays(2, elems * 2 - 1, seed=15, elems=elems)
    outs = run_all(agg, gen.contributions(arrays, slots=4, epoch=ep, elems=elems))
    got = [o.data for o in outs if o.verdict == XDP_TX]
    assert got == [gen.result_frame(w) for w in gen.expected_results(arrays, slots=4, epoch=ep, elems=elems)]


def test_result_layer_dissects(make_agg, joined):
    agg = make_agg(workers=1)
    ep = joined(agg, 1)
    out = agg.run(gen.contributions(gen.sample_arrays(1, 256, seed=16), slots=8, epoch=ep)[0])
    ar = Ether(out.data)[AllReduce]
    assert ar.type == proto.TYPE_RESULT and ar.rank == proto.RANK_AGG and ar.epoch == ep and ar.mask == 1


def test_a_rejected_record_moves_no_acknowledgement(make_agg, joined):
    """A record that fails a check changes no state, not even its rank's head (the gate)."""
    agg = make_agg(workers=2, slots=8)
    ep = joined(agg, 2)
    bad = gen.record(rank=0, round=0, slots=8, epoch=ep, mask=0b11, ack=1000)
    bad = bad[:proto.FIELD_OFFSETS["slot"]] + (99).to_bytes(4, "big") + bad[proto.FIELD_OFFSETS["slot"] + 4:]
    out = agg.run(gen.frame(bad, src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC, src_ip=gen.worker_ip(0),
                            dst_ip=gen.AGG_IP))
    assert out.verdict == XDP_DROP and agg.stats()["bad_slot"] == 1
    assert agg.job_state(1)["acks"] == [0, 0]
    good = gen.record(rank=0, round=0, slots=8, epoch=ep, mask=0b11, ack=5)
    agg.run(gen.frame(good, src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC, src_ip=gen.worker_ip(0),
                      dst_ip=gen.AGG_IP))
    assert agg.job_state(1)["acks"] == [5, 0]
