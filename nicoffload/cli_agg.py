"""``nicoffload agg``: load, inspect and unload the XDP aggregator on an interface."""
from __future__ import annotations

import json
import sys
import time

from . import proto
from .cli import add_examples
from .jobspec import JobSpec


def register(sub) -> None:
    p = sub.add_parser("agg", help="load, inspect and unload the XDP aggregator")
    add_examples(
        p,
        "sudo nicoffload agg load --netns nco-tb-agg --iface eth0 --workers 4",
        "sudo nicoffload agg status --netns nco-tb-agg --iface eth0 --json",
        "sudo nicoffload agg stats --netns nco-tb-agg --iface eth0 --watch 1",
        "sudo nicoffload agg slots --netns nco-tb-agg --iface eth0 --slot 0 --slot 1",
        "sudo nicoffload agg unload --netns nco-tb-agg --iface eth0",
    )
    asub = p.add_subparsers(dest="agg_command", metavar="ACTION")
    asub.required = True

    def where(q):
        q.add_argument("--netns", default=None, help="network namespace of the interface (default: root)")
        q.add_argument("--iface", required=True, help="interface the aggregator runs on")

    q = asub.add_parser("load", help="compile, attach (native XDP) and pin the aggregator")
    add_examples(q, "sudo nicoffload agg load --netns nco-tb-agg --iface eth0 --workers 4",
                 "sudo nicoffload agg load --netns NS --iface eth0 --workers 8 --slots 2048 --elems 512 --mode generic")
    where(q)
    q.add_argument("--workers", type=int, required=True, help=f"ranks in the job (1..{proto.MAX_WORKERS})")
    q.add_argument("--slots", type=int, default=1024, help="aggregation slots in the pool (default 1024)")
    q.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS,
                   help=f"int32 elements per packet (default {proto.DEFAULT_ELEMS} = 1 KiB)")
    q.add_argument("--mode", choices=["auto", "generic", "native"], default="auto",
                   help="XDP attach mode: auto picks the fastest that works on the interface (generic "
                        "batches on veth, native elsewhere) and says which")
    q.add_argument("--port", type=int, default=proto.DEFAULT_PORT, help=f"UDP port (default {proto.DEFAULT_PORT})")
    q.add_argument("--job", type=int, default=1, help="job id carried in every packet (default 1)")
    q.add_argument("--group", default="239.77.0.1", help="IP multicast group results are sent to")
    q.add_argument("--worker-ip", action="append", default=[], metavar="IP",
                   help="registered source address of rank 0, 1, ... (repeat; default: unchecked)")
    q.add_argument("--json", action="store_true", help="print the status as JSON")
    q.set_defaults(func=_load)

    _register_bench(asub)

    for name, fn, hlp in (("status", _status, "show what is loaded and its configuration"),
                          ("stats", _stats, "show the per-reason counters"),
                          ("slots", _slots, "dump slot state (bitmaps, counts, sets)"),
                          ("unload", _unload, "detach and remove the pins")):
        q = asub.add_parser(name, help=hlp)
        where(q)
        if name != "unload":
            q.add_argument("--json", action="store_true", help="print JSON")
        if name == "stats":
            q.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                           help="print rates every SECONDS until interrupted")
            add_examples(q, "sudo nicoffload agg stats --netns NS --iface eth0",
                         "sudo nicoffload agg stats --netns NS --iface eth0 --watch 0.5")
        elif name == "slots":
            q.add_argument("--slot", type=int, action="append", default=None, help="slot to show (repeat)")
            q.add_argument("--busy", action="store_true", help="show only slots that have been used")
            add_examples(q, "sudo nicoffload agg slots --netns NS --iface eth0 --slot 3",
                         "sudo nicoffload agg slots --netns NS --iface eth0 --busy --json")
        else:
            add_examples(q, f"sudo nicoffload agg {name} --netns NS --iface eth0")
        q.set_defaults(func=fn)


def _load(args) -> int:
    from .aggregator import AggSpec, Aggregator

    spec = AggSpec(args.netns, args.iface, args.workers, args.slots, args.elems, args.port, args.mode,
                   args.job, args.group, list(args.worker_ip))
    agg = Aggregator.load(spec)
    st = agg.status()
    # the program stays attached and pinned after this process exits
    agg.b = None
    if args.json:
        print(json.dumps(st))
    else:
        print(f"aggregator loaded on {args.iface} ({args.netns or 'root namespace'}): {st['mode_reason']}; "
              f"prog id {st['prog_id']}: {args.workers} workers, {args.slots} slots x {args.elems} int32, "
              f"port {args.port}, results to {args.group}; pinned in {st['pins']}")
    return 0


def _status(args) -> int:
    from .aggregator import Aggregator

    agg = Aggregator.open(args.netns, args.iface)
    st = agg.status()
    st["config"] = agg.config()
    st["stats"] = agg.stats()
    if args.json:
        print(json.dumps(st))
    else:
        state = "attached" if st["attached"] else "NOT attached (pins only; run unload)"
        print(f"{st['iface']} in {st['netns'] or 'root'}: {state}, {st['mode']} XDP, prog id {st['prog_id']}")
        print(f"  job {st['job']}, {st['workers']} workers, {st['slots']} slots x {st['elems']} int32, "
              f"port {st['port']}, results to {st['group']}")
        s = st["stats"]
        print(f"  rx {s['rx']}  completed {s['completed']}  retx answered {s['retx_answered']}  "
              f"dropped (malformed) {sum(v for k, v in s.items() if k.startswith('bad_'))}")
    return 0


def _print_stats(stats: dict, prev: dict | None, dt: float) -> None:
    width = max(len(k) for k in stats)
    for k, v in stats.items():
        line = f"{k:<{width}}  {v:>14,}"
        if prev is not None and dt > 0:
            line += f"  {(v - prev[k]) / dt:>14,.0f}/s"
        print(line)


def _stats(args) -> int:
    from .aggregator import Aggregator

    agg = Aggregator.open(args.netns, args.iface)
    if args.watch is None:
        s = agg.stats()
        print(json.dumps(s) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            _print_stats(s, None, 0)
        return 0
    prev, t0 = agg.stats(), time.monotonic()
    try:
        while True:
            time.sleep(args.watch)
            cur, t1 = agg.stats(), time.monotonic()
            if args.json:
                print(json.dumps({"t": t1, "stats": cur}), flush=True)
            else:
                print(f"--- {time.strftime('%H:%M:%S')}")
                _print_stats(cur, prev, t1 - t0)
                sys.stdout.flush()
            prev, t0 = cur, t1
    except KeyboardInterrupt:
        return 0


def _slots(args) -> int:
    from .aggregator import Aggregator

    agg = Aggregator.open(args.netns, args.iface)
    ids = args.slot if args.slot else range(agg.spec.slots)
    rows = [agg.slot(i) for i in ids]
    if args.busy:
        rows = [r for r in rows if any(s["used"] for s in r["sets"])]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'slot':>6} {'set':>3} {'epoch':>10} {'round':>10} {'bitmap':>10} {'mask':>10} {'done':>4} "
          f"{'count':>5} {'exp':>5} {'op':>5}")
    for r in rows:
        for s in r["sets"]:
            if not s["used"] and not args.slot:
                continue
            print(f"{r['slot']:>6} {s['set']:>3} {s['epoch']:>10} {s['round']:>10} {s['bitmap']:>#10x} "
                  f"{s['mask']:>#10x} {'yes' if s['complete'] else 'no':>4} {s['count']:>5} {s['exp']:>5} "
                  f"{s['op']:>5}")
    return 0


def _unload(args) -> int:
    from .aggregator import unload

    unload(args.netns, args.iface)
    print(f"aggregator unloaded from {args.iface} ({args.netns or 'root namespace'})")
    return 0


def _register_bench(asub) -> None:
    q = asub.add_parser("bench", help="in-kernel cost per packet (BPF_PROG_TEST_RUN and live bpf stats)")
    add_examples(q, "sudo nicoffload agg bench", "sudo nicoffload agg bench --elems 858 --workers 8 --no-live")
    q.add_argument("--workers", type=int, default=4)
    JobSpec.add_arguments(q, only=("elems",))
    q.add_argument("--rounds", type=int, default=2000, help="rounds through BPF_PROG_TEST_RUN")
    q.add_argument("--no-live", action="store_true", help="skip the live testbed measurement")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_bench)


def _bench(args) -> int:
    from . import bpf
    from .lab import xdpbench

    bpf.require_root("nicoffload agg bench")
    elems = JobSpec.from_args(args).elems
    out = {"workers": args.workers, "elems": elems, "test_run_ns": xdpbench.test_run_costs(args.workers, elems,
                                                                                            args.rounds)}
    if not args.no_live:
        out["live"] = xdpbench.live_cost(args.workers, elems=elems)
    print(json.dumps(out) if args.json else xdpbench.describe(out))
    return 0
