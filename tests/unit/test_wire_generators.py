"""Packet generators: deterministic, complete (every bad_* counter), one fault per malformed packet,
and in agreement with the user-space aggregator (same algorithm as the XDP program)."""
from __future__ import annotations

import hashlib
import inspect
import os
import struct
import subprocess
import sys
import types

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from nicoffload import proto
from nicoffload.codec import NEXT_NZ_NONE
from packets import generators as g
from packets.layers import AllReduce, payload_array

W, S, E = 4, 8, 256
BAD = {s for s in proto.STATS if s.startswith("bad_")}


def _digest(frames) -> str:
    h = hashlib.sha256()
    for f in frames:
        h.update(len(f).to_bytes(4, "big") + bytes(f))
    return h.hexdigest()


def _all_outputs() -> list[bytes]:
    arrs = g.sample_arrays(3, 700, seed=7, zero_blocks=0.3)
    out = g.contributions(arrs, slots=2, sparse=True, exp=-4)
    out += g.expected_results(arrs, slots=2, sparse=True, exp=-4)
    out += [f for _, f in g.malformed()]
    out += [f for _, f in g.foreign()]
    return out


# --- determinism ------------------------------------------------------------------------------


def test_same_inputs_same_bytes():
    assert _all_outputs() == _all_outputs()


def test_same_bytes_in_another_process():
    """No dependence on hash seeds, ids or the interpreter's state."""
    here = _digest(_all_outputs())
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from test_wire_generators import _all_outputs, _digest\n"
            "print(_digest(_all_outputs()))") % os.path.dirname(__file__)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert there.stdout.strip() == here


# --- contributions ----------------------------------------------------------------------------


def test_contributions_dense():
    arrs = g.sample_arrays(W, 5 * E + 10, seed=1)
    frames = g.contributions(arrs, slots=S, elems=E, job=9, exp=-2)
    assert len(frames) == W * 6
    for i, f in enumerate(frames):
        b, r = divmod(i, W)
        p = Ether(f)
        ar = p[AllReduce]
        assert (p[IP].src, p[Ether].src) == (g.worker_ip(r), g.worker_mac(r))
        assert (p[IP].dst, p[Ether].dst) == (g.AGG_IP, g.AGG_MAC)
        assert p[UDP].sport == p[UDP].dport == proto.DEFAULT_PORT
        assert (ar.type, ar.rank, ar.job, ar.block, ar.mask, ar.exp, int(ar.flags)) == (
            proto.TYPE_CONTRIB, r, 9, b, (1 << W) - 1, -2, 0)
        assert (ar.slot, ar.set) == (b % S, (b // S) % 2)
        assert ar.count == (E if b < 5 else 10)
        assert ar.next_nz == (b + 1 if b < 5 else NEXT_NZ_NONE)
        want = np.zeros(E, np.int32)
        chunk = arrs[r][b * E:(b + 1) * E]
        want[:len(chunk)] = chunk
        np.testing.assert_array_equal(payload_array(p), want)  # tail block zero padded


def test_contributions_schedule_and_options():
    arrs = [np.ones(10 * 4, np.int32)] * 2
    frames = g.contributions(arrs, slots=3, elems=4, first_use=1, first_block=100, op_max=True,
                             retx=True, port=40000, as_scapy=True)
    bound = [p for p in frames if p.haslayer(AllReduce)]
    assert not bound  # port 40000 is not bound for dissection
    ars = [AllReduce(bytes(p[UDP].payload)) for p in frames]
    assert [a.slot for a in ars[::2]] == [i % 3 for i in range(10)]
    assert [a.set for a in ars[::2]] == [(1 + i // 3) % 2 for i in range(10)]
    assert [a.block for a in ars[::2]] == list(range(100, 110))
    assert all(int(a.flags) == proto.FLAG_OP_MAX | proto.FLAG_RETX for a in ars)
    assert all(p[UDP].dport == p[UDP].sport == 40000 for p in frames)


def test_contributions_sparse_and_mask():
    arrs = [np.zeros(3 * E, np.int32) for _ in range(3)]
    arrs[0][:E] = 1       # rank 0: data in block 0
    arrs[2][2 * E:] = 2   # rank 2: data in block 2
    frames = [Ether(f) for f in g.contributions(arrs, slots=S, elems=E, sparse=True)]
    by = {(p[AllReduce].block, p[AllReduce].rank): p for p in frames}
    assert by[(0, 0)][AllReduce].count == E and by[(0, 0)][AllReduce].next_nz == NEXT_NZ_NONE
    for key in [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]:
        p = by[key]
        assert p[AllReduce].count == 0 and len(bytes(p[UDP].payload)) == proto.HDR_LEN, key
    assert by[(0, 2)][AllReduce].next_nz == 2 and by[(1, 2)][AllReduce].next_nz == 2
    # a subset of ranks: only they send, with that mask
    sub = [Ether(f)[AllReduce] for f in g.contributions([arrs[0], None, arrs[2]], slots=S, elems=E, mask=0b101)]
    assert {a.rank for a in sub} == {0, 2} and {a.mask for a in sub} == {0b101}


@pytest.mark.parametrize("kwargs,match", [
    (dict(mask=0), "mask"), (dict(mask=0b10000), "mask"), (dict(slots=0), "slots"),
    (dict(elems=0), "elems"), (dict(first_block=-1), "block ids"),
])
def test_contributions_reject_bad_arguments(kwargs, match):
    from nicoffload.errors import InputError

    args = dict(slots=S, elems=E)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        g.contributions([np.zeros(4, np.int32)] * 4, **args)


def test_helpers():
    slot, set_ = g.slot_schedule(7, 3, first_use=1)
    assert slot.tolist() == [0, 1, 2, 0, 1, 2, 0] and set_.tolist() == [1, 1, 1, 0, 0, 0, 1]
    blocks, counts = g.split_blocks(np.arange(1, 11, dtype=np.int32), 4)
    assert blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]] and counts.tolist() == [4, 4, 2]
    nz = g.next_nonzero(np.array([[0], [1], [0], [0], [3], [0]], np.int32))
    assert nz.tolist() == [1, 4, 4, 4, NEXT_NZ_NONE, NEXT_NZ_NONE]
    assert g.multicast_mac("239.77.0.1") == "01:00:5e:4d:00:01"
    assert g.multicast_mac("224.255.1.2") == "01:00:5e:7f:01:02"


def test_defaults_match_the_control_plane():
    from nicoffload import aggregator

    params = inspect.signature(aggregator.Aggregator.for_test).parameters
    assert params["agg_ip"].default == g.AGG_IP and params["agg_mac"].default == g.AGG_MAC
    assert params["group"].default == aggregator.DEFAULT_GROUP == g.GROUP_IP
    assert aggregator.mcast_mac(g.GROUP_IP).hex(":") == g.multicast_mac(g.GROUP_IP)


def test_result_frame_is_what_xdp_sends():
    dgram = bytes(AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG) / bytes(16))
    p = Ether(g.result_frame(dgram))
    assert (p[Ether].src, p[Ether].dst) == (g.AGG_MAC, g.multicast_mac(g.GROUP_IP))
    assert (p[IP].src, p[IP].dst, p[IP].ttl, p[IP].id, str(p[IP].flags)) == (g.AGG_IP, g.GROUP_IP, 64, 0, "DF")
    assert p[UDP].chksum == 0 and bytes(p[UDP].payload) == dgram
    uni = Ether(g.result_frame(dgram, dst_ip="10.0.0.2", dst_mac="02:00:00:00:00:02"))
    assert (uni[IP].dst, uni[Ether].dst) == ("10.0.0.2", "02:00:00:00:00:02")


# --- expected results against a numpy reference and the user-space aggregator -----------------


class _Recorder:
    def __init__(self):
        self.sent: list[tuple[bytes, tuple]] = []

    def sendto(self, data, addr):
        self.sent.append((bytes(data), addr))


@pytest.fixture
def userspace_agg():
    """The user-space aggregator (same slot algorithm as the XDP program), its sends recorded."""
    from nicoffload.userspace import UserspaceAggregator

    def make(workers=W, slots=S, elems=E, job=1):
        agg = UserspaceAggregator(workers=workers, port=0, slots=slots, elems=elems, job=job,
                                  group=g.GROUP_IP, worker_ips=[g.worker_ip(r) for r in range(workers)])
        made.append(agg._t)
        rec = _Recorder()
        agg._t = types.SimpleNamespace(sock=rec)
        return agg, rec

    made = []
    yield make
    for t in made:
        t.close()


def _feed(agg, frame: bytes) -> None:
    p = Ether(frame)
    agg.handle(memoryview(bytes(p[UDP].payload)), (p[IP].src, p[UDP].sport))


def test_expected_results_reference():
    a = np.array([1, 2**31 - 1, -5, 0, 7], np.int32)
    b = np.array([3, 1, -5, 0, -9], np.int32)
    res = g.expected_results([a, b], slots=2, elems=4, exp=3)
    assert len(res) == 2
    r0, r1 = (AllReduce(r) for r in res)
    assert (r0.type, r0.rank, r0.mask, r0.count, r0.exp, r0.next_nz, int(r0.flags)) == (
        proto.TYPE_RESULT, proto.RANK_AGG, 0b11, 4, 3, 1, 0)
    assert payload_array(r0).tolist() == [4, -(2**31), -10, 0]  # 2^31-1 + 1 wraps
    assert (r1.count, r1.next_nz, r1.slot, r1.set) == (1, NEXT_NZ_NONE, 1, 0)
    assert payload_array(r1).tolist() == [-2, 0, 0, 0]
    mx = AllReduce(g.expected_results([a, b], slots=2, elems=4, op_max=True)[0])
    assert payload_array(mx).tolist() == [3, 2**31 - 1, -5, 0] and int(mx.flags) == proto.FLAG_OP_MAX


@pytest.mark.parametrize("sparse,op_max", [(False, False), (True, False), (True, True), (False, True)])
def test_results_equal_the_userspace_aggregator(userspace_agg, sparse, op_max):
    arrs = g.sample_arrays(W, 20 * E + 3, seed=3, zero_blocks=0.5 if sparse else 0.0)
    for a in arrs:  # a block that is zero on every rank (all-null round) and one only rank 3 has
        a[2 * E:4 * E] = 0
    arrs[3][3 * E] = -8
    arrs[0][:E] = 2**31 - 1
    arrs[1][:E] = 2**31 - 1  # overflow wraps
    kw = dict(slots=S, elems=E, sparse=sparse, op_max=op_max, exp=-6, first_block=1000)
    agg, rec = userspace_agg()
    for f in g.contributions(arrs, **kw):
        _feed(agg, f)
    sent = [d for d, addr in rec.sent if addr[0] == g.GROUP_IP]
    assert sent == g.expected_results(arrs, **kw)
    assert agg.stats["completed"] == 21 and agg.stats["mismatch"] == 0
    if sparse:
        assert agg.stats["null"] > 0


def test_retransmission_answered_by_unicast(userspace_agg):
    arrs = g.sample_arrays(2, E, seed=5)
    agg, rec = userspace_agg(workers=2)
    frames = g.contributions(arrs, slots=S, elems=E)
    _feed(agg, frames[0])
    _feed(agg, frames[0])  # duplicate before completion, no RETX flag: dropped
    assert agg.stats["dup_dropped"] == 1 and not rec.sent
    _feed(agg, g.contributions(arrs, slots=S, elems=E, retx=True)[0])  # explicit RETX: STATUS
    (status, addr), = rec.sent
    st = AllReduce(status)
    assert addr[0] == g.worker_ip(0) and st.type == proto.TYPE_STATUS and st.mask == 0b01
    assert len(status) == proto.HDR_LEN
    _feed(agg, frames[1])
    result = g.expected_results(arrs, slots=S, elems=E)[0]
    assert rec.sent[-1] == (result, (g.GROUP_IP, 0))
    _feed(agg, g.contributions(arrs, slots=S, elems=E, retx=True)[1])
    assert rec.sent[-1] == (result, (g.worker_ip(1), 0))
    assert agg.stats["retx_answered"] == 1


# --- malformed and foreign traffic --------------------------------------------------------------


def test_malformed_covers_every_bad_counter():
    cases = g.malformed_cases()
    reasons = {c.reason for c in cases}
    assert reasons == BAD
    assert all(r in proto.STATS for r in reasons)
    assert [(c.reason, c.frame) for c in cases] == g.malformed()
    assert len({c.what for c in cases}) == len(cases)  # every case says what is wrong, distinctly


def test_malformed_truncation_at_every_field_boundary():
    cases = [c for c in g.malformed_cases() if c.reason == "bad_truncated"]
    boundaries = {off for _, off, _ in proto.FIELDS}
    short = {len(c.frame) - proto.L2L4_LEN for c in cases if not c.cut}
    cut = {len(c.frame) - proto.L2L4_LEN for c in cases if c.cut}
    assert boundaries <= short and boundaries <= cut
    assert all(n < proto.HDR_LEN for n in short)
    assert any(proto.HDR_LEN < n < proto.HDR_LEN + 4 * E for n in cut)  # cut inside the payload
    for c in cases:
        p = Ether(c.frame)
        udp_len = p[UDP].len
        if c.cut:  # IP and UDP lengths claim the full datagram; the frame is shorter
            assert udp_len == 8 + proto.HDR_LEN + 4 * E and len(c.frame) < 34 + udp_len
        else:
            assert len(c.frame) == 34 + udp_len and p[IP].len == 20 + udp_len


def _header(dgram: bytes) -> dict:
    return dict(zip((n for n, _, _ in proto.FIELDS), struct.unpack(proto.HDR_STRUCT, dgram[:proto.HDR_LEN])))


def test_each_malformed_packet_has_exactly_one_fault():
    good_frame = g.contributions([np.arange(1, E + 1, dtype=np.int32)] * W, slots=S, elems=E)[1]  # rank 1
    good = Ether(good_frame)
    gh = _header(bytes(good[UDP].payload))
    for c in g.malformed_cases():
        if c.reason == "bad_truncated":
            continue
        p = Ether(c.frame)
        dgram = bytes(p[UDP].payload)
        diff = {k for k, v in _header(dgram).items() if v != gh[k]} - {"next_nz"}
        faults = len(diff) + (len(dgram) != len(bytes(good[UDP].payload)) and "count" not in diff) \
            + (p[IP].src != good[IP].src)
        if c.reason == "bad_len" and diff == {"count"} and len(dgram) != len(bytes(good[UDP].payload)):
            faults = 1  # count and length changed together: one inconsistency between them
        assert faults == 1, (c.reason, c.what, diff)
        assert (p[Ether].src, p[Ether].dst, p[IP].dst) == (good[Ether].src, good[Ether].dst, good[IP].dst)


def test_malformed_counted_by_the_userspace_aggregator(userspace_agg):
    """Every case a UDP socket can deliver is counted under its reason and nothing else happens."""
    agg, rec = userspace_agg()
    for c in g.malformed_cases(workers=W, slots=S, elems=E):
        if c.cut:
            continue
        before = dict(agg.stats)
        _feed(agg, c.frame)
        changed = {k: agg.stats[k] - before[k] for k in agg.stats if agg.stats[k] != before[k]}
        assert changed == {"rx": 1, c.reason: 1}, (c.reason, c.what, changed)
    assert not rec.sent


@pytest.mark.parametrize("workers,rank", [(1, 0), (32, 31), (2, 0)])
def test_malformed_edge_sizes(workers, rank):
    """One worker (no other rank's address to spoof) and 32 (no rank >= workers fits the mask)."""
    cases = g.malformed_cases(workers=workers, rank=rank, elems=2, slots=1)
    assert {c.reason for c in cases} == BAD
    src = [c.what for c in cases if c.reason == "bad_src"]
    assert f"from {g.STRANGER_IP}, no rank's address" in src and len(src) == min(workers, 2)


def test_foreign_traffic_is_not_ours():
    names = [n for n, _ in g.foreign()]
    assert {"arp_request", "icmp_echo", "ipv6_udp_to_port", "udp_other_port", "tcp_to_port"} <= set(names)
    for name, f in g.foreign():
        p = Ether(f)
        ours = p.haslayer(IP) and p.haslayer(UDP) and p[UDP].dport == proto.DEFAULT_PORT
        assert not ours, name
