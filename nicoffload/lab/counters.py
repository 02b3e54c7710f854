"""Counters an experiment reads around what it measures: the machine's CPU ticks, an
interface's bytes, a BPF program's run time, the time of each AllReduce."""
from __future__ import annotations

import time

import numpy as np

from nicoffload.ebpf import libbpf

from ..errors import NicoffloadError


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine from /proc/stat's first line."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    v = [int(x) for x in parts[1:9]] + [0] * max(0, 9 - len(parts))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def iface_bytes(ifname: str, pid: int | None = None) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of an interface of this process's network namespace (``pid``: of
    that process's)."""
    try:
        with open(f"/proc/{pid or 'self'}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    v = rest.split()
                    return int(v[0]), int(v[8])
    except OSError:
        pass
    return None


def bpf_runtime(prog_id: int | None) -> tuple[int, int] | None:
    """(run_time_ns, run_cnt) of a BPF program (counted while stats are enabled); None when
    there is no program or it is gone."""
    if not prog_id:
        return None
    try:
        st = libbpf.prog_stats(prog_id)
    except (OSError, NicoffloadError):
        return None
    return st.run_time_ns, st.run_cnt


def delta(after: tuple | None, before: tuple | None) -> tuple | None:
    """Element-wise after - before of two readings, None unless both exist."""
    if not after or not before:
        return None
    return tuple(a - b for a, b in zip(after, before))


def timed_reps(comm, x: np.ndarray, reps: int = 1) -> tuple[np.ndarray, list[float]]:
    """``reps`` AllReduces of ``x`` through ``comm`` (anything with ``barrier()`` and
    ``allreduce(x, out)``), each behind a barrier: (the sum, each one's seconds)."""
    out = np.empty_like(x)
    times = []
    for _ in range(max(1, reps)):
        comm.barrier()
        t0 = time.perf_counter()
        comm.allreduce(x, out)
        times.append(time.perf_counter() - t0)
    return out, times
