"""Packet generators: deterministic, right on the wire (hand-derived bytes, an independent numpy
reference for every op), complete (every bad_* counter, one fault per malformed packet), and in
agreement with the user-space aggregator (the XDP program's algorithm in numpy)."""
from __future__ import annotations

import hashlib
import inspect
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from nicoffload import proto
from nicoffload.errors import InputError
from nicoffload.packets import generators as g
from nicoffload.packets.layers import AllReduce, payload_array, split_records

W, S, E = 4, 8, 256
FULL = (1 << W) - 1
BAD = {s for s in proto.STATS if s.startswith("bad_")}
OPS = [proto.OP_SUM, proto.OP_SUM64, proto.OP_MAX, proto.OP_OR]
NAMES = [n for n, _, _ in proto.FIELDS]
OUTCOMES = {"aggregated", "retx_answered", "pull_answered", "status_sent", "dup_dropped", "join", "ack", "early",
            "mismatch"}


def _hdr(dgram: bytes) -> dict:
    return dict(zip(NAMES, struct.unpack(proto.HDR_STRUCT, bytes(dgram[:proto.HDR_LEN]))))


def _udp(frame: bytes) -> tuple[bytes, str, int]:
    """(UDP payload, source address, source port) of an Ethernet/IPv4/UDP frame, read by hand."""
    assert frame[12:14] == b"\x08\x00" and frame[14] == 0x45 and frame[23] == 17
    ulen = int.from_bytes(frame[38:40], "big")
    return frame[42:34 + ulen], socket.inet_ntoa(frame[26:30]), int.from_bytes(frame[34:36], "big")


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
    out += [c.frame for c in g.malformed_cases(epoch=5)]
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
    assert g.multicast_mac("239.77.0.1") == "01:00:5e:4d:00:01"
    assert g.multicast_mac("224.255.1.2") == "01:00:5e:7f:01:02"
    with pytest.raises(InputError):
        g.multicast_mac("10.0.0.1")
    assert [g.worker_ip(r) for r in (0, 3)] == ["10.0.0.1", "10.0.0.4"]
    assert g.worker_mac(10) == "02:00:00:00:00:0b"


def test_defaults_match_the_control_plane():
    from nicoffload import aggregator

    params = inspect.signature(aggregator.Aggregator.for_test).parameters
    assert params["agg_ip"].default == g.AGG_IP and params["agg_mac"].default == g.AGG_MAC
    assert params["group"].default == g.GROUP_IP


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
        h = _hdr(r)
        i = 7 + b
        assert {k: h[k] for k in NAMES} == dict(
            magic=0x4E58, version=proto.VERSION, type=proto.TYPE_RESULT, flags=0, set=(i // 2) % 2,
            rank=0xFFFF, job=4, epoch=0xABCDEF, slot=i % 2, round=i, mask=masks[b], ack=0,
            count=8 if b < 5 else 3, exp=-5, op=op, detail=0, pad=0), b
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

# A JOIN of rank 2 of a 4-rank job 9 with nonce 0x0102030405060708, derived by hand:
#   magic 4e58 | version 02 | type 04 (JOIN) | flags 00 | set 00 | rank 0002 | job 00000009
#   epoch 00000000 | slot 00000000 | round 05060708 (nonce low) | mask 0000000f (every rank)
#   ack 01020304 (nonce high) | count 0000 | exp 0000 | op 00 | detail 00 | pad 0000
#   then AR_JOIN_PAYLOAD = 256 zero bytes
GOLDEN_JOIN = ("4e58020400000002" "00000009" "00000000" "00000000" "05060708" "0000000f" "01020304"
               "0000" "0000" "00" "00" "0000") + "00" * 256


def test_join_record_by_hand():
    rec = g.join_record(2, 4, 0x0102030405060708, job=9)
    assert rec.hex() == GOLDEN_JOIN
    assert len(rec) == proto.HDR_LEN + proto.JOIN_PAYLOAD == 296
    retx = g.join_record(2, 4, 0x0102030405060708, job=9, retx=True, mask=0b0111)
    assert _hdr(retx) == {**_hdr(rec), "flags": proto.FLAG_RETX, "mask": 0b0111}
    assert retx[proto.HDR_LEN:] == rec[proto.HDR_LEN:]


def test_join_frames_and_nonces():
    frames = g.join_frames(3, job=5)
    assert len(frames) == 3
    for r, f in enumerate(frames):
        dgram, ip, port = _udp(f)
        h = _hdr(dgram)
        assert (ip, port) == (g.worker_ip(r), proto.DEFAULT_PORT)
        assert h["round"] | h["ack"] << 32 == g.nonce_of(r)
        assert (h["type"], h["rank"], h["job"], h["mask"], h["epoch"]) == (proto.TYPE_JOIN, r, 5, 0b111, 0)
    some = g.join_frames(3, [11, 12, 13], ranks=[2], retx=True)
    h = _hdr(_udp(some[0])[0])
    assert len(some) == 1 and (h["rank"], h["round"], h["ack"], h["flags"]) == (2, 13, 0, proto.FLAG_RETX)
    # nonces: distinct per rank, and every rank's later run is above every rank's earlier run
    first = [g.nonce_of(r) for r in range(32)]
    assert len(set(first)) == 32 and max(first) < min(g.nonce_of(r, 2) for r in range(32))
    assert all(0 < n < 2**64 for n in first) and g.nonce_of(0) == g.nonce_of(0, run=1)


def test_joined_record():
    table = [g.nonce_of(r) for r in range(3)]
    rec = g.joined_record(1, 3, g.nonce_of(1), 0xCAFE, table, job=2)
    h = _hdr(rec)
    assert (h["type"], h["rank"], h["job"], h["epoch"], h["mask"], h["count"], h["flags"], h["detail"]) == (
        proto.TYPE_JOINED, 1, 2, 0xCAFE, 0b111, 0, 0, 0)
    assert h["round"] | h["ack"] << 32 == g.nonce_of(1)
    assert len(rec) == proto.HDR_LEN + proto.JOIN_PAYLOAD
    body = rec[proto.HDR_LEN:]
    assert [int.from_bytes(body[8 * r:8 * r + 8], "little") for r in range(32)] == table + [0] * 29
    # the JOIN it answers differs only in type, epoch and the table
    join = g.join_record(1, 3, g.nonce_of(1), job=2)
    assert {k for k in NAMES if _hdr(join)[k] != h[k]} == {"type", "epoch"}


def test_ack_frame():
    f = g.ack_frame(1, 0x10, epoch=7, job=2)
    dgram, ip, port = _udp(f)
    assert len(dgram) == proto.HDR_LEN and (ip, port) == (g.worker_ip(1), proto.DEFAULT_PORT)
    assert _hdr(dgram) == dict(magic=proto.MAGIC, version=proto.VERSION, type=proto.TYPE_ACK, flags=0, set=0,
                               rank=1, job=2, epoch=7, slot=0, round=0, mask=0b10, ack=0x10, count=0, exp=0,
                               op=0, detail=0, pad=0)


def test_record_and_pull():
    rec = g.record(rank=2, round=11, slots=4, epoch=3, mask=0b110, elems=8, job=5, payload=np.arange(8),
                   op=proto.OP_MAX, exp=-1, ack=9)
    h = _hdr(rec)
    assert len(rec) == proto.record_size(8)
    assert (h["slot"], h["set"], h["round"], h["count"], h["ack"], h["op"], h["exp"], h["flags"]) == (
        3, 0, 11, 8, 9, proto.OP_MAX, -1, 0)
    assert np.frombuffer(rec[proto.HDR_LEN:], "<i4").tolist() == list(range(8))
    p = g.pull(0, 13, slots=4, epoch=3, mask=0b110, elems=8)
    h = _hdr(p)
    assert len(p) == proto.record_size(8)  # full size, payload ignored
    assert (h["type"], h["flags"], h["count"], h["rank"], h["slot"], h["set"], h["round"], h["mask"]) == (
        proto.TYPE_CONTRIB, proto.FLAG_PULL, 0, 0, 1, 1, 13, 0b110)
    assert _hdr(g.pull(0, 13, slots=4, epoch=3, mask=6, elems=8, flags=proto.FLAG_RETX))["flags"] == \
        proto.FLAG_PULL | proto.FLAG_RETX


def test_batch_frame():
    recs = [g.record(rank=1, round=i, slots=S, epoch=4, mask=3, payload=np.full(E, i)) for i in range(3)]
    recs.append(g.pull(1, 3, slots=S, epoch=4, mask=1))
    f = g.batch(recs, 1)
    dgram, ip, port = _udp(f)
    assert (ip, port) == (g.worker_ip(1), proto.DEFAULT_PORT) and dgram == b"".join(recs)
    assert len(dgram) == 4 * proto.record_size(E) and 4 <= proto.max_records(E)
    parts = split_records(dgram, proto.record_size(E))
    assert [(p.round, int(p.flags)) for p in parts] == [(0, 0), (1, 0), (2, 0), (3, proto.FLAG_PULL)]
    assert [payload_array(p)[0] for p in parts[:3]] == [0, 1, 2]


def test_result_frame_is_what_xdp_sends():
    dgram = bytes(AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG) / bytes(16))
    raw = g.result_frame(dgram, dport=40123)
    p = Ether(raw)
    assert (p[Ether].src, p[Ether].dst) == (g.AGG_MAC, g.multicast_mac(g.GROUP_IP))
    assert (p[IP].src, p[IP].dst, p[IP].ttl, p[IP].id, str(p[IP].flags)) == (g.AGG_IP, g.GROUP_IP, 64, 0, "DF")
    assert (p[UDP].sport, p[UDP].dport, p[UDP].chksum) == (proto.DEFAULT_PORT, 40123, 0)
    assert raw[proto.L2L4_LEN:] == dgram and raw[40:42] == b"\0\0"
    s = sum(int.from_bytes(raw[i:i + 2], "big") for i in range(14, 34, 2))  # IPv4 checksum verifies
    assert (s & 0xFFFF) + (s >> 16) == 0xFFFF
    uni = Ether(g.unicast_frame(dgram, 2, checksum=0x1234))
    assert (uni[IP].dst, uni[Ether].dst, uni[UDP].dport, uni[UDP].chksum) == (
        g.worker_ip(2), g.worker_mac(2), proto.DEFAULT_PORT, 0x1234)


# --- malformed and foreign traffic --------------------------------------------------------------


def test_malformed_covers_every_bad_counter():
    cases = g.malformed_cases()
    reasons = {c.reason for c in cases}
    assert reasons == BAD
    assert BAD >= {"bad_op", "bad_mixed", "bad_src", "bad_truncated", "bad_len"}
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
            assert udp_len == 8 + proto.record_size(E) and len(c.frame) < 34 + udp_len
        else:
            assert len(c.frame) == 34 + udp_len and p[IP].len == 20 + udp_len


def _valid_variants(good: bytes, case: dict) -> list[tuple[dict, int]]:
    """Valid records near ``good`` (header, datagram length): the contribution itself, the same
    with the case's count if that count is valid, a PULL, a JOIN and an ACK with this header."""
    h = _hdr(good)
    out = [(h, len(good))]
    if 1 <= case["count"] <= E:
        out.append(({**h, "count": case["count"]}, len(good)))
    out.append(({**h, "flags": proto.FLAG_PULL, "count": 0}, len(good)))
    out.append(({**h, "type": proto.TYPE_JOIN, "count": 0}, proto.HDR_LEN + proto.JOIN_PAYLOAD))
    out.append(({**h, "type": proto.TYPE_ACK, "count": 0}, proto.HDR_LEN))
    return out


@pytest.mark.parametrize("workers,rank", [(W, 1), (1, 0), (32, 31)])
def test_each_malformed_packet_has_exactly_one_fault(workers, rank):
    full = (1 << workers) - 1
    good = g.record(rank=rank, round=0, slots=S, epoch=9, mask=full, payload=np.arange(1, E + 1), elems=E)
    good_frame = g.batch([good], rank)
    size = len(good)
    for c in g.malformed_cases(workers=workers, rank=rank, slots=S, elems=E, epoch=9):
        if c.cut:  # a prefix of the good frame
            assert good_frame.startswith(c.frame) and len(c.frame) < len(good_frame), c.what
            continue
        dgram, ip, _ = _udp(c.frame)
        src_fault = ip != g.worker_ip(rank)
        assert c.frame[:12] == good_frame[:12] and c.frame[30:34] == good_frame[30:34], c.what  # MACs, dst
        if c.reason == "bad_truncated":
            assert good.startswith(dgram) and len(dgram) < proto.HDR_LEN and not src_fault, c.what
            continue
        if len(dgram) > size and len(dgram) % size == 0:  # a batch: a good record, then one bad one
            first, second = dgram[:size], dgram[size:]
            assert len(dgram) == 2 * size and first == good and not src_fault, c.what
            diff = {k for k in NAMES if _hdr(second)[k] != _hdr(good)[k]}
            assert len(diff) == 1 and second[proto.HDR_LEN:] == good[proto.HDR_LEN:], (c.what, diff)
            continue
        case = _hdr(dgram)
        faults = min(
            sum(case[k] != ref[k] for k in NAMES) + (len(dgram) != length) + src_fault
            for ref, length in _valid_variants(good, case)
        )
        assert faults == 1, (c.reason, c.what)
        if len(dgram) == size and case["count"]:  # the payload is the good one
            assert dgram[proto.HDR_LEN:] == good[proto.HDR_LEN:], c.what


@pytest.mark.parametrize("workers,rank", [(1, 0), (32, 31), (2, 0)])
def test_malformed_edge_sizes(workers, rank):
    """One worker (no other rank's address to spoof) and 32 (no rank >= workers fits the mask)."""
    cases = g.malformed_cases(workers=workers, rank=rank, elems=2, slots=1)
    assert {c.reason for c in cases} == BAD
    src = [c.what for c in cases if c.reason == "bad_src"]
    assert f"from {g.STRANGER_IP}, no rank's address" in src and len(src) == min(workers, 2)
    with pytest.raises(InputError):
        g.malformed_cases(workers=2, rank=2)
    with pytest.raises(InputError):
        g.malformed_cases(elems=1)


def test_foreign_traffic_is_not_ours():
    names = [n for n, _ in g.foreign()]
    assert {"arp_request", "icmp_echo", "ipv6_udp_to_port", "udp_other_port", "udp_from_port_to_other",
            "tcp_to_port", "ipv4_fragment_to_port"} <= set(names)
    assert len(set(names)) == len(names)
    for port in (proto.DEFAULT_PORT, 40000, 0xFFFF):
        for name, f in g.foreign(port=port):
            p = Ether(f)
            ours = (p.haslayer(IP) and p.haslayer(UDP) and p[UDP].dport == port
                    and not (p[IP].flags.MF or p[IP].frag))
            assert not ours, (port, name)


# --- agreement with the user-space aggregator ---------------------------------------------------


class Harness:
    """A user-space aggregator whose sends are captured instead of leaving through its socket."""

    def __init__(self, workers=W, slots=S, elems=E, job=1):
        from nicoffload.userspace import UserspaceAggregator

        # port 0: the constructor binds an ephemeral UDP port, which nothing here sends to
        self.agg = UserspaceAggregator(workers=workers, port=0, slots=slots, elems=elems, job=job,
                                       group=g.GROUP_IP, worker_ips=[g.worker_ip(r) for r in range(workers)])
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self.agg._send = lambda data, dst, port: self.sent.append((bytes(data), (dst, port)))
        self.workers = workers

    def feed(self, frame: bytes, sport: int | None = None) -> list[tuple[bytes, tuple[str, int]]]:
        """Hand the frame's UDP payload to the aggregator; return what it sent for it."""
        dgram, ip, port = _udp(frame)
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
    s = _hdr(status)
    assert addr == (g.worker_ip(0), 40123)
    assert (s["type"], s["detail"], s["mask"], s["rank"]) == (proto.TYPE_STATUS, proto.DETAIL["joining"], 0b0111, 0)
    # the last JOIN forms the epoch: its JOINED goes to the group, to the sender's port
    (joined, addr), = h.feed(joins[-1], sport=40124)
    live = h.agg.live
    table = [g.nonce_of(r) for r in range(W)]
    assert live and addr == (g.GROUP_IP, 40124)
    assert joined == g.joined_record(W - 1, W, g.nonce_of(W - 1), live, table)
    # a JOIN repeated after formation (its JOINED was lost): the JOINED again, by unicast
    assert h.feed(joins[1]) == [(g.joined_record(1, W, g.nonce_of(1), live, table),
                                 (g.worker_ip(1), proto.DEFAULT_PORT))]
    # a worker that counts another world: STATUS WORLD with the job's ranks
    wrong = g.frame(g.join_record(2, W - 1, g.nonce_of(2)), src_mac=g.worker_mac(2), dst_mac=g.AGG_MAC,
                    src_ip=g.worker_ip(2), dst_ip=g.AGG_IP)
    (status, addr), = h.feed(wrong)
    s = _hdr(status)
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
    s = _hdr(status)
    assert (s["type"], s["detail"], s["epoch"], addr[0]) == (proto.TYPE_STATUS, proto.DETAIL["epoch"], live,
                                                             g.worker_ip(0))
    assert h.delta(before) == {"rx": 2, "records": 2, "stale_epoch": 2}  # the STATUS is its outcome
    # the old process of rank 2: superseded (silently, or with a STATUS if it asks)
    before = h.stats
    assert h.feed(g.join_frames(W, ranks=[2])[0]) == []
    (status, _), = h.feed(g.join_frames(W, ranks=[2], retx=True)[0])
    assert (_hdr(status)["type"], _hdr(status)["detail"]) == (proto.TYPE_STATUS, proto.DETAIL["superseded"])
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
        rnd = _hdr(_udp(f)[0])["round"]
        if rnd == 3 + 2 * S and not acked:  # the first reuse of a set: every rank acknowledges
            for r in range(W):
                assert h.feed(g.ack_frame(r, 3 + 2 * S, epoch=live)) == []
            acked = True
        h.feed(f, sport=40000 + rnd)
    # results carry the job's gate: 0 until every rank acknowledged 3 + 2S, then that round
    gates = [0 if 3 + b < 3 + 2 * S else 3 + 2 * S for b in range(nb)]
    want = g.expected_results(arrs, gate=gates, **kw)
    assert [d for d, _ in h.sent[1:]] == want
    assert [a for _, a in h.sent[1:]] == [(g.GROUP_IP, 40000 + _hdr(d)["round"]) for d in want]
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
    s = _hdr(status)
    assert addr == (g.worker_ip(0), 40001)
    assert (s["type"], s["detail"], s["mask"], s["count"], s["rank"], len(status)) == (
        proto.TYPE_STATUS, proto.DETAIL["waiting"], 0b001, 0, 0, proto.record_size(E))
    pull0 = g.batch([g.pull(2, 0, slots=1, epoch=live, mask=0b011)], 2)
    (status, addr), = h.feed(pull0, sport=40002)
    assert (_hdr(status)["detail"], _hdr(status)["mask"], addr) == (proto.DETAIL["waiting"], 0b001,
                                                                    (g.worker_ip(2), 40002))
    assert h.feed(f[1]) == [(want[0], (g.GROUP_IP, proto.DEFAULT_PORT))]
    assert h.feed(r[0], sport=40003) == [(want[0], (g.worker_ip(0), 40003))]  # RETX after completion
    assert h.feed(pull0) == [(want[0], (g.worker_ip(2), proto.DEFAULT_PORT))]  # PULL after completion
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
    assert (_hdr(status)["type"], _hdr(status)["detail"], _hdr(status)["round"]) == (
        proto.TYPE_STATUS, proto.DETAIL["gone"], 0)
    (status, _), = h.feed(pull0)
    assert _hdr(status)["detail"] == proto.DETAIL["gone"]
    assert h.delta(before) == {"rx": 3, "records": 3, "stale_round": 1, "status_sent": 2}


def test_mismatching_contributions(harness):
    h = harness(workers=2)
    live = h.form()
    arrs = g.sample_arrays(2, E, seed=6)
    f = g.contributions(arrs, slots=S, epoch=live)
    h.feed(f[0])  # rank 0 starts round 0: SUM, exp 0, count E, mask 0b11
    others = {
        "op": g.contributions(arrs, slots=S, epoch=live, op=proto.OP_MAX)[1],
        "exp": g.contributions(arrs, slots=S, epoch=live, exp=1)[1],
        "count": g.batch([g.record(rank=1, round=0, slots=S, epoch=live, mask=0b11, count=E - 1)], 1),
        "mask": g.batch([g.record(rank=1, round=0, slots=S, epoch=live, mask=0b10)], 1),
    }
    for what, x in others.items():
        before = h.stats
        assert h.feed(x) == []
        assert h.delta(before) == {"rx": 1, "records": 1, "mismatch": 1}, what
    assert h.feed(f[1]) == [(g.expected_results(arrs, slots=S, epoch=live)[0], (g.GROUP_IP, proto.DEFAULT_PORT))]


def test_batches_answer_once_with_only_their_answers(harness):
    """A batch goes out once, to the group if it completed a round: its answers (RESULT and
    STATUS records) move to the front and the datagram ends after them."""
    h = harness(workers=2)
    live = h.form()
    arrs = g.sample_arrays(2, 4 * E, seed=7)
    f = g.contributions(arrs, slots=S, epoch=live)
    want = g.expected_results(arrs, slots=S, epoch=live)
    rank0 = [_udp(x)[0] for x in f[0::2]]
    h.feed(f[1]), h.feed(f[3])  # rank 1 has contributed to rounds 0 and 1
    (out, addr), = h.feed(g.batch(rank0[1::-1] + rank0[2:], 0), sport=40005)  # rounds 1, 0, 2, 3
    assert addr == (g.GROUP_IP, 40005) and out == want[1] + want[0]  # rounds 2 and 3 need no answer
    assert h.stats["result_sent"] == 2 and h.stats["completed"] == 2
    # a batch whose only answer is to the sender (a RETX of a completed round) goes back to it
    retx1 = _udp(g.contributions(arrs, slots=S, epoch=live, retx=True)[3])[0]  # rank 1, round 1
    dup0 = _udp(f[1])[0]  # rank 1, round 0 again, without RETX
    (out, addr), = h.feed(g.batch([dup0, retx1], 1))
    assert addr == (g.worker_ip(1), proto.DEFAULT_PORT) and out == want[1]
    # a batch of records that need no answer is not sent at all
    before = h.stats
    assert h.feed(g.batch([dup0, _udp(f[3])[0]], 1)) == []
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
    for c in g.malformed_cases(workers=W, slots=S, elems=E, epoch=live):
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
