"""Packet generators: deterministic, right on the wire (hand-derived bytes, an independent numpy
reference for every op), complete (every bad_* counter, one fault per malformed packet), and in
agreement with the user-space aggregator (the XDP program's algorithm in numpy)."""
from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from wirecheck import NAMES, header_of, udp_of

from nicoffload.errors import InputError
from nicoffload.packets import generators as g
from nicoffload.packets import hostile
from nicoffload.packets.layers import AllReduce, payload_array, split_records
from nicoffload.wire import proto
from nicoffload.wire.addr import multicast_mac

W, S, E = 4, 8, 256
FULL = (1 << W) - 1
OPS = [proto.OP_SUM, proto.OP_SUM64, proto.OP_MAX, proto.OP_OR]




def _digest(frames) -> str:
    h = hashlib.sha256()
    for f in frames:
        h.update(len(f).to_bytes(4, "big") + bytes(f))
    return h.hexdigest()


def _all_outputs() -> list[bytes]:
    arrs = g.sample_arrays(3, 700, seed=7, zero_blocks=0.3, elems=E)
    masks = [0b111, 0b101, 0b011]
    out = g.contributions(arrs, slots=2, epoch=5, exp=-4, masks=masks, first_round=3, ack=2, op=proto.OP_MAX)
    for op in OPS:
        out += g.expected_results(arrs, slots=2, epoch=5, exp=-4, masks=masks, first_round=3, op=op)
    out += g.join_frames(3) + g.join_frames(3, [g.nonce_of(r, 2) for r in range(3)], retx=True)
    out += [g.joined_record(1, 3, g.nonce_of(1), 5, [g.nonce_of(r) for r in range(3)])]
    out += [g.ack_frame(1, 9, epoch=5), g.batch([g.record(rank=0, round=4, slots=2, epoch=5, mask=3),
                                                 g.pull(0, 5, slots=2, epoch=5, mask=2)], 0)]
    out += [c.frame for c in hostile.malformed_cases(epoch=5)]
    out += [f for _, f in hostile.foreign()]
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
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                           cwd=Path(__file__).resolve().parents[2])
    assert there.stdout.strip() == here


# --- the worker's schedule ----------------------------------------------------------------------


def test_slot_schedule():
    # round i -> slot i % S, set (i // S) % 2; by hand for S = 3 from round 2: i = 2..8
    slot, set_ = g.slot_schedule(7, 3, first_round=2)
    assert slot.tolist() == [2, 0, 1, 2, 0, 1, 2] and set_.tolist() == [0, 1, 1, 1, 0, 0, 0]
    slot, set_ = g.slot_schedule(5, 2)
    assert slot.tolist() == [0, 1, 0, 1, 0] and set_.tolist() == [0, 0, 1, 1, 0]
    slot, set_ = g.slot_schedule(3, 1, first_round=10)
    assert slot.tolist() == [0, 0, 0] and set_.tolist() == [0, 1, 0]
    with pytest.raises(InputError, match="slots"):
        g.slot_schedule(1, 0)


def test_helpers():
    blocks, counts = g.split_blocks(np.arange(1, 11, dtype=np.int32), 4)
    assert blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]] and counts.tolist() == [4, 4, 2]
    blocks, counts = g.split_blocks(np.arange(8, dtype=np.int32), 4)
    assert counts.tolist() == [4, 4]
    assert multicast_mac("239.77.0.1") == "01:00:5e:4d:00:01"
    assert multicast_mac("224.255.1.2") == "01:00:5e:7f:01:02"
    with pytest.raises(InputError):
        multicast_mac("10.0.0.1")
    assert [g.worker_ip(r) for r in (0, 3)] == ["10.0.0.1", "10.0.0.4"]
    assert g.worker_mac(10) == "02:00:00:00:00:0b"


def test_defaults_match_the_control_plane():
    from nicoffload.agg import control as aggregator

    params = inspect.signature(aggregator.Aggregator.for_test).parameters
    assert params["agg_ip"].default == g.AGG_IP and params["agg_mac"].default == g.AGG_MAC
    assert params["group"].default == g.GROUP_IP
    assert params["key"].default == g.KEY and g.KEY  # the generated records carry the test job's key


# --- contributions ----------------------------------------------------------------------------


def test_contributions_dense():
    arrs = g.sample_arrays(W, 5 * E + 10, seed=1)
    frames = g.contributions(arrs, slots=S, elems=E, job=9, epoch=0x01020304, exp=-2, op=proto.OP_SUM64, ack=3)
    assert len(frames) == W * 6
    for i, f in enumerate(frames):
        b, r = divmod(i, W)  # round-major, ranks in order
        p = Ether(f)
        ar = p[AllReduce]
        assert (p[IP].src, p[Ether].src) == (g.worker_ip(r), g.worker_mac(r))
        assert (p[IP].dst, p[Ether].dst) == (g.AGG_IP, g.AGG_MAC)
        assert p[UDP].sport == p[UDP].dport == proto.DEFAULT_PORT
        assert (ar.type, ar.rank, ar.job, ar.epoch, ar.round, ar.mask, ar.ack, ar.exp, ar.op, int(ar.flags),
                ar.detail, ar.pad) == (proto.TYPE_CONTRIB, r, 9, 0x01020304, b, FULL, 3, -2, proto.OP_SUM64, 0, 0, 0)
        assert (ar.slot, ar.set) == (b % S, (b // S) % 2)
        assert ar.count == (E if b < 5 else 10)
        assert len(bytes(p[UDP].payload)) == proto.record_size(E)  # every record is full size
        want = np.zeros(E, np.int32)
        chunk = arrs[r][b * E:(b + 1) * E]
        want[:len(chunk)] = chunk
        np.testing.assert_array_equal(payload_array(p), want)  # tail block zero padded


def test_contributions_schedule_and_options():
    arrs = [np.ones(10 * 4, np.int32)] * 2
    frames = g.contributions(arrs, slots=3, epoch=1, elems=4, first_round=4, op=proto.OP_OR, retx=True, port=40000,
                             as_scapy=True)
    assert not [p for p in frames if p.haslayer(AllReduce)]  # port 40000 is not bound for dissection
    ars = [AllReduce(bytes(p[UDP].payload)) for p in frames]
    # rounds 4..13 on 3 slots: slot i % 3, set (i // 3) % 2
    assert [a.round for a in ars[::2]] == list(range(4, 14))
    assert [a.slot for a in ars[::2]] == [1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
    assert [a.set for a in ars[::2]] == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    assert all(int(a.flags) == proto.FLAG_RETX and a.op == proto.OP_OR for a in ars)
    assert all(p[UDP].dport == p[UDP].sport == 40000 for p in frames)
    src = g.contributions(arrs, slots=3, epoch=1, elems=4, src_ips=["10.1.0.1", "10.1.0.2"],
                          src_macs=["02:aa:00:00:00:01", "02:aa:00:00:00:02"], dst_ip="10.1.0.100",
                          dst_mac="02:aa:00:00:00:64")
    p = Ether(src[1])
    assert (p[IP].src, p[Ether].src, p[IP].dst, p[Ether].dst) == (
        "10.1.0.2", "02:aa:00:00:00:02", "10.1.0.100", "02:aa:00:00:00:64")


def test_contributions_with_per_round_masks():
    """A rank sends a record for round b only if masks[b] has its bit; the record carries masks[b]."""
    arrs = [np.arange(4 * E, dtype=np.int32) * (r + 1) for r in range(3)]
    masks = [0b111, 0b001, 0b110, 0b101]
    frames = [Ether(f)[AllReduce] for f in g.contributions(arrs, slots=S, epoch=2, elems=E, masks=masks)]
    assert [(a.round, a.rank, a.mask) for a in frames] == [
        (0, 0, 7), (0, 1, 7), (0, 2, 7), (1, 0, 1), (2, 1, 6), (2, 2, 6), (3, 0, 5), (3, 2, 5)]
    # a scalar mask applies to every round; a rank outside every mask may have no array
    sub = [Ether(f)[AllReduce] for f in g.contributions([arrs[0], None, arrs[2]], slots=S, epoch=2, elems=E,
                                                        masks=0b101)]
    assert [(a.round, a.rank) for a in sub] == [(b, r) for b in range(4) for r in (0, 2)]
    assert {a.mask for a in sub} == {0b101}


@pytest.mark.parametrize("kwargs,match", [
    (dict(masks=0), "mask"), (dict(masks=0b10000), "mask"), (dict(masks=[1, 0, 3]), "mask"),
    (dict(slots=0), "slots"), (dict(elems=0), "elems"),
])
def test_contributions_reject_bad_arguments(kwargs, match):
    args = dict(slots=S, elems=E, epoch=1)
    args.update(kwargs)
    with pytest.raises(InputError, match=match):
        g.contributions([np.zeros(3 * E, np.int32)] * 4, **args)


def test_contributions_reject_bad_arrays():
    with pytest.raises(InputError, match="differ in length"):
        g.contributions([np.zeros(4, np.int32), np.zeros(5, np.int32)], slots=S, epoch=1)
    with pytest.raises(InputError, match="no array"):
        g.contributions([np.zeros(4, np.int32), None], slots=S, epoch=1)
    with pytest.raises(InputError, match="int32"):
        g.contributions([np.zeros(4, np.float32)], slots=S, epoch=1)


# --- combine and expected results against an independent reference -----------------------------


def _wrap32(x):
    """Python/int64 integers to int32 two's complement."""
    return ((np.asarray(x, dtype=object) + 2**31) % 2**32 - 2**31).astype(np.int64)


def _reference(op: int, rows: list[np.ndarray]) -> np.ndarray:
    """What a round of ``rows`` (int32 payloads) must yield, with Python integers (no views)."""
    rows = [[int(v) for v in r] for r in rows]
    n = len(rows[0])
    if op == proto.OP_SUM:
        return _wrap32([sum(r[k] for r in rows) for k in range(n)])
    if op == proto.OP_SUM64:  # 64-bit words: lane 2k is the low half, lane 2k+1 the high half
        out = []
        for k in range(0, n, 2):
            w = sum((r[k] & 0xFFFFFFFF) | (r[k + 1] & 0xFFFFFFFF) << 32 for r in rows) % 2**64
            out += [w & 0xFFFFFFFF, w >> 32]
        return _wrap32(out)
    if op == proto.OP_MAX:
        return np.array([max(r[k] for r in rows) for k in range(n)], dtype=np.int64)
    acc = [0] * n
    for r in rows:
        acc = [a | (v & 0xFFFFFFFF) for a, v in zip(acc, r)]
    return _wrap32(acc)


def test_combine_by_hand():
    i32 = np.int32
    a, b = np.array([-1, 0, -1, -1], i32), np.array([1, 0, 1, 0], i32)
    # SUM wraps each int32 lane; SUM64 carries from lane 0 into lane 1 and wraps at 2^64
    assert g.combine(proto.OP_SUM, np.stack([a, b])).tolist() == [0, 0, 0, -1]
    assert g.combine(proto.OP_SUM64, np.stack([a, b])).tolist() == [0, 1, 0, 0]
    assert g.combine(proto.OP_SUM, np.array([[2**31 - 1], [1]], i32)).tolist() == [-(2**31)]
    assert g.combine(proto.OP_MAX, np.array([[-5, 3], [2, -(2**31)], [-7, 1]], i32)).tolist() == [2, 3]
    assert g.combine(proto.OP_OR, np.array([[0x0F, -(2**31)], [0xF0, 1]], i32)).tolist() == [0xFF, -(2**31) + 1]
    assert g.combine(proto.OP_MAX, np.array([[4, -4]], i32)).tolist() == [4, -4]  # a lone contributor
    with pytest.raises(InputError):
        g.combine(proto.OP_COUNT, np.stack([a, b]))


@pytest.mark.parametrize("op", OPS)
def test_combine_matches_the_reference(op):
    rng = np.random.default_rng(op)
    for rows in (3, 1, 32):
        p = rng.integers(-(2**31), 2**31, size=(rows, 16), dtype=np.int64).astype(np.int32)
        p[0, :4] = [2**31 - 1, -(2**31), -1, 0]
        np.testing.assert_array_equal(g.combine(op, p), _reference(op, list(p)))


@pytest.mark.parametrize("op", OPS)
def test_expected_results_match_the_reference(op):
    arrs = g.sample_arrays(3, 5 * 8 + 3, seed=11, elems=8, bound=1 << 31)
    arrs[0][:8] = 2**31 - 1
    arrs[1][:8] = 2**31 - 1  # SUM overflows and wraps; SUM64 carries into the high lane
    masks = [0b111, 0b010, 0b101, 0b111, 0b011, 0b110]
    res = g.expected_results(arrs, slots=2, epoch=0xABCDEF, elems=8, job=4, masks=masks, first_round=7, exp=-5,
                             op=op)
    assert len(res) == 6 and all(len(r) == proto.record_size(8) for r in res)
    for b, r in enumerate(res):
        h = header_of(r)
        i = 7 + b
        assert {k: h[k] for k in NAMES} == dict(
            magic=0x4E58, version=proto.VERSION, type=proto.TYPE_RESULT, flags=0, set=(i // 2) % 2,
            rank=0xFFFF, job=4, epoch=0xABCDEF, slot=i % 2, round=i, mask=masks[b], ack=0,
            count=8 if b < 5 else 3, exp=-5, op=op, detail=0, pad=0, key=g.KEY), b
        rows = []
        for rank in range(3):
            if masks[b] >> rank & 1:
                block = np.zeros(8, np.int32)
                chunk = arrs[rank][b * 8:(b + 1) * 8]
                block[:len(chunk)] = chunk
                rows.append(block)
        np.testing.assert_array_equal(np.frombuffer(r[proto.HDR_LEN:], "<i4"), _reference(op, rows))


def test_expected_results_by_hand():
    a = np.array([1, 2**31 - 1, -5, 0, 7], np.int32)
    b = np.array([3, 1, -5, 0, -9], np.int32)
    res = g.expected_results([a, b], slots=2, epoch=6, elems=4, exp=3)
    r0, r1 = (AllReduce(r) for r in res)
    assert (r0.type, r0.rank, r0.mask, r0.count, r0.exp, r0.epoch, r0.round, int(r0.flags)) == (
        proto.TYPE_RESULT, proto.RANK_AGG, 0b11, 4, 3, 6, 0, 0)
    assert payload_array(r0).tolist() == [4, -(2**31), -10, 0]  # 2^31-1 + 1 wraps
    assert (r1.count, r1.slot, r1.set, r1.round) == (1, 1, 0, 1)
    assert payload_array(r1).tolist() == [-2, 0, 0, 0]
    mx = AllReduce(g.expected_results([a, b], slots=2, epoch=6, elems=4, op=proto.OP_MAX)[0])
    assert payload_array(mx).tolist() == [3, 2**31 - 1, -5, 0] and mx.op == proto.OP_MAX
    wide = AllReduce(g.expected_results([a, b], slots=2, epoch=6, elems=4, op=proto.OP_SUM64)[0])
    # words (lo 1, hi 2^31-1) + (lo 3, hi 1) = (4, 2^31); (lo -5, hi 0) + (lo -5, hi 0) carries: (-10, 1)
    assert payload_array(wide).tolist() == [4, -(2**31), -10, 1]
    one = AllReduce(g.expected_results([a, None], slots=2, epoch=6, elems=4, masks=0b01)[0])
    assert payload_array(one).tolist() == [1, 2**31 - 1, -5, 0] and one.mask == 0b01


# --- records of the handshake, pulls, acks and batches -------------------------------------------

# A JOIN of rank 2 of a 4-rank job 9 with nonce 0x0102030405060708 and key 0xa1b2c3d4e5f60718,
# derived by hand:
#   magic 4e58 | version 03 | type 04 (JOIN) | flags 00 | set 00 | rank 0002 | job 00000009
#   epoch 00000000 | slot 00000000 | round 05060708 (nonce low) | mask 0000000f (every rank)
#   ack 01020304 (nonce high) | count 0000 | exp 0000 | op 00 | detail 00 | pad 0000
#   key a1b2c3d4e5f60718 (big endian), then AR_JOIN_PAYLOAD = 256 zero bytes
GOLDEN_JOIN = ("4e58030400000002" "00000009" "00000000" "00000000" "05060708" "0000000f" "01020304"
               "0000" "0000" "00" "00" "0000" "a1b2c3d4e5f60718") + "00" * 256


def test_join_record_by_hand():
    rec = g.join_record(2, 4, 0x0102030405060708, job=9, key=0xA1B2C3D4E5F60718)
    assert rec.hex() == GOLDEN_JOIN
    assert len(rec) == proto.HDR_LEN + proto.JOIN_PAYLOAD == 304
    retx = g.join_record(2, 4, 0x0102030405060708, job=9, retx=True, mask=0b0111, key=0xA1B2C3D4E5F60718)
    assert header_of(retx) == {**header_of(rec), "flags": proto.FLAG_RETX, "mask": 0b0111}
    assert retx[proto.HDR_LEN:] == rec[proto.HDR_LEN:]


def test_join_frames_and_nonces():
    frames = g.join_frames(3, job=5)
    assert len(frames) == 3
    for r, f in enumerate(frames):
        dgram, ip, port = udp_of(f)
        h = header_of(dgram)
        assert (ip, port) == (g.worker_ip(r), proto.DEFAULT_PORT)
        assert h["round"] | h["ack"] << 32 == g.nonce_of(r)
        assert (h["type"], h["rank"], h["job"], h["mask"], h["epoch"]) == (proto.TYPE_JOIN, r, 5, 0b111, 0)
    some = g.join_frames(3, [11, 12, 13], ranks=[2], retx=True)
    h = header_of(udp_of(some[0])[0])
    assert len(some) == 1 and (h["rank"], h["round"], h["ack"], h["flags"]) == (2, 13, 0, proto.FLAG_RETX)
    # nonces: distinct per rank, and every rank's later run is above every rank's earlier run
    first = [g.nonce_of(r) for r in range(32)]
    assert len(set(first)) == 32 and max(first) < min(g.nonce_of(r, 2) for r in range(32))
    assert all(0 < n < 2**64 for n in first) and g.nonce_of(0) == g.nonce_of(0, run=1)


def test_joined_record():
    table = [g.nonce_of(r) for r in range(3)]
    rec = g.joined_record(1, 3, g.nonce_of(1), 0xCAFE, table, job=2)
    h = header_of(rec)
    assert (h["type"], h["rank"], h["job"], h["epoch"], h["mask"], h["count"], h["flags"], h["detail"]) == (
        proto.TYPE_JOINED, 1, 2, 0xCAFE, 0b111, 0, 0, 0)
    assert h["round"] | h["ack"] << 32 == g.nonce_of(1)
    assert len(rec) == proto.HDR_LEN + proto.JOIN_PAYLOAD
    body = rec[proto.HDR_LEN:]
    assert [int.from_bytes(body[8 * r:8 * r + 8], "little") for r in range(32)] == table + [0] * 29
    # the JOIN it answers differs only in type, epoch and the table
    join = g.join_record(1, 3, g.nonce_of(1), job=2)
    assert {k for k in NAMES if header_of(join)[k] != h[k]} == {"type", "epoch"}


def test_ack_frame():
    f = g.ack_frame(1, 0x10, epoch=7, job=2)
    dgram, ip, port = udp_of(f)
    assert len(dgram) == proto.HDR_LEN and (ip, port) == (g.worker_ip(1), proto.DEFAULT_PORT)
    assert header_of(dgram) == dict(magic=proto.MAGIC, version=proto.VERSION, type=proto.TYPE_ACK, flags=0, set=0,
                               rank=1, job=2, epoch=7, slot=0, round=0, mask=0b10, ack=0x10, count=0, exp=0,
                               op=0, detail=0, pad=0, key=g.KEY)


def test_record_and_pull():
    rec = g.record(rank=2, round=11, slots=4, epoch=3, mask=0b110, elems=8, job=5, payload=np.arange(8),
                   op=proto.OP_MAX, exp=-1, ack=9)
    h = header_of(rec)
    assert len(rec) == proto.record_size(8)
    assert (h["slot"], h["set"], h["round"], h["count"], h["ack"], h["op"], h["exp"], h["flags"]) == (
        3, 0, 11, 8, 9, proto.OP_MAX, -1, 0)
    assert np.frombuffer(rec[proto.HDR_LEN:], "<i4").tolist() == list(range(8))
    p = g.pull(0, 13, slots=4, epoch=3, mask=0b110, elems=8)
    h = header_of(p)
    assert len(p) == proto.record_size(8)  # full size, payload ignored
    assert (h["type"], h["flags"], h["count"], h["rank"], h["slot"], h["set"], h["round"], h["mask"]) == (
        proto.TYPE_CONTRIB, proto.FLAG_PULL, 0, 0, 1, 1, 13, 0b110)
    assert header_of(g.pull(0, 13, slots=4, epoch=3, mask=6, elems=8, flags=proto.FLAG_RETX))["flags"] == \
        proto.FLAG_PULL | proto.FLAG_RETX


def test_batch_frame():
    recs = [g.record(rank=1, round=i, slots=S, epoch=4, mask=3, payload=np.full(E, i)) for i in range(3)]
    recs.append(g.pull(1, 3, slots=S, epoch=4, mask=1))
    f = g.batch(recs, 1)
    dgram, ip, port = udp_of(f)
    assert (ip, port) == (g.worker_ip(1), proto.DEFAULT_PORT) and dgram == b"".join(recs)
    assert len(dgram) == 4 * proto.record_size(E) and 4 <= proto.max_records(E)
    parts = split_records(dgram, proto.record_size(E))
    assert [(p.round, int(p.flags)) for p in parts] == [(0, 0), (1, 0), (2, 0), (3, proto.FLAG_PULL)]
    assert [payload_array(p)[0] for p in parts[:3]] == [0, 1, 2]


def test_result_frame_is_what_xdp_sends():
    dgram = bytes(AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG) / bytes(16))
    raw = g.result_frame(dgram, dport=40123)
    p = Ether(raw)
    assert (p[Ether].src, p[Ether].dst) == (g.AGG_MAC, multicast_mac(g.GROUP_IP))
    assert (p[IP].src, p[IP].dst, p[IP].ttl, p[IP].id, str(p[IP].flags)) == (g.AGG_IP, g.GROUP_IP, 64, 0, "DF")
    assert (p[UDP].sport, p[UDP].dport, p[UDP].chksum) == (proto.DEFAULT_PORT, 40123, 0)
    assert raw[proto.L2L4_LEN:] == dgram and raw[40:42] == b"\0\0"
    s = sum(int.from_bytes(raw[i:i + 2], "big") for i in range(14, 34, 2))  # IPv4 checksum verifies
    assert (s & 0xFFFF) + (s >> 16) == 0xFFFF
    uni = Ether(g.unicast_frame(dgram, 2, checksum=0x1234))
    assert (uni[IP].dst, uni[Ether].dst, uni[UDP].dport, uni[UDP].chksum) == (
        g.worker_ip(2), g.worker_mac(2), proto.DEFAULT_PORT, 0x1234)
