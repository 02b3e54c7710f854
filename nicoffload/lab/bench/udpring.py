"""A user-space Ring AllReduce over nicoffload's ring protocol (UDP): the baseline that does in
the worker process what the ring offload (xdp/ring.c) does in every worker's XDP.

The same records, the same chunks and journeys, the same fixed point and the same loss recovery
as the ring offload (docs/ring.md): each rank's process receives every record its predecessor
sends (recvmmsg with UDP_GRO), adds its own record or stores the final, and sends it on
(sendmmsg with UDP_SEGMENT), with the very kernels (:mod:`nicoffload.ring.kernels`) the
offloaded ring's host uses for the records its program parks. It is
:class:`nicoffload.ring.RingCommunicator` with ``offload=False``; this module is its rank
program, next to :mod:`nicoffload.lab.bench.tcpring` (the TCP ring baseline).

Run one rank::

    python -m nicoffload.lab.bench.udpring --rank 0 --world 3 --peers 10.0.0.10,10.0.0.11,10.0.0.12 \\
        --input g0.npy --output sum.npy --json
"""
from __future__ import annotations

import argparse
import sys

from nicoffload.jobspec import DEFAULT
from nicoffload.lab.bench import rankprog


def ring(rank: int, world: int, peers: list[str], port: int = DEFAULT.port, timeout: float = DEFAULT.timeout,
         elems: int = DEFAULT.elems, capacity: int | None = None):
    """One rank of the user-space UDP ring (a RingCommunicator without XDP)."""
    from nicoffload.ring.comm import RingCommunicator

    kw = {"capacity": capacity} if capacity else {}
    return RingCommunicator(rank, world, peers, port=port, elems=elems, timeout=timeout, offload=False, **kw)


def build_parser() -> argparse.ArgumentParser:
    return rankprog.build_parser("nicoffload.lab.bench.udpring",
                                 "One rank of the user-space UDP ring (nicoffload's ring protocol, every hop in user "
                                 "space).", DEFAULT.port, DEFAULT.timeout)


def main(argv: list[str] | None = None) -> int:
    return rankprog.main(build_parser().parse_args(argv),
                         lambda args, peers, x: ring(args.rank, args.world, peers, args.port, args.timeout,
                                                     capacity=-(-x.size // DEFAULT.elems)),
                         "udpring", "udp ring")


if __name__ == "__main__":
    sys.exit(main())
