"""The end of a call with ``confirm``: a rank returns only once the job's gate (the lowest head
of all ranks, which every result carries) has passed the call's last round, so every rank holds
every result of it and a failover never needs a result some rank has already handed back.
Kept apart from the round stream (:mod:`nicoffload.worker.stream`), which runs the rounds; this
only asks the aggregator for the gate and waits. :class:`GateWait` is a part of
:class:`~nicoffload.worker.stream.RoundStream`."""
from __future__ import annotations

import time

import numpy as np

from nicoffload.datapath import pump
from nicoffload.errors import TimeoutError_
from nicoffload.worker.recovery import unheard

#: the first wait for the gate's answer; it doubles up to the rto (seconds)
CONFIRM_POLL = 0.0002

#: the outputs the gate's wait does not write (decode_results takes all three kinds)
_NONE_I32, _NONE_F32, _NONE_F64 = np.empty(0, np.int32), np.empty(0, np.float32), np.empty(0, np.float64)
_NONE_U8 = np.zeros(1, np.uint8)


class GateWait:
    """RoundStream's ``confirm`` (a part of the stream: it uses the stream's transport ``_t``,
    ``_records``, ``_epoch``, ``_gate``, ``_stash``, ``_check_abort`` and ``_check_silence``)."""

    def confirm(self, end_abs: int) -> None:
        """Return once the job's gate reaches ``end_abs``: every rank holds every result before it.
        Asks the aggregator for the gate, quickly at first (the last rank to finish is usually a
        few hundred microseconds behind), then every rto; silence, abort and the timeout apply."""
        if self._gate[0] >= end_abs:
            return
        t, dest, every = self._t, (self.aggregator, self.port), CONFIRM_POLL
        start = heard_at = time.monotonic()
        rx, one = t.recv_args(), np.zeros(1, np.int64)
        while self._gate[0] < end_abs:
            t.send_one(self._records.ack(self._epoch, end_abs, ask=True), dest)
            self._acked = max(self._acked, end_abs)
            self.last.acks += 1
            until = wake_by = time.monotonic() + every
            while self._gate[0] < end_abs:
                foreign0 = t.foreign
                n, _new, _event = pump.pump_recv(*rx, self._rec, self.elems, self.job, self._epoch, self.rank,
                                                 end_abs, 0, self.slots, one, _NONE_I32, self._bias,
                                                 pump.KIND_INT32, _NONE_I32, _NONE_F32, _NONE_F64, _NONE_U8, one,
                                                 one, self._stash, self._stash_round, self._gate)
                now = time.monotonic()
                heard_at, wake_by = unheard(heard_at, min(wake_by, until), now), now
                if n > t.foreign - foreign0:
                    heard_at = now
                elif now >= until:
                    break
                elif not n:
                    wake_by = until
                    t.wait(until - now)
            self._check_abort()
            self._check_silence(heard_at, "confirming a call of")
            if time.monotonic() - start > self.timeout:
                raise TimeoutError_(f"rank {self.rank}: job {self.job}: the gate did not reach round {end_abs} "
                                    f"within {self.timeout:g}s: a rank has not acknowledged this call's results")
            every = min(2 * every, self.rto)
