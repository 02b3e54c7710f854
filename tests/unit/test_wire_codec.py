"""The vectorised codec: byte-for-byte equal to the scapy layer, round-trips, no per-datagram or
per-element Python loop, and refuses values that would wrap silently."""
from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nicoffload import codec, proto
from nicoffload.errors import InputError, ProtocolError
from packets.layers import AllReduce

CODES = {name: code for name, _, code in proto.FIELDS}


def _range(code: str) -> tuple[int, int]:
    bits = 8 * struct.calcsize("!" + code)
    return (-(1 << bits - 1), (1 << bits - 1) - 1) if code.islower() else (0, (1 << bits) - 1)


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
        lo, hi = _range(code)
        if name == "count":
            hi = elems
        if draw(st.booleans()):
            fields[name] = draw(st.integers(lo, hi))
        else:
            fields[name] = np.array(draw(st.lists(st.integers(lo, hi), min_size=k, max_size=k)), dtype=np.int64)
    return blocks, fields


def _row(fields: dict, i: int) -> dict:
    return {n: int(v[i]) if np.ndim(v) else int(v) for n, v in fields.items()}


@settings(max_examples=150, deadline=None)
@given(batches())
def test_encode_equals_scapy_and_decodes_back(batch):
    blocks, fields = batch
    k, elems = blocks.shape
    buf = codec.encode_blocks(blocks, **fields)
    assert isinstance(buf, bytearray)
    assert len(buf) == k * codec.datagram_size(elems)
    want = b"".join(bytes(AllReduce(**_row(fields, i)) / blocks[i].astype("<i4").tobytes()) for i in range(k))
    assert bytes(buf) == want

    dec = codec.decode_datagrams(bytes(buf), k, elems)
    for name in codec.FIELD_NAMES:
        assert dec.fields[name].tolist() == [_row(fields, i)[name] for i in range(k)], name
        assert dec.fields[name].dtype.isnative
    assert dec.payload.shape == (k, elems)
    np.testing.assert_array_equal(dec.payload, blocks)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_defaults_match_scapys_computed_fields(batch):
    """magic and version default to the header's values, count to elems, like the layer's post_build."""
    blocks, fields = batch
    for name in ("magic", "version", "count"):
        fields.pop(name)
    k, elems = blocks.shape
    buf = codec.encode_blocks(blocks, **fields)
    want = b"".join(bytes(AllReduce(**_row(fields, i)) / blocks[i].astype("<i4").tobytes()) for i in range(k))
    assert bytes(buf) == want


def test_header_dtype_offsets_are_the_c_headers():
    dt = codec.header_dtype()
    assert dt.itemsize == proto.HDR_LEN == proto.C["AR_HDR_LEN"]
    for name, (fdt, off) in ((n, dt.fields[n][:2]) for n in dt.names):
        assert off == proto.C[f"AR_OFF_{name.upper()}"], name
        assert fdt.itemsize == struct.calcsize("!" + CODES[name])
        assert fdt.byteorder in (">", "|"), f"{name} must be big endian"
    dd = codec.datagram_dtype(256)
    assert dd.itemsize == codec.datagram_size(256) == proto.HDR_LEN + 1024
    assert dd.fields["payload"][1] == proto.HDR_LEN
    assert dd.fields["payload"][0].base == np.dtype("<i4")
    assert codec.datagram_dtype(0) == dt


def test_nulls_and_out_buffer():
    buf = codec.encode_nulls(3, rank=1, job=2, slot=[0, 1, 2], set=1, block=[7, 8, 9], mask=3, exp=-4)
    assert len(buf) == 3 * proto.HDR_LEN
    assert bytes(buf[:32]) == bytes(AllReduce(rank=1, job=2, slot=0, set=1, block=7, mask=3, exp=-4, count=0))
    out = bytearray(b"\xaa" * (3 * proto.HDR_LEN + 5))
    view = codec.encode_nulls(3, rank=1, job=2, slot=[0, 1, 2], set=1, block=[7, 8, 9], mask=3, exp=-4, out=out)
    assert isinstance(view, memoryview) and bytes(view) == bytes(buf)
    assert out[-5:] == b"\xaa" * 5  # nothing written past the datagrams
    np_out = np.zeros(3 * proto.HDR_LEN, dtype=np.uint8)
    codec.encode_nulls(3, rank=1, job=2, slot=[0, 1, 2], set=1, block=[7, 8, 9], mask=3, exp=-4, out=np_out)
    assert np_out.tobytes() == bytes(buf)


def test_decode_all_and_views():
    blocks = np.arange(12, dtype=np.int32).reshape(3, 4)
    buf = codec.encode_blocks(blocks, rank=0, job=1, slot=0, set=0, block=[0, 1, 2], mask=1)
    dec = codec.decode_datagrams(buf, None, 4)
    assert dec.fields["block"].tolist() == [0, 1, 2]
    assert dec.fields["next_nz"].tolist() == [codec.NEXT_NZ_NONE] * 3
    assert dec.fields["type"].tolist() == [proto.TYPE_CONTRIB] * 3
    assert np.shares_memory(dec.payload, np.frombuffer(buf, dtype=np.uint8))  # zero copy
    assert codec.decode_datagrams(buf, 2, 4).payload.shape == (2, 4)
    with pytest.raises(ProtocolError):
        codec.decode_datagrams(buf[:-1], None, 4)
    with pytest.raises(ProtocolError):
        codec.decode_datagrams(buf, 4, 4)


@pytest.mark.parametrize("over,match", [
    (dict(rank=70000), "rank"),
    (dict(set=-1), "set"),
    (dict(slot=2**32), "slot"),
    (dict(exp=40000), "exp"),
    (dict(count=5), "count"),
    (dict(block=[1, 2, 3]), "shape"),
    (dict(mask=1.5), "integer"),
])
def test_rejects_values_that_would_wrap(over, match):
    fields = dict(rank=0, job=1, slot=0, set=0, block=[0, 1], mask=1)
    fields.update(over)
    with pytest.raises(InputError, match=match):
        codec.encode_blocks(np.zeros((2, 4), np.int32), **fields)


@pytest.mark.parametrize("blocks", [np.zeros((2, 4), np.int64), np.zeros((2, 4), np.float32),
                                    np.zeros((2, 4), np.uint32), np.zeros(8, np.int32)])
def test_rejects_blocks_that_are_not_2d_int32(blocks):
    with pytest.raises(InputError):
        codec.encode_blocks(blocks, rank=0, job=1, slot=0, set=0, block=0, mask=1)


def test_rejects_small_or_readonly_out():
    blocks = np.zeros((2, 4), np.int32)
    with pytest.raises(InputError, match="writable"):
        codec.encode_blocks(blocks, rank=0, job=1, slot=0, set=0, block=0, mask=1, out=bytearray(10))
    with pytest.raises((InputError, TypeError)):
        codec.encode_blocks(blocks, rank=0, job=1, slot=0, set=0, block=0, mask=1, out=bytes(200))


def _lines_executed_in_codec(fn) -> int:
    """Python line events inside nicoffload/codec.py while ``fn`` runs."""
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
        kw = dict(rank=1, job=1, slot=np.arange(k) % 7, set=np.arange(k) % 2, block=np.arange(k),
                  mask=3, next_nz=np.arange(k) + 1, count=elems, exp=-3)
        return lambda: codec.decode_datagrams(codec.encode_blocks(blocks, **kw), k, elems)

    small, large = _lines_executed_in_codec(work(1)), _lines_executed_in_codec(work(2000))
    assert small == large, f"{small} Python lines for 1 datagram, {large} for 2000"
