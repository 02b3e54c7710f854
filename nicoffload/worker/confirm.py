"""The end of a call with ``confirm``: a rank returns only once the job's gate (the lowest head
of all ranks, which every result carries) has passed the call's last round, so every rank holds
every result of it and a failover never needs a result some rank has already handed back.
Kept apart from the round stream (:mod:`nicoffload.worker.stream`), which runs the rounds; this
only asks the aggregator for the gate and waits."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from nicoffload.datapath import pump
from nicoffload.errors import TimeoutError_
from nicoffload.worker.recovery import unheard

if TYPE_CHECKING:
    from nicoffload.worker.stream import RoundStream

#: the first wait for the gate's answer; it doubles up to the rto (seconds)
CONFIRM_POLL = 0.0002

#: the outputs the gate's wait does not write (decode_results takes all three kinds)
_NONE_I32, _NONE_F32, _NONE_F64 = np.empty(0, np.int32), np.empty(0, np.float32), np.empty(0, np.float64)
_NONE_U8 = np.zeros(1, np.uint8)


def confirm_gate(s: RoundStream, end_abs: int) -> None:
    """Return once the gate of ``s``'s job reaches ``end_abs``. Asks the aggregator for the gate,
    quickly at first (the last rank to finish is usually a few hundred microseconds behind), then
    every rto; silence, abort and the timeout apply."""
    if s._gate[0] >= end_abs:
        return
    t, dest, every = s._t, (s.aggregator, s.port), CONFIRM_POLL
    start = heard_at = time.monotonic()
    rx, one = t.recv_args(), np.zeros(1, np.int64)
    while s._gate[0] < end_abs:
        t.send_one(s._records.ack(s._epoch, end_abs, ask=True), dest)
        s._acked = max(s._acked, end_abs)
        s.last.acks += 1
        until = wake_by = time.monotonic() + every
        while s._gate[0] < end_abs:
            foreign0 = t.foreign
            n, _new, _event = pump.pump_recv(*rx, s._rec, s.elems, s.job, s._epoch, s.rank, end_abs, 0, s.slots,
                                             one, _NONE_I32, s._bias, pump.KIND_INT32, _NONE_I32, _NONE_F32,
                                             _NONE_F64, _NONE_U8, one, one, s._stash, s._stash_round, s._gate)
            now = time.monotonic()
            heard_at, wake_by = unheard(heard_at, min(wake_by, until), now), now
            if n > t.foreign - foreign0:
                heard_at = now
            elif now >= until:
                break
            elif not n:
                wake_by = until
                t.wait(until - now)
        s._check_abort()
        s._check_silence(heard_at, "confirming a call of")
        if time.monotonic() - start > s.timeout:
            raise TimeoutError_(f"rank {s.rank}: job {s.job}: the gate did not reach round {end_abs} "
                                f"within {s.timeout:g}s: a rank has not acknowledged this call's results")
        every = min(2 * every, s.rto)
