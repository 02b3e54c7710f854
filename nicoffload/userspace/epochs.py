"""The user-space aggregator's epoch state and JOIN handshake (as struct ar_job in xdp/agg_maps.h
and join_epoch() in xdp/slots.h): who has joined, with which nonce, the live epoch, each rank's
acknowledged head and the job's gate. Mixed into :class:`nicoffload.userspace.UserspaceAggregator`,
which provides ``workers``, ``group``, ``stats``, ``_hdt``, ``_mask_all``, ``_status``, ``_send``
and ``_to_ranks``."""
from __future__ import annotations

import secrets

import numpy as np

from nicoffload.wire import proto


def serial_after(a: int, b: int) -> bool:
    """a is after b in 32-bit serial order."""
    return 0 < ((a - b) & 0xFFFFFFFF) < 0x80000000


class EpochState:
    def _init_epochs(self) -> None:
        self.live = 0
        self.last_epoch = secrets.randbits(32)
        self.joined = 0
        self.nonces = [0] * proto.MAX_WORKERS
        self.acks = [0] * proto.MAX_WORKERS

    def _job_gate(self) -> int:
        """The lowest acknowledgement of the job's ranks (serial order), as job_gate() in C."""
        gate = self.acks[0]
        for q in range(1, self.workers):
            if serial_after(gate, self.acks[q]):
                gate = self.acks[q]
        return gate

    def _ack(self, rank: int, ack: int) -> None:
        if serial_after(ack, self.acks[rank]):
            self.acks[rank] = ack

    def _join(self, out: bytearray, h, rank: int, addr) -> None:
        st = self.stats
        rec = np.frombuffer(out, dtype=self._hdt, count=1)
        table = np.frombuffer(out, dtype="<u8", count=proto.MAX_WORKERS, offset=proto.HDR_LEN)
        if int(h["mask"]) != self._mask_all:
            self._status(rec[0], self._mask_all, "world")
            st["status_sent"] += 1
            return self._send(out, addr[0], addr[1])
        nonce = (int(h["ack"]) << 32) | int(h["round"])
        cur = self.nonces[rank]
        bit = 1 << rank
        if self.live and nonce == cur:
            st["join"] += 1
            self._joined(rec[0], table)
            rec[0]["flags"] = proto.FLAG_ANSWER
            return self._send(out, addr[0], addr[1])
        if cur and nonce < cur:
            st["stale_join"] += 1
            if int(h["flags"]) & proto.FLAG_RETX:
                self._status(rec[0], 0, "superseded")
                self._send(out, addr[0], addr[1])
            return
        st["join"] += 1
        if not self.live and self.joined & bit and nonce == cur:
            if int(h["flags"]) & proto.FLAG_RETX:
                self._status(rec[0], self.joined, "joining")
                self._send(out, addr[0], addr[1])
            return
        if self.live:
            self.live, self.joined = 0, 0
        self.nonces[rank] = nonce
        self.joined |= bit
        if self.joined == self._mask_all:
            self.last_epoch = (self.last_epoch + 1) & 0xFFFFFFFF or 1
            self.live = self.last_epoch
            self.acks = [0] * proto.MAX_WORKERS
            st["epoch_formed"] += 1
            st["result_sent"] += 1
            self._joined(rec[0], table)
            self._to_ranks(out, addr[1])

    def _joined(self, r, table: np.ndarray) -> None:
        r["type"], r["flags"], r["epoch"], r["mask"], r["detail"] = (
            proto.TYPE_JOINED, 0, self.live, self.joined, 0)
        table[:] = self.nonces

