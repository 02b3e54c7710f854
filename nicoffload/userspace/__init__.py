"""The user-space aggregator: the same protocol and slot algorithm as xdp/aggregator.c, over a
UDP socket in numpy; the baseline the XDP path is measured against, and a fallback where XDP
cannot be loaded (``nicoffload aggregator-userspace``).

    aggregator  :class:`UserspaceAggregator`: the socket, datagrams checked and answered, results
                to the group or each rank
    slots       its slot algorithm per record: rounds, double buffering, retransmission answers,
                the optimizer's update (the same arithmetic as the XDP program)
    epochs      its epoch state and JOIN handshake (as struct ar_job and join_epoch in the C)
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"UserspaceAggregator": "aggregator"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
