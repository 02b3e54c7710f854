"""What a call of the host's communicator (:mod:`~nicoffload.local.host`) is, as its local
ranks check that they all make the same one, and what one rank's calls did."""
from __future__ import annotations

from dataclasses import dataclass

#: what a call is, for the check that every local rank makes the same one
OPS = {"sum": 1, "max": 2, "min": 3, "barrier": 4}
CALL_DTYPES = {"int32": 1, "float32": 2, "float64": 3}


def describe(sig: tuple[int, ...]) -> str:
    """A call's signature (barrier check) as a person reads it."""
    op = {v: k for k, v in OPS.items()}.get(sig[0], "?")
    if op == "barrier" or len(sig) < 4:
        return op
    dtype = {v: k for k, v in CALL_DTYPES.items()}.get(sig[1], "?")
    return f"{op} of {sig[2]} {dtype}" + (" in 16-bit lanes" if sig[3] == 16 else "")


@dataclass
class HostStats:
    """What one rank's calls did (``last``: the last call; ``stats``: every call so far)."""

    calls: int = 0
    seconds: float = 0.0
    lane_s: float = 0.0          # in the lane's collectives (this rank's share across hosts)
    wait_s: float = 0.0          # at the host's barriers, waiting for the other local ranks
    packets_sent: int = 0        # the lane's, where it counts them
    retransmissions: int = 0
    blocks_skipped: int = 0      # blocks zero on every rank of the group: not sent across hosts

    def add(self, other: "HostStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))
