"""The XDP aggregator's control plane (xdp/aggregator.c, the SmartNIC of SwitchML and OmNICCL).

    control    :class:`Aggregator`: compile with the pool's sizes, attach in a namespace, pin
               program and maps so they outlive the process, add and remove jobs, read counters
               and slots, close
    spec       :class:`AggSpec` (what is loaded where, the jobs recorded since), the program's
               entry points, the pin directory and state file of a loaded aggregator
    teardown   :func:`unload` (from the pins and state file alone) and :func:`loaded`
    maps       typed access to the program's maps through bcc's tables (job entries, slots,
               per-job counters), written the way the program reads them
    jobtable   the job table as data: ranks, addresses, group, share of the slot pool, and the
               rules that admit a job or refuse it naming the free space
    optimizer  the control of an optimizer job (OptimusNIC): parameters up and back, state,
               learning rate, checkpoints (its arithmetic is :mod:`nicoffload.optim`)
    fallback   jobs the XDP pool refuses, handed to the AF_XDP engine beside it (``--fallback afxdp``)

Below it: :mod:`nicoffload.ebpf` (bcc, libbpf, interfaces, state files) and the wire.
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"Aggregator": "control", "AggSpec": "spec", "unload": "teardown", "loaded": "teardown"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
