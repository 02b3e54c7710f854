"""Readers the unit tests share (imported by the test modules): header fields and UDP payloads
read by hand, independently of the codec, and the host's C compiler."""
from __future__ import annotations

import shutil
import socket
import struct

import pytest

from nicoffload.wire import proto

NAMES = [n for n, _, _ in proto.FIELDS]


def header_of(dgram: bytes) -> dict:
    """The header fields of a record (a datagram's first bytes), by struct.unpack."""
    return dict(zip(NAMES, struct.unpack(proto.HDR_STRUCT, bytes(dgram[:proto.HDR_LEN]))))


def udp_of(frame: bytes) -> tuple[bytes, str, int]:
    """(UDP payload, source address, source port) of an Ethernet/IPv4/UDP frame, read by hand."""
    assert frame[12:14] == b"\x08\x00" and frame[14] == 0x45 and frame[23] == 17
    ulen = int.from_bytes(frame[38:40], "big")
    return frame[42:34 + ulen], socket.inet_ntoa(frame[26:30]), int.from_bytes(frame[34:36], "big")


def c_compiler() -> str:
    """The host's C compiler (scripts/setup.sh installs gcc); skips the test when there is none."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (apt-get install gcc)")
    return cc
