"""The epoch handshake and ACKs, as the generators build them: a rank's JOIN with its nonce, the
JOINED the aggregator answers with (the epoch formed from every rank's nonce), and the
header-only ACK that says which rounds' results a rank holds (protocol: docs/protocol.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nicoffload.wire import proto
from nicoffload.wire.codec import encode_blocks

from .frames import AGG_IP, AGG_MAC, KEY, frame, worker_ip, worker_mac


def nonce_of(rank: int, run: int = 1) -> int:
    """A deterministic 64-bit nonce for ``rank`` in the ``run``-th process start (later runs are
    larger, as the worker's clock-based nonces are)."""
    return (run << 40) | (rank + 1)


def join_record(rank: int, workers: int, nonce: int, *, job: int = 1, retx: bool = False,
                mask: int | None = None, key: int = KEY) -> bytes:
    """A JOIN: ``rank`` of a ``workers``-rank job asks to join with ``nonce`` (u64)."""
    hdr = encode_blocks(
        np.zeros((1, proto.JOIN_PAYLOAD // 4), np.int32), rank=rank, job=job, slot=0, set=0,
        round=nonce & 0xFFFFFFFF, ack=nonce >> 32, mask=(1 << workers) - 1 if mask is None else mask,
        count=0, type=proto.TYPE_JOIN, flags=proto.FLAG_RETX if retx else 0, key=key,
    )
    return bytes(hdr)


def join_frames(workers: int, nonces: Sequence[int] | None = None, *, job: int = 1,
                ranks: Sequence[int] | None = None, retx: bool = False, key: int = KEY, **kw) -> list[bytes]:
    """JOIN frames of ``ranks`` (default: every rank) with their nonces (default :func:`nonce_of`)."""
    nonces = list(nonces) if nonces is not None else [nonce_of(r) for r in range(workers)]
    return [frame(join_record(r, workers, nonces[r], job=job, retx=retx, key=key), src_mac=worker_mac(r),
                  dst_mac=AGG_MAC, src_ip=worker_ip(r), dst_ip=AGG_IP, **kw)
            for r in (ranks if ranks is not None else range(workers))]


def joined_record(rank: int, workers: int, nonce: int, epoch: int, table: Sequence[int], *, job: int = 1,
                  flags: int = 0, key: int = KEY) -> bytes:
    """The JOINED the aggregator makes of ``rank``'s JOIN: ``epoch`` formed with every rank's nonce
    (``flags`` FLAG_ANSWER: the repeat that answers a JOIN whose JOINED was lost)."""
    tab = np.zeros(proto.MAX_WORKERS, "<u8")
    tab[:len(table)] = table
    return bytes(encode_blocks(
        tab.view("<i4").reshape(1, -1), rank=rank, job=job, epoch=epoch, slot=0, set=0, round=nonce & 0xFFFFFFFF,
        ack=nonce >> 32, mask=(1 << workers) - 1, count=0, type=proto.TYPE_JOINED, flags=flags, key=key,
    ))


def ack_frame(rank: int, ack: int, *, epoch: int, job: int = 1, key: int = KEY, **kw) -> bytes:
    """A header-only ACK: ``rank`` holds the result of every round below ``ack``."""
    rec = encode_blocks(np.zeros((1, 0), np.int32), rank=rank, job=job, epoch=epoch, slot=0, set=0, round=0,
                        mask=1 << rank, ack=ack, count=0, type=proto.TYPE_ACK, key=key)
    return frame(bytes(rec), src_mac=worker_mac(rank), dst_mac=AGG_MAC, src_ip=worker_ip(rank), dst_ip=AGG_IP, **kw)
