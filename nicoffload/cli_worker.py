"""``nicoffload worker``, ``aggregator-userspace``, ``allreduce`` and ``demo``."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from . import proto
from .cli import add_examples
from .errors import InputError

DTYPES = (np.int32, np.float32, np.float64)


def parse_size(s: str) -> int:
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
             "g": 10**9, "gb": 10**9, "gib": 1 << 30}
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in units:
        raise InputError(f"cannot read size {s!r}: use e.g. 4KiB, 16MiB, 1000000")
    return int(float(num) * units[unit])


def register(sub) -> None:
    # --- worker ---------------------------------------------------------------------------
    p = sub.add_parser("worker", help="one rank of an AllReduce job (run on each host)")
    add_examples(p,
                 "nicoffload worker --rank 0 --world 4 --aggregator 10.0.0.100 --input g0.npy --output sum.npy",
                 "nicoffload worker --rank 1 --world 4 --aggregator 10.0.0.100 --local-ip 10.0.0.2 "
                 "--group 239.77.0.1 --input g1.npy --output sum.npy --json")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--aggregator", required=True, metavar="IP", help="address of the aggregator")
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--port", type=int, default=proto.DEFAULT_PORT)
    p.add_argument("--group", default="239.77.0.1", help="multicast group the results arrive on")
    p.add_argument("--local-ip", default=None, help="this host's address (selects the interface)")
    p.add_argument("--input", required=True, type=Path, help=".npy file (int32, float32 or float64)")
    p.add_argument("--output", type=Path, default=None, help=".npy file for the sum")
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS, help="int32 elements per packet")
    p.add_argument("--slots", type=int, default=1024, help="slots of the aggregator's pool")
    p.add_argument("--window", type=int, default=None, help="rounds outstanding (default 512)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds without progress before failing")
    p.add_argument("--reps", type=int, default=1, help="repeat the AllReduce (timings of each)")
    p.add_argument("--dense", action="store_true", help="no zero-block detection (skips a metadata round for int32)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    p.set_defaults(func=_worker)

    # --- user-space aggregator ------------------------------------------------------------
    p = sub.add_parser("aggregator-userspace", help="the user-space aggregator (same protocol, no XDP)")
    add_examples(p, "nicoffload aggregator-userspace --workers 4 --local-ip 10.0.0.100",
                 "nicoffload aggregator-userspace --workers 8 --slots 2048 --group 239.77.0.1 --json")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--port", type=int, default=proto.DEFAULT_PORT)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS)
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--group", default="239.77.0.1")
    p.add_argument("--local-ip", default=None, help="address to send results from")
    p.add_argument("--worker-ip", action="append", default=[], help="registered address of rank 0, 1, ...")
    p.add_argument("--duration", type=float, default=None, help="stop after SECONDS (default: until SIGTERM)")
    p.add_argument("--json", action="store_true", help="print counters as JSON on exit")
    p.set_defaults(func=_userspace)

    # --- allreduce on a testbed -----------------------------------------------------------
    p = sub.add_parser("allreduce", help="sum .npy files through a namespace testbed (needs root)")
    add_examples(p, "sudo nicoffload allreduce a.npy b.npy c.npy d.npy -o sum.npy",
                 "sudo nicoffload allreduce a.npy b.npy -o sum.npy --aggregator userspace --json",
                 "sudo nicoffload allreduce a.npy b.npy -o sum.npy --drop 0.02 --dup 0.02 --seed 7")
    p.add_argument("inputs", nargs="+", type=Path, help="one .npy per worker (same shape and dtype)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--aggregator", choices=["xdp", "userspace"], default="xdp")
    p.add_argument("--drop", type=float, default=0.0, help="drop probability on every link")
    p.add_argument("--dup", type=float, default=0.0, help="duplication probability on every link")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_allreduce)

    # --- demo -----------------------------------------------------------------------------
    p = sub.add_parser("demo", help="the main job: gradients through XDP and user space, checked (root)")
    add_examples(p, "sudo nicoffload demo", "sudo nicoffload demo --workers 8 --size 64MiB --sparsity 0.75",
                 "sudo nicoffload demo --json")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", default="16MiB", help="bytes of float32 gradients per worker")
    p.add_argument("--sparsity", type=float, default=0.5, help="fraction of 1 KiB blocks that are zero")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_demo)


# --- implementations ------------------------------------------------------------------------
def load_input(path: Path) -> np.ndarray:
    try:
        a = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file")
    except Exception as e:
        raise InputError(f"{path}: not a readable .npy file ({e.__class__.__name__}: {e})")
    if a.dtype not in DTYPES:
        raise InputError(f"{path}: dtype {a.dtype} is not supported (int32, float32, float64)")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise InputError(f"{path}: holds NaN or Inf; refusing to sum it")
    return a


def _worker(args) -> int:
    from .worker import Communicator

    x = load_input(args.input)
    kw = dict(job=args.job, port=args.port, group=args.group, local_ip=args.local_ip, slots=args.slots,
              elems=args.elems, timeout=args.timeout, sparse=not args.dense)
    if args.window:
        kw["window"] = args.window
    times = []
    with Communicator(args.rank, args.world, args.aggregator, **kw) as c:
        out = np.empty_like(x)
        for _ in range(max(1, args.reps)):
            c.barrier()
            t0 = time.perf_counter()
            c.allreduce(x, out=out)
            times.append(time.perf_counter() - t0)
        if args.output:
            np.save(args.output, out)
        last = c.last.__dict__
    if args.json:
        print(json.dumps({"rank": args.rank, "times": times, "stats": last,
                          "elements": int(x.size), "dtype": str(x.dtype)}))
    else:
        print(f"rank {args.rank}: {x.size} {x.dtype} in {min(times) * 1e3:.1f} ms "
              f"({last['packets_sent']} packets, {last['retransmissions']} retransmitted)")
    return 0


def _userspace(args) -> int:
    from .userspace import UserspaceAggregator

    agg = UserspaceAggregator(args.workers, args.port, args.slots, args.elems, args.job, args.group,
                              args.local_ip, list(args.worker_ip))
    def on_term(signum, frame):
        agg.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("ready", flush=True)
    try:
        agg.serve(until=None if args.duration is None else time.monotonic() + args.duration)
    finally:
        agg.close()
    if args.json:
        print(json.dumps({"stats": agg.stats}), flush=True)
    else:
        print(f"completed {agg.stats['completed']} rounds, received {agg.stats['rx']} packets")
    return 0


def check_inputs(paths: list[Path]) -> list[np.ndarray]:
    arrays = [load_input(p) for p in paths]
    shapes = {a.shape for a in arrays}
    dtypes = {str(a.dtype) for a in arrays}
    if len(shapes) > 1:
        raise InputError(f"inputs differ in shape: {', '.join(f'{p}: {a.shape}' for p, a in zip(paths, arrays))}")
    if len(dtypes) > 1:
        raise InputError(f"inputs differ in dtype: {', '.join(f'{p}: {a.dtype}' for p, a in zip(paths, arrays))}")
    if not 1 <= len(arrays) <= proto.MAX_WORKERS:
        raise InputError(f"need 1..{proto.MAX_WORKERS} inputs, got {len(arrays)}")
    return arrays


def _testbed(workers: int, mtu: int = 1500, rate=None):
    from nicoffload.testbed.testbed import running

    return running(workers, mtu=mtu, rate=rate)


def _allreduce(args) -> int:
    from . import bpf
    from .runner import run_job, tempdir

    arrays = check_inputs(args.inputs)
    for p in (args.drop, args.dup):
        if not 0 <= p < 1:
            raise InputError("--drop and --dup are probabilities in [0, 1)")
    bpf.require_root("nicoffload allreduce (it builds a namespace testbed)")
    mtu = max(1500, proto.mtu_for_elems(args.elems))
    with _testbed(len(arrays), mtu) as tb, tempdir() as d:
        if args.drop or args.dup:
            tb.faults.configure(drop=args.drop, dup=args.dup, seed=args.seed)
        ins = [Path(d) / f"in{r}.npy" for r in range(len(arrays))]
        outs = [Path(d) / f"out{r}.npy" for r in range(len(arrays))]
        for a, p in zip(arrays, ins):
            np.save(p, a.reshape(-1))
        res = run_job(tb, ins, outs, args.aggregator, elems=args.elems, timeout=args.timeout)
        results = [np.load(p) for p in outs]
        for r, y in enumerate(results[1:], 1):
            if not np.array_equal(y, results[0]):
                raise InputError(f"rank {r}'s result differs from rank 0's (a bug: please report)")
        out = results[0].reshape(arrays[0].shape).astype(arrays[0].dtype)
    np.save(args.output, out)
    report = {"workers": len(arrays), "elements": int(out.size), "dtype": str(out.dtype),
              "seconds": res.seconds, "aggregator": args.aggregator,
              "packets_sent": res.totals("packets_sent"), "retransmissions": res.totals("retransmissions"),
              "output": str(args.output)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"summed {len(arrays)} x {out.size} {out.dtype} through the {args.aggregator} aggregator in "
              f"{res.seconds * 1e3:.1f} ms ({report['packets_sent']} packets, "
              f"{report['retransmissions']} retransmitted) -> {args.output}")
    return 0


def make_gradients(workers: int, n: int, sparsity: float, seed: int, elems: int = proto.DEFAULT_ELEMS):
    """Random float32 gradients; a fraction ``sparsity`` of each rank's blocks is all zero."""
    rng = np.random.default_rng(seed)
    nb = -(-n // elems)
    out = []
    for _ in range(workers):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        zero = rng.random(nb) < sparsity
        g[np.repeat(zero, elems)[:n]] = 0
        out.append(g)
    return out


def _demo(args) -> int:
    from . import bpf
    from .quant import block_exponents, error_bound
    from .runner import run_job, tempdir

    bpf.require_root("nicoffload demo (it builds a namespace testbed and loads XDP)")
    if not 0 <= args.sparsity <= 1:
        raise InputError("--sparsity is a fraction in [0, 1]")
    n = parse_size(args.size) // 4
    grads = make_gradients(args.workers, n, args.sparsity, args.seed)
    exact = np.sum(np.stack(grads).astype(np.float64), axis=0)
    # the documented bound, per block, from the inputs' own exponents
    E = proto.DEFAULT_ELEMS
    nb = -(-n // E)
    padded = np.zeros((args.workers, nb * E), dtype=np.float32)
    padded[:, :n] = np.stack(grads)
    exps = np.max([block_exponents(p.reshape(nb, E)) for p in padded], axis=0)
    bound = np.repeat(error_bound(exps, args.workers), E)[:n]
    rows = []
    with _testbed(args.workers) as tb, tempdir() as d:
        ins = [Path(d) / f"g{r}.npy" for r in range(args.workers)]
        for g, p in zip(grads, ins):
            np.save(p, g)
        for kind in ("xdp", "userspace"):
            outs = [Path(d) / f"{kind}{r}.npy" if r == 0 else None for r in range(args.workers)]
            if not args.json:
                print(f"running {args.workers} workers x {args.size} float32 through the {kind} aggregator ...",
                      file=sys.stderr, flush=True)
            res = run_job(tb, ins, outs, kind, reps=args.reps, timeout=20)
            y = np.load(outs[0]).astype(np.float64)
            err = np.abs(y - exact)
            f32_ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) / 2
            rows.append({
                "aggregator": kind, "seconds": res.seconds, "min_s": min(res.rep_seconds),
                "goodput_gbps": n * 4 * 8 / res.seconds / 1e9, "max_abs_err": float(err.max()),
                "within_bound": bool((err <= bound + f32_ulp).all()),
                "packets_sent": res.totals("packets_sent"),
                "retransmissions": res.totals("retransmissions"),
                "blocks_skipped": res.ranks[0]["stats"]["blocks_skipped"],
            })
    if args.json:
        print(json.dumps({"workers": args.workers, "bytes": n * 4, "sparsity": args.sparsity, "runs": rows}))
        return 0 if all(r["within_bound"] for r in rows) else 1
    print(f"\n{args.workers} workers, {n * 4 / 2**20:.1f} MiB float32 each, {args.sparsity:.0%} zero blocks "
          f"(median of {args.reps})")
    print(f"{'aggregator':<11} {'time':>10} {'goodput':>12} {'max |err|':>11} {'in bound':>9} {'packets':>9} "
          f"{'retx':>6}")
    for r in rows:
        print(f"{r['aggregator']:<11} {r['seconds'] * 1e3:>8.1f}ms {r['goodput_gbps']:>8.2f}Gb/s "
              f"{r['max_abs_err']:>11.3g} {'yes' if r['within_bound'] else 'NO':>9} {r['packets_sent']:>9} "
              f"{r['retransmissions']:>6}")
    if len(rows) == 2:
        print(f"XDP is {rows[1]['seconds'] / rows[0]['seconds']:.1f}x faster than the user-space aggregator")
    return 0 if all(r["within_bound"] for r in rows) else 1
