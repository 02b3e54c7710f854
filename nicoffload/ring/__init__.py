"""The ring offload (DirectReduce, docs/ring.md): every worker's interface runs xdp/ring.c, which
adds the host's staged records into the passing packets and sends them on.

    node       :class:`RingNode`: compile, configure, attach, pin and record one node's program
               (:class:`RingSpec`, :func:`unload`, :func:`loaded`)
    maps       a node's maps by fd: state words, staged records and finals as mmap-ed arrays,
               the event ring buffer, per-CPU counters
    layout     the ring's arithmetic, pure: chunks, journeys, staging order, whom to ask for a
               lost record, the wire constants of the ring block
    kernels    the host's side in numba: tagging staged records, NACKs, decoding the finals
    hop        a node's work on ring records in user space (numba, as xdp/ring.c does it),
               receiving, replaying the records kept for the next call
    comm       :class:`RingCommunicator`, the API of :class:`nicoffload.worker.Communicator`
               for a ring (``offload=False``: the user-space UDP ring)
    passes     one pass as the host drives it: staging, its own chunk, wake-ups, parked records
    diag       PINGs, whether the ring stands still, and the timeout that names the node
    setup      where a rank keeps its records (the program's maps, or plain arrays)
    nodelock   one communicator per node (an exclusive flock held for its life)
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"RingNode": "node", "RingSpec": "node", "unload": "node", "loaded": "node",
          "RingCommunicator": "comm", "RingStats": "comm"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
