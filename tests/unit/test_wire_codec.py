"""The vectorised codec: golden bytes, byte-for-byte equal to the scapy layer, round-trips, no
per-datagram or per-element Python loop, and refuses values that would wrap silently."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nicoffload.errors import InputError, ProtocolError
from nicoffload.packets.layers import AllReduce
from nicoffload.wire import codec, proto

CODES = {name: code for name, _, code in proto.FIELDS}
#: wire range of each struct code, written out (not derived from numpy or the codec)
RANGES = {"B": (0, 0xFF), "H": (0, 0xFFFF), "I": (0, 0xFFFFFFFF), "h": (-0x8000, 0x7FFF),
          "Q": (0, 0xFFFFFFFFFFFFFFFF)}
#: the smallest valid record header fields (encode_blocks' required keywords)
BASE = dict(rank=0, job=1, slot=0, set=0, round=0, mask=1)


@st.composite
def batches(draw):
    """K datagrams of ``elems`` int32 with random header columns (scalars or per-datagram arrays)."""
    k = draw(st.integers(1, 6))
    elems = draw(st.integers(0, 12))
    blocks = np.array(
        draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=k * elems, max_size=k * elems)),
        dtype=np.int32,
    ).reshape(k, elems)
    fields = {}
    for name, code in CODES.items():
        lo, hi = RANGES[code]
        if name == "count":
            hi = elems
        if draw(st.booleans()):
            fields[name] = draw(st.integers(lo, hi))
        else:
            dt = np.uint64 if code == "Q" else np.int64
            fields[name] = np.array(draw(st.lists(st.integers(lo, hi), min_size=k, max_size=k)), dtype=dt)
    return blocks, fields


def _row(fields: dict, i: int) -> dict:
    return {n: int(v[i]) if np.ndim(v) else int(v) for n, v in fields.items()}


# --- golden bytes (derived by hand from the header's table) -----------------------------------

# An ACK (header only, elems 0): rank 3 of job 1 holds every result below round 0x12345678.
#   magic 4e58 | version 03 | type 06 (ACK) | flags 00 | set 00 | rank 0003 | job 00000001
#   epoch deadbeef | slot 00000000 | round 00000000 | mask 00000008 | ack 12345678
#   count 0000 | exp 0000 | op 00 | detail 00 | pad 0000 | key 0123456789abcdef (big endian)
GOLDEN_ACK = ("4e58030600000003" "00000001" "deadbeef" "00000000" "00000000" "00000008" "12345678"
              "0000" "0000" "00" "00" "0000" "0123456789abcdef")
# A batch of two RESULT records of 2 elements (op SUM64, exp -1), back to back:
#   record 0: set 00, rank ffff, job 00000007, epoch 00000001, slot 00000003, round 00000003,
#             mask 00000003, ack 0, count 0002, exp ffff, op 01, key fedcba9876543210
#             | payload [1, 2]
#   record 1: set 01, slot 00000004, round 0000000c (12), count 0001, rest as record 0
#             | payload [-2, 0]
GOLDEN_BATCH = (
    "4e58030200" "00" "ffff" "00000007" "00000001" "00000003" "00000003" "00000003" "00000000"
    "0002" "ffff" "01" "00" "0000" "fedcba9876543210" "01000000" "02000000"
    "4e58030200" "01" "ffff" "00000007" "00000001" "00000004" "0000000c" "00000003" "00000000"
    "0001" "ffff" "01" "00" "0000" "fedcba9876543210" "feffffff" "00000000"
)


def test_golden_ack():
    buf = codec.encode_blocks(np.zeros((1, 0), np.int32), rank=3, job=1, epoch=0xDEADBEEF, slot=0, set=0,
                              round=0, mask=8, ack=0x12345678, key=0x0123456789ABCDEF, type=proto.TYPE_ACK)
    assert bytes(buf).hex() == GOLDEN_ACK
    assert len(buf) == proto.HDR_LEN == 48


def test_golden_batch():
    buf = codec.encode_blocks(
        np.array([[1, 2], [-2, 0]], np.int32), rank=proto.RANK_AGG, job=7, epoch=1, slot=[3, 4], set=[0, 1],
        round=[3, 12], mask=3, count=[2, 1], exp=-1, op=proto.OP_SUM64, key=0xFEDCBA9876543210,
        type=proto.TYPE_RESULT)
    assert bytes(buf).hex() == GOLDEN_BATCH
    dec = codec.decode_datagrams(bytes.fromhex(GOLDEN_BATCH), None, 2)
    assert dec.fields["round"].tolist() == [3, 12] and dec.fields["exp"].tolist() == [-1, -1]
    assert dec.fields["rank"].tolist() == [0xFFFF] * 2 and dec.fields["count"].tolist() == [2, 1]
    assert dec.fields["key"].tolist() == [0xFEDCBA9876543210] * 2
    assert dec.payload.tolist() == [[1, 2], [-2, 0]]


# --- the codec against the scapy layer, and back -----------------------------------------------


@settings(max_examples=150, deadline=None)
@given(batches())
def test_encode_equals_scapy_and_decodes_back(batch):
    blocks, fields = batch
    k, elems = blocks.shape
    buf = codec.encode_blocks(blocks, **fields)
    assert isinstance(buf, bytearray)
    assert len(buf) == k * codec.datagram_size(elems) == k * proto.record_size(elems)
    want = b"".join(bytes(AllReduce(**_row(fields, i)) / blocks[i].astype("<i4").tobytes()) for i in range(k))
    assert bytes(buf) == want

    dec = codec.decode_datagrams(bytes(buf), k, elems)
    assert set(dec.fields) == set(CODES)
    for name in codec.FIELD_NAMES:
        assert dec.fields[name].tolist() == [_row(fields, i)[name] for i in range(k)], name
        assert dec.fields[name].dtype.isnative
    assert dec.payload.shape == (k, elems)
    np.testing.assert_array_equal(dec.payload, blocks)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_defaults_match_scapys_computed_fields(batch):
    """magic and version default to the header's values, count to elems, like the layer's post_build;
    the optional fields (epoch, ack, exp, op, flags, detail, pad, type) default like the layer's."""
    blocks, fields = batch
    for name in ("magic", "version", "count", "epoch", "ack", "exp", "op", "flags", "detail", "pad", "type"):
        fields.pop(name)
    k, elems = blocks.shape
    buf = codec.encode_blocks(blocks, **fields)
    want = b"".join(bytes(AllReduce(**_row(fields, i)) / blocks[i].astype("<i4").tobytes()) for i in range(k))
    assert bytes(buf) == want
    dec = codec.decode_datagrams(buf, k, elems)
    assert dec.fields["count"].tolist() == [elems] * k
    assert dec.fields["type"].tolist() == [proto.TYPE_CONTRIB] * k


def test_datagram_dtype():
    """The header's layout is checked against C in test_wire_header.py; here: header + payload."""
    dd = codec.datagram_dtype(256)
    assert dd.itemsize == codec.datagram_size(256) == proto.HDR_LEN + 1024
    assert dd.fields["payload"][1] == proto.HDR_LEN
    assert dd.fields["payload"][0].base == np.dtype("<i4")
    assert codec.datagram_dtype(0) == codec.header_dtype()
    with pytest.raises(InputError):
        codec.datagram_dtype(-1)


def test_out_buffer():
    blocks = np.arange(12, dtype=np.int32).reshape(3, 4)
    kw = dict(rank=1, job=2, epoch=5, slot=[0, 1, 2], set=1, round=[7, 8, 9], mask=3, ack=7, exp=-4)
    buf = codec.encode_blocks(blocks, **kw)
    size = proto.HDR_LEN + 16
    assert len(buf) == 3 * size
    assert bytes(buf[:size]) == bytes(AllReduce(rank=1, job=2, epoch=5, slot=0, set=1, round=7, mask=3, ack=7,
                                                exp=-4) / np.arange(4, dtype="<i4").tobytes())
    out = bytearray(b"\xaa" * (3 * size + 5))
    view = codec.encode_blocks(blocks, **kw, out=out)
    assert isinstance(view, memoryview) and bytes(view) == bytes(buf) and view.nbytes == 3 * size
    assert out[-5:] == b"\xaa" * 5  # nothing written past the datagrams
    np_out = np.zeros(3 * size, dtype=np.uint8)
    codec.encode_blocks(blocks, **kw, out=np_out)
    assert np_out.tobytes() == bytes(buf)
    # header-only records (ACK) into an offset of a larger buffer
    end = 10 + 2 * proto.HDR_LEN
    big = bytearray(end + 10)
    codec.encode_blocks(np.zeros((2, 0), np.int32), **{**kw, "slot": 0, "round": 0}, type=proto.TYPE_ACK,
                        out=memoryview(big)[10:])
    assert big[:10] == bytes(10) and big[end:] == bytes(10)
    assert codec.decode_datagrams(big[10:end], None, 0).fields["ack"].tolist() == [7, 7]


def test_decode_all_and_views():
    blocks = np.arange(12, dtype=np.int32).reshape(3, 4)
    buf = codec.encode_blocks(blocks, rank=0, job=1, epoch=4, slot=0, set=0, round=[0, 1, 2], mask=1,
                              op=proto.OP_OR, detail=proto.DETAIL["gone"])
    dec = codec.decode_datagrams(buf, None, 4)
    assert dec.fields["round"].tolist() == [0, 1, 2]
    assert dec.fields["epoch"].tolist() == [4] * 3
    assert dec.fields["op"].tolist() == [proto.OP_OR] * 3
    assert dec.fields["detail"].tolist() == [proto.DETAIL["gone"]] * 3
    assert dec.fields["type"].tolist() == [proto.TYPE_CONTRIB] * 3
    assert dec.fields["exp"].dtype == np.int16 and dec.fields["ack"].dtype == np.uint32
    assert np.shares_memory(dec.payload, np.frombuffer(buf, dtype=np.uint8))  # zero copy
    assert codec.decode_datagrams(buf, 2, 4).payload.shape == (2, 4)
    # a decoded batch of header-only records has an empty payload of the right shape
    acks = codec.encode_blocks(np.zeros((2, 0), np.int32), **BASE, type=proto.TYPE_ACK)
    assert codec.decode_datagrams(acks, None, 0).payload.shape == (2, 0)
    with pytest.raises(ProtocolError):
        codec.decode_datagrams(buf[:-1], None, 4)
    with pytest.raises(ProtocolError):
        codec.decode_datagrams(buf, 4, 4)


# --- range checks ------------------------------------------------------------------------------


def _encode(**over):
    fields = dict(BASE)
    fields.update(over)
    return codec.encode_blocks(np.zeros((2, 4), np.int32), **fields)


@pytest.mark.parametrize("name", list(CODES))
def test_rejects_values_that_would_wrap(name):
    """Every field takes its whole wire range and refuses one past either end, as a scalar and
    inside an array (a value that would wrap must not be written)."""
    lo, hi = RANGES[CODES[name]]
    if name == "count":
        hi = 4  # elems of the blocks: a count above it is refused too
    for ok in (lo, hi):
        dec = codec.decode_datagrams(_encode(**{name: ok}), 2, 4)
        assert dec.fields[name].tolist() == [ok, ok], (name, ok)
    for bad in (lo - 1, hi + 1):
        with pytest.raises(InputError, match=name):
            _encode(**{name: bad})
        with pytest.raises(InputError, match=name):  # 2**64 fits no integer dtype: an object array
            _encode(**{name: np.array([lo, bad], dtype=None if CODES[name] == "Q" else np.int64)})


@pytest.mark.parametrize("over,match", [
    (dict(round=[1, 2, 3]), "shape"),
    (dict(round=[[1, 2]]), "shape"),
    (dict(mask=1.5), "integer"),
    (dict(slot=np.array([0.0, 1.0])), "integer"),
    (dict(count=5), "count"),
])
def test_rejects_bad_columns(over, match):
    with pytest.raises(InputError, match=match):
        _encode(**over)


@pytest.mark.parametrize("blocks", [np.zeros((2, 4), np.int64), np.zeros((2, 4), np.float32),
                                    np.zeros((2, 4), np.uint32), np.zeros(8, np.int32)])
def test_rejects_blocks_that_are_not_2d_int32(blocks):
    with pytest.raises(InputError):
        codec.encode_blocks(blocks, **BASE)


def test_rejects_small_or_readonly_out():
    blocks = np.zeros((2, 4), np.int32)
    with pytest.raises(InputError, match="writable"):
        codec.encode_blocks(blocks, **BASE, out=bytearray(2 * (proto.HDR_LEN + 16) - 1))
    with pytest.raises((InputError, TypeError)):
        codec.encode_blocks(blocks, **BASE, out=bytes(200))


# --- no Python loop per datagram or element ------------------------------------------------------


def _lines_executed_in_codec(fn) -> int:
    """Python line events inside nicoffload/wire/codec.py while ``fn`` runs."""
    n = 0
    target = codec.__file__

    def tracer(frame, event, arg):
        nonlocal n
        if frame.f_code.co_filename != target:
            return None
        if event == "line":
            n += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
    return n


@pytest.mark.parametrize("elems", [0, 256])
def test_no_python_loop_per_datagram_or_element(elems):
    """The Python work of encode/decode does not grow with the number of datagrams or elements."""

    def work(k: int):
        blocks = np.ones((k, elems), dtype=np.int32)
        kw = dict(rank=1, job=1, epoch=9, slot=np.arange(k) % 7, set=np.arange(k) % 2, round=np.arange(k),
                  mask=3, ack=np.arange(k) // 2, count=elems, exp=-3, op=proto.OP_SUM64)
        return lambda: codec.decode_datagrams(codec.encode_blocks(blocks, **kw), k, elems)

    small, large = _lines_executed_in_codec(work(1)), _lines_executed_in_codec(work(2000))
    assert small == large, f"{small} Python lines for 1 datagram, {large} for 2000"
