"""The one place the record header's layout is checked on the Python side: every Python view of
it (proto.FIELDS and HDR_STRUCT, the codec's numpy dtype, the scapy layer) against the C
compiler's view of ``struct ar_hdr``, the struct the XDP program reads. The C side ties that
struct to the shared AR_OFF_* constants with _Static_asserts (xdp/record.h), checked whenever the
program or the AF_XDP engine is compiled; here the host's C compiler lays the struct out from its
own text."""
from __future__ import annotations

import re
import struct
import subprocess

import pytest
from wirecheck import c_compiler

from nicoffload.packets.layers import AllReduce
from nicoffload.wire import codec, proto

TYPES = "typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32;\n" \
        "typedef signed short s16; typedef unsigned long long u64;\n"


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    """{"size": sizeof, field: (offset, size, signed)} of struct ar_hdr as cc lays it out."""
    cc = c_compiler()
    text = (proto.xdp_dir() / "record.h").read_text()
    m = re.search(r"^struct ar_hdr \{\n(.*?)^\} __attribute__\(\(packed\)\);", text, re.S | re.M)
    assert m, "xdp/record.h: struct ar_hdr not found"
    names = re.findall(r"^\s+\w+ (\w+);", m.group(1), re.M)
    prints = "\n".join(
        f'    printf("{n} %zu %zu %d\\n", offsetof(struct ar_hdr, {n}), sizeof(h.{n}), '
        f'(int)((__typeof__(h.{n}))-1 < 0));' for n in names)
    d = tmp_path_factory.mktemp("hdr")
    src = d / "hdr.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n" + TYPES + m.group(0) + "\n"
                   "int main(void) {\n    struct ar_hdr h;\n    (void)h;\n"
                   '    printf("size %zu 0 0\\n", sizeof(struct ar_hdr));\n' + prints + "\n    return 0;\n}\n")
    subprocess.run([cc, "-o", d / "hdr", src], check=True)
    out = subprocess.run([d / "hdr"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    layout = {n: (int(o), int(s), bool(int(sg))) for n, o, s, sg in rows}
    layout["size"] = layout["size"][0]
    return layout


def fields_of(layout: dict) -> list[tuple[str, int, int, bool]]:
    return sorted(((n, *v) for n, v in layout.items() if n != "size"), key=lambda r: r[1])


def test_the_c_struct_is_48_bytes_without_gaps(c_layout):
    assert c_layout["size"] == proto.HDR_LEN == 48
    end = 0
    for name, off, size, _ in fields_of(c_layout):
        assert off == end, f"gap or overlap before {name}"
        end = off + size
    assert end == c_layout["size"]


def test_proto_fields_are_the_c_struct(c_layout):
    py = [(n, off, struct.calcsize("!" + code), code.islower()) for n, off, code in proto.FIELDS]
    assert py == fields_of(c_layout)
    assert struct.calcsize(proto.HDR_STRUCT) == c_layout["size"]


def test_codec_dtype_is_the_c_struct(c_layout):
    dt = codec.header_dtype()
    got = sorted(((n, dt.fields[n][1], dt.fields[n][0].itemsize, dt.fields[n][0].kind == "i") for n in dt.names),
                 key=lambda r: r[1])
    assert got == fields_of(c_layout)
    assert dt.itemsize == c_layout["size"]
    assert all(dt.fields[n][0].byteorder in (">", "|") for n in dt.names), "wire fields are big endian"


def test_scapy_layer_is_the_c_struct(c_layout):
    off, got = 0, []
    for fld in AllReduce.fields_desc:
        got.append((fld.name, off, int(fld.sz)))
        off += int(fld.sz)
    assert got == [(n, o, s) for n, o, s, _ in fields_of(c_layout)]
    assert len(bytes(AllReduce())) == c_layout["size"]


@pytest.mark.parametrize("name", [n for n, _, _ in proto.FIELDS])
def test_each_layer_field_lands_where_c_reads_it(c_layout, name):
    """Set one field to all ones in the scapy layer: the ones are exactly the bytes C reads."""
    off, size, signed = c_layout[name]
    zero = {f: 0 for f, _, _ in proto.FIELDS}
    zero[name] = -1 if signed else (1 << 8 * size) - 1
    raw = bytes(AllReduce(**zero))
    assert [i for i, b in enumerate(raw) if b] == list(range(off, off + size))
