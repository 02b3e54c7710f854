"""``nicoffload bench``: nicoffload (XDP and user-space aggregators) against a TCP ring, gloo and
Open MPI, side by side on one namespace testbed, with a table, results.json/csv and plots.

Arguments only; the sweep is :mod:`nicoffload.lab.sweep`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli import add_examples
from .errors import InputError
from .lab import plan


def _list(conv, what):
    def parse(text: str):
        try:
            return plan.parse_list(conv, text)
        except (ValueError, InputError) as e:
            raise argparse.ArgumentTypeError(f"bad {what} {text!r}: {e}") from None
    return parse


def register(sub) -> None:
    p = sub.add_parser("bench", help="nicoffload vs a TCP ring, gloo and MPI on one testbed, with plots (root)",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    add_examples(p, "sudo nicoffload bench",
                 "sudo nicoffload bench --quick --out /tmp/bench",
                 "sudo nicoffload bench --workers 4 --sizes 16MiB --rate unshaped --reps 10",
                 "sudo nicoffload bench --workers 4 --sizes 64MiB --rate 1gbit --systems xdp,userspace,ring",
                 "sudo nicoffload bench --workers 2,4,8 --sizes 4KiB,1MiB,64MiB --sparsity 0,0.25,0.5,0.75 --full")
    p.add_argument("--workers", type=_list(plan.workers, "worker counts"), default=None,
                   help="worker counts, one testbed each (default 2,4,8)")
    p.add_argument("--sizes", type=_list(plan.size, "sizes"), default=None,
                   help="bytes of float32 gradients per worker (default 4KiB,64KiB,1MiB)")
    p.add_argument("--sparsity", type=_list(plan.sparsity, "sparsities"), default=None,
                   help="fractions of 1 KiB blocks that are zero (default 0,0.5,0.75)")
    p.add_argument("--rate", type=_list(plan.rate, "rates"), default=None,
                   help="worker link rates; the aggregator gets N x rate (default unshaped,1gbit)")
    p.add_argument("--systems", type=_list(plan.system, "systems"), default=None,
                   help="default xdp,userspace,ring,gloo,mpi (unavailable ones are skipped with a reason)")
    p.add_argument("--reps", type=int, default=None, help="timed AllReduces per point, at least (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed AllReduces per point (default 1)")
    p.add_argument("--min-time", type=float, default=None,
                   help="keep repeating a point until this many seconds (CPU ticks are 10 ms; default 0.2)")
    p.add_argument("--max-reps", type=int, default=None, help="reps per point at most (default 200)")
    p.add_argument("--max-point-time", type=float, default=None,
                   help="stop repeating a point after this many seconds, even below --reps (default 10)")
    p.add_argument("--full", action="store_true",
                   help="every size x sparsity at every worker count (default: all sizes at the lowest "
                        "sparsity, and all sparsities at the centre worker count and largest size <= 16MiB)")
    p.add_argument("--out", type=Path, default=plan.BenchConfig.out, help="directory for results and plots")
    p.add_argument("--quick", action="store_true",
                   help="a tiny sweep for tests: 2 workers, 4KiB and 256KiB, unshaped and 200mbit, 3 reps")
    p.add_argument("--seed", type=int, default=plan.BenchConfig.seed)
    p.add_argument("--mpirun", default=plan.BenchConfig.mpirun, help="the mpirun to use (default: from PATH)")
    p.add_argument("--timeout", type=float, default=None, help="seconds without progress before a rank fails")
    p.add_argument("--dtype", choices=["float32", "int32"], default=plan.BenchConfig.dtype,
                   help="gradients: float32 (quantized to int32 fixed point) or int32 (summed exactly)")
    p.add_argument("--mode", choices=["auto", "generic", "native"], default=plan.BenchConfig.mode,
                   help="XDP attach mode of the aggregator (default auto: generic batches on veth)")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from . import bpf
    from .lab import report, sweep

    bpf.require_root("nicoffload bench (it builds namespace testbeds and loads XDP)")
    given = {k: v for k, v in dict(workers=args.workers, sizes=args.sizes, sparsities=args.sparsity,
                                   rates=args.rate, systems=args.systems, reps=args.reps, warmup=args.warmup,
                                   min_time=args.min_time, max_reps=args.max_reps, timeout=args.timeout,
                                   max_point_s=args.max_point_time).items()
             if v is not None}
    given.update(out=args.out, seed=args.seed, mpirun=args.mpirun, full=args.full, mode=args.mode, dtype=args.dtype)
    cfg = (plan.BenchConfig.quick(**given) if args.quick else plan.BenchConfig(**given)).validate()
    print(f"nicoffload bench: workers {cfg.workers}, sizes {cfg.sizes}, sparsity {cfg.sparsities}, "
          f"rates {cfg.rates}, systems {cfg.systems} -> {cfg.out}", file=sys.stderr, flush=True)
    rows, pngs = sweep.run(cfg, argv=sys.argv)
    print(report.table(rows))
    print(report.summary(rows, cfg.out, pngs))
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print(f"{len(errors)} point(s) failed; see 'reason' in results.json", file=sys.stderr)
        return 1
    return 0
