"""The AF_XDP aggregator engine: the DPDK-style, off-path counterpart of the XDP aggregator.

An XDP program steers a job's frames into AF_XDP sockets; a compiled poll loop (engine.c, gcc,
through ctypes) owns each queue's UMEM and its fill, rx, tx and completion rings and speaks the
same protocol as the XDP and the user-space aggregators (slot pool, double buffering, epochs and
JOIN, loss-recovery answers, multicast or unicast results), with no socket layer on its path.
It serves what the XDP program cannot hold (a job the XDP pool refuses: ``agg job add
--fallback afxdp``) and is the off-path point of comparison on the same wire
(``--aggregator afxdp``, bench system ``afxdp``).

    engine  :class:`AfxdpEngine`: open on an interface, add jobs, run, counters, close
    build   compile engine.c once per source (cached) and load it with ctypes
    engine.c  the C engine: its API; engine.h (the state), engine_tx.h (results out),
              engine_proto.h (answers, joins, checks), engine_rx.h (records in): one unit
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"AfxdpEngine": "engine"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
