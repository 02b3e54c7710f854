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
FLAG_RETX = C["AR_FLAG_RETX"]
FLAG_OP_MAX = C["AR_FLAG_OP_MAX"]
FLAGS_KNOWN = C["AR_FLAGS_KNOWN"]
RANK_AGG = C["AR_RANK_AGG"]
NEXT_NZ_NONE = C["AR_NEXT_NZ_NONE"]
MAX_WORKERS = C["AR_MAX_WORKERS"]
HDR_LEN = C["AR_HDR_LEN"]
L2L4_LEN = C["AR_L2L4_LEN"]
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
    ("slot", C["AR_OFF_SLOT"], "I"),
    ("block", C["AR_OFF_BLOCK"], "I"),
    ("mask", C["AR_OFF_MASK"], "I"),
    ("next_nz", C["AR_OFF_NEXT_NZ"], "I"),
    ("count", C["AR_OFF_COUNT"], "H"),
    ("exp", C["AR_OFF_EXP"], "h"),
]
#: struct format of the header (network byte order), derived from FIELDS
HDR_STRUCT = "!" + "".join(code for _, _, code in FIELDS)

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
STAT = {name: i for i, name in enumerate(STATS)}
#: fault injector counter names, from AR_FAULT_*
FAULTS: list[str] = _named("FAULT")


def max_elems_for_mtu(mtu: int) -> int:
    """Largest int32 payload that fits an IPv4/UDP packet of ``mtu`` bytes."""
    return (mtu - 20 - 8 - HDR_LEN) // 4


def mtu_for_elems(elems: int) -> int:
    """Smallest MTU that carries ``elems`` int32 elements."""
    return 20 + 8 + HDR_LEN + 4 * elems
