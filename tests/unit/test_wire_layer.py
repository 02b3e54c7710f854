"""The scapy AllReduce layer: golden bytes, drift against the C header, computed fields, binding."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from nicoffload import proto
from packets.generators import frame
from packets.layers import AR_FLAGS, AR_TYPES, AllReduce, bind_port, payload_array, unbind_port

HEADER_TEXT = (proto.xdp_dir() / proto.HEADER_NAME).read_text()

# Derived by hand from the header's table (big-endian fields, little-endian int32 payload):
#   magic 4e58 | version 01 | type 01 (CONTRIB) | flags 01 (RETX) | set 01 | rank 0002
#   job 01020304 | slot 00000005 | block 00000011 (17) | mask 00000007 | next_nz 00000012 (18)
#   count 0005 (5 elements, computed) | exp fffd (-3)
GOLDEN_HDR = "4e58010101010002" "01020304" "00000005" "00000011" "00000007" "00000012" "0005" "fffd"
#   payload [1, -1, 0x01020304, 0x7fffffff, -2**31] as little-endian int32
GOLDEN_PAYLOAD = "01000000" "ffffffff" "04030201" "ffffff7f" "00000080"
# Ethernet 02:00:00:00:00:03 -> 02:00:00:00:00:fe; IPv4 10.0.0.3 -> 10.0.0.254, len 80, id 0,
# ttl 64, UDP, header checksum 0x659d (one's complement sum worked out by hand); UDP 48879 ->
# 48879 (0xbeef), len 60, checksum 0x10fe (RFC 1071 over the pseudo header, see _csum below)
GOLDEN_FRAME = (
    "0200000000fe" "020000000003" "0800"
    "45000050" "00000000" "4011659d" "0a000003" "0a0000fe"
    "beefbeef" "003c10fe"
) + GOLDEN_HDR + GOLDEN_PAYLOAD
VALUES = [1, -1, 0x01020304, 0x7FFFFFFF, -(2**31)]
FIELDS = dict(type="CONTRIB", flags="RETX", set=1, rank=2, job=0x01020304, slot=5, block=17, mask=7,
              next_nz=18, exp=-3)


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
    assert (ar.set, ar.rank, ar.job, ar.slot, ar.block, ar.mask, ar.next_nz, ar.count, ar.exp) == (
        1, 2, 0x01020304, 5, 17, 7, 18, 5, -3)
    assert payload_array(pkt).tolist() == VALUES
    assert payload_array(pkt).dtype == np.int32
    assert ar.summary().startswith("AllReduce CONTRIB rank=2 slot=5 set=1 block=17 count=5")


def test_summary_format():
    p = AllReduce(rank=2, slot=5, set=1, block=17) / bytes(4 * 256)
    assert p.mysummary() == "AllReduce CONTRIB rank=2 slot=5 set=1 block=17 count=256"
    r = AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG, flags="OP_MAX")
    assert r.mysummary() == "AllReduce RESULT rank=AGG slot=0 set=0 block=0 count=0 flags=OP_MAX"


# --- drift: the layer against the C header --------------------------------------------------


def _c_defines() -> dict[str, int]:
    """AR_* defines read with a plain regex, independently of proto.parse_header."""
    return {m[1]: int(m[2], 0) for m in re.finditer(r"^#define\s+(AR_\w+)\s+(\S+)\s*$", HEADER_TEXT, re.M)}


def test_header_length_matches_c():
    c = _c_defines()
    assert len(bytes(AllReduce())) == proto.HDR_LEN == c["AR_HDR_LEN"]
    assert struct.calcsize(proto.HDR_STRUCT) == c["AR_HDR_LEN"]


def test_field_offsets_match_c():
    c = _c_defines()
    off = 0
    names = []
    for fld in AllReduce.fields_desc:
        assert off == c[f"AR_OFF_{fld.name.upper()}"], fld.name
        off += int(fld.sz)
        names.append(fld.name)
    assert off == c["AR_HDR_LEN"]
    # every AR_OFF_* of the header is a field of the layer
    assert sorted(k[len("AR_OFF_"):].lower() for k in c if k.startswith("AR_OFF_")) == sorted(names)


@pytest.mark.parametrize("name,off,code", proto.FIELDS)
def test_each_field_lands_at_its_offset(name, off, code):
    """Set one field to all ones, everything else to zero: the ones are exactly at its offset."""
    size = struct.calcsize("!" + code)
    zero = {f: 0 for f, _, _ in proto.FIELDS}
    zero[name] = -1 if code.islower() else (1 << 8 * size) - 1
    raw = bytes(AllReduce(**zero))
    assert len(raw) == proto.HDR_LEN
    assert [i for i, b in enumerate(raw) if b] == list(range(off, off + size))
    assert _c_defines()[f"AR_OFF_{name.upper()}"] == off


def test_header_comment_table_matches_defines():
    """The table in the header's top comment agrees with its #defines (offsets and sizes)."""
    rows = re.findall(r"^ \*\s+(\d+)\s+(\d+)\s+([a-z_]+)\s", HEADER_TEXT, re.M)
    table = {name: (int(off), int(size)) for off, size, name in rows}
    c = _c_defines()
    for name, off, code in proto.FIELDS:
        assert table[name] == (c[f"AR_OFF_{name.upper()}"], struct.calcsize("!" + code)), name


def test_enums_come_from_c():
    c = _c_defines()
    assert AR_TYPES == {v: k[len("AR_TYPE_"):] for k, v in c.items() if k.startswith("AR_TYPE_")}
    assert AR_TYPES[proto.TYPE_CONTRIB] == "CONTRIB" and AR_TYPES[proto.TYPE_RESULT] == "RESULT"
    assert AR_FLAGS[proto.FLAG_RETX.bit_length() - 1] == "RETX"
    assert AR_FLAGS[proto.FLAG_OP_MAX.bit_length() - 1] == "OP_MAX"


# --- computed fields and overrides ----------------------------------------------------------


def test_computed_fields_and_overrides():
    p = AllReduce() / bytes(12)
    hdr = bytes(p)[: proto.HDR_LEN]
    magic, version, *_, count, _exp = struct.unpack(proto.HDR_STRUCT, hdr)
    assert (magic, version, count) == (proto.MAGIC, proto.VERSION, 3)
    bad = bytes(AllReduce(magic=0x1234, version=9, count=700) / bytes(12))
    magic, version, *_, count, _exp = struct.unpack(proto.HDR_STRUCT, bad[: proto.HDR_LEN])
    assert (magic, version, count) == (0x1234, 9, 700)
    assert bytes(AllReduce(count=0))[proto.C["AR_OFF_COUNT"]:][:2] == b"\0\0"
    assert len(bytes(AllReduce())) == proto.HDR_LEN  # null: no payload, count 0


def test_payload_array_valid_only():
    p = AllReduce(count=2) / np.arange(4, dtype="<i4").tobytes()
    assert payload_array(p).tolist() == [0, 1, 2, 3]
    assert payload_array(p, valid_only=True).tolist() == [0, 1]
    with pytest.raises(ValueError):
        payload_array(Ether() / IP())


# --- binding ----------------------------------------------------------------------------------


def test_bound_to_default_port_both_directions():
    built = Ether() / IP() / UDP() / AllReduce()
    assert built[UDP].sport == built[UDP].dport == proto.DEFAULT_PORT
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


def test_result_answers_its_round():
    c = AllReduce(type=proto.TYPE_CONTRIB, job=1, slot=2, set=1, block=9)
    r = AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG, job=1, slot=2, set=1, block=9)
    other = AllReduce(type=proto.TYPE_RESULT, rank=proto.RANK_AGG, job=1, slot=2, set=0, block=9)
    assert r.answers(c) and not c.answers(r) and not other.answers(c)
    assert r.hashret() == c.hashret()
