"""The records one rank sends besides its data (JOIN, ACK, pulls) and the reading of the
answers to a JOIN: wire details the worker's loop should not spell out."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from nicoffload.wire import codec, proto

_ACK = slice(proto.FIELD_OFFSETS["ack"], proto.FIELD_OFFSETS["ack"] + 4)
_MASK = slice(proto.FIELD_OFFSETS["mask"], proto.FIELD_OFFSETS["mask"] + 4)
FLAGS_AT = proto.FIELD_OFFSETS["flags"]


def _be32(v: int) -> np.ndarray:
    return np.frombuffer((v & 0xFFFFFFFF).to_bytes(4, "big"), np.uint8)


class RankRecords:
    """Record headers with one rank's constant fields (rank, job, the job's key, epoch), made once
    and copied."""

    def __init__(self, rank: int, job: int, world: int, key: int = 0):
        self.rank, self.job, self.world, self.key = rank, job, world, key
        self._cache: dict = {}

    def template(self, type_: int, flags: int, epoch: int) -> np.ndarray:
        """A header-only record (a fresh copy: callers patch it)."""
        key = (type_, flags, epoch)
        t = self._cache.get(key)
        if t is None:
            t = np.frombuffer(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job,
                                                  epoch=epoch, slot=0, set=0, round=0, mask=0, count=0,
                                                  type=type_, flags=flags, key=self.key), dtype=np.uint8).copy()
            self._cache[key] = t
        return t.copy()

    def join(self, nonce: int) -> bytearray:
        """JOIN with this process's 64-bit nonce (low half in ``round``, high half in ``ack``)."""
        return codec.encode_blocks(
            np.zeros((1, proto.JOIN_PAYLOAD // 4), np.int32), rank=self.rank, job=self.job, slot=0, set=0,
            round=nonce & 0xFFFFFFFF, ack=nonce >> 32, mask=(1 << self.world) - 1, count=0, type=proto.TYPE_JOIN,
            key=self.key)

    def ack(self, epoch: int, head_abs: int, ask: bool = False) -> bytes:
        """ACK of this rank's head; ``ask`` (RETX) also asks the aggregator for the job's gate."""
        t = self.template(proto.TYPE_ACK, proto.FLAG_RETX if ask else 0, epoch)
        t[_ACK] = _be32(head_abs)
        t[_MASK] = _be32(1 << self.rank)
        return t.tobytes()

    def pull(self, epoch: int, head_abs: int) -> np.ndarray:
        """The header of a pull (a retransmission request without data) carrying this rank's head."""
        t = self.template(proto.TYPE_CONTRIB, proto.FLAG_PULL | proto.FLAG_RETX, epoch)
        t[_ACK] = _be32(head_abs)
        return t


def ack_column(recs: np.ndarray) -> np.ndarray:
    """The big-endian ``ack`` field of a (n, record) uint8 array, as a writable view."""
    return recs[:, _ACK].view(">u4")[:, 0] if len(recs) else np.empty(0, ">u4")


def flags_column(recs: np.ndarray) -> np.ndarray:
    return recs[:, FLAGS_AT] if len(recs) else np.empty(0, np.uint8)


class JoinReply(NamedTuple):
    """What an answer to a JOIN says to rank ``rank``: ``kind`` is one of "joined" (``value``:
    the epoch), "world" (``value``: the job's rank count on the aggregator), "superseded",
    "joining" (``value``: bitmap of the ranks that have joined) or "" (not for this rank)."""

    kind: str
    value: int = 0


_HDR = codec.header_dtype()


def read_join_reply(buf, n: int, rank: int, job: int, nonce: int) -> JoinReply:
    if n < proto.HDR_LEN:
        return JoinReply("")
    h = np.frombuffer(buf, dtype=_HDR, count=1)[0]
    if int(h["magic"]) != proto.MAGIC or int(h["job"]) != job:
        return JoinReply("")
    t = int(h["type"])
    if t == proto.TYPE_JOINED and n >= proto.HDR_LEN + proto.JOIN_PAYLOAD:
        table = np.frombuffer(buf, dtype="<u8", count=proto.MAX_WORKERS, offset=proto.HDR_LEN)
        if int(table[rank]) == nonce and int(h["epoch"]):
            return JoinReply("joined", int(h["epoch"]))
    elif t == proto.TYPE_STATUS and int(h["rank"]) == rank:
        detail = int(h["detail"])
        if detail == proto.DETAIL["world"]:
            return JoinReply("world", bin(int(h["mask"])).count("1"))
        if detail == proto.DETAIL["superseded"]:
            return JoinReply("superseded")
        if detail == proto.DETAIL["joining"]:
            return JoinReply("joining", int(h["mask"]))
    return JoinReply("")
