"""``nicoffload worker``, ``aggregator-userspace``, ``allreduce`` and ``demo``: arguments only;
the work is in :mod:`nicoffload.lab`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from nicoffload.cli.app import add_examples
from nicoffload.errors import InputError
from nicoffload.jobspec import JobSpec
from nicoffload.lab.aggregators import AGG_FIELDS


def register(sub) -> None:
    _register_worker(sub)
    _register_userspace(sub)
    _register_afxdp(sub)
    _register_allreduce(sub)
    _register_demo(sub)


def _register_worker(sub) -> None:
    p = sub.add_parser("worker", help="one rank of an AllReduce job (run on each host)")
    add_examples(p,
                 "nicoffload worker --rank 0 --world 4 --aggregator 10.0.0.100 --key KEY --input g0.npy "
                 "--output sum.npy   # KEY: as 'agg load'/'agg job add' printed it",
                 "NICOFFLOAD_KEY=KEY nicoffload worker --rank 1 --world 4 --aggregator 10.0.0.100 --local-ip 10.0.0.2 "
                 "--group 239.77.0.1 --input g1.npy --output sum.npy --json",
                 "sudo nicoffload worker --mode ring --rank 1 --world 3 --peers 10.0.0.1,10.0.0.2,10.0.0.3 "
                 "--input g1.npy --output sum.npy   # the ring offload (DirectReduce)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--aggregator", metavar="IP", default=None,
                   help="address of the aggregator (--mode aggregator); IP1,IP2,...: a job sharded over several")
    p.add_argument("--peers", default=None, metavar="IP,IP,...",
                   help="--mode ring: every rank's address, in rank order (this rank's is on its interface)")
    p.add_argument("--ring-userspace", action="store_true",
                   help="--mode ring without XDP: every hop in user space (the user-space UDP ring baseline)")
    p.add_argument("--capacity", type=int, default=None, metavar="RECORDS",
                   help="--mode ring: records per pass when this worker loads its own ring program")
    p.add_argument("--local-ip", default=None, help="this host's address (selects the interface)")
    p.add_argument("--input", required=True, type=Path, help=".npy file (int32, float32 or float64)")
    p.add_argument("--output", type=Path, default=None, help=".npy file for the sum")
    p.add_argument("--reps", type=int, default=1, help="repeat the AllReduce (timings of each)")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    JobSpec.add_arguments(p)
    p.set_defaults(func=_worker)


def _register_userspace(sub) -> None:
    p = sub.add_parser("aggregator-userspace", help="the user-space aggregator (same protocol, no XDP)")
    add_examples(p, "nicoffload aggregator-userspace --workers 4 --local-ip 10.0.0.100",
                 "nicoffload aggregator-userspace --workers 8 --slots 2048 --group 239.77.0.1 --json")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--local-ip", default=None, help="address to send results from")
    p.add_argument("--worker-ip", action="append", default=[], help="registered address of rank 0, 1, ...")
    p.add_argument("--duration", type=float, default=None, help="stop after SECONDS (default: until SIGTERM)")
    p.add_argument("--json", action="store_true", help="print counters as JSON on exit")
    JobSpec.add_arguments(p, only=AGG_FIELDS)
    p.set_defaults(func=_userspace)


def _register_afxdp(sub) -> None:
    p = sub.add_parser("aggregator-afxdp",
                       help="the AF_XDP aggregator engine: the same protocol in a compiled poll loop over AF_XDP "
                            "sockets (the DPDK-style, off-path engine; root)")
    add_examples(p, "sudo nicoffload aggregator-afxdp --workers 4 --local-ip 10.0.0.100",
                 "sudo nicoffload aggregator-afxdp --workers 8 --iface eth1 --xdp-mode native --spin-us 0 --json",
                 "sudo nicoffload aggregator-afxdp --iface eth1 --xsk-map id:42 --jobs-file jobs.json   "
                 "# beside the XDP aggregator (agg job add --fallback afxdp does this)")
    p.add_argument("--workers", type=int, default=None, help="ranks of the job (not with --jobs-file)")
    p.add_argument("--jobs-file", default=None,
                   help="serve the jobs this JSON file lists (job id -> job, workers, group, slots, delivery, "
                        "worker_ips), following it as it changes, instead of one job from the options")
    p.add_argument("--local-ip", default=None, help="address to send results from (selects the interface)")
    p.add_argument("--iface", default=None, help="the interface (default: the one holding --local-ip)")
    p.add_argument("--worker-ip", action="append", default=[], help="registered address of rank 0, 1, ...")
    p.add_argument("--xdp-mode", dest="xdp_mode", choices=["auto", "generic", "native"], default="auto",
                   help="how the steering program is attached (auto: generic on veth, where batches arrive whole)")
    p.add_argument("--spin-us", type=int, default=None,
                   help="microseconds the loop busy-polls after the last frame before it sleeps (default 20)")
    p.add_argument("--xsk-map", default=None,
                   help="an XSKMAP to join, id:N or a pinned path (the XDP aggregator's, for a job it hands off) "
                        "instead of attaching the engine's own steering program")
    p.add_argument("--tx", choices=["auto", "xsk", "socket"], default="auto",
                   help="how results leave: the AF_XDP tx ring (xsk) or a UDP socket, a batch per UDP_SEGMENT send "
                        "(socket); auto: socket in copy mode (veth), where the tx ring cannot batch, else xsk")
    p.add_argument("--stats-file", default=None, help="write the counters there (JSON) every half second")
    p.add_argument("--duration", type=float, default=None, help="stop after SECONDS (default: until SIGTERM)")
    p.add_argument("--json", action="store_true", help="print counters as JSON on exit")
    JobSpec.add_arguments(p, only=AGG_FIELDS)
    p.set_defaults(func=_afxdp)


def _register_allreduce(sub) -> None:
    p = sub.add_parser("allreduce", help="sum .npy files through a namespace testbed (needs root)")
    add_examples(p, "sudo nicoffload allreduce a.npy b.npy c.npy d.npy -o sum.npy",
                 "sudo nicoffload allreduce a.npy b.npy -o sum.npy --aggregator userspace --json",
                 "sudo nicoffload allreduce a.npy b.npy -o sum.npy --drop 0.02 --dup 0.02 --seed 7",
                 "sudo nicoffload allreduce a.npy b.npy c.npy -o sum.npy --mode ring   # every worker's XDP adds",
                 "sudo nicoffload allreduce a.npy b.npy c.npy -o sum.npy --mode ring --aggregator userspace")
    p.add_argument("inputs", nargs="+", type=Path, help="one .npy per worker (same shape and dtype)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--aggregator", choices=["xdp", "afxdp", "userspace"], default="xdp",
                   help="who sums: XDP, the AF_XDP engine or user space (the aggregator; with --mode ring every "
                        "worker: xdp or userspace)")
    p.add_argument("--drop", type=float, default=0.0, help="drop probability on every link")
    p.add_argument("--dup", type=float, default=0.0, help="duplication probability on every link")
    p.add_argument("--seed", type=int, default=1)
    JobSpec.add_arguments(p, only=("elems", "timeout", "mode", "delivery", "layout", "lanes"), delivery=None)
    _add_fabric_arguments(p)
    p.set_defaults(func=_allreduce)


def _register_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job: gradients through XDP, AF_XDP and user space, checked (root)")
    add_examples(p, "sudo nicoffload demo", "sudo nicoffload demo --workers 8 --size 64MiB --sparsity 0.75",
                 "sudo nicoffload demo --json", "sudo nicoffload demo --mode ring --workers 4 --sparsity 0")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size", default="16MiB", help="bytes of float32 gradients per worker")
    p.add_argument("--sparsity", type=float, default=0.5, help="fraction of 1 KiB blocks that are zero")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    JobSpec.add_arguments(p, only=("mode", "delivery", "layout", "lanes"), delivery=None)
    _add_fabric_arguments(p)
    p.set_defaults(func=_demo)


def _add_fabric_arguments(p) -> None:
    """The testbed's fabric and aggregators, and --json: shared by ``allreduce`` and ``demo``."""
    p.add_argument("--no-multicast", action="store_true",
                   help="a fabric that drops multicast frames (testbed up --no-multicast): unicast delivery unless "
                        "--delivery says otherwise")
    p.add_argument("--aggregators", type=int, default=1, metavar="K",
                   help="aggregator hosts; the job is sharded over them (--shard-layout), one shard on each")
    p.add_argument("--json", action="store_true")


def _worker(args) -> int:
    from nicoffload.lab.inputs import check_output, load_input, save_output
    from nicoffload.lab.jobs import describe_rank, worker_rank

    spec = JobSpec.from_args(args)
    peers = [ip.strip() for ip in args.peers.split(",") if ip.strip()] if args.peers else None
    if spec.mode == "ring" and not peers:
        raise InputError("--mode ring needs --peers (every rank's address, in rank order)")
    if spec.mode == "aggregator" and not args.aggregator:
        raise InputError("--mode aggregator needs --aggregator (the aggregator's address)")
    x = load_input(args.input, finite=False)  # a NaN or an Inf: every rank refuses the call together
    if args.output:
        check_output(args.output)
    out, report = worker_rank(args.rank, args.world, args.aggregator, x, spec, args.local_ip, args.reps, peers,
                              args.ring_userspace, args.capacity)
    if args.output:
        save_output(args.output, out)
    print(json.dumps(report) if args.json else describe_rank(report))
    return 0


def _userspace(args) -> int:
    from nicoffload.lab.aggregators import serve_userspace

    stats = serve_userspace(args.workers, JobSpec.from_args(args), args.local_ip, args.worker_ip, args.duration,
                            ready=lambda: print("ready", flush=True))
    print(json.dumps({"stats": stats}) if args.json else
          f"completed {stats['completed']} rounds, received {stats['rx']} packets", flush=True)
    return 0


def _afxdp(args) -> int:
    from nicoffload.lab.aggregators import serve_afxdp

    if (args.workers is None) == (args.jobs_file is None):
        raise InputError("give the job's --workers, or --jobs-file (not both)")

    out = serve_afxdp(args.workers, JobSpec.from_args(args), args.local_ip, args.worker_ip, args.duration,
                      ready=lambda d: print(f"ready {json.dumps(d)}", flush=True), iface=args.iface,
                      mode=args.xdp_mode, spin_us=args.spin_us, xsk_map=args.xsk_map,
                      stats_file=args.stats_file, tx=args.tx, jobs_file=args.jobs_file)
    stats = out["stats"]
    print(json.dumps(out) if args.json else
          f"completed {stats['completed']} rounds, received {stats['rx']} packets", flush=True)
    return 0


def _allreduce(args) -> int:
    from nicoffload.lab.allreduce import allreduce_arrays, describe_allreduce
    from nicoffload.lab.inputs import check_inputs, check_output, save_output

    arrays = check_inputs(args.inputs)
    check_output(args.output)  # before the testbed is built and the job run
    spec = JobSpec.from_args(args, delivery=delivery_for(args))
    out, report = allreduce_arrays(arrays, args.aggregator, spec, args.drop, args.dup, args.seed,
                                   multicast=not args.no_multicast, aggregators=args.aggregators)
    save_output(args.output, out)
    report["output"] = str(args.output)
    print(json.dumps(report) if args.json else describe_allreduce(report))
    return 0


def _demo(args) -> int:
    from nicoffload.lab.allreduce import demo, demo_ok, describe_demo
    from nicoffload.lab.inputs import parse_size

    spec = JobSpec.from_args(args, delivery=delivery_for(args))
    mode = spec.mode
    what = "ring" if mode == "ring" else "aggregator"

    def say(kind: str) -> None:
        if not args.json:
            lanes = " in 16-bit lanes" if spec.lanes == 16 else ""
            print(f"running {args.workers} workers x {args.size} float32{lanes} through the {kind} {what} ...",
                  file=sys.stderr, flush=True)

    summary = demo(args.workers, parse_size(args.size), args.sparsity, args.reps, args.seed, progress=say, mode=mode,
                   delivery=spec.delivery, multicast=not args.no_multicast, aggregators=args.aggregators,
                   lanes=spec.lanes)
    print(json.dumps(summary) if args.json else describe_demo(summary, args.reps))
    return 0 if demo_ok(summary) else 1


def delivery_for(args) -> str:
    """--delivery, or by default unicast on a fabric without multicast (--no-multicast)."""
    return args.spec_delivery or ("unicast" if args.no_multicast else "multicast")
