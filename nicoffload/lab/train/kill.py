"""``train-demo --kill-aggregator-at STEP``: the aggregator's XDP program detached from its
interface once rank 0 has finished STEP training steps, in the middle of a run through the
torch.distributed backend, so the run shows the group's failover (issue 32): the aggregator goes
silent, every rank agrees to finish the cut call and the later ones on the fallback (gloo over
the same fixed-point integers), and the loss curve goes on.

The ranks learn nothing from here: they find the silence themselves (``NICOFFLOAD_FAILOVER``
seconds of it). What this module keeps is when it acted, so the summary can say how long the
group took from the aggregator's loss to its first call done on the fallback."""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

#: how often the watcher reads rank 0's progress file (seconds)
POLL = 0.01


class AggregatorKiller:
    """Detaches every XDP program from the testbed aggregator's interface once the number in
    ``progress`` (rank 0's finished steps, :mod:`ddp_rank`'s ``--progress``) reaches ``step``.
    A context manager: the watcher stops on exit whether or not it acted."""

    def __init__(self, tb, progress: Path, step: int):
        if step < 1:
            raise ValueError(f"the aggregator is killed after a step: STEP must be at least 1, not {step}")
        self.tb, self.progress, self.step = tb, Path(progress), step
        self.killed_at: float | None = None   # time.time() when the program was detached
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kill-aggregator", daemon=True)

    def __enter__(self) -> "AggregatorKiller":
        self.progress.unlink(missing_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _done(self) -> int:
        try:
            return int(self.progress.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._done() >= self.step:
                self.kill()
                return
            self._stop.wait(POLL)

    def kill(self) -> None:
        """Detach the aggregator's program, in whichever mode it was attached (``ip link set dev
        IF xdp off`` leaves a generic one in place)."""
        agg = self.tb.agg
        self.killed_at = time.time()
        errors = []
        for mode in ("xdpgeneric", "xdpdrv"):
            r = subprocess.run(["ip", "-n", agg.netns, "link", "set", "dev", agg.iface, mode, "off"],
                               capture_output=True, text=True)
            if r.returncode:
                errors.append(r.stderr.strip())
        if len(errors) == 2:
            self.error = f"could not detach the aggregator's program: {'; '.join(errors)}"

    def summary(self, ranks_stats: list[dict]) -> dict:
        """What the kill did, from every rank's ``pg.stats()`` (the backend's failover record)."""
        recovered = [d.get("recovered_at") for d in ranks_stats if d.get("recovered_at")]
        return {"at_step": self.step, "killed": self.killed_at is not None, "error": self.error,
                "failovers": [d.get("failovers") for d in ranks_stats],
                "cause": next((d.get("cause") for d in ranks_stats if d.get("cause")), None),
                "on_fallback": all(d.get("on_fallback") for d in ranks_stats),
                "recovery_s": (max(recovered) - self.killed_at) if recovered and self.killed_at else None}
