"""docs/protocol.md agrees with the C header: the header table, every `AR_NAME` = value it quotes,
the numbers it derives from them, and the counter table (every counter, in index order)."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from nicoffload.wire import proto

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
HEADER_TEXT = (proto.xdp_dir() / proto.HEADER_NAME).read_text()
TYPES = {"u8": "B", "u16": "H", "u32": "I", "i16": "h", "u64": "Q"}


def _c_defines() -> dict[str, int]:
    """AR_* defines read with a plain regex, independently of proto.parse_header."""
    return {m[1]: int(m[2], 0) for m in re.finditer(r"^#define\s+(AR_\w+)\s+(\S+)\s*$", HEADER_TEXT, re.M)}


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## \d+\. {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '{title}'"
    return m.group(1)


def test_title_names_the_version(text):
    assert text.splitlines()[0] == f"# The nicoffload wire protocol (version {_c_defines()['AR_VERSION']})"


def test_header_table_matches_the_c_header(text):
    c = _c_defines()
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \| (\w+) \|", _section(text, "Record header"), re.M)
    assert rows, "no header table"
    pos = 0
    for off, size, name, typ in rows:  # in offset order, tiling the header
        assert int(off) == pos == c[f"AR_OFF_{name.upper()}"], name
        assert int(size) == struct.calcsize("!" + TYPES[typ]), name
        pos += int(size)
    assert pos == c["AR_HDR_LEN"]
    assert sorted(name.upper() for _, _, name, _ in rows) == sorted(k[len("AR_OFF_"):] for k in c
                                                                     if k.startswith("AR_OFF_"))
    # and the Python view agrees with the same table
    assert [(name, int(off), TYPES[typ]) for off, _size, name, typ in rows] == proto.FIELDS
    assert f"| {c['AR_HDR_LEN']} | elems x 4 | payload |" in text


def test_quoted_constants_match_the_header(text):
    c = _c_defines()
    quoted = re.findall(r"`(AR_[A-Z0-9_]+)` = (-?(?:0[xX][0-9a-fA-F]+|\d+))", text)
    assert quoted
    for name, value in quoted:
        assert name in c, f"{name} is not in the header"
        assert c[name] == int(value, 0), name
    documented = dict(quoted)
    for name in ("AR_MAGIC", "AR_VERSION", "AR_DEFAULT_PORT", "AR_HDR_LEN", "AR_L2L4_LEN", "AR_RANK_AGG",
                 "AR_FLAGS_KNOWN", "AR_DEFAULT_ELEMS", "AR_JOIN_PAYLOAD", "AR_MAX_WORKERS", "AR_MAX_JOBS",
                 "AR_MAX_PACKET_OFF", "AR_MAX_MTU", "AR_OP__COUNT"):
        assert name in documented, f"{name} is not documented"
    enums = [k for k in c if k.startswith(("AR_TYPE_", "AR_OP_", "AR_DETAIL_"))]
    assert set(enums) <= set(documented), "every type, op and STATUS detail is documented"
    for k, v in c.items():  # flags are quoted in the header table
        if k.startswith("AR_FLAG_"):
            assert documented.get(k) == f"0x{v:02X}", k


def test_derived_numbers(text):
    c = _c_defines()
    elems = c["AR_DEFAULT_ELEMS"]
    rec = c["AR_HDR_LEN"] + 4 * elems
    assert f"= {proto.max_elems_for_mtu(c['AR_MAX_MTU'])} on native XDP" in text
    assert f"({rec} by default)" in text
    assert f"{(c['AR_MAX_PACKET_OFF'] - c['AR_L2L4_LEN']) // rec} records of {elems} elements" in text
    assert f"exactly {c['AR_HDR_LEN'] + c['AR_JOIN_PAYLOAD']} bytes" in text
    assert f"ACK is exactly {c['AR_HDR_LEN']}" in text


def test_every_type_and_detail_has_its_entry(text):
    """Each AR_TYPE_* and AR_DETAIL_* is described in its list under its own name."""
    c = _c_defines()
    for prefix, title in (("AR_TYPE_", "### Types"), ("AR_DETAIL_", "### STATUS details"), ("AR_OP_", "### Ops")):
        block = text.split(title, 1)[1].split("\n#", 1)[0]
        items = re.findall(r"^- `(AR_[A-Z0-9_]+)` = ", block, re.M)
        assert sorted(items) == sorted(k for k in c if k.startswith(prefix) and not k.endswith("__COUNT")), title


def test_counter_table_lists_every_counter_in_order(text):
    c = _c_defines()
    want = [k[len("AR_STAT_"):].lower() for k, _ in sorted(
        ((k, v) for k, v in c.items() if k.startswith("AR_STAT_") and not k.endswith("__COUNT")),
        key=lambda kv: kv[1])]
    assert len(want) == c["AR_STAT__COUNT"]
    got = re.findall(r"^\| `([a-z_]+)` \|", _section(text, "Counters"), re.M)
    assert got == want
    assert got == proto.STATS
