"""A user-space Ring AllReduce over nicoffload's ring protocol (UDP): the baseline that does in
the worker process what the ring offload (xdp/ring.c) does in every worker's XDP.

The same records, the same chunks and journeys, the same fixed point and the same loss recovery
as the ring offload (docs/ring.md): each rank's process receives every record its predecessor
sends (recvmmsg with UDP_GRO), adds its own record or stores the final, and sends it on
(sendmmsg with UDP_SEGMENT), with the very kernels (:mod:`nicoffload.ring_kernels`) the
offloaded ring's host uses for the records its program parks. It is
:class:`nicoffload.ring_comm.RingCommunicator` with ``offload=False``; this module is its rank
program, next to :mod:`nicoffload.lab.tcpring` (the TCP ring baseline).

Run one rank::

    python -m nicoffload.lab.udpring --rank 0 --world 3 --peers 10.0.0.10,10.0.0.11,10.0.0.12 \\
        --input g0.npy --output sum.npy --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..errors import NicoffloadError
from ..jobspec import DEFAULT
from .counters import timed_reps


def ring(rank: int, world: int, peers: list[str], port: int = DEFAULT.port, timeout: float = DEFAULT.timeout,
         elems: int = DEFAULT.elems, capacity: int | None = None):
    """One rank of the user-space UDP ring (a RingCommunicator without XDP)."""
    from ..ring_comm import RingCommunicator

    kw = {"capacity": capacity} if capacity else {}
    return RingCommunicator(rank, world, peers, port=port, elems=elems, timeout=timeout, offload=False, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nicoffload.lab.udpring",
                                description="One rank of the user-space UDP ring (nicoffload's ring protocol, every "
                                            "hop in user space).",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n"
                                "  python -m nicoffload.lab.udpring --rank 0 --world 2 --peers 10.0.0.10,10.0.0.11 "
                                "--input g0.npy --output sum.npy\n"
                                "  python -m nicoffload.lab.udpring --rank 1 --world 2 --peers 10.0.0.10,10.0.0.11 "
                                "--input g1.npy --reps 5 --json")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--peers", required=True, help="comma-separated IPv4 address of every rank, in rank order")
    p.add_argument("--port", type=int, default=DEFAULT.port)
    p.add_argument("--input", type=Path, required=True, help=".npy file (int32, float32 or float64)")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--timeout", type=float, default=DEFAULT.timeout, help="seconds without progress before failing")
    p.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        x = np.load(args.input, allow_pickle=False)
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        with ring(args.rank, args.world, peers, args.port, args.timeout, capacity=-(-x.size // DEFAULT.elems)) as r:
            out, times = timed_reps(r, x, args.reps)
        if args.output:
            np.save(args.output, out)
    except NicoffloadError as e:
        print(f"nicoffload udpring: error: {e}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:
        print(f"nicoffload udpring: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rank": args.rank, "times": times, "elements": int(x.size), "dtype": str(x.dtype)}))
    else:
        print(f"udp ring rank {args.rank}: {x.size} {x.dtype} in {min(times) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
