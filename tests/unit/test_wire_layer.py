"""The scapy AllReduce layer: golden bytes, drift against the C header, computed fields, enums,
answers/hashret, batches, binding."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from nicoffload.packets.generators import frame
from nicoffload.packets.layers import (
    AR_DETAILS,
    AR_FLAGS,
    AR_OPS,
    AR_TYPES,
    AllReduce,
    bind_port,
    payload_array,
    split_records,
    unbind_port,
)
from nicoffload.wire import proto

HEADER_TEXT = (proto.xdp_dir() / proto.HEADER_NAME).read_text()

# Derived by hand from the header's table (big-endian fields, little-endian int32 payload):
#   magic 4e58 | version 03 | type 01 (CONTRIB) | flags 01 (RETX) | set 01 | rank 0002
#   job 01020304 | epoch 0a0b0c0d | slot 00000005 | round 00000011 (17) | mask 00000007
#   ack 00000010 (16) | count 0005 (5 elements, computed) | exp fffd (-3) | op 02 (MAX)
#   detail 00 | pad 0000 | key 1122334455667788 (big endian)           = 48 bytes
GOLDEN_HDR = ("4e58030101010002" "01020304" "0a0b0c0d" "00000005" "00000011" "00000007" "00000010"
              "0005" "fffd" "02" "00" "0000" "1122334455667788")
#   payload [1, -1, 0x01020304, 0x7fffffff, -2**31] as little-endian int32 (20 bytes)
GOLDEN_PAYLOAD = "01000000" "ffffffff" "04030201" "ffffff7f" "00000080"
# Ethernet 02:00:00:00:00:03 -> 02:00:00:00:00:fe, type 0800.
# IPv4 10.0.0.3 -> 10.0.0.254, total length 20 + 8 + 48 + 20 = 96 (0x0060), id 0, no flags,
#   ttl 64, UDP. Header checksum by hand: 4500 + 0060 + 0000 + 0000 + 4011 + 0a00 + 0003 + 0a00
#   + 00fe = 9a72 (no carry); ~9a72 = 658d.
# UDP 48879 -> 48879 (beef), length 8 + 68 = 76 (0x004c). Checksum by hand (RFC 768/1071):
#   pseudo header 0a00 + 0003 + 0a00 + 00fe + 0011 + 004c          = 0x0155e
#   UDP header    beef + beef + 004c (+ checksum 0000)              = 0x17e2a
#   record header 4e58 0301 0101 0002 0102 0304 0a0b 0c0d 0000 0005
#                 0000 0011 0000 0007 0000 0010 0005 fffd 0200 0000 = 0x16ea9
#   key           1122 3344 5566 7788                               = 0x11154
#   payload       0100 0000 ffff ffff 0403 0201 ffff ff7f 0000 0080 = 0x40700
#   total 0x81a85, folded 1a85 + 8 = 1a8d, ~1a8d = e572.
GOLDEN_FRAME = (
    "0200000000fe" "020000000003" "0800"
    "45000060" "00000000" "4011658d" "0a000003" "0a0000fe"
    "beefbeef" "004ce572"
) + GOLDEN_HDR + GOLDEN_PAYLOAD
VALUES = [1, -1, 0x01020304, 0x7FFFFFFF, -(2**31)]
FIELDS = dict(type="CONTRIB", flags="RETX", set=1, rank=2, job=0x01020304, epoch=0x0A0B0C0D, slot=5, round=17,
              mask=7, ack=16, exp=-3, op="MAX", key=0x1122334455667788)


def _csum(data: bytes) -> int:
    """RFC 1071 Internet checksum, independent of scapy."""
    if len(data) % 2:
        data += b"\0"
    s = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _golden_layer() -> AllReduce:
    return AllReduce(**FIELDS) / Raw(np.array(VALUES, dtype="<i4").tobytes())


def test_golden_header_and_payload():
    assert bytes(_golden_layer()).hex() == GOLDEN_HDR + GOLDEN_PAYLOAD
    assert len(bytes.fromhex(GOLDEN_HDR)) == proto.HDR_LEN


def test_golden_frame_and_checksums():
    built = bytes(Ether(src="02:00:00:00:00:03", dst="02:00:00:00:00:fe")
                  / IP(src="10.0.0.3", dst="10.0.0.254", id=0, ttl=64) / UDP() / _golden_layer())
    assert built.hex() == GOLDEN_FRAME
    via_generator = frame(bytes(_golden_layer()), src_mac="02:00:00:00:00:03", dst_mac="02:00:00:00:00:fe",
                          src_ip="10.0.0.3", dst_ip="10.0.0.254")
    assert via_generator == built
    raw = bytes.fromhex(GOLDEN_FRAME)
    assert _csum(raw[14:34]) == 0  # IPv4 header checksum verifies
    udp = raw[34:]
    pseudo = raw[26:34] + bytes([0, 17]) + len(udp).to_bytes(2, "big")
    assert _csum(pseudo + udp) == 0  # UDP checksum verifies


def test_golden_parse_back():
    pkt = Ether(bytes.fromhex(GOLDEN_FRAME))
    assert pkt.haslayer(AllReduce)
    ar = pkt[AllReduce]
    assert ar.magic == proto.MAGIC and ar.version == proto.VERSION
    assert ar.type == proto.TYPE_CONTRIB and int(ar.flags) == proto.FLAG_RETX
    assert (ar.set, ar.rank, ar.job, ar.epoch, ar.slot, ar.round, ar.mask, ar.ack, ar.count, ar.exp,
            ar.op, ar.detail, ar.pad) == (1, 2, 0x01020304, 0x0A0B0C0D, 5, 17, 7, 16, 5, -3, proto.OP_MAX, 0, 0)
    assert ar.key == 0x1122334455667788
    assert payload_array(pkt).tolist() == VALUES
    assert payload_array(pkt).dtype == np.int32
    assert ar.mysummary() == ("AllReduce CONTRIB rank=2 epoch=168496141 slot=5 set=1 round=17 count=5 op=MAX "
                            "flags=RETX")
    assert bytes(ar) == bytes.fromhex(GOLDEN_HDR + GOLDEN_PAYLOAD)  # rebuilt unchanged


def test_summary_format():
    p = AllReduce(rank=2, epoch=9, slot=5, set=1, round=17, mask=0xF) / bytes(4 * 256)
    assert p.mysummary() == "AllReduce CONTRIB rank=2 epoch=9 slot=5 set=1 round=17 count=256 op=SUM"
    r = AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG, epoch=3, round=4, op=proto.OP_SUM64, count=7)
    assert r.mysummary() == "AllReduce RESULT rank=AGG epoch=3 slot=0 set=0 round=4 count=7 op=SUM64"
    s = AllReduce(type=proto.TYPE_STATUS, rank=1, flags="RETX+PULL", op=proto.OP_OR, detail=proto.DETAIL["gone"])
    assert s.mysummary() == ("AllReduce STATUS rank=1 epoch=0 slot=0 set=0 round=0 count=0 op=OR "
                             "flags=RETX+PULL detail=GONE")
    # the detail is shown only for a STATUS; unknown enum values as numbers
    assert "detail" not in AllReduce(detail=proto.DETAIL["epoch"]).mysummary()
    assert AllReduce(type=0xEE, op=0x99).mysummary() == (
        "AllReduce type238 rank=0 epoch=0 slot=0 set=0 round=0 count=0 op=153")


# --- drift: the layer against the C header --------------------------------------------------


def _c_defines() -> dict[str, int]:
    """AR_* defines read with a plain regex, independently of proto.parse_header."""
    return {m[1]: int(m[2], 0) for m in re.finditer(r"^#define\s+(AR_\w+)\s+(\S+)\s*$", HEADER_TEXT, re.M)}


def test_header_comment_table_matches_defines():
    """The table in the header's top comment agrees with its #defines (offsets and sizes), row
    for row, in order, and ends where the payload begins."""
    rows = re.findall(r"^ \*\s+(\d+)\s+(\d+)\s+([a-z_]+)\s", HEADER_TEXT, re.M)
    c = _c_defines()
    want = [(c[f"AR_OFF_{name.upper()}"], struct.calcsize("!" + code), name) for name, _, code in proto.FIELDS]
    assert [(int(o), int(s), n) for o, s, n in rows] == want
    assert re.search(rf"^ \*\s+{c['AR_HDR_LEN']}\s+payload\s", HEADER_TEXT, re.M)


def test_enums_come_from_c():
    c = _c_defines()

    def named(prefix):
        return {v: k[len(prefix):] for k, v in c.items() if k.startswith(prefix) and not k.endswith("__COUNT")}

    assert AR_TYPES == named("AR_TYPE_")
    assert {"CONTRIB", "RESULT", "STATUS", "JOIN", "JOINED", "ACK", "NOP", "RING_REDUCE", "RING_GATHER", "RING_NACK",
            "RING_PING", "RING_PONG"} == set(AR_TYPES.values())
    assert AR_OPS == named("AR_OP_") and set(AR_OPS.values()) == {"SUM", "SUM64", "MAX", "OR", "SGD", "SUM16"}
    assert len(AR_OPS) == c["AR_OP__COUNT"]
    assert AR_DETAILS == {0: "NONE", **named("AR_DETAIL_")}
    flags = named("AR_FLAG_")
    assert {v.bit_length() - 1: n for v, n in flags.items()} == {
        i: n for i, n in enumerate(AR_FLAGS) if not n.startswith("bit")}
    # a worker's flags (the program refuses others); ANSWER is the aggregator's, on its answers
    assert sum(flags) - c["AR_FLAG_ANSWER"] == c["AR_FLAGS_KNOWN"]
    # the enums are wired into the fields: a packet shows names, not numbers
    p = AllReduce(type=c["AR_TYPE_JOINED"], op=c["AR_OP_SUM64"], detail=c["AR_DETAIL_SUPERSEDED"],
                  flags=c["AR_FLAG_PULL"], rank=c["AR_RANK_AGG"])
    assert p.sprintf("%AllReduce.type% %AllReduce.op% %AllReduce.detail% %AllReduce.flags% %AllReduce.rank%") \
        == "JOINED SUM64 SUPERSEDED PULL AGG"


# --- computed fields and overrides ----------------------------------------------------------


def _unpack(raw: bytes) -> dict:
    return dict(zip((n for n, _, _ in proto.FIELDS), struct.unpack(proto.HDR_STRUCT, raw[:proto.HDR_LEN])))


def test_computed_fields_and_overrides():
    h = _unpack(bytes(AllReduce() / bytes(12)))
    assert (h["magic"], h["version"], h["count"]) == (proto.MAGIC, proto.VERSION, 3)
    assert (h["magic"], h["version"]) == (0x4E58, 3)
    bad = _unpack(bytes(AllReduce(magic=0x1234, version=9, count=700) / bytes(12)))
    assert (bad["magic"], bad["version"], bad["count"]) == (0x1234, 9, 700)
    zero = _unpack(bytes(AllReduce(magic=0, version=0, count=0) / bytes(12)))
    assert (zero["magic"], zero["version"], zero["count"]) == (0, 0, 0)  # 0 is an override, not "unset"
    assert len(bytes(AllReduce())) == proto.HDR_LEN and _unpack(bytes(AllReduce()))["count"] == 0
    # an odd payload length: count is the whole int32 it holds
    assert _unpack(bytes(AllReduce() / bytes(7)))["count"] == 1
    # the other fields are not touched by post_build
    h = _unpack(bytes(AllReduce(op=3, detail=5, pad=0xBEEF, ack=0xFFFFFFFF) / bytes(8)))
    assert (h["op"], h["detail"], h["pad"], h["ack"]) == (3, 5, 0xBEEF, 0xFFFFFFFF)


def test_payload_array_valid_only():
    p = AllReduce(count=2) / np.arange(4, dtype="<i4").tobytes()
    assert payload_array(p).tolist() == [0, 1, 2, 3]
    assert payload_array(p, valid_only=True).tolist() == [0, 1]
    assert payload_array(AllReduce() / np.arange(3, dtype="<i4").tobytes(), valid_only=True).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        payload_array(Ether() / IP())
    with pytest.raises(ValueError):
        payload_array(AllReduce() / bytes(6))


# --- answers / hashret ------------------------------------------------------------------------

KEY = dict(job=3, epoch=77, slot=2, set=1, round=9)


@pytest.mark.parametrize("kind", [proto.TYPE_RESULT, proto.TYPE_STATUS])
def test_result_and_status_answer_their_round(kind):
    c = AllReduce(type=proto.TYPE_CONTRIB, rank=1, **KEY)
    r = AllReduce(type=kind, rank=proto.RANK_AGG if kind == proto.TYPE_RESULT else 1, mask=3, **KEY)
    assert r.answers(c) and not c.answers(r)
    assert r.hashret() == c.hashret()
    for field, other in (("job", 4), ("epoch", 78), ("slot", 3), ("set", 0), ("round", 10)):
        moved = AllReduce(type=kind, rank=proto.RANK_AGG, **{**KEY, field: other})
        assert not moved.answers(c), field
        assert moved.hashret() != c.hashret(), field


@pytest.mark.parametrize("kind", [proto.TYPE_CONTRIB, proto.TYPE_JOIN, proto.TYPE_JOINED, proto.TYPE_ACK,
                                  proto.TYPE_NOP])
def test_other_types_answer_nothing(kind):
    c = AllReduce(type=proto.TYPE_CONTRIB, rank=1, **KEY)
    assert not AllReduce(type=kind, rank=proto.RANK_AGG, **KEY).answers(c)
    if kind != proto.TYPE_CONTRIB:  # a RESULT answers nothing but a CONTRIB
        assert not AllReduce(type=proto.TYPE_RESULT, **KEY).answers(AllReduce(type=kind, **KEY))


def test_answers_through_whole_frames():
    """scapy's matching (hashret, then answers) works on dissected frames too."""
    c = Ether(bytes(Ether() / IP(src="10.0.0.2", dst="10.0.0.100") / UDP() / AllReduce(**KEY) / bytes(16)))
    r = Ether(bytes(Ether() / IP(src="10.0.0.100", dst="239.77.0.1") / UDP()
                    / AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG, **KEY) / bytes(16)))
    assert r[AllReduce].answers(c[AllReduce]) and r[AllReduce].hashret() == c[AllReduce].hashret()


# --- batches ----------------------------------------------------------------------------------


def test_split_records():
    recs = [AllReduce(round=i, slot=i % 2, rank=1, count=2 - i % 2) / np.array([i, -i], "<i4").tobytes()
            for i in range(3)]
    dgram = b"".join(bytes(r) for r in recs)
    size = proto.HDR_LEN + 8
    assert len(dgram) == 3 * size
    got = split_records(dgram, size)
    assert [type(p) for p in got] == [AllReduce] * 3
    assert [(p.round, p.slot, p.rank, p.count) for p in got] == [(0, 0, 1, 2), (1, 1, 1, 1), (2, 0, 1, 2)]
    assert [payload_array(p).tolist() for p in got] == [[0, 0], [1, -1], [2, -2]]
    assert [bytes(p) for p in got] == [bytes(r) for r in recs]
    assert [p.round for p in split_records(bytes(recs[0]), size)] == [0]
    for bad in (size - 1, size + 1, 0, -size):
        with pytest.raises(ValueError):
            split_records(dgram, bad)


# --- binding ----------------------------------------------------------------------------------


def test_bound_to_default_port_both_directions():
    built = Ether() / IP() / UDP() / AllReduce()
    assert built[UDP].sport == built[UDP].dport == proto.DEFAULT_PORT == 48879
    to_port = Ether(bytes(Ether() / IP() / UDP(sport=1234, dport=proto.DEFAULT_PORT) / bytes(AllReduce())))
    from_port = Ether(bytes(Ether() / IP() / UDP(sport=proto.DEFAULT_PORT, dport=1234) / bytes(AllReduce())))
    other = Ether(bytes(Ether() / IP() / UDP(sport=1234, dport=4321) / bytes(AllReduce())))
    assert to_port.haslayer(AllReduce) and from_port.haslayer(AllReduce)
    assert not other.haslayer(AllReduce)


def test_bind_another_port():
    port = 40001
    raw = bytes(Ether() / IP() / UDP(sport=port, dport=port) / bytes(AllReduce(rank=3)))
    assert not Ether(raw).haslayer(AllReduce)
    bind_port(port)
    try:
        assert Ether(raw)[AllReduce].rank == 3
    finally:
        unbind_port(port)
    assert not Ether(raw).haslayer(AllReduce)
