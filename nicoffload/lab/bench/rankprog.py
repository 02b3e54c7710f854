"""The command line both ring baselines' rank programs share (``python -m nicoffload.lab.bench.tcpring``,
``python -m nicoffload.lab.bench.udpring``): the same flags, the input read from a .npy file, timed
repetitions, the sum saved and the times reported (one JSON line, or a line people read), errors
as a message and an exit code. Each program brings the ring it opens."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, ContextManager

import numpy as np

from nicoffload.errors import NicoffloadError
from nicoffload.lab.counters import timed_reps


def build_parser(module: str, description: str, port: int, timeout: float) -> argparse.ArgumentParser:
    """The flags of the rank program ``python -m <module>`` (``port``, ``timeout``: its defaults)."""
    prog = f"python -m {module}"
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n"
                                f"  {prog} --rank 0 --world 2 --peers 10.0.0.10,10.0.0.11 "
                                "--input g0.npy --output sum.npy\n"
                                f"  {prog} --rank 1 --world 2 --peers 10.0.0.10,10.0.0.11 "
                                "--input g1.npy --reps 5 --json")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--peers", required=True, help="comma-separated IPv4 address of every rank, in rank order")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--input", type=Path, required=True, help=".npy file (int32, float32 or float64)")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--timeout", type=float, default=timeout, help="seconds without progress before failing")
    p.add_argument("--json", action="store_true")
    return p


def main(args: argparse.Namespace, open_ring: Callable[[argparse.Namespace, list[str], np.ndarray], ContextManager],
         name: str, label: str) -> int:
    """Run the rank ``args`` describe on the ring ``open_ring(args, peers, x)`` opens; errors are
    reported as ``nicoffload <name>: error: ...``, the times as ``<label> rank R: ...``."""
    try:
        x = np.load(args.input, allow_pickle=False)
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        with open_ring(args, peers, x) as ring:
            out, times = timed_reps(ring, x, args.reps)
        if args.output:
            np.save(args.output, out)
    except NicoffloadError as e:
        print(f"nicoffload {name}: error: {e}", file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:
        print(f"nicoffload {name}: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rank": args.rank, "times": times, "elements": int(x.size), "dtype": str(x.dtype)}))
    else:
        print(f"{label} rank {args.rank}: {x.size} {x.dtype} in {min(times) * 1e3:.2f} ms")
    return 0
