"""The user-space aggregator, fed generated frames with its sends captured: epochs, results
against the generators' reference, the Tx-spot rule, retransmissions, pulls, batches and
malformed input, counted as the XDP program counts them."""
from __future__ import annotations

import pytest
from wirecheck import header_of, udp_of

from nicoffload.packets import generators as g
from nicoffload.packets import hostile
from nicoffload.wire import proto

W, S, E = 4, 8, 256
FULL = (1 << W) - 1
OPS = [proto.OP_SUM, proto.OP_SUM64, proto.OP_MAX, proto.OP_OR]
OUTCOMES = {"aggregated", "retx_answered", "pull_answered", "status_sent", "dup_dropped", "join", "ack", "early",
            "mismatch"}




# --- agreement with the user-space aggregator ---------------------------------------------------


class Harness:
    """A user-space aggregator whose sends are captured instead of leaving through its socket."""

    def __init__(self, workers=W, slots=S, elems=E, job=1, key=g.KEY):
        from nicoffload.userspace.aggregator import UserspaceAggregator

        # port 0: the constructor binds an ephemeral UDP port, which nothing here sends to
        self.agg = UserspaceAggregator(workers=workers, port=0, slots=slots, elems=elems, job=job,
                                       group=g.GROUP_IP, worker_ips=[g.worker_ip(r) for r in range(workers)],
                                       key=key)
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self.agg._send = lambda data, dst, port: self.sent.append((bytes(data), (dst, port)))
        self.workers = workers

    def feed(self, frame: bytes, sport: int | None = None) -> list[tuple[bytes, tuple[str, int]]]:
        """Hand the frame's UDP payload to the aggregator; return what it sent for it."""
        dgram, ip, port = udp_of(frame)
        n = len(self.sent)
        self.agg.handle_datagram(memoryview(bytearray(dgram)), (ip, port if sport is None else sport))
        return self.sent[n:]

    def form(self) -> int:
        for f in g.join_frames(self.workers):
            self.feed(f)
        assert self.agg.live
        return self.agg.live

    @property
    def stats(self) -> dict:
        return dict(self.agg.stats)

    def delta(self, before: dict) -> dict:
        return {k: v - before[k] for k, v in self.agg.stats.items() if v != before[k]}

    def outcomes(self) -> int:
        """Records that ended in an outcome counter (each record ends in exactly one)."""
        return sum(v for k, v in self.agg.stats.items() if k in OUTCOMES or k.startswith(("bad_", "stale_")))


@pytest.fixture
def harness():
    made = []

    def make(**kw) -> Harness:
        h = Harness(**kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.agg.close()
    for h in made:  # whatever a test fed: every record ended in exactly one outcome counter
        assert h.outcomes() == h.stats["records"], h.stats


def test_epoch_formation(harness):
    h = harness()
    joins = g.join_frames(W)
    for f in joins[:-1]:
        assert h.feed(f) == [] and h.agg.live == 0
    # a RETX JOIN of a rank that has joined: who has joined so far
    (status, addr), = h.feed(g.join_frames(W, ranks=[0], retx=True)[0], sport=40123)
    s = header_of(status)
    assert addr == (g.worker_ip(0), 40123)
    assert (s["type"], s["detail"], s["mask"], s["rank"]) == (proto.TYPE_STATUS, proto.DETAIL["joining"], 0b0111, 0)
    # the last JOIN forms the epoch: its JOINED goes to the group, to the sender's port
    (joined, addr), = h.feed(joins[-1], sport=40124)
    live = h.agg.live
    table = [g.nonce_of(r) for r in range(W)]
    assert live and addr == (g.GROUP_IP, 40124)
    assert joined == g.joined_record(W - 1, W, g.nonce_of(W - 1), live, table)
    # a JOIN repeated after formation (its JOINED was lost): the JOINED again, by unicast
    assert h.feed(joins[1]) == [(g.joined_record(1, W, g.nonce_of(1), live, table, flags=proto.FLAG_ANSWER),
                                 (g.worker_ip(1), proto.DEFAULT_PORT))]
    # a worker that counts another world: STATUS WORLD with the job's ranks
    wrong = g.frame(g.join_record(2, W - 1, g.nonce_of(2)), src_mac=g.worker_mac(2), dst_mac=g.AGG_MAC,
                    src_ip=g.worker_ip(2), dst_ip=g.AGG_IP)
    (status, addr), = h.feed(wrong)
    s = header_of(status)
    assert (s["type"], s["detail"], s["mask"], addr[0]) == (proto.TYPE_STATUS, proto.DETAIL["world"], FULL,
                                                           g.worker_ip(2))
    assert h.agg.live == live
    st = h.stats
    assert (st["join"], st["epoch_formed"], st["result_sent"], st["status_sent"], st["records"], st["rx"]) == (
        W + 2, 1, 1, 1, W + 3, W + 3)


def test_a_newer_nonce_ends_the_epoch_and_an_older_one_is_superseded(harness):
    h = harness()
    live = h.form()
    arrs = g.sample_arrays(W, E, seed=2)
    first = g.contributions(arrs, slots=S, epoch=live)
    h.feed(first[0])
    # rank 2 restarts: its JOIN with a newer nonce ends the running epoch
    newer = [g.nonce_of(r, 2 if r == 2 else 1) for r in range(W)]
    assert h.feed(g.join_frames(W, newer, ranks=[2])[0]) == [] and h.agg.live == 0
    # records of the ended epoch: dropped, or a STATUS EPOCH if they ask
    before = h.stats
    assert h.feed(first[1]) == []
    (status, addr), = h.feed(g.contributions(arrs, slots=S, epoch=live, retx=True)[0])
    s = header_of(status)
    assert (s["type"], s["detail"], s["epoch"], addr[0]) == (proto.TYPE_STATUS, proto.DETAIL["epoch"], live,
                                                             g.worker_ip(0))
    assert h.delta(before) == {"rx": 2, "records": 2, "stale_epoch": 2}  # the STATUS is its outcome
    # the old process of rank 2: superseded (silently, or with a STATUS if it asks)
    before = h.stats
    assert h.feed(g.join_frames(W, ranks=[2])[0]) == []
    (status, _), = h.feed(g.join_frames(W, ranks=[2], retx=True)[0])
    assert (header_of(status)["type"], header_of(status)["detail"]) == (proto.TYPE_STATUS, proto.DETAIL["superseded"])
    assert h.delta(before) == {"rx": 2, "records": 2, "stale_join": 2}
    # the other ranks join again (same nonces): a new epoch with rank 2's new nonce
    for f in g.join_frames(W, newer, ranks=[0, 1, 3]):
        h.feed(f)
    assert h.agg.live not in (0, live)
    assert h.sent[-1] == (g.joined_record(3, W, newer[3], h.agg.live, newer), (g.GROUP_IP, proto.DEFAULT_PORT))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("sparse", [False, True])
def test_results_equal_the_userspace_aggregator(harness, op, sparse):
    """2S + 5 rounds from round 3 (each set used twice, acknowledged in between), with extreme
    values; the results the aggregator multicasts are expected_results, byte for byte."""
    h = harness()
    live = h.form()
    nb = 2 * S + 5
    arrs = g.sample_arrays(W, nb * E - 7, seed=3 + op, bound=1 << 31)
    arrs[0][:E] = arrs[1][:E] = 2**31 - 1  # SUM wraps, SUM64 carries
    arrs[2][E:2 * E] = -(2**31)
    masks = [FULL if b % 3 == 0 else b % FULL + 1 for b in range(nb)] if sparse else None
    kw = dict(slots=S, epoch=live, elems=E, masks=masks, first_round=3, exp=-6, op=op)
    frames = g.contributions(arrs, **kw)
    acked = False
    for f in frames:
        rnd = header_of(udp_of(f)[0])["round"]
        if rnd == 3 + 2 * S and not acked:  # the first reuse of a set: every rank acknowledges
            for r in range(W):
                assert h.feed(g.ack_frame(r, 3 + 2 * S, epoch=live)) == []
            acked = True
        h.feed(f, sport=40000 + rnd)
    # results carry the job's gate: 0 until every rank acknowledged 3 + 2S, then that round
    gates = [0 if 3 + b < 3 + 2 * S else 3 + 2 * S for b in range(nb)]
    want = g.expected_results(arrs, gate=gates, **kw)
    assert [d for d, _ in h.sent[1:]] == want
    assert [a for _, a in h.sent[1:]] == [(g.GROUP_IP, 40000 + header_of(d)["round"]) for d in want]
    st = h.stats
    assert (st["completed"], st["result_sent"] - 1, st["early"], st["mismatch"], st["ack"]) == (nb, nb, 0, 0, W)
    assert st["aggregated"] == len(frames)


def test_a_set_is_reused_only_after_every_rank_has_acknowledged(harness):
    """The Tx-spot rule: round i + 2S overwrites round i's result only once every rank's ack is
    past round i (ACK records, or the ack field of contributions)."""
    h = harness(workers=2, slots=1)
    live = h.form()
    arrs = g.sample_arrays(2, 4 * E, seed=4)
    f = g.contributions(arrs, slots=1, epoch=live)  # rounds 0..3 on slot 0, sets 0, 1, 0, 1
    # results carry the gate when they complete: round 2 after both acked 1, round 3 after both acked 2
    want = g.expected_results(arrs, slots=1, epoch=live, gate=[0, 0, 1, 2])
    for x in f[:4]:
        h.feed(x)
    assert [d for d, _ in h.sent[1:]] == want[:2]
    before = h.stats
    assert h.feed(f[4]) == [] and h.feed(f[5]) == []  # round 2 would overwrite round 0's result
    assert h.delta(before) == {"rx": 2, "records": 2, "early": 2}
    h.feed(g.ack_frame(0, 1, epoch=live))
    assert h.feed(f[4]) == [] and h.stats["early"] == 3  # rank 1 has not acknowledged
    h.feed(g.ack_frame(1, 1, epoch=h.agg.live + 1))  # an ACK of another epoch counts for nothing
    assert h.stats["stale_epoch"] == 1
    h.feed(g.ack_frame(1, 1, epoch=live))
    h.feed(g.ack_frame(1, 0, epoch=live))  # an older ack does not move the head back
    h.feed(f[4])
    assert h.feed(f[5]) == [(want[2], (g.GROUP_IP, proto.DEFAULT_PORT))]
    # the ack field of contributions acknowledges too
    late = g.contributions(arrs, slots=1, epoch=live, ack=2)
    assert h.feed(late[6]) == [] and h.stats["early"] == 4  # its ack counts, but rank 1 has not moved
    assert h.feed(late[7]) == [] and h.stats["early"] == 4  # now both have: rank 1 starts round 3
    assert h.feed(late[6]) == [(want[3], (g.GROUP_IP, proto.DEFAULT_PORT))]
    assert h.stats["ack"] == 3 and h.stats["completed"] == 4


def test_retransmissions_pulls_and_stale_rounds(harness):
    h = harness(workers=3, slots=1)
    live = h.form()
    arrs = g.sample_arrays(3, 3 * E, seed=5)
    kw = dict(slots=1, epoch=live, masks=0b011)  # rank 2 contributes nothing, it pulls
    f = g.contributions(arrs, **kw)
    r = g.contributions(arrs, **kw, retx=True)
    want = g.expected_results(arrs, **kw, gate=[0, 0, 1])  # round 2 completes after everyone acked 1
    before = h.stats
    assert h.feed(f[0]) == []
    assert h.feed(f[0]) == []  # duplicate without RETX: dropped
    (status, addr), = h.feed(r[0], sport=40001)  # RETX before completion: who has contributed
    s = header_of(status)
    assert addr == (g.worker_ip(0), 40001)
    assert (s["type"], s["detail"], s["mask"], s["count"], s["rank"], len(status)) == (
        proto.TYPE_STATUS, proto.DETAIL["waiting"], 0b001, 0, 0, proto.record_size(E))
    pull0 = g.batch([g.pull(2, 0, slots=1, epoch=live, mask=0b011)], 2)
    (status, addr), = h.feed(pull0, sport=40002)
    assert (header_of(status)["detail"], header_of(status)["mask"], addr) == (proto.DETAIL["waiting"], 0b001,
                                                                    (g.worker_ip(2), 40002))
    assert h.feed(f[1]) == [(want[0], (g.GROUP_IP, proto.DEFAULT_PORT))]
    assert h.feed(r[0], sport=40003) == [(g.answered(want[0]), (g.worker_ip(0), 40003))]  # RETX after completion
    assert h.feed(pull0) == [(g.answered(want[0]), (g.worker_ip(2), proto.DEFAULT_PORT))]  # PULL after completion
    assert h.delta(before) == {"rx": 7, "records": 7, "aggregated": 2, "completed": 1, "result_sent": 1,
                               "dup_dropped": 1, "status_sent": 2, "retx_answered": 1, "pull_answered": 1}
    # rounds 1 and 2 (round 2 reuses round 0's set once everyone has acknowledged round 0)
    for x in f[2:4]:
        h.feed(x)
    for rank in range(3):
        h.feed(g.ack_frame(rank, 1, epoch=live))
    for x in f[4:6]:
        h.feed(x)
    assert [d for d, _ in h.sent[-2:]] == want[1:3]
    # round 0 is gone now: a late copy is stale, a RETX or PULL learns why
    before = h.stats
    assert h.feed(f[0]) == []
    (status, _), = h.feed(r[0])
    assert (header_of(status)["type"], header_of(status)["detail"], header_of(status)["round"]) == (
        proto.TYPE_STATUS, proto.DETAIL["gone"], 0)
    (status, _), = h.feed(pull0)
    assert header_of(status)["detail"] == proto.DETAIL["gone"]
    assert h.delta(before) == {"rx": 3, "records": 3, "stale_round": 1, "status_sent": 2}


@pytest.mark.parametrize("what", ["op", "exp", "count", "mask"])
def test_mismatching_contributions(harness, what):
    """A contribution that disagrees with its round (op, exp, count or mask: the ranks were not
    given the same tensors) is counted and answered with STATUS MISMATCH, and the round never
    completes: every later record of it (the first rank's retransmission, a contribution that
    agrees) gets the same answer, so that every rank fails at once instead of timing out."""
    h = harness(workers=2)
    live = h.form()
    arrs = g.sample_arrays(2, E, seed=6)
    f = g.contributions(arrs, slots=S, epoch=live)
    h.feed(f[0])  # rank 0 starts round 0: SUM, exp 0, count E, mask 0b11
    other = {
        "op": lambda: g.contributions(arrs, slots=S, epoch=live, op=proto.OP_MAX)[1],
        "exp": lambda: g.contributions(arrs, slots=S, epoch=live, exp=1)[1],
        "count": lambda: g.batch([g.record(rank=1, round=0, slots=S, epoch=live, mask=0b11, count=E - 1)], 1),
        "mask": lambda: g.batch([g.record(rank=1, round=0, slots=S, epoch=live, mask=0b10)], 1),
    }[what]()
    before = h.stats
    (status, addr), = h.feed(other, sport=40001)
    hd = header_of(status)
    assert (hd["type"], hd["detail"], hd["mask"], hd["rank"], hd["round"]) == (
        proto.TYPE_STATUS, proto.DETAIL["mismatch"], 0b01, 1, 0), what
    assert addr == (g.worker_ip(1), 40001)
    assert h.delta(before) == {"rx": 1, "records": 1, "mismatch": 1}, what
    before = h.stats
    for frame, rank in ((f[1], 1), (g.contributions(arrs, slots=S, epoch=live, retx=True)[0], 0)):
        (status, addr), = h.feed(frame, sport=40002)
        assert (header_of(status)["detail"], addr) == (proto.DETAIL["mismatch"], (g.worker_ip(rank), 40002))
    assert h.delta(before) == {"rx": 2, "records": 2, "status_sent": 2}, what


def test_batches_answer_once_with_only_their_answers(harness):
    """A batch goes out once, to the group if it completed a round: its answers (RESULT and
    STATUS records) move to the front and the datagram ends after them."""
    h = harness(workers=2)
    live = h.form()
    arrs = g.sample_arrays(2, 4 * E, seed=7)
    f = g.contributions(arrs, slots=S, epoch=live)
    want = g.expected_results(arrs, slots=S, epoch=live)
    rank0 = [udp_of(x)[0] for x in f[0::2]]
    h.feed(f[1]), h.feed(f[3])  # rank 1 has contributed to rounds 0 and 1
    (out, addr), = h.feed(g.batch(rank0[1::-1] + rank0[2:], 0), sport=40005)  # rounds 1, 0, 2, 3
    assert addr == (g.GROUP_IP, 40005) and out == want[1] + want[0]  # rounds 2 and 3 need no answer
    assert h.stats["result_sent"] == 2 and h.stats["completed"] == 2
    # a batch whose only answer is to the sender (a RETX of a completed round) goes back to it
    retx1 = udp_of(g.contributions(arrs, slots=S, epoch=live, retx=True)[3])[0]  # rank 1, round 1
    dup0 = udp_of(f[1])[0]  # rank 1, round 0 again, without RETX
    (out, addr), = h.feed(g.batch([dup0, retx1], 1))
    assert addr == (g.worker_ip(1), proto.DEFAULT_PORT) and out == g.answered(want[1])
    # a batch of records that need no answer is not sent at all
    before = h.stats
    assert h.feed(g.batch([dup0, udp_of(f[3])[0]], 1)) == []
    assert h.delta(before) == {"rx": 1, "records": 2, "dup_dropped": 2}


def test_records_before_any_epoch_are_stale(harness):
    h = harness(workers=2)
    f = g.contributions(g.sample_arrays(2, E, seed=8), slots=S, epoch=1)
    assert h.feed(f[0]) == [] and h.feed(g.ack_frame(0, 1, epoch=1)) == []
    assert h.stats["stale_epoch"] == 2 and h.stats["aggregated"] == 0


def test_malformed_counted_by_the_userspace_aggregator(harness):
    """Every case a UDP socket can deliver is counted under its reason, nothing is sent, and no
    other outcome happens (the good first record of a bad_mixed batch is an ordinary one)."""
    h = harness()
    live = h.form()
    h.sent.clear()
    seen_good = False
    for c in hostile.malformed_cases(workers=W, slots=S, elems=E, epoch=live):
        if c.cut:
            continue
        before = h.stats
        assert h.feed(c.frame) == [], c.what
        want = {"rx": 1, "records": 1, c.reason: 1}
        if c.reason == "bad_mixed":
            want["records"] = 2
            want["dup_dropped" if seen_good else "aggregated"] = 1
            seen_good = True
        assert h.delta(before) == want, (c.reason, c.what)
    assert seen_good


def test_a_probe_says_what_its_round_lacks_and_touches_nothing(harness):
    """As the XDP program (tests/bpf/test_aggregator.py): a PULL of one header is answered by a
    header-only STATUS of what its round lacks, and the round completes as it would without it."""
    h = harness(workers=3, slots=1)
    live = h.form()
    arrs = g.sample_arrays(3, 3 * E, seed=9)
    f = g.contributions(arrs, slots=1, epoch=live, elems=E)
    want = g.expected_results(arrs, slots=1, epoch=live, elems=E)

    def ask(rank, rnd, epoch=live):
        out = h.feed(g.batch([g.probe(rank, rnd, slots=1, epoch=epoch, mask=0b111, elems=E)], rank))
        if not out:
            return None
        (d, addr), = out
        s = header_of(d)
        assert len(d) == proto.HDR_LEN and addr == (g.worker_ip(rank), proto.DEFAULT_PORT)
        assert (s["type"], s["rank"], s["round"]) == (proto.TYPE_STATUS, rank, rnd)
        return proto.DETAILS[s["detail"]], s["mask"]

    assert ask(1, 0) == ("waiting", 0)
    h.feed(f[0]), h.feed(f[1])
    assert ask(2, 0) == ("waiting", 0b011)
    assert h.feed(f[2]) == [(want[0], (g.GROUP_IP, proto.DEFAULT_PORT))]
    assert ask(0, 0) == ("done", 0b111) and ask(0, 0, epoch=live + 1) == ("epoch", 0)
    for x in f[3:5]:
        h.feed(x)
    for rank in range(3):
        h.feed(g.ack_frame(rank, 1, epoch=live))
    h.feed(f[6])
    assert ask(1, 0) == ("gone", 0) and ask(1, 1) == ("waiting", 0b011)
    bad = bytearray(udp_of(g.batch([g.probe(1, 1, slots=1, epoch=live, mask=0b111, elems=E)], 1))[0])
    bad[proto.FIELD_OFFSETS["flags"]] = proto.FLAG_RETX
    assert h.feed(g.frame(bytes(bad), src_mac=g.worker_mac(1), dst_mac=g.AGG_MAC, src_ip=g.worker_ip(1),
                          dst_ip=g.AGG_IP)) == []
    assert (h.stats["probed"], h.stats["stale_epoch"], h.stats["bad_len"]) == (5, 1, 1)
