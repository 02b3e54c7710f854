"""A compute loop beside a rank: how much an AllReduce takes from the work a host would do
meanwhile (DirectReduce's first claim: with the reduction in the NIC the host keeps computing).

:class:`ComputeLoop` forks a child that runs elementwise float32 math for ever (no BLAS: its
thread pool does not survive a fork) and counts the steps in shared memory; the rank reads the
count around what it measures. On this testbed every "NIC" is the same two CPUs as the hosts,
so the loop loses whatever the AllReduce costs the machine: its process, the kernel's network
path and the XDP programs alike.
"""
from __future__ import annotations

import mmap
import os
import signal
import time

import numpy as np

from nicoffload.testbed.signals import terminated_with

#: elements the loop works on (a step takes a few microseconds)
ELEMS = 4096


def _loop(counter: np.ndarray) -> None:
    x = np.linspace(0, 1, ELEMS, dtype=np.float32)
    y = np.empty_like(x)
    while True:
        for _ in range(16):
            np.sin(x, out=y)
            np.multiply(y, np.float32(0.999), out=x)
        counter[0] += 16


class ComputeLoop:
    """The child and its counter. ``rate(seconds)``: steps per second over an interval while
    nothing else is measured; ``count()`` for intervals of the caller's own."""

    def __init__(self):
        self._mem = mmap.mmap(-1, mmap.PAGESIZE)
        self.counter = np.frombuffer(self._mem, dtype=np.uint64, count=1)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: single-threaded numpy, until it is killed or its rank dies
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            terminated_with(parent)()
            # not the rank's stdout/stderr: a bench reads those pipes until every writer is gone
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.environ["OMP_NUM_THREADS"] = "1"
            try:
                _loop(self.counter)
            finally:
                os._exit(0)
        self.pid = pid
        self.best_idle = 0.0

    def count(self) -> int:
        return int(self.counter[0])

    def rate(self, seconds: float) -> float:
        c0, t0 = self.count(), time.monotonic()
        time.sleep(seconds)
        return (self.count() - c0) / (time.monotonic() - t0)

    def idle_rate(self, seconds: float) -> float:
        """The loop's rate while its rank idles: the best of every such interval measured so far
        (what the machine can give the loop does not change within a run; a lower reading means
        something else ran, e.g. the bench preparing the next system)."""
        self.best_idle = max(self.best_idle, self.rate(seconds))
        return self.best_idle

    def close(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            self.pid = 0

    def __enter__(self) -> "ComputeLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
