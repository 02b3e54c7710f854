"""The XDP aggregator on scapy-built packets through BPF_PROG_TEST_RUN (no namespaces).

Each case: packets in, expected verdicts, expected output packets (byte-exact), expected map state.
"""
from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether

from nicoffload import bpf, proto
from nicoffload.bpf import XDP_DROP, XDP_PASS, XDP_TX
from packets import generators as gen
from packets.layers import AllReduce

NONE = 0xFFFFFFFF


def hdr_of(frame: bytes) -> dict:
    vals = struct.unpack(proto.HDR_STRUCT, frame[proto.L2L4_LEN:proto.L2L4_LEN + proto.HDR_LEN])
    return dict(zip([f[0] for f in proto.FIELDS], vals))


def run_all(agg, frames):
    return [agg.run(f) for f in frames]


def test_n_contributions_produce_one_exact_result(make_agg):
    n, elems = 4, 256
    agg = make_agg(workers=n, slots=8)
    arrays = gen.sample_arrays(n, elems * 3 - 17, seed=1)  # 3 blocks, the last one partial
    frames = gen.contributions(arrays, slots=8)
    outs = run_all(agg, frames)
    verdicts = [o.verdict for o in outs]
    assert verdicts == ([XDP_DROP] * (n - 1) + [XDP_TX]) * 3
    want = gen.expected_results(arrays, slots=8)
    got = [o.data for o in outs if o.verdict == XDP_TX]
    for g, w in zip(got, want):
        assert g == gen.result_frame(w), "the result frame differs from the expected bytes"
    total = np.sum(np.stack(arrays), axis=0, dtype=np.int32)
    res = np.concatenate([np.frombuffer(g[proto.L2L4_LEN + proto.HDR_LEN:], "<i4") for g in got])
    assert np.array_equal(res[:total.size], total)
    st = agg.stats()
    assert st["rx"] == 12 and st["aggregated"] == 12 and st["completed"] == 3 and st["result_sent"] == 3
    s = agg.slot(2)["sets"][0]
    assert s["complete"] and s["bitmap"] == 0xF and s["mask"] == 0xF and s["count"] == elems - 17


def test_duplicate_before_completion_is_dropped(make_agg):
    agg = make_agg(workers=3)
    arrays = gen.sample_arrays(3, 256, seed=2)
    f = gen.contributions(arrays, slots=8)
    assert agg.run(f[0]).verdict == XDP_DROP
    assert agg.run(f[0]).verdict == XDP_DROP  # same rank again: duplicate
    st = agg.stats()
    assert st["dup_dropped"] == 1 and st["aggregated"] == 1
    assert agg.slot(0)["sets"][0]["bitmap"] == 0b001
    # the duplicate did not add twice: completing gives the exact sum
    assert agg.run(f[1]).verdict == XDP_DROP
    out = agg.run(f[2])
    assert out.verdict == XDP_TX
    assert out.data == gen.result_frame(gen.expected_results(arrays, slots=8)[0])


def test_explicit_retransmission_before_completion_gets_status(make_agg):
    agg = make_agg(workers=3)
    arrays = gen.sample_arrays(3, 256, seed=3)
    f = gen.contributions(arrays, slots=8)
    r = gen.contributions(arrays, slots=8, retx=True)
    agg.run(f[0]), agg.run(f[1])
    out = agg.run(r[1])  # rank 1 retransmits while rank 2 is missing
    assert out.verdict == XDP_TX
    h = hdr_of(out.data)
    assert h["type"] == proto.TYPE_STATUS and h["mask"] == 0b011 and h["count"] == 0
    pkt = Ether(out.data)
    assert pkt[IP].dst == gen.worker_ip(1) and pkt.dst == gen.worker_mac(1)
    assert len(out.data) == proto.L2L4_LEN + proto.HDR_LEN
    assert pkt[IP].len == 20 + 8 + proto.HDR_LEN
    assert agg.stats()["status_sent"] == 1


def test_retransmission_after_completion_gets_stored_result_by_unicast(make_agg):
    agg = make_agg(workers=2)
    arrays = gen.sample_arrays(2, 256, seed=4)
    f = gen.contributions(arrays, slots=8)
    run_all(agg, f)
    out = agg.run(gen.contributions(arrays, slots=8, retx=True)[0])
    assert out.verdict == XDP_TX
    want = gen.result_frame(gen.expected_results(arrays, slots=8)[0], dst_ip=gen.worker_ip(0),
                            dst_mac=gen.worker_mac(0))
    assert out.data == want
    st = agg.stats()
    assert st["retx_answered"] == 1 and st["completed"] == 1


def test_sets_alternate_over_many_rounds(make_agg):
    """Two slots, 40 blocks: each slot runs 20 rounds alternating set 0 and 1; every result exact."""
    n, slots = 3, 2
    agg = make_agg(workers=n, slots=slots)
    arrays = gen.sample_arrays(n, 256 * 40, seed=5)
    frames = gen.contributions(arrays, slots=slots)
    outs = run_all(agg, frames)
    got = [o.data for o in outs if o.verdict == XDP_TX]
    want = [gen.result_frame(w) for w in gen.expected_results(arrays, slots=slots)]
    assert got == want
    for s in range(slots):
        sets = agg.slot(s)["sets"]
        assert [x["rounds"] for x in sets] == [10, 10]
        # the last round ran on set 1; contributing there cleared every rank's bit in set 0
        assert sets[1]["bitmap"] == 0b111 and sets[0]["bitmap"] == 0
    assert agg.stats()["completed"] == 40


def test_reuse_of_a_slot_after_both_sets_with_same_block_ids(make_agg):
    """A later call with the same block ids on the same (slot, set) is a new round, not a retx,
    because contributing to the other set in between cleared the ranks' bits."""
    agg = make_agg(workers=2, slots=1)
    a1 = gen.sample_arrays(2, 256 * 2, seed=6)
    a2 = gen.sample_arrays(2, 256 * 2, seed=7)
    run_all(agg, gen.contributions(a1, slots=1))
    outs = run_all(agg, gen.contributions(a2, slots=1, first_use=2))
    got = [o.data for o in outs if o.verdict == XDP_TX]
    assert got == [gen.result_frame(w) for w in gen.expected_results(a2, slots=1, first_use=2)]


@pytest.mark.parametrize("case", gen.malformed_cases(workers=4, slots=8), ids=lambda c: f"{c.reason}:{c.what}")
def test_every_malformed_reason_is_counted_and_dropped(make_agg, case):
    agg = make_agg(workers=4, slots=8)
    out = agg.run(case.frame)
    assert out.verdict == XDP_DROP, case.what
    st = agg.stats()
    assert st[case.reason] == 1, f"{case.what}: counted under {[k for k, v in st.items() if v and k != 'rx']}"
    assert st["aggregated"] == 0 and st["passed"] == 0
    assert all(not s["used"] for s in agg.slot(0)["sets"])


def test_malformed_cases_cover_every_bad_counter():
    reasons = {c.reason for c in gen.malformed_cases()}
    assert {s for s in proto.STATS if s.startswith("bad_")} <= reasons


@pytest.mark.parametrize("name,frame", gen.foreign(), ids=lambda x: x if isinstance(x, str) else "")
def test_foreign_traffic_passes_untouched(make_agg, name, frame):
    agg = make_agg(workers=2)
    out = agg.run(frame)
    assert out.verdict == XDP_PASS
    assert out.data == frame
    st = agg.stats()
    assert st["passed"] == 1 and st["rx"] == 0


def test_int32_overflow_wraps_modulo_2_32(make_agg):
    agg = make_agg(workers=3)
    big = np.full(256, 2**31 - 1, dtype=np.int32)
    small = np.full(256, -(2**31), dtype=np.int32)
    arrays = [big, big, small]
    outs = run_all(agg, gen.contributions(arrays, slots=8))
    res = np.frombuffer(outs[-1].data[proto.L2L4_LEN + proto.HDR_LEN:], "<i4")
    want = (2 * (2**31 - 1) - 2**31 + 2**32) % 2**32
    want = want - 2**32 if want >= 2**31 else want
    assert (res == want).all()
    with np.errstate(over="ignore"):
        assert np.array_equal(res, np.sum(np.stack(arrays), axis=0, dtype=np.int32))


def test_max_round(make_agg):
    agg = make_agg(workers=4)
    arrays = gen.sample_arrays(4, 256, seed=8)
    outs = run_all(agg, gen.contributions(arrays, slots=8, op_max=True))
    assert outs[-1].data == gen.result_frame(gen.expected_results(arrays, slots=8, op_max=True)[0])
    res = np.frombuffer(outs[-1].data[proto.L2L4_LEN + proto.HDR_LEN:], "<i4")
    assert np.array_equal(res, np.max(np.stack(arrays), axis=0))


@pytest.mark.parametrize("null_last", [False, True])
def test_null_contributions(make_agg, null_last):
    """Sparse mode: ranks with an all-zero block send a header-only null; a null may complete the
    round, and then its packet grows to carry the result."""
    agg = make_agg(workers=3)
    arrays = gen.sample_arrays(3, 256 * 4, seed=9)
    zero_rank = 2 if null_last else 0
    arrays[zero_rank][:] = 0
    frames = gen.contributions(arrays, slots=8, sparse=True)
    outs = run_all(agg, frames)
    got = [o.data for o in outs if o.verdict == XDP_TX]
    assert got == [gen.result_frame(w) for w in gen.expected_results(arrays, slots=8, sparse=True)]
    st = agg.stats()
    assert st["null"] == 4 and st["completed"] == 4


def test_mismatched_exponent_is_rejected(make_agg):
    agg = make_agg(workers=2)
    arrays = gen.sample_arrays(2, 256, seed=10)
    a = gen.contributions(arrays, slots=8, exp=3)
    b = gen.contributions(arrays, slots=8, exp=4)
    assert agg.run(a[0]).verdict == XDP_DROP
    assert agg.run(b[1]).verdict == XDP_DROP
    st = agg.stats()
    assert st["mismatch"] == 1 and st["completed"] == 0


def test_unconfigured_program_drops_with_no_job(make_agg):
    agg = make_agg(workers=2)
    cfg = agg.b["ar_config"]
    c = cfg[cfg.Key(0)]
    c.configured = 0
    cfg[cfg.Key(0)] = c
    assert agg.run(gen.contributions(gen.sample_arrays(2, 256), slots=8)[0]).verdict == XDP_DROP
    assert agg.stats()["no_job"] == 1


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_exact_under_concurrency_on_two_cpus(make_agg):
    """Two threads pinned to CPU 0 and CPU 1 feed the contributions of the same round at the same
    moment (a barrier per round; ranks split between them): no addition is lost, no round
    completes twice. Largest packets, to widen the window in which a race would show."""
    n, slots, rounds = 32, 4, 160
    elems = proto.max_elems_for_mtu(proto.MAX_MTU)
    agg = make_agg(workers=n, slots=slots, elems=elems)
    arrays = gen.sample_arrays(n, elems * rounds, seed=11, elems=elems)
    frames = gen.contributions(arrays, slots=slots, elems=elems)  # block-major, rank order
    per_round = [[frames[b * n + r] for r in range(n)] for b in range(rounds)]
    results: list[list] = [[], []]
    barrier = threading.Barrier(2)

    def feed(cpu):
        os.sched_setaffinity(0, {cpu})
        for b in range(rounds):
            mine = per_round[b][cpu::2]
            barrier.wait()
            for f in mine:
                o = bpf.test_run(agg.fn.fd, f)
                if o.verdict == XDP_TX:
                    results[cpu].append(o.data)

    ts = [threading.Thread(target=feed, args=(c,)) for c in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    got = sorted(results[0] + results[1])
    want = sorted(gen.result_frame(w) for w in gen.expected_results(arrays, slots=slots, elems=elems))
    assert len(got) == rounds, "some round completed twice or never"
    assert got == want, "an addition was lost"
    st = agg.stats()
    assert st["completed"] == rounds and st["aggregated"] == n * rounds and st["dup_dropped"] == 0


def test_larger_packets_up_to_the_mtu(make_agg):
    elems = proto.max_elems_for_mtu(proto.MAX_MTU)
    agg = make_agg(workers=2, elems=elems)
    arrays = gen.sample_arrays(2, elems * 2, seed=12, elems=elems)
    outs = run_all(agg, gen.contributions(arrays, slots=8, elems=elems))
    got = [o.data for o in outs if o.verdict == XDP_TX]
    assert got == [gen.result_frame(w) for w in gen.expected_results(arrays, slots=8, elems=elems)]


def test_result_layer_dissects():
    pkt = Ether(gen.result_frame(gen.expected_results(gen.sample_arrays(2, 256), slots=8)[0]))
    assert pkt.haslayer(AllReduce) and pkt[AllReduce].type == proto.TYPE_RESULT
