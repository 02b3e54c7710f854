"""docs/protocol.md agrees with the C header: the header table, every `AR_NAME` = value it quotes,
and the counter table."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from nicoffload import proto

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TYPES = {"u8": "B", "u16": "H", "u32": "I", "i16": "h"}


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def test_header_table_matches_fields(text):
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \| (\w+) \|", text, re.M)
    assert [(name, int(off), TYPES[typ]) for off, _size, name, typ in rows] == proto.FIELDS
    for off, size, name, typ in rows:
        assert int(size) == struct.calcsize("!" + TYPES[typ]), name
        assert int(off) == proto.C[f"AR_OFF_{name.upper()}"], name
    assert f"| {proto.HDR_LEN} | elems x 4 | payload |" in text


def test_quoted_constants_match_the_header(text):
    quoted = re.findall(r"`(AR_[A-Z0-9_]+)` = (-?(?:0[xX][0-9a-fA-F]+|\d+))", text)
    for name, value in quoted:
        assert proto.C[name] == int(value, 0), name
    for name in ("AR_MAGIC", "AR_VERSION", "AR_DEFAULT_PORT", "AR_HDR_LEN", "AR_L2L4_LEN", "AR_RANK_AGG",
                 "AR_FLAGS_KNOWN", "AR_DEFAULT_ELEMS"):
        assert name in dict(quoted), f"{name} is not documented"
    types = [k for k in proto.C if k.startswith(("AR_TYPE_", "AR_FLAG_"))]
    assert set(types) <= set(dict(quoted)), "every type and flag is documented"
    assert f"= {proto.max_elems_for_mtu(proto.MAX_MTU)} on native XDP" in text


def test_counter_table_lists_every_counter_in_order(text):
    section = text.split("## 10. Counters", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `([a-z_]+)` \|", section, re.M) == proto.STATS
