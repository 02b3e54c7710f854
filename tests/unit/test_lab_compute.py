"""The bench's compute loop (``--compute``): it counts, and it never outlives its rank nor holds
the rank's output pipe (a rank killed without cleanup once left it spinning and the bench waiting)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from nicoffload.lab.bench.compute import ComputeLoop

ORPHAN = "import os; from nicoffload.lab.bench.compute import ComputeLoop; print(ComputeLoop().pid, flush=True); os._exit(0)"


def test_the_loop_counts_and_stops():
    with ComputeLoop() as loop:
        assert loop.rate(0.2) > 0
        pid = loop.pid
    assert loop.pid == 0
    assert not os.path.exists(f"/proc/{pid}")


def _gone(pid: int, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_rank_that_dies_without_closing_takes_its_loop_along():
    # run() returns at EOF of stdout: it would time out if the loop kept the pipe open
    r = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=20)
    pid = int(r.stdout)
    assert _gone(pid, 5.0), f"compute loop {pid} outlived its rank"
