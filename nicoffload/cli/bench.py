"""``nicoffload bench``: nicoffload (XDP, AF_XDP and user-space aggregators) against a TCP ring,
gloo and Open MPI, side by side on one namespace testbed, with a table, results.json/csv and plots.
``--soak N`` instead: N consecutive AllReduces with frames dropped and duplicated on every link.

Arguments only; the sweep is :mod:`nicoffload.lab.bench.sweep`, the soak :mod:`nicoffload.lab.soak`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nicoffload.cli.app import add_examples
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT
from nicoffload.lab.bench import plan
from nicoffload.lab.inputs import format_size
from nicoffload.lab.soak import DTYPES as SOAK_DTYPES
from nicoffload.lab.soak import SoakConfig
from nicoffload.wire import keys


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
                 "sudo nicoffload bench --workers 4 --sizes 1MiB,16MiB --sparsity 0 --rate unshaped "
                 "--systems xdp,afxdp,userspace   # the three aggregators",
                 "sudo nicoffload bench --workers 2,4,8 --sizes 4KiB,1MiB,64MiB --sparsity 0,0.25,0.5,0.75 --full",
                 "sudo nicoffload bench --workers 2,4,8 --sizes 4KiB,64KiB,1MiB,64MiB --sparsity 0 --rate 1gbit "
                 "--systems ring,xdpring,udpring,gloo --compute     # the ring offload against the rings",
                 "sudo nicoffload bench --workers 2 --ranks-per-host 2 --systems xdp,gloo --sizes 16MiB --sparsity 0 "
                 "--rate unshaped   # torchrun --nproc-per-node 2's placement",
                 "sudo nicoffload bench --workers 1 --ranks-per-host 4 --systems xdp,gloo --sizes 16MiB --sparsity 0 "
                 "--rate unshaped   # one host: shared memory against gloo on loopback",
                 "sudo nicoffload bench --scaling                  # time against N = 2..16 at 200 Mbit/s and "
                 "1 Gbit/s, with each system's bound",
                 "sudo nicoffload bench --scaling --rate 200mbit --sizes 16MiB --systems xdp --agg-rate 1x   "
                 "# an aggregator with the workers' NIC",
                 "sudo nicoffload bench --soak 1000                # 3 ranks, 2% drop + 2% dup on every link",
                 "sudo nicoffload bench --torch-overhead --workers 4 --sizes 16MiB --reps 40",
                 "sudo nicoffload bench --soak 200 --workers 4 --sizes 64KiB,16MiB --dtypes float64 --drop 0.05 --json")
    _point_arguments(p)
    _repetition_arguments(p)
    _nicoffload_arguments(p)
    _mode_arguments(p)
    p.set_defaults(func=_bench)


def _point_arguments(p) -> None:
    """The points of the sweep: worker counts, sizes, sparsity, rates, systems."""
    p.add_argument("--workers", type=_list(plan.workers, "worker counts"), default=None,
                   help="worker counts, one testbed each (default 2,4,8)")
    p.add_argument("--sizes", type=_list(plan.size, "sizes"), default=None,
                   help="bytes of float32 gradients per worker (default 4KiB,64KiB,1MiB)")
    p.add_argument("--sparsity", type=_list(plan.sparsity, "sparsities"), default=None,
                   help="fractions of 1 KiB blocks that are zero (default 0,0.5,0.75)")
    p.add_argument("--zero-run", type=int, default=1, metavar="BLOCKS",
                   help="each rank's zero blocks come in runs of this many neighbouring blocks (default 1: "
                        "scattered one by one; e.g. 64: clustered, as an embedding's untouched rows are)")
    p.add_argument("--rate", type=_list(plan.rate, "rates"), default=None,
                   help="worker link rates; the aggregator gets N x rate (default unshaped,1gbit)")
    p.add_argument("--ranks-per-host", type=int, default=None, metavar="K",
                   help="K rank processes in each worker host (ranks = workers x K; default 1): xdp and xdp16 "
                        "reduce inside a host through shared memory and send local rank j's share across hosts "
                        "through a job of its own (one per lane; none with --workers 1), xdpring and udpring through "
                        "the ring of the hosts, gloo runs its K ranks per namespace as torch places them; systems "
                        f"{','.join(plan.HOST_SYSTEMS)}")
    p.add_argument("--systems", type=_list(plan.system, "systems"), default=None,
                   help=f"default all: {', '.join(plan.SYSTEMS)} (afxdp: the AF_XDP aggregator engine, same "
                        "protocol as xdp and userspace, needs gcc and libxdp-dev; ring: the TCP ring; xdpring: the "
                        "ring offload in every worker's XDP; udpring: the same protocol in user space; unavailable "
                        "ones are skipped with a reason)")


def _repetition_arguments(p) -> None:
    """How each point runs: repetitions and time limits, which points, output, seed, inputs."""
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
    p.add_argument("--scaling", action="store_true",
                   help="time against N: workers 2,4,8,16, sizes 16MiB,64MiB dense, rates 200mbit,1gbit, systems "
                        "xdp,xdp16,ring,gloo, 3 reps, 60 s a point at most (any of them can be given too); adds "
                        "scaling_vs_workers.png: each system's time and bound against N, CPU-bound points marked")
    p.add_argument("--seed", type=int, default=plan.BenchConfig.seed)
    p.add_argument("--mpirun", default=plan.BenchConfig.mpirun, help="the mpirun to use (default: from PATH)")
    p.add_argument("--timeout", type=float, default=None, help="seconds without progress before a rank fails")
    p.add_argument("--dtype", choices=["float32", "int32"], default=plan.BenchConfig.dtype,
                   help="gradients: float32 (quantized to int32 fixed point) or int32 (summed exactly)")


def _nicoffload_arguments(p) -> None:
    """The nicoffload systems' settings (XDP mode, delivery, fabric, aggregators, lanes, records)
    and the compute loop beside every rank."""
    p.add_argument("--mode", choices=["auto", "generic", "native"], default=plan.BenchConfig.mode,
                   help="XDP attach mode of the aggregator and of the ring programs (default auto: generic batches "
                        "on veth); the ring mode itself is chosen with --systems xdpring,udpring")
    p.add_argument("--delivery", choices=["multicast", "unicast"], default=None,
                   help="how the aggregator's results reach the ranks (default multicast; unicast with "
                        "--no-multicast)")
    p.add_argument("--no-multicast", action="store_true",
                   help="testbeds whose fabric drops multicast frames, as networks without multicast do")
    p.add_argument("--afxdp-tx", choices=["auto", "xsk", "socket"], default="auto",
                   help="how the afxdp system's results leave: the engine's AF_XDP tx ring (xsk), or a UDP socket, "
                        "a batch per UDP_SEGMENT send (socket); auto: socket in copy mode (veth), else xsk")
    p.add_argument("--aggregators", type=int, default=1, metavar="K",
                   help="aggregator hosts: the xdp, afxdp, userspace and xdpuni jobs are sharded over them "
                        "(default 1)")
    p.add_argument("--agg-rate", default=None, metavar="RATE",
                   help="each aggregator's link on shaped testbeds: a rate, or a multiple of --rate (1x: an "
                        "aggregator with the workers' NIC); default N x --rate (a dedicated aggregator node)")
    p.add_argument("--lanes", type=int, choices=[16, 32], default=32,
                   help="bits per fixed-point lane of xdp, afxdp, userspace, xdpuni and xdptorch (16: half the "
                        "bytes; the system xdp16 is xdp with 16)")
    p.add_argument("--elems", type=int, default=None, metavar="E",
                   help=f"int32 elements per record of the nicoffload systems (default {DEFAULT.elems}: 1 KiB, "
                        "fits a 1500-byte MTU); the testbed's MTU grows to fit (jumbo frames; at most 856 on veth). "
                        "The sweep, --paired and --soak take it")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help=f"aggregation slots of each nicoffload job, and so its rounds in flight per rank "
                        f"(default {DEFAULT.slots}). The sweep, --paired and --soak take it")
    p.add_argument("--shard-layout", choices=["contiguous", "roundrobin"], default="contiguous",
                   help="how a sharded job splits a tensor over the aggregators")
    p.add_argument("--compute", action="store_true",
                   help="run a compute loop beside every rank: how much of its throughput each system's AllReduces "
                        "take (compute_drop)")


def _mode_arguments(p) -> None:
    """Instead of the sweep: --soak, --paired, --torch-overhead, --tenants."""
    soak = p.add_argument_group("soak (--soak N; --workers, --sizes, --sparsity, --seed, --timeout, --mode apply)")
    soak.add_argument("--soak", type=int, metavar="N", default=None,
                      help="instead of the sweep: N consecutive AllReduces on one testbed through the XDP aggregator "
                           "with frames dropped and duplicated on every link, every result checked; prints the call "
                           "times' distribution, the worst call and the fault and aggregator counters (defaults: "
                           f"workers {SOAK_WORKERS}, sizes {','.join(map(format_size, SoakConfig.sizes))}, "
                           f"sparsity {SoakConfig.sparsity}, timeout {DEFAULT.timeout:g})")
    soak.add_argument("--drop", type=float, default=None, metavar="P",
                      help=f"probability a frame is dropped, each way of every link (default {SoakConfig.drop})")
    soak.add_argument("--dup", type=float, default=None, metavar="P",
                      help=f"probability a frame is duplicated, each way of every link (default {SoakConfig.dup})")
    soak.add_argument("--dtypes", type=_list(_dtype, "dtypes"), default=None,
                      help=f"dtypes the calls cycle through (default {','.join(SoakConfig.dtypes)})")
    soak.add_argument("--json", action="store_true", help="print the summary and every call as JSON")
    p.add_argument("--paired", choices=["delivery", "sparsity"], default=None,
                   help="instead of the sweep: two variants of one job on one XDP aggregator, their reps interleaved "
                        "(delivery: multicast against unicast; sparsity: dense inputs against --sparsity, 0.75 by "
                        "default, with --zero-run), with the spread of the paired ratio")
    tor = p.add_argument_group("the torch backend's overhead (--torch-overhead; one --workers and --sizes value, "
                               "--reps apply)")
    tor.add_argument("--torch-overhead", action="store_true",
                     help="instead of the sweep: dist.all_reduce through the backend 'nicoffload' against the same "
                          "group's Communicator.allreduce, interleaved rep by rep in one torchrun job (paired ratios)")
    ten = p.add_argument_group("tenants (--tenants J,..; --workers per job, one --sizes value, --reps apply)")
    ten.add_argument("--tenants", type=_list(plan.workers, "job counts"), default=None, metavar="J,..",
                     help="J jobs of the same shape at once on one XDP aggregator, against one alone")


def _tenants(args) -> int:
    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab import tenants

    bpf.require_root("nicoffload bench --tenants (it builds a namespace testbed and loads XDP)")
    workers = (args.workers or [2])[0]
    size = (args.sizes or [16 << 20])[0]
    counts = sorted(set([1, *args.tenants]))
    print(f"nicoffload bench --tenants: {counts} jobs of {workers} workers, {size >> 10} KiB float32 each, "
          f"{args.reps or 10} reps", file=sys.stderr, flush=True)
    rows = tenants.run(counts, workers=workers, nbytes=size, reps=args.reps or 10, seed=args.seed)
    if not all(r.exact for r in rows):
        print("nicoffload bench --tenants: a job's result was outside its bound", file=sys.stderr)
        return 1
    return 0


def _torch_overhead(args) -> int:
    import json

    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab.train import ddp_train, torchcost

    ddp_train.require_torch()
    bpf.require_root("nicoffload bench --torch-overhead (it builds a namespace testbed and loads XDP)")
    workers, size = (args.workers or [4])[0], (args.sizes or [16 << 20])[0]
    r = torchcost.run(workers, size, args.reps or 40, progress=lambda m: print(m, file=sys.stderr, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch_overhead.json").write_text(json.dumps(r, indent=1))
    print(torchcost.describe(r))
    return 0


def _paired(args) -> int:
    import json

    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab import paired

    bpf.require_root("nicoffload bench --paired (it builds a namespace testbed and loads XDP)")
    workers, size = (args.workers or [4])[0], (args.sizes or [16 << 20])[0]
    sparse = [s for s in (args.sparsity or [0.75]) if s > 0]
    if args.paired == "sparsity" and len(sparse) != 1:
        raise InputError("--paired sparsity takes one sparsity above 0 (dense is the other variant), e.g. --sparsity 0.75")
    r = paired.run(args.paired, workers, size, args.reps or 30,
                   progress=lambda m: print(m, file=sys.stderr, flush=True),
                   sparsity=sparse[0] if sparse else 0.75, zero_run=args.zero_run, seed=args.seed,
                   spec=DEFAULT.replace(**_record_args(args), key=keys.new_key()).validate())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"paired_{args.paired}.json").write_text(json.dumps(r, indent=1))
    print(paired.describe(r))
    return 0


#: ranks of a soak unless --workers says
SOAK_WORKERS = 3
#: sweep options a soak does not take, and soak options a sweep does not (None or False when not given)
SWEEP_ONLY = ("rate", "systems", "reps", "warmup", "min_time", "max_reps", "max_point_time", "full", "quick", "scaling",
              "compute", "ranks_per_host")
SOAK_ONLY = ("drop", "dup", "dtypes", "json")


def _record_args(args) -> dict:
    """--elems and --slots as JobSpec fields (those given)."""
    return {k: getattr(args, k) for k in ("elems", "slots") if getattr(args, k) is not None}


def _no_record_args(args, mode: str) -> None:
    if _record_args(args):
        raise InputError(f"{mode} runs its jobs with the default records and slots: "
                         f"{', '.join(_given(args, ('elems', 'slots')))} go with the sweep, --paired and --soak")


def _given(args, names) -> list[str]:
    return [f"--{k.replace('_', '-')}" for k in names if getattr(args, k) not in (None, False)]


def _dtype(t: str) -> str:
    if t not in SOAK_DTYPES:
        raise InputError(f"one of {', '.join(SOAK_DTYPES)}")
    return t


def _bench(args) -> int:
    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab.bench import drive, report, sweep

    if args.soak is not None:
        return _soak(args)
    modes = _given(args, ("tenants", "torch_overhead", "paired"))
    if modes and args.ranks_per_host not in (None, 1):
        raise InputError(f"--ranks-per-host goes with the sweep, not {modes[0]}")
    if args.tenants is not None:
        _no_record_args(args, "--tenants")
        return _tenants(args)
    if args.torch_overhead:
        _no_record_args(args, "--torch-overhead")
        return _torch_overhead(args)
    if args.paired:
        return _paired(args)
    if _given(args, SOAK_ONLY):
        raise InputError(f"{', '.join(_given(args, SOAK_ONLY))} go with --soak N")
    bpf.require_root("nicoffload bench (it builds namespace testbeds and loads XDP)")
    given = {k: v for k, v in dict(workers=args.workers, sizes=args.sizes, sparsities=args.sparsity,
                                   rates=args.rate, systems=args.systems, reps=args.reps, warmup=args.warmup,
                                   min_time=args.min_time, max_reps=args.max_reps, timeout=args.timeout,
                                   max_point_s=args.max_point_time, ranks_per_host=args.ranks_per_host).items()
             if v is not None}
    delivery = args.delivery or ("unicast" if args.no_multicast else "multicast")
    given.update(out=args.out, seed=args.seed, mpirun=args.mpirun, full=args.full, mode=args.mode, dtype=args.dtype,
                 compute=args.compute, multicast=not args.no_multicast, aggregators=args.aggregators,
                 agg_rate=args.agg_rate, afxdp_tx=args.afxdp_tx, zero_run=args.zero_run,
                 spec=DEFAULT.replace(delivery=delivery, layout=args.shard_layout, lanes=args.lanes,
                                      key=keys.new_key(), **_record_args(args)).validate())
    if args.quick and args.scaling:
        raise InputError("--quick and --scaling are two presets: give one")
    preset = plan.BenchConfig.quick if args.quick else plan.BenchConfig.scaling if args.scaling else plan.BenchConfig
    cfg = preset(**given).validate()
    each = f" x {cfg.ranks_per_host} ranks each" if cfg.ranks_per_host > 1 else ""
    print(f"nicoffload bench: workers {cfg.workers}{each}, sizes {cfg.sizes}, sparsity {cfg.sparsities}, "
          f"rates {cfg.rates}, systems {cfg.systems} -> {cfg.out}", file=sys.stderr, flush=True)
    rows, pngs = sweep.run(cfg, argv=sys.argv)
    print(report.table(rows))
    ratios = drive.ratio_lines(rows)
    if ratios:
        print("\npaired ratios, baseline/nicoffload (rep by rep in one run: median [quartiles]):")
        print("\n".join(ratios))
    print(report.summary(rows, cfg.out, pngs))
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print(f"{len(errors)} point(s) failed; see 'reason' in results.json", file=sys.stderr)
        return 1
    return 0


def _soak_config(args) -> tuple[int, SoakConfig]:
    """(workers, the soak's configuration) from the command line, refusing sweep-only options."""
    given = _given(args, SWEEP_ONLY)
    if args.dtype != plan.BenchConfig.dtype:
        given.append("--dtype (use --dtypes)")
    if given:
        raise InputError(f"--soak does not take {', '.join(given)}")
    for what, values in (("--workers", args.workers), ("--sparsity", args.sparsity)):
        if values is not None and len(values) != 1:
            raise InputError(f"--soak runs one testbed: give one value of {what}, not {len(values)}")
    workers = args.workers[0] if args.workers else SOAK_WORKERS
    spec = DEFAULT.replace(**_record_args(args), **({} if args.timeout is None else {"timeout": args.timeout}))
    kw = dict(calls=args.soak, seed=args.seed, spec=spec, mode=args.mode)
    for name in ("drop", "dup"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.sizes:
        kw["sizes"] = tuple(args.sizes)
    if args.dtypes:
        kw["dtypes"] = tuple(args.dtypes)
    if args.sparsity:
        kw["sparsity"] = args.sparsity[0]
    return workers, SoakConfig(**kw).validate()


def _soak(args) -> int:
    import json

    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab import soak
    from nicoffload.lab.jobs import testbed

    workers, cfg = _soak_config(args)
    bpf.require_root("nicoffload bench --soak (it builds a namespace testbed and loads XDP)")
    print(f"nicoffload bench --soak: {cfg.calls} AllReduces, {workers} ranks, sizes "
          f"{','.join(map(format_size, cfg.sizes))}, dtypes {','.join(cfg.dtypes)}, drop {cfg.drop} dup {cfg.dup} "
          f"on every link, seed {cfg.seed}", file=sys.stderr, flush=True)

    def show(summary) -> None:
        print(json.dumps(summary.to_dict(), indent=1) if args.json else soak.format_summary(summary), flush=True)

    with testbed(workers, cfg.spec.elems) as tb:
        try:
            summary = soak.run(tb, cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
        except soak.SoakError as e:
            show(e.summary)
            raise
    show(summary)
    if not summary.exact:
        print(f"nicoffload bench --soak: {len(summary.failures)} of {summary.count} calls returned a wrong result",
              file=sys.stderr)
        return 1
    return 0
