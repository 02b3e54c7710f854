"""``nicoffload bench``: nicoffload (XDP and user-space aggregators) against a TCP ring, gloo and
Open MPI, side by side on one namespace testbed, with a table, results.json/csv and plots."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cli import add_examples
from .errors import InputError


def _list(conv, what):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty list of {what}")
        try:
            return [conv(t) for t in items]
        except (ValueError, InputError) as e:
            raise argparse.ArgumentTypeError(f"bad {what} {text!r}: {e}") from None
    return parse


def _size(t: str) -> int:
    from .cli_worker import parse_size

    n = parse_size(t)
    if n < 4:
        raise ValueError("at least 4 bytes (one float32)")
    return n


def _sparsity(t: str) -> float:
    v = float(t)
    if not 0.0 <= v <= 1.0:
        raise ValueError("a fraction in [0, 1]")
    return v


def _workers(t: str) -> int:
    from . import proto

    v = int(t)
    if not 1 <= v <= proto.MAX_WORKERS:
        raise ValueError(f"1..{proto.MAX_WORKERS}")
    return v


def _rate(t: str) -> str:
    from nicoffload.testbed.topology import parse_rate

    parse_rate(t)  # raises InputError with the accepted forms
    return t


def _system(t: str) -> str:
    from .bench import SYSTEMS

    if t not in SYSTEMS:
        raise ValueError(f"choose from {','.join(SYSTEMS)}")
    return t


def register(sub) -> None:
    p = sub.add_parser("bench", help="nicoffload vs a TCP ring, gloo and MPI on one testbed, with plots (root)",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    add_examples(p, "sudo nicoffload bench",
                 "sudo nicoffload bench --quick --out /tmp/bench",
                 "sudo nicoffload bench --workers 4 --sizes 16MiB --rate unshaped --reps 10",
                 "sudo nicoffload bench --workers 4 --sizes 64MiB --rate 1gbit --systems xdp,userspace,ring",
                 "sudo nicoffload bench --workers 2,4,8 --sizes 4KiB,1MiB,64MiB --sparsity 0,0.25,0.5,0.75 --full")
    p.add_argument("--workers", type=_list(_workers, "worker counts"), default=None,
                   help="worker counts, one testbed each (default 2,4,8)")
    p.add_argument("--sizes", type=_list(_size, "sizes"), default=None,
                   help="bytes of float32 gradients per worker (default 4KiB,64KiB,1MiB)")
    p.add_argument("--sparsity", type=_list(_sparsity, "sparsities"), default=None,
                   help="fractions of 1 KiB blocks that are zero (default 0,0.5,0.75)")
    p.add_argument("--rate", type=_list(_rate, "rates"), default=None,
                   help="worker link rates; the aggregator gets N x rate (default unshaped,1gbit)")
    p.add_argument("--systems", type=_list(_system, "systems"), default=None,
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
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="directory for results and plots")
    p.add_argument("--quick", action="store_true",
                   help="a tiny sweep for tests: 2 workers, 4KiB and 256KiB, unshaped and 200mbit, 3 reps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mpirun", default="mpirun", help="the mpirun to use (default: from PATH)")
    p.add_argument("--timeout", type=float, default=None, help="seconds without progress before a rank fails")
    p.add_argument("--dtype", choices=["float32", "int32"], default="float32",
                   help="gradients: float32 (quantized to int32 fixed point) or int32 (summed exactly)")
    p.add_argument("--mode", choices=["auto", "generic", "native"], default="auto",
                   help="XDP attach mode of the aggregator (default auto: generic batches on veth)")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from . import bpf
    from .bench import SYSTEMS, BenchConfig, run, table

    bpf.require_root("nicoffload bench (it builds namespace testbeds and loads XDP)")
    given = {k: v for k, v in dict(workers=args.workers, sizes=args.sizes, sparsities=args.sparsity,
                                   rates=args.rate, systems=args.systems, reps=args.reps, warmup=args.warmup,
                                   min_time=args.min_time, max_reps=args.max_reps, timeout=args.timeout,
                                   max_point_s=args.max_point_time).items()
             if v is not None}
    given.update(out=args.out, seed=args.seed, mpirun=args.mpirun, full=args.full, mode=args.mode, dtype=args.dtype)
    for k in ("reps", "max_reps"):
        if k in given and given[k] < 1:
            raise InputError(f"--{k.replace('_', '-')} must be at least 1")
    if given.get("warmup", 0) < 0 or given.get("min_time", 0) < 0 or given.get("max_point_s", 1) <= 0:
        raise InputError("--warmup and --min-time cannot be negative, --max-point-time must be positive")
    if "systems" in given:
        given["systems"] = [s for s in SYSTEMS if s in given["systems"]]
    cfg = BenchConfig.quick(**given) if args.quick else BenchConfig(**given)
    if cfg.max_reps < cfg.reps:
        cfg.max_reps = cfg.reps
    print(f"nicoffload bench: workers {cfg.workers}, sizes {cfg.sizes}, sparsity {cfg.sparsities}, "
          f"rates {cfg.rates}, systems {cfg.systems} -> {cfg.out}", file=sys.stderr, flush=True)
    rows, pngs = run(cfg, argv=sys.argv)
    print(table(rows))
    skipped = {r["system"]: r["reason"] for r in rows if r["status"] == "skipped"}
    for s, why in skipped.items():
        print(f"skipped {s}: {why}")
    print(f"results: {cfg.out / 'results.json'}, {cfg.out / 'results.csv'}, {cfg.out / 'meta.json'}")
    print("plots:   " + ", ".join(str(p) for p in pngs))
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print(f"{len(errors)} point(s) failed; see 'reason' in results.json", file=sys.stderr)
        return 1
    return 0
