"""Shared wire constants, read from xdp/nicoffload_proto.h (the single source of truth).

The header's "shared" block is parsed under a strict grammar: blank lines, comments and
``#define AR_NAME <int>`` only. Anything else raises, so C and Python cannot drift silently.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

HEADER_NAME = "nicoffload_proto.h"

_DEFINE = re.compile(r"^#define\s+(AR_[A-Z0-9_]+)\s+\(?\s*(-?(?:0[xX][0-9a-fA-F]+|\d+))\s*\)?\s*$")
_COMMENT = re.compile(r"^(/\*.*\*/|//.*)$")


def xdp_dir() -> Path:
    """Directory holding the BPF C sources (works for editable and plain installs)."""
    return Path(str(resources.files("nicoffload.xdp")))


def parse_header(text: str) -> dict[str, int]:
    """Return the AR_* constants of the shared block of ``text``; raise ValueError on anything else."""
    out: dict[str, int] = {}
    inside = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line == "/* --- shared: begin --- */":
            inside = True
            continue
        if line == "/* --- shared: end --- */":
            inside = False
            continue
        if not inside or not line or _COMMENT.match(line):
            continue
        m = _DEFINE.match(line)
        if not m:
            raise ValueError(f"{HEADER_NAME}:{lineno}: not a plain '#define AR_NAME <int>': {raw!r}")
        name, value = m.group(1), int(m.group(2), 0)
        if name in out:
            raise ValueError(f"{HEADER_NAME}:{lineno}: {name} defined twice")
        out[name] = value
    if not out:
        raise ValueError(f"{HEADER_NAME}: no shared block found")
    return out


C: dict[str, int] = parse_header((xdp_dir() / HEADER_NAME).read_text())

MAGIC = C["AR_MAGIC"]
VERSION = C["AR_VERSION"]
DEFAULT_PORT = C["AR_DEFAULT_PORT"]
TYPE_CONTRIB = C["AR_TYPE_CONTRIB"]
TYPE_RESULT = C["AR_TYPE_RESULT"]
TYPE_STATUS = C["AR_TYPE_STATUS"]
TYPE_JOIN = C["AR_TYPE_JOIN"]
TYPE_JOINED = C["AR_TYPE_JOINED"]
TYPE_ACK = C["AR_TYPE_ACK"]
TYPE_NOP = C["AR_TYPE_NOP"]
FLAG_RETX = C["AR_FLAG_RETX"]
FLAG_PULL = C["AR_FLAG_PULL"]
FLAG_ANSWER = C["AR_FLAG_ANSWER"]
DELIVERY_MULTICAST = C["AR_DELIVERY_MULTICAST"]
DELIVERY_UNICAST = C["AR_DELIVERY_UNICAST"]
FLAGS_KNOWN = C["AR_FLAGS_KNOWN"]
OP_SUM = C["AR_OP_SUM"]
OP_SUM64 = C["AR_OP_SUM64"]
OP_MAX = C["AR_OP_MAX"]
OP_OR = C["AR_OP_OR"]
OP_SGD = C["AR_OP_SGD"]
OP_SUM16 = C["AR_OP_SUM16"]
OP_COUNT = C["AR_OP__COUNT"]
RANK_AGG = C["AR_RANK_AGG"]
MAX_WORKERS = C["AR_MAX_WORKERS"]
MAX_JOBS = C["AR_MAX_JOBS"]
HDR_LEN = C["AR_HDR_LEN"]
JOIN_PAYLOAD = C["AR_JOIN_PAYLOAD"]
L2L4_LEN = C["AR_L2L4_LEN"]
MAX_PACKET_OFF = C["AR_MAX_PACKET_OFF"]
DEFAULT_ELEMS = C["AR_DEFAULT_ELEMS"]
MAX_MTU = C["AR_MAX_MTU"]

#: header fields in wire order: (name, offset, struct code); offsets come from the C header
FIELDS: list[tuple[str, int, str]] = [
    ("magic", C["AR_OFF_MAGIC"], "H"),
    ("version", C["AR_OFF_VERSION"], "B"),
    ("type", C["AR_OFF_TYPE"], "B"),
    ("flags", C["AR_OFF_FLAGS"], "B"),
    ("set", C["AR_OFF_SET"], "B"),
    ("rank", C["AR_OFF_RANK"], "H"),
    ("job", C["AR_OFF_JOB"], "I"),
    ("epoch", C["AR_OFF_EPOCH"], "I"),
    ("slot", C["AR_OFF_SLOT"], "I"),
    ("round", C["AR_OFF_ROUND"], "I"),
    ("mask", C["AR_OFF_MASK"], "I"),
    ("ack", C["AR_OFF_ACK"], "I"),
    ("count", C["AR_OFF_COUNT"], "H"),
    ("exp", C["AR_OFF_EXP"], "h"),
    ("op", C["AR_OFF_OP"], "B"),
    ("detail", C["AR_OFF_DETAIL"], "B"),
    ("pad", C["AR_OFF_PAD"], "H"),
    ("key", C["AR_OFF_KEY"], "Q"),
]
#: struct format of the header (network byte order), derived from FIELDS
HDR_STRUCT = "!" + "".join(code for _, _, code in FIELDS)
FIELD_OFFSETS: dict[str, int] = {name: off for name, off, _ in FIELDS}


def _named(prefix: str) -> list[str]:
    """Lower-case names of the ``AR_<prefix>_*`` counter slots in index order (no ``__COUNT``)."""
    pre = f"AR_{prefix}_"
    slots = sorted((v, k) for k, v in C.items() if k.startswith(pre) and not k.endswith("__COUNT"))
    names = [k[len(pre):].lower() for _, k in slots]
    if [v for v, _ in slots] != list(range(len(slots))) or len(slots) != C[f"{pre}_COUNT"]:
        raise ValueError(f"{HEADER_NAME}: {pre}* slots must be 0..{pre}_COUNT-1 without gaps")
    return names


#: per-CPU counter names in index order, from AR_STAT_*
STATS: list[str] = _named("STAT")
#: STATUS detail names by value, from AR_DETAIL_*
DETAILS: dict[int, str] = {v: k[len("AR_DETAIL_"):].lower() for k, v in C.items() if k.startswith("AR_DETAIL_")}
DETAIL = {name: v for v, name in DETAILS.items()}
#: op names by value, from AR_OP_* (without the count)
OPS: dict[int, str] = {v: k[len("AR_OP_"):].lower() for k, v in C.items()
                       if k.startswith("AR_OP_") and not k.endswith("__COUNT")}
STAT = {name: i for i, name in enumerate(STATS)}
#: fault injector counter names, from AR_FAULT_*
FAULTS: list[str] = _named("FAULT")


def record_size(elems: int) -> int:
    """Bytes of one record (header + ``elems`` int32): the UDP_SEGMENT size of a batch."""
    return HDR_LEN + 4 * elems


def max_elems_for_mtu(mtu: int) -> int:
    """Largest even int32 payload that fits an IPv4/UDP packet of ``mtu`` bytes."""
    return ((mtu - 20 - 8 - HDR_LEN) // 4) & ~1


def max_records(elems: int) -> int:
    """Records of one frame the XDP program handles (it reaches AR_MAX_PACKET_OFF bytes at most)."""
    return (MAX_PACKET_OFF - L2L4_LEN) // record_size(elems)


def mtu_for_elems(elems: int) -> int:
    """Smallest MTU that carries ``elems`` int32 elements."""
    return 20 + 8 + HDR_LEN + 4 * elems
