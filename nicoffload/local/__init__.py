"""The ranks of one host: POSIX shared memory between them, and the communicator of a group whose
hosts run several ranks each (``torchrun --nproc-per-node K``).

    segment  the host's ranks in one group: shared memory segments (named per group, unlinked as
             soon as every rank has them mapped), the futex barrier, a dead local rank noticed
    futex    futex wait and wake on a word of shared memory
    fixed    the aggregator's fixed point, bit for bit: quantize, add as integers, decode
    fixedsum :class:`~nicoffload.local.fixedsum.FixedSum`: that fixed point summed over any exact
             int32 collective (the failovers' paths: gloo, the ring)
    host     :class:`~nicoffload.local.host.HostCommunicator`: reduce inside the host through
             shared memory, each local rank's share across hosts through its lane
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"HostCommunicator": "host", "HostGroup": "segment"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
