"""Joining a job: JOIN with this process's nonce until the aggregator hands out the run's epoch
(every rank has joined), and the errors that say why it did not."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nicoffload.datapath.transport import SLOT_BYTES
from nicoffload.errors import InputError, ProtocolError, TimeoutError_
from nicoffload.wire import proto
from nicoffload.worker.records import read_join_reply

if TYPE_CHECKING:
    from nicoffload.worker.stream import RoundStream


def join_job(self: RoundStream) -> int:
    """Join the job: returns once every rank of it has joined this run (the aggregator then
    hands out the run's epoch). Called by the first collective; calling it again is free."""
    self._check_abort()
    if self._epoch:
        return self._epoch
    rec = self._records.join(self.nonce)
    dest = (self.aggregator, self.port)
    buf = bytearray(SLOT_BYTES)
    deadline = time.monotonic() + self.timeout
    rto, joined = self.rto, -1
    heard_at = time.monotonic()
    while True:
        self._t.send_one(rec, dest)
        # from the second send on, ask for the forming epoch's state (who has joined)
        rec[proto.FIELD_OFFSETS["flags"]] = proto.FLAG_RETX
        until = min(deadline, time.monotonic() + rto)
        while time.monotonic() < until:
            if not self._t.wait(until - time.monotonic()):
                continue
            while True:
                n, _seg, _addr = self._t.recv_into(buf)
                if not n:
                    break
                heard_at = time.monotonic()
                kind, value = read_join_reply(buf, n, self.rank, self.job, self.nonce)
                if kind == "joined":
                    self._gate[2 if buf[proto.FIELD_OFFSETS["flags"]] & proto.FLAG_ANSWER else 1] += 1
                    self._epoch = value
                    self._round = self._acked = 0
                    self._gate[0] = 0
                    return self._epoch
                if kind == "world":
                    raise InputError(
                        f"rank {self.rank}: job {self.job} on the aggregator has {value} ranks, but this "
                        f"worker was started with world {self.world}")
                if kind == "superseded":
                    raise ProtocolError(
                        f"rank {self.rank}: a newer process has joined job {self.job} as rank {self.rank}; "
                        f"this one gives way")
                if kind == "joining":
                    joined = value
        self._check_abort()
        if time.monotonic() >= deadline:
            _join_timeout(self, joined)
        self._check_silence(heard_at, "joining")
        rto = min(rto * 2, self.max_rto)


def _join_timeout(self: RoundStream, joined: int) -> None:
    where = f"aggregator {self.aggregator}:{self.port}"
    if joined >= 0:
        have = [r for r in range(self.world) if joined >> r & 1]
        missing = [r for r in range(self.world) if not joined >> r & 1]
        raise TimeoutError_(
            f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s; the {where} "
            f"has heard from rank(s) {', '.join(map(str, have))}: no JOIN from rank(s) "
            f"{', '.join(map(str, missing))}")
    raise TimeoutError_(
        f"rank {self.rank}: joining job {self.job} timed out after {self.timeout:g}s: the {where} did "
        f"not answer; is the aggregator loaded with job {self.job} for {self.world} workers?")
