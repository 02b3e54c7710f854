"""Scapy layer for the nicoffload AllReduce record header (48 bytes) and its int32 payload.

Field order, sizes and offsets come from ``nicoffload.wire.proto.FIELDS`` (which reads them from
xdp/nicoffload_proto.h); nothing here retypes a number of the wire format. ``magic``, ``version``
and ``count`` default to None and are filled in by ``post_build`` (count = payload bytes / 4), so a
test sets them explicitly to build a bad packet. The payload is a ``Raw`` layer of little-endian int32.

    >>> p = AllReduce(rank=2, epoch=9, slot=5, set=1, round=17, mask=0xF) / bytes(1024)
    >>> p.mysummary()
    'AllReduce CONTRIB rank=2 epoch=9 slot=5 set=1 round=17 count=256 op=SUM'
    >>> len(bytes(p)), payload_array(p)[:3].tolist()
    (1072, [0, 0, 0])

A batch (several records in one datagram) is dissected one record at a time: see
:func:`split_records`.
"""
from __future__ import annotations

import struct

import numpy as np
from scapy.config import conf
from scapy.fields import (
    ByteEnumField,
    ByteField,
    Field,
    FlagsField,
    IntField,
    LongField,
    ShortEnumField,
    ShortField,
    SignedShortField,
    XIntField,
    XLongField,
    XShortField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_top_down, split_bottom_up

from nicoffload.wire import proto

#: field name -> struct code, offset (the single source: proto.FIELDS)
_CODES: dict[str, str] = {name: code for name, _, code in proto.FIELDS}
_OFFSETS: dict[str, int] = {name: off for name, off, _ in proto.FIELDS}

# --- enums (from the C header) ---------------------------------------------------------------

#: AR_TYPE_* value -> name
AR_TYPES: dict[int, str] = {
    v: k[len("AR_TYPE_"):] for k, v in proto.C.items() if k.startswith("AR_TYPE_")
}


def _flag_names() -> list[str]:
    """Bit-indexed names of AR_FLAG_* (FlagsField wants a list; unknown bits stay unnamed)."""
    bits: dict[int, str] = {}
    for k, v in proto.C.items():
        if k.startswith("AR_FLAG_"):
            if v <= 0 or v & (v - 1):
                raise AssertionError(f"{k} = {v:#x} is not a single bit")
            bits[v.bit_length() - 1] = k[len("AR_FLAG_"):]
    width = 8 * struct.calcsize("!" + _CODES["flags"])
    return [bits.get(i, f"bit{i}") for i in range(width)]


AR_FLAGS: list[str] = _flag_names()
#: AR_OP_* value -> name
AR_OPS: dict[int, str] = {v: k.upper() for v, k in proto.OPS.items()}
#: AR_DETAIL_* value -> name
AR_DETAILS: dict[int, str] = {0: "NONE", **{v: k.upper() for v, k in proto.DETAILS.items()}}

# --- fields --------------------------------------------------------------------------------

_PLAIN = {"B": ByteField, "H": ShortField, "I": IntField, "h": SignedShortField, "Q": LongField}

#: types the aggregator answers a contribution with
_ANSWERS = frozenset({proto.TYPE_RESULT, proto.TYPE_STATUS})

#: fields computed in post_build when left None
_COMPUTED = ("magic", "version", "count")


def _make_field(name: str, code: str) -> Field:
    """The scapy field for one wire field; the class follows the struct code of proto.FIELDS."""
    special = {
        "magic": lambda: XShortField(name, None),
        "version": lambda: ByteField(name, None),
        "count": lambda: ShortField(name, None),
        "type": lambda: ByteEnumField(name, proto.TYPE_CONTRIB, AR_TYPES),
        "flags": lambda: FlagsField(name, 0, 8 * struct.calcsize("!" + code), AR_FLAGS),
        "rank": lambda: ShortEnumField(name, 0, {proto.RANK_AGG: "AGG"}),
        "mask": lambda: XIntField(name, 0),
        "op": lambda: ByteEnumField(name, proto.OP_SUM, AR_OPS),
        "detail": lambda: ByteEnumField(name, 0, AR_DETAILS),
        "key": lambda: XLongField(name, 0),
    }
    fld = special[name]() if name in special else _PLAIN[code](name, 0)
    ok = fld.sz == struct.calcsize("!" + code)  # bytes on the wire (bit fields: bits / 8)
    if name != "flags":  # flags is a bit field: its fmt is scapy's internal carrier
        ok = ok and fld.fmt.lstrip("!<>=") == code
    if not ok:
        raise AssertionError(f"scapy field {name} does not match the C header's {code!r}")
    return fld


def _fields_desc() -> list[Field]:
    out, pos = [], 0
    for name, off, code in sorted(proto.FIELDS, key=lambda f: f[1]):
        if off != pos:
            raise AssertionError(f"AllReduce field {name} at offset {off}, layout has it at {pos}")
        out.append(_make_field(name, code))
        pos += struct.calcsize("!" + code)
    if pos != proto.HDR_LEN:
        raise AssertionError(f"AllReduce header is {pos} bytes, AR_HDR_LEN is {proto.HDR_LEN}")
    return out


class AllReduce(Packet):
    """nicoffload AllReduce header; the payload (Raw) is ``elems`` little-endian int32."""

    name = "AllReduce"
    fields_desc = _fields_desc()

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        hdr = bytearray(pkt)
        auto = {"magic": proto.MAGIC, "version": proto.VERSION, "count": len(pay) // 4}
        for name in _COMPUTED:
            if self.getfieldval(name) is None:
                struct.pack_into("!" + _CODES[name], hdr, _OFFSETS[name], auto[name])
        return bytes(hdr) + pay

    def _count(self) -> int:
        c = self.count
        return len(bytes(self.payload)) // 4 if c is None else c

    def mysummary(self) -> str:
        kind = AR_TYPES.get(self.type, f"type{self.type}")
        rank = "AGG" if self.rank == proto.RANK_AGG else str(self.rank)
        s = (
            f"AllReduce {kind} rank={rank} epoch={self.epoch} slot={self.slot} set={self.set} "
            f"round={self.round} count={self._count()} op={AR_OPS.get(self.op, self.op)}"
        )
        if int(self.flags):
            s += f" flags={self.flags}"
        if self.type == proto.TYPE_STATUS:
            s += f" detail={AR_DETAILS.get(self.detail, self.detail)}"
        return s

    def _round_key(self) -> tuple:
        return (self.job, self.epoch, self.slot, self.set, self.round)

    def hashret(self) -> bytes:
        return struct.pack("!IIIIB", self.job, self.epoch, self.slot, self.round, self.set)

    def answers(self, other: Packet) -> int:
        """A RESULT or STATUS answers the CONTRIBs of its round (same job, epoch, slot, set, round)."""
        return int(
            isinstance(other, AllReduce)
            and self.type in _ANSWERS
            and other.type == proto.TYPE_CONTRIB
            and self._round_key() == other._round_key()
        )


def payload_array(pkt: Packet, valid_only: bool = False) -> np.ndarray:
    """The AllReduce payload of ``pkt`` as int32 (a copy): all ``elems``, or the first ``count``."""
    layer = pkt if isinstance(pkt, AllReduce) else pkt.getlayer(AllReduce)
    if layer is None:
        raise ValueError(f"not an AllReduce packet: {pkt.summary()}")
    raw = layer.getlayer(conf.raw_layer)
    data = raw.load if raw is not None else b""
    if len(data) % 4:
        raise ValueError(f"AllReduce payload of {len(data)} bytes is not a whole number of int32")
    arr = np.frombuffer(data, dtype="<i4").astype(np.int32)
    return arr[: layer._count()] if valid_only else arr


def split_records(datagram: bytes, record_size: int) -> list[AllReduce]:
    """Dissect a datagram that holds several records of ``record_size`` bytes (a batch)."""
    if record_size <= 0 or len(datagram) % record_size:
        raise ValueError(f"a datagram of {len(datagram)} bytes is not a whole number of "
                         f"{record_size}-byte records")
    return [AllReduce(datagram[i:i + record_size]) for i in range(0, len(datagram), record_size)]


def bind_port(port: int, default: bool = False) -> None:
    """Dissect UDP datagrams to or from ``port`` as AllReduce; ``default``: also use it when building."""
    bind_bottom_up(UDP, AllReduce, dport=port)
    bind_bottom_up(UDP, AllReduce, sport=port)
    if default:
        bind_top_down(UDP, AllReduce, sport=port, dport=port)


def unbind_port(port: int) -> None:
    """Undo :func:`bind_port` for dissection (the building default is left as it is)."""
    split_bottom_up(UDP, AllReduce, dport=port)
    split_bottom_up(UDP, AllReduce, sport=port)


bind_port(proto.DEFAULT_PORT, default=True)
