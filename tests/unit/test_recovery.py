"""The worker's loss-recovery decisions, without sockets: when a round is resent, pulled early,
backed off, when the gate is asked for, when an ACK is due, and whom a timeout names."""
from __future__ import annotations

import numpy as np
import pytest

from nicoffload.packets import generators as gen
from nicoffload.wire import codec, proto
from nicoffload.worker.calls import rotation_starts
from nicoffload.worker.records import RankRecords, read_join_reply
from nicoffload.worker.recovery import MAX_WAIT, RoundTimer, ack_due, missing_ranks, unheard


def window(K: int, sent: float = 0.0):
    return np.zeros(K, np.uint8), np.full(K, sent, np.float64)


def test_nothing_is_resent_before_the_timeout_and_only_what_lacks_a_result_after_it():
    t = RoundTimer(rto_min=0.02, rto_max=0.5, timeout=10)
    done, sent_at = window(8)
    done[[0, 2, 5]] = 1
    t.start(0.0)
    assert t.rto == pytest.approx(0.06)  # 3 * srtt, srtt starts at rto_min
    assert len(t.timed_out(done, head=1, hi=8, sent_at=sent_at, now=0.059)) == 0
    late = t.timed_out(done, head=1, hi=8, sent_at=sent_at, now=0.06)
    assert late.tolist() == [1, 3, 4, 6, 7]
    assert (sent_at[late] == 0.06).all() and sent_at[0] == 0.0


def test_rounds_beyond_the_window_are_never_resent():
    t = RoundTimer(0.02, 0.5, 10)
    done, sent_at = window(8)
    assert t.timed_out(done, head=0, hi=3, sent_at=sent_at, now=1.0).tolist() == [0, 1, 2]
    assert t.timed_out(done, head=3, hi=3, sent_at=sent_at, now=5.0).tolist() == []


def test_a_round_resent_recently_waits_for_its_own_timeout():
    t = RoundTimer(0.02, 0.5, 10)
    done, sent_at = window(4)
    sent_at[2] = 0.05  # resent just now
    assert t.timed_out(done, 0, 4, sent_at, now=0.07).tolist() == [0, 1, 3]


def test_a_timeout_resends_no_more_than_the_congestion_window_oldest_first():
    t = RoundTimer(0.02, 0.5, 10)
    done, sent_at = window(8)
    late = t.timed_out(done, 0, 8, sent_at, now=1.0, limit=3)
    assert late.tolist() == [0, 1, 2]
    assert (sent_at[:3] == 1.0).all() and (sent_at[3:] == 0.0).all()  # the rest wait their turn


def test_backoff_doubles_and_is_capped():
    t = RoundTimer(0.02, 0.5, 10)
    done, sent_at = window(1)
    rtos, now = [], 0.0
    for _ in range(6):
        rtos.append(t.rto)
        now += t.rto + 1e-9
        assert t.timed_out(done, 0, 1, sent_at, now).tolist() == [0]
    assert rtos == pytest.approx([0.06, 0.12, 0.24, 0.48, 0.5, 0.5])
    t.on_results(0, 1, np.array([now - 0.01]), now)  # a result resets the backoff
    assert t.rto == t.base_rto < 0.1


def test_srtt_follows_results_of_rounds_in_the_window_only():
    t = RoundTimer(0.001, 0.5, 10, srtt=0.010)
    sent_at = np.array([0.0, 0.0, 0.0])
    t.on_results(0, hi=2, sent_at=sent_at, now=0.090)  # took 90 ms
    assert t.srtt == pytest.approx(0.875 * 0.010 + 0.125 * 0.090)
    before = t.srtt
    t.on_results(2, hi=2, sent_at=sent_at, now=5.0)  # round 2 was never sent by this rank
    assert t.srtt == before and t.last_progress == 5.0


def test_fast_retransmit_resends_a_round_overtaken_by_gap_later_ones():
    t = RoundTimer(0.02, 0.5, 10, gap=4)
    done, sent_at = window(16)
    done[:] = 1
    done[[2, 12]] = 0       # 2 is overtaken by 3..11 (9 later results), 12 only by 13..15
    assert t.fast_retransmit(done, 2, 16, sent_at, now=0.001).tolist() == []  # younger than the timeout
    assert t.fast_retransmit(done, 2, 16, sent_at, now=1.0).tolist() == [2]
    assert sent_at[2] == 1.0
    assert t.fast_retransmit(done, 2, 16, sent_at, now=1.01).tolist() == []  # not twice in a row


def test_the_gate_is_asked_for_only_when_the_window_is_empty_and_not_too_often():
    t = RoundTimer(0.02, 0.5, 10, srtt=0.004)
    assert not t.ask_gate(head=3, hi=5, K=10, now=1.0)   # results outstanding: wait for them
    assert not t.ask_gate(head=10, hi=10, K=10, now=1.0)  # stream done
    assert t.ask_gate(head=5, hi=5, K=10, now=1.0)
    assert not t.ask_gate(head=5, hi=5, K=10, now=1.003)
    assert t.ask_gate(head=5, hi=5, K=10, now=1.004)


def test_waits_end_at_the_next_timeout_and_never_exceed_the_maximum():
    t = RoundTimer(0.02, 0.5, 10)
    sent_at = np.array([1.0, 1.0])
    assert t.wait(0, 2, sent_at, now=1.05) == pytest.approx(0.01)
    assert t.wait(0, 2, sent_at, now=2.0) == 0.0
    assert t.wait(2, 2, sent_at, now=2.0) == MAX_WAIT


def test_expiry_counts_from_the_last_progress():
    t = RoundTimer(0.02, 0.5, timeout=2.0)
    t.start(10.0)
    assert not t.expired(12.0) and t.expired(12.01)
    t.on_results(0, 0, np.zeros(1), 12.0)
    assert not t.expired(13.9)


def test_acks_are_due_for_sparse_ranks_after_half_a_window():
    assert not ack_due(100, 0, window=256, dense=True)
    assert not ack_due(127, 0, window=256, dense=False)
    assert ack_due(128, 0, window=256, dense=False)
    assert ack_due(1, 0, window=1, dense=False)


def test_missing_ranks_are_those_expected_and_not_heard():
    masks = np.array([0b1111, 0b0110, 0b1111])
    heard = np.array([0b0111, 0b0010, -1])   # the third round's state is unknown
    assert missing_ranks(4, masks, heard) == ([3], [2])
    assert missing_ranks(4, masks, np.array([0b1111, 0b0110, -1])) == ([], [])


def test_a_rank_held_by_its_window_is_not_blamed_for_the_rank_that_stopped():
    """Rank 2 stopped at round 1; rank 1's window (smaller than rank 0's) ends at round 3: the
    rounds past it lack rank 1 too, but the oldest incomplete round names only rank 2."""
    masks = np.full(5, 0b111)
    heard = np.array([0b011, 0b011, 0b011, 0b001, 0b001])
    assert missing_ranks(3, masks, heard) == ([2], [1])
    assert missing_ranks(3, masks[:3], np.array([-1, 0b001, 0b001])) == ([1, 2], [])


def test_join_replies_are_read_for_this_rank_and_nonce_only():
    W, rank = 3, 1
    table = [gen.nonce_of(r) for r in range(W)]
    joined = gen.joined_record(rank, W, gen.nonce_of(rank), 0xBEEF, table)
    assert read_join_reply(joined, len(joined), rank, 1, gen.nonce_of(rank)) == ("joined", 0xBEEF)
    assert read_join_reply(joined, len(joined), rank, 1, gen.nonce_of(rank, 2)).kind == ""  # an older process
    assert read_join_reply(joined, len(joined), rank, 2, gen.nonce_of(rank)).kind == ""     # another job
    assert read_join_reply(joined, proto.HDR_LEN - 1, rank, 1, gen.nonce_of(rank)).kind == ""


def test_join_and_ack_records_carry_the_nonce_and_head():
    r = RankRecords(rank=2, job=5, world=4)
    hdr = np.frombuffer(bytes(r.join(0x1234_5678_9ABC_DEF1)), dtype=codec.header_dtype(), count=1)[0]
    assert (int(hdr["type"]), int(hdr["job"]), int(hdr["rank"])) == (proto.TYPE_JOIN, 5, 2)
    assert int(hdr["round"]) | int(hdr["ack"]) << 32 == 0x1234_5678_9ABC_DEF1 and int(hdr["mask"]) == 0b1111
    ack = np.frombuffer(r.ack(epoch=9, head_abs=(1 << 32) + 7, ask=True), dtype=codec.header_dtype(),
                        count=1)[0]
    assert (int(ack["type"]), int(ack["epoch"]), int(ack["ack"]), int(ack["mask"])) == (proto.TYPE_ACK, 9, 7, 0b100)
    assert int(ack["flags"]) & proto.FLAG_RETX


def test_time_a_rank_did_not_run_is_not_the_aggregators_silence():
    """A loop that meant to look again at t=1.0 and woke at t=3.0 (descheduled, or the GIL held
    by another thread) moves the last answer forward by those 2 s; a wake-up on time does not."""
    assert unheard(0.5, 1.0, 3.0) == pytest.approx(2.5)
    assert unheard(0.5, 1.0, 1.05) == 0.5


def test_probe_answers_resend_only_what_the_aggregator_lacks_of_this_rank():
    """Answers to probes (status: -1 none yet, the contributors, or DONE): a rank resends a round
    only when its own bit is missing from a round it is in, or the round is done and its result
    never came; a rank whose record is in sends nothing."""
    from nicoffload.datapath.pump import DONE
    from nicoffload.worker.recovery import probe_answers

    done = np.zeros(8, np.uint8)
    status = np.full(8, -1, np.int64)
    masks = np.full(8, 0b1111, np.int64)
    status[1], status[2], status[4] = 0b1011, DONE, 0b0111  # rank 2 missing; complete; rank 3 missing
    done[5] = 1  # round 5 has its result
    status[7], masks[7] = 0b0001, 0b0101  # round 7 lacks rank 2 (rank 1 is not in it)
    rounds = np.array([1, 2, 3, 4, 5, 7])
    a, resend, lost = probe_answers(rounds, done, status, masks, 2, DONE)
    assert a.tolist() == [1, 2, 4, 5, 7] and resend.tolist() == [1, 2, 7] and lost
    a, resend, lost = probe_answers(rounds, done, status, masks, 0, DONE)
    assert resend.tolist() == [2] and lost  # rank 0's records are in: it only pulls the lost result
    a, resend, lost = probe_answers(rounds, done, status, masks, 1, DONE)
    assert resend.tolist() == [2] and lost  # its records are in; round 7 is not its round at all
    a, resend, lost = probe_answers(np.array([3, 5]), done, status, masks, 2, DONE)
    assert a.tolist() == [5] and not len(resend) and not lost  # no answer yet; a result is no loss


def test_a_small_window_finds_its_lost_round_after_a_quarter_of_its_span():
    """A window of 12 rounds never holds 128 later results: the gap is a quarter of the window's
    span (3 here): a result 4 rounds past round 0 finds it lost, one 3 rounds past does not."""
    t = RoundTimer(rto_min=0.02, rto_max=0.5, timeout=10, srtt=0.01)
    done, sent_at = window(12)
    done[1:4] = 1
    assert t.fast_retransmit(done, 0, 12, sent_at, 0.02).tolist() == []
    done[4] = 1
    assert t.fast_retransmit(done, 0, 12, sent_at, 0.02).tolist() == [0]


def test_a_sparse_round_waiting_for_a_slower_rank_is_not_lost_until_that_rank_moves_on():
    """Sparse rounds complete out of order with nothing lost: round 0 waits for rank 1, whose
    records come later than rank 0's, while rounds 1..8 hold rank 0 alone and complete. Only once
    rank 1 has ``gap`` later results too was round 0's record (or its result) lost. Without the
    contributors, the whole window of a sparse call was probed again and again (16 MiB at 50%
    zero blocks: 228,000 probes a point and 4x the time)."""
    t = RoundTimer(rto_min=0.02, rto_max=0.5, timeout=10, srtt=0.01)
    done, sent_at = window(16)
    masks = np.array([0b11] + [0b01] * 8 + [0b10] * 4 + [0b11] * 3, np.int64)
    flags = np.zeros(16, np.uint8)
    done[1:9] = 1  # rank 0's rounds: all in
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05).tolist() == [0]  # all contributors alike: lost
    sent_at[:] = 0
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05, masks, flags).tolist() == []  # it waits for rank 1
    done[9:12] = 1  # rank 1 has 3 later results: fewer than the gap (a quarter of the span: 4)
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05, masks, flags).tolist() == []
    done[12] = 1    # ... 4: round 0's record from rank 1 went out before them
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05, masks, flags).tolist() == [0]


def test_a_rotated_runs_segments_complete_side_by_side_and_only_a_segments_own_later_results_overtake():
    """A rotated run (an optimizer step: rank q sends from q K / N on, calls.rotation_starts):
    segment 1's rounds complete while segment 0 still waits for the rank that sends it last.
    That is no loss; a round that later rounds of its own segment overtook is. Without the
    segments, 4 ranks probed 1,000-5,000 rounds a step and cut their windows."""
    segs = rotation_starts(16, 2)
    assert segs == [0, 8, 16]
    assert rotation_starts(10, 4) == [0, 2, 5, 7, 10]
    t = RoundTimer(rto_min=0.02, rto_max=0.5, timeout=10, srtt=0.01)
    done, sent_at = window(16)
    done[8:16] = 1                       # segment 1 complete, segment 0 not begun
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05).tolist() == list(range(8))  # as one order: lost
    sent_at[:] = 0
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05, segments=segs).tolist() == []
    done[3:8] = 1                        # segment 0 overtaken by 5 of its own: rounds 0..2 lost
    assert t.fast_retransmit(done, 0, 16, sent_at, 0.05, segments=segs).tolist() == [0, 1, 2]
