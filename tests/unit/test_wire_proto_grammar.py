"""proto.parse_header accepts exactly the header grammar: blank lines, comments and
``#define AR_NAME <int>`` inside the shared block; anything else there is an error."""
from __future__ import annotations

import pytest

from nicoffload.wire import proto


def block(*lines: str) -> str:
    return "\n".join(["/* before */", "int ignored_outside;", "/* --- shared: begin --- */", *lines,
                      "/* --- shared: end --- */", "#define NOT_PARSED(x) x", ""])


def test_accepts_the_grammar():
    got = proto.parse_header(block(
        "",
        "/* a comment */",
        "// another comment",
        "#define AR_A 1",
        "#define AR_HEX 0xBEEF",
        "#define AR_UPPER_X 0X10",
        "#define AR_NEG -3",
        "#define AR_NEG_HEX -0x10",
        "#define AR_PAREN (42)",
        "#define AR_PAREN_NEG ( -7 )",
        "  #define AR_INDENTED\t5  ",
        "#define AR_9_DIGITS 9",
    ))
    assert got == {"AR_A": 1, "AR_HEX": 0xBEEF, "AR_UPPER_X": 16, "AR_NEG": -3, "AR_NEG_HEX": -16,
                   "AR_PAREN": 42, "AR_PAREN_NEG": -7, "AR_INDENTED": 5, "AR_9_DIGITS": 9}


@pytest.mark.parametrize("line", [
    "#define AR_X 1 + 2",          # expression
    "#define AR_X (1 << 3)",       # expression in parentheses
    "#define AR_X",                # no value
    "#define AR_X 1UL",            # integer suffix
    "#define AR_X 1.5",            # not an integer
    "#define AR_X 0x",             # incomplete hex
    "#define AR_X 0xG1",           # bad hex digit
    "#define AR_X AR_Y",           # reference to another name
    "#define AR_X 1 /* trailing comment */",
    "#define AR_X 1 // trailing comment",
    "#define AR_X(a) a",           # function-like macro
    "#define FOO 1",               # name without the AR_ prefix
    "#define ar_x 1",              # lower case
    "#define AR_x 1",              # lower case after the prefix
    "# define AR_X 1",             # space after '#'
    "#undef AR_X",
    "#if 1",
    "#include <linux/types.h>",
    "int x;",
    "struct ar_hdr { int a; };",
    "/* a comment that does not end on its line",
    "*/",
    "AR_X = 1",
])
def test_rejects_lines_outside_the_grammar(line):
    with pytest.raises(ValueError, match="not a plain"):
        proto.parse_header(block("#define AR_OK 1", line))


def test_rejects_duplicates():
    with pytest.raises(ValueError, match="defined twice"):
        proto.parse_header(block("#define AR_X 1", "#define AR_X 2"))


@pytest.mark.parametrize("text", ["", "#define AR_X 1\n", block()])
def test_rejects_missing_or_empty_block(text):
    with pytest.raises(ValueError, match="no shared block"):
        proto.parse_header(text)


def test_error_names_the_line():
    with pytest.raises(ValueError, match=r":5: .*'int x;'"):
        proto.parse_header(block("#define AR_OK 1", "int x;"))


def test_the_real_header_is_consistent():
    c = proto.C
    assert c["AR_VERSION"] == 3 and c["AR_HDR_LEN"] == 48
    offsets = [off for _, off, _ in proto.FIELDS]
    assert offsets == sorted(set(offsets))
    assert [proto.STAT[n] for n in proto.STATS] == list(range(len(proto.STATS)))
    assert len(proto.STATS) == c["AR_STAT__COUNT"]
    assert {f"bad_{r}" for r in ("truncated", "magic", "version", "type", "flags", "job", "rank", "slot",
                                 "set", "len", "mask", "src", "op", "mixed", "key")} <= set(proto.STATS)
    assert sorted(proto.OPS) == list(range(c["AR_OP__COUNT"]))
    assert 0 not in proto.DETAILS  # 0 means "no detail" (a RESULT, a JOINED)
    assert proto.record_size(proto.DEFAULT_ELEMS) == c["AR_HDR_LEN"] + 4 * c["AR_DEFAULT_ELEMS"]
    assert proto.max_records(proto.DEFAULT_ELEMS) * proto.record_size(proto.DEFAULT_ELEMS) \
        <= c["AR_MAX_PACKET_OFF"] - c["AR_L2L4_LEN"]


@pytest.mark.parametrize("values", [[0, 2], [1, 2], [0, 1, 1]])
def test_counter_slots_must_be_dense(monkeypatch, values):
    """AR_STAT_* (and the other counter families) must number 0..__COUNT-1 without gaps."""
    fake = {f"AR_STAT_N{i}": v for i, v in enumerate(values)}
    fake["AR_STAT__COUNT"] = len(values)
    monkeypatch.setattr(proto, "C", fake)
    with pytest.raises(ValueError, match="without gaps"):
        proto._named("STAT")


def test_counter_names_follow_their_values(monkeypatch):
    monkeypatch.setattr(proto, "C", {"AR_STAT_ZETA": 0, "AR_STAT_ALPHA": 1, "AR_STAT__COUNT": 2})
    assert proto._named("STAT") == ["zeta", "alpha"]
