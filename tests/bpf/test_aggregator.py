"""The XDP aggregator on scapy-built packets through BPF_PROG_TEST_RUN (no namespaces).

Each case: packets in, expected verdicts, expected output packets (byte-exact), expected map state.
"""
from __future__ import annotations

import numpy as np
import pytest
from aggcheck import hdr_of, outcome_total, run_all
from scapy.layers.inet import IP
from scapy.layers.l2 import Ether

from nicoffload.ebpf.libbpf import XDP_DROP, XDP_TX
from nicoffload.packets import generators as gen
from nicoffload.wire import proto

# --- the epoch handshake ------------------------------------------------------------------------


def test_join_forms_an_epoch_when_every_rank_has_joined(make_agg, joined):
    agg = make_agg(workers=3)
    frames = gen.join_frames(3)
    outs = run_all(agg, frames)
    assert [o.verdict for o in outs] == [XDP_DROP, XDP_DROP, XDP_TX]
    js = agg.job_state(1)
    assert js["epoch"] and js["joined"] == 0b111 and js["nonces"] == [gen.nonce_of(r) for r in range(3)]
    # the last JOIN became the JOINED, multicast, with every rank's nonce
    want = gen.joined_record(2, 3, gen.nonce_of(2), js["epoch"], [gen.nonce_of(r) for r in range(3)])
    assert outs[-1].data == gen.result_frame(want)
    # a JOIN repeated after formation (its JOINED was lost) is answered by unicast, marked an answer
    again = agg.run(frames[0])
    assert again.verdict == XDP_TX
    assert again.data == gen.unicast_frame(gen.joined_record(0, 3, gen.nonce_of(0), js["epoch"],
                                                             [gen.nonce_of(r) for r in range(3)],
                                                             flags=proto.FLAG_ANSWER), 0)
    assert hdr_of(outs[-1].data)["flags"] == 0  # the first delivery is not
    st = agg.stats()
    assert st["join"] == 4 and st["epoch_formed"] == 1 and st["records"] == outcome_total(st) == 4


def test_joining_status_names_who_has_joined_and_world_mismatch(make_agg, joined):
    agg = make_agg(workers=3)
    agg.run(gen.join_frames(3, ranks=[1])[0])
    # a repeated JOIN of rank 1 before the others: dropped, unless it asks (RETX)
    assert agg.run(gen.join_frames(3, ranks=[1])[0]).verdict == XDP_DROP
    out = agg.run(gen.join_frames(3, ranks=[1], retx=True)[0])
    assert out.verdict == XDP_TX
    h = hdr_of(out.data)
    assert h["type"] == proto.TYPE_STATUS and h["detail"] == proto.DETAIL["joining"] and h["mask"] == 0b010
    # a worker that counts 4 ranks in a 3-rank job is told so
    out = agg.run(gen.frame(gen.join_record(0, 4, gen.nonce_of(0)), src_mac=gen.worker_mac(0), dst_mac=gen.AGG_MAC,
                            src_ip=gen.worker_ip(0), dst_ip=gen.AGG_IP))
    h = hdr_of(out.data)
    assert out.verdict == XDP_TX and h["type"] == proto.TYPE_STATUS and h["detail"] == proto.DETAIL["world"]
    assert h["mask"] == 0b111 and Ether(out.data)[IP].dst == gen.worker_ip(0)
    assert agg.job_state(1)["joined"] == 0b010


def test_a_rerun_never_sees_the_results_of_the_previous_run(make_agg, joined):
    """The bug this protocol fixes: a second run of the same job starts its rounds at 0 again;
    the aggregator still holds the first run's completed rounds with every rank's bit set."""
    agg = make_agg(workers=3, slots=8)
    first = gen.sample_arrays(3, 256 * 5, seed=1)
    e1 = joined(agg, 3, run=1)
    outs = run_all(agg, gen.contributions(first, slots=8, epoch=e1))
    assert sum(o.verdict == XDP_TX for o in outs) == 5
    # the same command again, new processes (newer nonces), new inputs, rounds from 0
    second = gen.sample_arrays(3, 256 * 5, seed=2)
    e2 = joined(agg, 3, run=2)
    assert e2 != e1
    outs = run_all(agg, gen.contributions(second, slots=8, epoch=e2))
    got = [o.data for o in outs if o.verdict == XDP_TX]
    want = gen.expected_results(second, slots=8, epoch=e2)
    assert got == [gen.result_frame(w) for w in want]
    st = agg.stats()
    assert st["retx_answered"] == 0 and st["dup_dropped"] == 0 and st["completed"] == 10


def test_a_restarted_rank_ends_the_running_epoch_and_stale_senders_learn_why(make_agg, joined):
    agg = make_agg(workers=3, slots=8)
    arrays = gen.sample_arrays(3, 256 * 2, seed=3)
    e1 = joined(agg, 3, run=1)
    f = gen.contributions(arrays, slots=8, epoch=e1)
    run_all(agg, f[:2])  # ranks 0 and 1 of round 0
    # rank 2 crashed and its new process joins: the run is over
    assert agg.run(gen.join_frames(3, [0, 0, gen.nonce_of(2, run=2)], ranks=[2])[0]).verdict == XDP_DROP
    js = agg.job_state(1)
    assert js["epoch"] == 0 and js["joined"] == 0b100
    # the old processes' records are stale; a retransmission is told why nothing will answer
    assert agg.run(f[2]).verdict == XDP_DROP
    r = gen.contributions(arrays, slots=8, epoch=e1, retx=True)
    out = agg.run(r[0])
    h = hdr_of(out.data)
    assert out.verdict == XDP_TX and h["type"] == proto.TYPE_STATUS and h["detail"] == proto.DETAIL["epoch"]
    assert Ether(out.data)[IP].dst == gen.worker_ip(0)
    # the old process of rank 2 (older nonce) asking to join is superseded
    out = agg.run(gen.join_frames(3, [0, 0, gen.nonce_of(2, run=1)], ranks=[2], retx=True)[0])
    h = hdr_of(out.data)
    assert out.verdict == XDP_TX and h["detail"] == proto.DETAIL["superseded"]
    st = agg.stats()
    assert st["stale_epoch"] == 2 and st["stale_join"] == 1 and st["records"] == outcome_total(st)


def test_records_before_any_epoch_are_stale(make_agg, joined):
    agg = make_agg(workers=2)
    arrays = gen.sample_arrays(2, 256, seed=4)
    outs = run_all(agg, gen.contributions(arrays, slots=8, epoch=12345))
    assert [o.verdict for o in outs] == [XDP_DROP, XDP_DROP]
    assert agg.stats()["stale_epoch"] == 2 and not agg.slot(0)["sets"][0]["used"]


# --- the slot algorithm -------------------------------------------------------------------------


def test_n_contributions_produce_one_exact_result(make_agg, joined):
    n, elems = 4, 256
    agg = make_agg(workers=n, slots=8)
    ep = joined(agg)
    arrays = gen.sample_arrays(n, elems * 3 - 17, seed=1)  # 3 blocks, the last one partial
    outs = run_all(agg, gen.contributions(arrays, slots=8, epoch=ep))
    assert [o.verdict for o in outs] == ([XDP_DROP] * (n - 1) + [XDP_TX]) * 3
    want = gen.expected_results(arrays, slots=8, epoch=ep)
    got = [o.data for o in outs if o.verdict == XDP_TX]
    assert got == [gen.result_frame(w) for w in want]
    total = np.sum(np.stack(arrays), axis=0, dtype=np.int32)
    res = np.concatenate([np.frombuffer(g[proto.L2L4_LEN + proto.HDR_LEN:], "<i4") for g in got])
    assert np.array_equal(res[:total.size], total)
    st = agg.stats()
    assert st["aggregated"] == 12 and st["completed"] == 3 and st["result_sent"] == 4  # + the JOINED
    assert st["records"] == outcome_total(st) == 12 + 4
    s = agg.slot(2)["sets"][0]
    assert s["complete"] and s["bitmap"] == 0xF and s["mask"] == 0xF and s["count"] == elems - 17
    assert s["epoch"] == ep and s["round"] == 2


def test_duplicate_before_completion_is_dropped(make_agg, joined):
    agg = make_agg(workers=3)
    ep = joined(agg)
    arrays = gen.sample_arrays(3, 256, seed=2)
    f = gen.contributions(arrays, slots=8, epoch=ep)
    assert agg.run(f[0]).verdict == XDP_DROP
    assert agg.run(f[0]).verdict == XDP_DROP  # same rank again: duplicate
    st = agg.stats()
    assert st["dup_dropped"] == 1 and st["aggregated"] == 1
    assert agg.slot(0)["sets"][0]["bitmap"] == 0b001
    assert agg.run(f[1]).verdict == XDP_DROP
    out = agg.run(f[2])
    assert out.verdict == XDP_TX
    assert out.data == gen.result_frame(gen.expected_results(arrays, slots=8, epoch=ep)[0])


def test_retransmissions_get_status_before_and_the_result_after_completion(make_agg, joined):
    agg = make_agg(workers=3)
    ep = joined(agg)
    arrays = gen.sample_arrays(3, 256, seed=3)
    f = gen.contributions(arrays, slots=8, epoch=ep)
    r = gen.contributions(arrays, slots=8, epoch=ep, retx=True)
    agg.run(f[0]), agg.run(f[1])
    out = agg.run(r[1])  # rank 1 retransmits while rank 2 is missing
    h = hdr_of(out.data)
    assert out.verdict == XDP_TX
    assert h["type"] == proto.TYPE_STATUS and h["detail"] == proto.DETAIL["waiting"] and h["mask"] == 0b011
    assert h["rank"] == 1 and Ether(out.data)[IP].dst == gen.worker_ip(1)
    agg.run(f[2])
    out = agg.run(r[0])  # rank 0 lost the result
    want = gen.expected_results(arrays, slots=8, epoch=ep)[0]
    assert out.verdict == XDP_TX and out.data == gen.unicast_frame(gen.answered(want), 0)
    st = agg.stats()
    assert st["retx_answered"] == 1 and st["status_sent"] == 1 and st["aggregated"] == 3


def test_sets_alternate_over_many_rounds(make_agg, joined):
    agg = make_agg(workers=2, slots=4)
    ep = joined(agg, 2)
    arrays = gen.sample_arrays(2, 256 * 13, seed=5)
    outs = run_all(agg, gen.contributions(arrays, slots=4, epoch=ep, ack=0))
    # round r+8 reuses round r's set: allowed once both ranks acknowledged round r; these
    # records all claim ack 0, so from round 8 on the aggregator keeps the Tx spots
    assert sum(o.verdict == XDP_TX for o in outs) == 8
    assert agg.stats()["early"] == 10  # both ranks' records of rounds 8..12
    # with the acknowledgements a worker really sends (its head), every round completes
    agg2 = make_agg(workers=2, slots=4)
    ep = joined(agg2, 2)
    frames = []
    for b in range(13):
        frames += gen.contributions([a[b * 256:(b + 1) * 256] for a in arrays], slots=4, epoch=ep,
                                    first_round=b, ack=b)
    outs = run_all(agg2, frames)
    got = [o.data for o in outs if o.verdict == XDP_TX]
    want = gen.expected_results(arrays, slots=4, epoch=ep)
    assert len(got) == 13 and all(g[proto.L2L4_LEN + proto.HDR_LEN:] == w[proto.HDR_LEN:] for g, w in zip(got, want))
    assert [agg2.slot(i)["sets"][k]["round"] for i in range(4) for k in range(2)] == [8, 12, 9, 5, 10, 6, 11, 7]


def test_ack_records_release_a_tx_spot(make_agg, joined):
    """A set's previous round is overwritten only once every rank's acknowledgement is past it;
    a rank that contributes to nothing says so with an ACK record."""
    agg = make_agg(workers=2, slots=1)
    ep = joined(agg, 2)
    a = gen.sample_arrays(2, 256 * 5, seed=6)

    def contrib(b, masks=0b11, ack=None):
        return gen.contributions([x[b * 256:(b + 1) * 256] for x in a], slots=1, epoch=ep, first_round=b,
                                 masks=masks, ack=b if ack is None else ack)

    for b in range(3):  # rounds 0, 1, 2: both ranks, each acknowledging what it holds
        assert [o.verdict for o in run_all(agg, contrib(b))] == [XDP_DROP, XDP_TX]
    assert agg.job_state(1)["acks"] == [2, 2]
    # round 3 (rank 0 alone) takes round 1's set: both ranks are past round 1
    assert agg.run(contrib(3, masks=0b01)[0]).verdict == XDP_TX
    # round 4 (rank 0 alone) would take round 2's set, but rank 1 has not said it holds round 2
    assert agg.run(contrib(4, masks=0b01)[0]).verdict == XDP_DROP
    assert agg.stats()["early"] == 1 and agg.slot(0)["sets"][0]["round"] == 2
    assert agg.run(gen.ack_frame(1, 4, epoch=ep)).verdict == XDP_DROP
    assert agg.job_state(1)["acks"] == [4, 4]
    out = agg.run(contrib(4, masks=0b01)[0])  # the retry of round 4 goes through
    assert out.verdict == XDP_TX and hdr_of(out.data)["round"] == 4 and hdr_of(out.data)["mask"] == 0b01
    # an ACK of another epoch is not taken
    assert agg.run(gen.ack_frame(1, 9, epoch=ep + 1)).verdict == XDP_DROP
    st = agg.stats()
    assert agg.job_state(1)["acks"] == [4, 4] and st["stale_epoch"] == 1
    assert st["ack"] == 1 and st["records"] == outcome_total(st)


def test_sparse_rounds_and_pulls(make_agg, joined):
    """A round completes with its contributors only; a rank outside the round pulls its result."""
    agg = make_agg(workers=3, slots=8)
    ep = joined(agg, 3)
    arrays = gen.sample_arrays(3, 256 * 3, seed=7)
    masks = [0b001, 0b110, 0b111]
    outs = run_all(agg, gen.contributions(arrays, slots=8, epoch=ep, masks=masks))
    assert [o.verdict for o in outs] == [XDP_TX, XDP_DROP, XDP_TX, XDP_DROP, XDP_DROP, XDP_TX]
    want = gen.expected_results(arrays, slots=8, epoch=ep, masks=masks)
    assert [o.data for o in outs if o.verdict == XDP_TX] == [gen.result_frame(w) for w in want]
    # rank 0 did not take part in round 1 and lost its result: it pulls it
    out = agg.run(gen.batch([gen.pull(0, 1, slots=8, epoch=ep, mask=0b110)], 0))
    assert out.verdict == XDP_TX and out.data == gen.unicast_frame(gen.answered(want[1]), 0)
    # a pull of a round that has not begun, and of a round still waiting
    out = agg.run(gen.batch([gen.pull(0, 3, slots=8, epoch=ep, mask=0b011)], 0))
    h = hdr_of(out.data)
    assert h["type"] == proto.TYPE_STATUS and h["detail"] == proto.DETAIL["waiting"] and h["mask"] == 0
    agg.run(gen.contributions(gen.sample_arrays(3, 256, seed=8), slots=8, epoch=ep, first_round=3, masks=0b011)[0])
    h = hdr_of(agg.run(gen.batch([gen.pull(2, 3, slots=8, epoch=ep, mask=0b011)], 2)).data)
    assert h["mask"] == 0b001 and h["rank"] == 2
    st = agg.stats()
    assert st["pull_answered"] == 1 and st["status_sent"] == 2 and st["records"] == outcome_total(st)


def test_int32_overflow_wraps_modulo_2_32(make_agg, joined):
    agg = make_agg(workers=2)
    ep = joined(agg, 2)
    big = np.full(256, 2**31 - 1, np.int32)
    outs = run_all(agg, gen.contributions([big, big], slots=8, epoch=ep))
    res = np.frombuffer(outs[-1].data[proto.L2L4_LEN + proto.HDR_LEN:], "<i4")
    assert (res == -2).all()


@pytest.mark.parametrize("op", [proto.OP_SUM64, proto.OP_MAX, proto.OP_OR])
def test_ops(make_agg, joined, op):
    agg = make_agg(workers=3)
    ep = joined(agg, 3)
    rng = np.random.default_rng(op)
    if op == proto.OP_SUM64:  # lanes the worker keeps carry-free: non-negative, sum below 2^32
        arrays = [rng.integers(0, 2**30, 256 * 2, dtype=np.int64).astype(np.int32) for _ in range(3)]
    else:
        arrays = [rng.integers(-(2**31), 2**31 - 1, 256 * 2, dtype=np.int32) for _ in range(3)]
    outs = run_all(agg, gen.contributions(arrays, slots=8, epoch=ep, op=op))
    got = [o.data for o in outs if o.verdict == XDP_TX]
    want = gen.expected_results(arrays, slots=8, epoch=ep, op=op)
    assert got == [gen.result_frame(w) for w in want]
    ref = {proto.OP_SUM64: lambda s: s.astype(np.int64).sum(0).astype(np.int32),
           proto.OP_MAX: lambda s: s.max(0), proto.OP_OR: lambda s: np.bitwise_or.reduce(s, 0)}[op]
    res = np.concatenate([np.frombuffer(g[proto.L2L4_LEN + proto.HDR_LEN:], "<i4") for g in got])
    assert np.array_equal(res, ref(np.stack(arrays)))


def test_sum16_adds_four_lanes_per_word_and_carries_twice_the_count(make_agg, joined):
    """SUM16 adds the payload's 64-bit words (four 16-bit lanes each, which the sender keeps
    carry-free) and accepts a count up to 2 * elems (a record holds twice the elements); a round
    never mixes 16-bit and 32-bit contributions."""
    E = 16
    agg = make_agg(workers=3, slots=8, elems=E)
    ep = joined(agg, 3)
    rng = np.random.default_rng(16)
    lanes = [rng.integers(0, 2 ** 14, 2 * E, dtype=np.int64).astype(np.uint16) for _ in range(3)]
    rec = lambda r, b, **kw: gen.record(rank=r, round=b, slots=8, epoch=ep, mask=0b111, elems=E,  # noqa: E731
                                        payload=lanes[r].view(np.int32), op=proto.OP_SUM16, **kw)
    assert agg.run(gen.batch([rec(0, 0, count=2 * E)], 0)).verdict == XDP_DROP
    assert agg.run(gen.batch([rec(1, 0, count=2 * E)], 1)).verdict == XDP_DROP
    out = agg.run(gen.batch([rec(2, 0, count=2 * E)], 2))
    assert out.verdict == XDP_TX
    res = hdr_of(out.data)
    assert res["count"] == 2 * E and res["op"] == proto.OP_SUM16
    got = np.frombuffer(out.data[proto.L2L4_LEN + proto.HDR_LEN:], "<u2")
    assert np.array_equal(got, np.sum(lanes, axis=0, dtype=np.int64).astype(np.uint16))
    # a 32-bit contribution to a 16-bit round is a mismatch; SUM64 takes no more than elems
    agg.run(gen.batch([rec(0, 1, count=2 * E)], 0))

    def as_sum64(count):
        r = bytearray(rec(1, 1, count=count))
        r[proto.FIELD_OFFSETS["op"]] = proto.OP_SUM64
        return bytes(r)

    assert agg.run(gen.batch([as_sum64(2 * E)], 1)).verdict == XDP_DROP and agg.stats()["bad_len"] == 1
    assert agg.run(gen.batch([as_sum64(E + 1)], 1)).verdict == XDP_DROP and agg.stats()["bad_len"] == 2
    out = agg.run(gen.batch([as_sum64(E)], 1))  # answered: the ranks disagree on the round
    assert out.verdict == XDP_TX and agg.stats()["mismatch"] == 1
    assert (hdr_of(out.data)["type"], hdr_of(out.data)["detail"]) == (proto.TYPE_STATUS, proto.DETAIL["mismatch"])


def test_a_contribution_that_disagrees_with_its_round_is_answered_and_the_round_never_completes(make_agg, joined):
    """Rank 1's contribution carries another exp than rank 0's (the ranks were not given the same
    tensors): STATUS MISMATCH back to it, and the round is conflicted: every later record of it
    (another disagreeing one, rank 0's retransmission, a contribution that agrees) gets the same
    answer, and nothing completes. A completed round keeps its result."""
    agg = make_agg(workers=2)
    ep = joined(agg, 2)
    arrays = gen.sample_arrays(2, 256, seed=9)
    a = gen.contributions(arrays, slots=8, epoch=ep, exp=5)  # rank 0's record of round 0, then rank 1's
    b = gen.contributions(arrays, slots=8, epoch=ep, exp=6)
    c = gen.contributions(arrays, slots=8, epoch=ep, exp=5, op=proto.OP_MAX)
    assert agg.run(a[0]).verdict == XDP_DROP  # rank 0 starts round 0
    out = agg.run(b[1])
    h = hdr_of(out.data)
    assert out.verdict == XDP_TX and agg.stats()["mismatch"] == 1
    assert (h["type"], h["detail"], h["mask"], h["rank"], h["round"]) == (
        proto.TYPE_STATUS, proto.DETAIL["mismatch"], 0b01, 1, 0)
    for frame in (c[1], a[1], gen.contributions(arrays, slots=8, epoch=ep, exp=5, retx=True)[0]):
        out = agg.run(frame)
        assert out.verdict == XDP_TX and hdr_of(out.data)["detail"] == proto.DETAIL["mismatch"]
    st = agg.stats()
    assert (st["mismatch"], st["status_sent"], st["completed"]) == (1, 3, 0), st
    # a completed round keeps its result: a record that disagrees is answered, and the ranks'
    # retransmissions still get the result
    d = gen.contributions(arrays, slots=8, epoch=ep, exp=5, first_round=1, masks=0b01)
    assert agg.run(d[0]).verdict == XDP_TX  # round 1, rank 0 alone: complete
    late = gen.contributions(arrays, slots=8, epoch=ep, exp=5, first_round=1)[1]  # rank 1, mask 0b11
    assert hdr_of(agg.run(late).data)["detail"] == proto.DETAIL["mismatch"] and agg.stats()["mismatch"] == 2
    again = agg.run(gen.contributions(arrays, slots=8, epoch=ep, exp=5, first_round=1, masks=0b01, retx=True)[0])
    assert hdr_of(again.data)["type"] == proto.TYPE_RESULT and agg.stats()["retx_answered"] == 1


def test_stale_rounds_are_dropped(make_agg, joined):
    agg = make_agg(workers=2, slots=2)
    ep = joined(agg, 2)
    a = gen.sample_arrays(2, 256 * 5, seed=10)
    frames = []
    for b in range(5):
        frames += gen.contributions([x[b * 256:(b + 1) * 256] for x in a], slots=2, epoch=ep, first_round=b, ack=b)
    run_all(agg, frames)
    old = gen.contributions([x[:256] for x in a], slots=2, epoch=ep, first_round=0)
    assert agg.run(old[0]).verdict == XDP_DROP and agg.stats()["stale_round"] == 1
    out = agg.run(gen.contributions([x[:256] for x in a], slots=2, epoch=ep, first_round=0, retx=True)[0])
    assert hdr_of(out.data)["detail"] == proto.DETAIL["gone"]


def test_a_probe_says_what_its_round_lacks_and_touches_nothing(make_agg, joined):
    """A PROBE (a PULL of one header) is answered by a header-only STATUS to its sender: WAITING
    with the contributors so far, DONE once the round is complete, GONE once its set has moved on,
    EPOCH for an ended run; a header without PULL is malformed. The round completes as it would
    without probes."""
    agg = make_agg(workers=3, slots=1)
    ep = joined(agg, 3)
    arrays = gen.sample_arrays(3, 3 * 256, seed=9)
    f = gen.contributions(arrays, slots=1, epoch=ep)  # rounds 0, 1, 2; ranks 0, 1, 2 in each

    def ask(rank, rnd, epoch=ep, **kw):
        out = agg.run(gen.batch([gen.probe(rank, rnd, slots=1, epoch=epoch, mask=0b111, **kw)], rank))
        if out.verdict != XDP_TX:
            return out.verdict
        assert len(out.data) == 14 + 20 + 8 + proto.HDR_LEN and Ether(out.data)[IP].dst == gen.worker_ip(rank)
        h = hdr_of(out.data)
        assert h["type"] == proto.TYPE_STATUS and h["rank"] == rank and h["round"] == rnd
        return proto.DETAILS[int(h["detail"])], int(h["mask"])

    assert ask(1, 0) == ("waiting", 0)  # nothing of it has arrived
    agg.run(f[0]), agg.run(f[1])
    assert ask(2, 0) == ("waiting", 0b011)
    want = gen.expected_results(arrays, slots=1, epoch=ep)
    out = agg.run(f[2])
    assert out.verdict == XDP_TX and out.data == gen.result_frame(want[0])
    assert ask(0, 0) == ("done", 0b111)  # complete: the prober pulls it in full
    assert ask(0, 0, epoch=ep + 1) == ("epoch", 0)
    assert ask(0, 0, flags=0)[0] == "done"  # RETX or not, a header-only PULL is a probe
    for x in f[3:5]:
        agg.run(x)
    for rank in range(3):
        agg.run(gen.ack_frame(rank, 1, epoch=ep))
    agg.run(f[6])  # round 2 takes round 0's set
    assert ask(1, 0) == ("gone", 0) and ask(1, 1) == ("waiting", 0b011)
    # a header alone without PULL: a contribution with no payload
    bad = bytearray(gen.probe(1, 1, slots=1, epoch=ep, mask=0b111))
    bad[proto.FIELD_OFFSETS["flags"]] = proto.FLAG_RETX
    assert agg.run(gen.batch([bytes(bad)], 1)).verdict == XDP_DROP
    st = agg.stats()
    assert st["probed"] == 6 and st["stale_epoch"] == 1 and st["bad_len"] == 1, st
    assert st["records"] == outcome_total(st)
