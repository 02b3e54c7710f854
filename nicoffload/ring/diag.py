"""When a ring stalls (mixed into :class:`nicoffload.ring.RingCommunicator`): PING every
node and read its PONG (the call it is in, the finals it stored), answer the PINGs that reach
this host, tell whether the ring stands still (only then are records asked for again: a slow ring
is not a lossy one), and, when a call times out, name what it waits for: a rank that does not
answer, a rank that never entered the call, or losses not recovered.
"""
from __future__ import annotations

import time

import numpy as np

from nicoffload.errors import ProtocolError, TimeoutError_
from nicoffload.ring import hop
from nicoffload.ring.layout import TYPE_PING, TYPE_PONG
from nicoffload.wire import codec

#: seconds a diagnosis waits for the nodes' PONGs
PING_WAIT = 0.3


def _behind(pongs: dict[int, dict], c: int) -> dict[int, int]:
    """{rank: its call} of the nodes whose PONG says they have not entered call ``c`` yet."""
    return {r: p["call"] for r, p in pongs.items() if (p["call"] - c) & 0x80000000}


class RingDiagnosis:
    """PING/PONG and the timeout's diagnosis of :class:`~nicoffload.ring.RingCommunicator`
    (its transport, peers and the PONGs its kernels recorded)."""

    def _answer_pings(self, c: int, K: int) -> None:
        for sender in self._pings[:int(self._io[hop.IO_PINGS])]:
            self._t.send_one(self._pong(c, K), (self.peers[int(sender)], self.port))

    def _pong(self, c: int, K: int) -> bytes:
        return bytes(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job, epoch=c,
                                         slot=self._stored(), set=0, round=K, mask=0, count=0, type=TYPE_PONG))

    def _ring_state(self, c: int, K: int) -> tuple[dict[int, int], bool]:
        """Ask every node (PING): ({rank: its call} of the nodes that say they have not entered
        call ``c`` yet, whether any node stored records since the last time it was asked). A node
        that does not answer in time is neither (asking it again costs little; if it is gone, the
        timeout names it)."""
        pongs = self.ping(c, K, wait=min(PING_WAIT, max(4 * self.rto, 0.01)))
        behind = _behind(pongs, c)
        seen = {r: (p["call"], p["stored"]) for r, p in pongs.items()}
        moving = any(self._seen.get(r) not in (None, v) for r, v in seen.items() if v[0] == c)
        self._seen.update(seen)
        return behind, moving

    def ping(self, c: int = 0, K: int = 0, wait: float = PING_WAIT) -> dict[int, dict]:
        """Every other node's answer to a PING: {rank: {"call", "stored", "expected"}} (ranks that
        do not answer within ``wait`` seconds are missing). The host keeps taking over what its
        socket holds meanwhile."""
        before = self._pongs[:, 0].copy()
        ping = bytes(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job, epoch=c, slot=0,
                                         set=0, round=0, mask=0, count=0, type=TYPE_PING))
        others = [r for r in range(self.world) if r != self.rank]
        for r in others:
            self._t.send_one(ping, (self.peers[r], self.port))
        until = time.monotonic() + wait
        while not all(self._pongs[r, 0] > before[r] for r in others):
            left = until - time.monotonic()
            if left <= 0:
                break
            if self._t.wait(left):
                self._take_over(c or self._call, K)
        return {r: {"call": int(self._pongs[r, 1]), "stored": int(self._pongs[r, 2]),
                    "expected": int(self._pongs[r, 3])} for r in others if self._pongs[r, 0] > before[r]}

    _mismatch_seen = 0

    def _check_agreement(self, c: int) -> None:
        """Raise ProtocolError if this node refused records since the last look because they
        disagree with its own (element count, exponent or op): the ranks were given calls of
        different shapes or dtypes, and no record of this call can ever complete."""
        n = int(self.counters().get("mismatch", 0))
        new, self._mismatch_seen = n - self._mismatch_seen, n
        if new > 0:
            pred = (self.rank - 1) % self.world
            raise ProtocolError(f"rank {self.rank}: in call {c}, {new} record(s) from rank {pred} disagree with "
                                f"this rank's own (element count, exponent or op): the ranks were not given "
                                f"tensors of the same shape and dtype")

    def _fail(self, c: int, K: int) -> None:
        have = self._stored()
        pongs = self.ping(c, K)
        silent = [r for r in range(self.world) if r != self.rank and r not in pongs]
        behind = _behind(pongs, c)
        head = (f"rank {self.rank}: ring allreduce timed out after {self.timeout:g}s without progress in call {c} "
                f"({have} of {K} records here)")
        parts = []
        if silent:
            parts.append("no answer from rank(s) " + ", ".join(f"{r} ({self.peers[r]})" for r in silent)
                         + ": its ring program is not running there or its link is down")
        if behind:
            parts.append("rank(s) " + ", ".join(f"{r} (in call {p})" for r, p in sorted(behind.items()))
                         + f" never entered call {c}: the process stopped or stalls (it stalls the ring)")
        if not parts:
            low = sorted(pongs.items(), key=lambda kv: kv[1]["stored"])
            parts.append("every rank is in this call; stored: " + ", ".join(
                f"rank {r} {p['stored']}/{p['expected']}" for r, p in low) + " (losses not recovered)")
        raise TimeoutError_(head + "; " + "; ".join(parts))
