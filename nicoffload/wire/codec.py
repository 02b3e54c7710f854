"""Vectorised encoder/decoder of AllReduce datagrams (UDP payloads) for the worker hot path.

A batch of K datagrams is one numpy structured array: each record is the 48-byte header (big-endian
fields at the offsets of ``nicoffload.wire.proto.FIELDS``, i.e. of the C header) followed by ``elems``
little-endian int32. Encoding fills the header columns from per-block arrays (or scalars) and the
payload column from a 2-D int32 array, then returns the records as one contiguous buffer: exactly
what a UDP socket with ``UDP_SEGMENT = datagram_size(elems)`` sends in one call. There is no Python
loop per element nor per datagram: the only loop is over the 18 header fields.

Records without a payload (ACK) are a batch with ``elems = 0`` (a 2-D array of shape (K, 0));
every record of a batch has one size.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from nicoffload.errors import InputError, ProtocolError
from nicoffload.wire import proto

#: header field names in wire order
FIELD_NAMES: tuple[str, ...] = tuple(name for name, _, _ in sorted(proto.FIELDS, key=lambda f: f[1]))

_PAYLOAD_DTYPE = np.dtype("<i4")


def _field_dtype(code: str) -> np.dtype:
    """Big-endian numpy dtype for a struct code of proto.FIELDS (same size as struct's '!code')."""
    dt = np.dtype(">" + code)
    if dt.itemsize != struct.calcsize("!" + code) or dt.kind not in "iu":
        raise AssertionError(f"struct code {code!r} has no matching fixed-size numpy integer dtype")
    return dt


def _check_layout() -> None:
    """FIELDS must tile [0, HDR_LEN) exactly (so np.empty never leaks uninitialised bytes)."""
    pos = 0
    for name, off, code in sorted(proto.FIELDS, key=lambda f: f[1]):
        if off != pos:
            raise AssertionError(f"header field {name} at offset {off}, expected {pos} (gap or overlap)")
        pos += struct.calcsize("!" + code)
    if pos != proto.HDR_LEN:
        raise AssertionError(f"header fields end at {pos}, AR_HDR_LEN is {proto.HDR_LEN}")


_check_layout()


def header_dtype() -> np.dtype:
    """Structured dtype of the 48-byte header: big-endian fields at the C header's offsets."""
    return np.dtype(
        {
            "names": [name for name, _, _ in proto.FIELDS],
            "formats": [_field_dtype(code) for _, _, code in proto.FIELDS],
            "offsets": [off for _, off, _ in proto.FIELDS],
            "itemsize": proto.HDR_LEN,
        }
    )


def datagram_dtype(elems: int) -> np.dtype:
    """Structured dtype of one datagram: the header, then ``payload`` = ``elems`` x '<i4'.

    With ``elems == 0`` this is the header alone (an ACK record has no payload).
    """
    if elems < 0:
        raise InputError(f"elems must be >= 0, got {elems}")
    if elems == 0:
        return header_dtype()
    return np.dtype(
        {
            "names": [name for name, _, _ in proto.FIELDS] + ["payload"],
            "formats": [_field_dtype(code) for _, _, code in proto.FIELDS] + [(_PAYLOAD_DTYPE, (elems,))],
            "offsets": [off for _, off, _ in proto.FIELDS] + [proto.HDR_LEN],
            "itemsize": proto.HDR_LEN + 4 * elems,
        }
    )


def datagram_size(elems: int) -> int:
    """Bytes of one datagram (UDP payload) carrying ``elems`` int32: the UDP_SEGMENT size."""
    return proto.HDR_LEN + 4 * elems


def _column(name: str, value, k: int, dt: np.dtype) -> np.ndarray:
    """Validate one header column (scalar or length-k array) against its wire type's range."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iub":
        raise InputError(f"header field {name!r} must be integer, got dtype {arr.dtype}")
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != k):
        raise InputError(f"header field {name!r} must be a scalar or have shape ({k},), got {arr.shape}")
    if arr.size:
        info = np.iinfo(dt)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise InputError(
                f"header field {name!r} out of range for its {dt.itemsize}-byte wire type "
                f"[{info.min}, {info.max}]: got values in [{lo}, {hi}]"
            )
    return arr


def encode_blocks(
    blocks: np.ndarray,
    *,
    rank,
    job,
    slot,
    set,  # noqa: A002 - wire field name
    round,  # noqa: A002 - wire field name
    mask,
    epoch=0,
    ack=0,
    count=None,
    exp=0,
    op=proto.OP_SUM,
    flags=0,
    detail=0,
    pad=0,
    key=0,
    type=proto.TYPE_CONTRIB,  # noqa: A002 - wire field name
    magic=proto.MAGIC,
    version=proto.VERSION,
    out=None,
) -> bytearray | memoryview:
    """Encode K datagrams from ``blocks`` (int32, shape (K, elems)) into one contiguous buffer.

    Every header argument is a scalar (same for all K) or an integer array of shape (K,); ``key``
    is the job's 64-bit key (0: a job without one).
    ``count`` defaults to ``elems`` (full blocks); it must not exceed ``elems``. Values are checked
    against their wire type's range (no silent wrap). Returns a new ``bytearray`` of
    K * datagram_size(elems) bytes; with ``out`` (a writable buffer at least that long) the
    datagrams are written there instead and a memoryview of the written bytes is returned.
    """
    blocks = np.asarray(blocks)
    if blocks.ndim != 2:
        raise InputError(f"blocks must be 2-D (K, elems), got shape {blocks.shape}")
    if blocks.dtype.kind != "i" or blocks.dtype.itemsize != 4:
        raise InputError(f"blocks must be int32, got dtype {blocks.dtype} (quantize first)")
    k, elems = blocks.shape
    dt = datagram_dtype(elems)
    if count is None:
        count = elems
    values = {
        "magic": magic, "version": version, "type": type, "flags": flags, "set": set, "rank": rank,
        "job": job, "epoch": epoch, "slot": slot, "round": round, "mask": mask, "ack": ack,
        "count": count, "exp": exp, "op": op, "detail": detail, "pad": pad, "key": key,
    }
    missing = [n for n in FIELD_NAMES if n not in values]
    if missing:  # a field added to the C header must be added here too
        raise AssertionError(f"encode_blocks does not know header fields {missing}")
    cols = {n: _column(n, values[n], k, dt.fields[n][0]) for n in FIELD_NAMES}
    # a record holds elems int32 words: elems elements, or 2 * elems in 16-bit lanes (op SUM16)
    limit = np.where(cols["op"] == proto.OP_SUM16, 2 * elems, elems)
    if cols["count"].size and (cols["count"] > limit).any():
        raise InputError(f"count {int(cols['count'].max())} exceeds the elements per datagram ({elems} words)")

    nbytes = k * dt.itemsize
    # fill the caller's (or a new) buffer in place: rec.tobytes() would copy record by record
    target = bytearray(nbytes) if out is None else out
    view = memoryview(target).cast("B")
    if view.readonly or view.nbytes < nbytes:
        raise InputError(f"out must be a writable buffer of at least {nbytes} bytes, got {view.nbytes}")
    rec = np.frombuffer(view, dtype=dt, count=k)
    for n in FIELD_NAMES:  # one vectorised assignment per header field, none per datagram
        rec[n] = cols[n]
    if elems:
        rec["payload"] = blocks
    return target if out is None else view[:nbytes]


class Decoded(NamedTuple):
    """A decoded batch: native-endian header columns and the (K, elems) int32 payload view."""

    fields: dict[str, np.ndarray]
    payload: np.ndarray


def decode_datagrams(buf, n: int | None, elems: int) -> Decoded:
    """Decode ``n`` datagrams of ``datagram_size(elems)`` bytes each from the start of ``buf``.

    ``n = None`` takes every datagram in ``buf`` (its length must then be a multiple of the size).
    Header columns are native-endian copies (uint8/16/32, int16 for ``exp``); ``payload`` is a
    zero-copy view into ``buf`` of shape (n, elems), dtype '<i4' (read-only if ``buf`` is).
    """
    dt = datagram_dtype(elems)
    view = memoryview(buf).cast("B")
    if n is None:
        if view.nbytes % dt.itemsize:
            raise ProtocolError(
                f"buffer of {view.nbytes} bytes is not a whole number of {dt.itemsize}-byte datagrams "
                f"(elems={elems})"
            )
        n = view.nbytes // dt.itemsize
    elif view.nbytes < n * dt.itemsize:
        raise ProtocolError(
            f"buffer of {view.nbytes} bytes is too short for {n} datagrams of {dt.itemsize} bytes"
        )
    rec = np.frombuffer(view, dtype=dt, count=n)
    fields = {name: rec[name].astype(rec.dtype.fields[name][0].newbyteorder("=")) for name in FIELD_NAMES}
    payload = rec["payload"] if elems else np.empty((n, 0), dtype=_PAYLOAD_DTYPE)
    return Decoded(fields, payload)
