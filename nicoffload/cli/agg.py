"""``nicoffload agg``: load, inspect and unload the XDP aggregator on an interface. Its jobs are
``agg job`` (:mod:`.aggjob`), an optimizer job's state ``agg opt`` (:mod:`.aggopt`), the service
``agg serve`` (:mod:`.aggserve`)."""
from __future__ import annotations

import json

from nicoffload.cli import aggjob as cli_aggjob
from nicoffload.cli import aggopt as cli_aggopt
from nicoffload.cli import aggserve as cli_aggserve
from nicoffload.cli.app import add_examples
from nicoffload.cli.xdp import MODES, action, show_stats, watch_argument, where_arguments
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import keys


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

    _register_load(asub)
    cli_aggjob.register(asub, _where_or_service)
    cli_aggopt.register(asub, _where)
    _register_bench(asub)
    cli_aggserve.register(asub)
    _register_inspect(asub)


def _where(q) -> None:
    where_arguments(q, "interface the aggregator runs on")


def _where_or_service(q) -> None:
    where_arguments(q, "interface the aggregator runs on (or --service)")
    q._option_string_actions["--iface"].required = False
    cli_aggjob.service_arguments(q)


def _register_load(asub) -> None:
    q = asub.add_parser("load", help="compile, attach and pin the aggregator (and register a first job)")
    add_examples(q, "sudo nicoffload agg load --netns nco-tb-agg --iface eth0 --workers 4",
                 "sudo nicoffload agg load --netns NS --iface eth0 --slots 4096   # jobs come with 'agg job add'",
                 "sudo nicoffload agg load --netns NS --iface eth0 --workers 8 --slots 2048 --elems 512 --mode generic")
    _where(q)
    q.add_argument("--slots", type=int, default=DEFAULT.slots,
                   help=f"aggregation slots in the pool, shared by the jobs (default {DEFAULT.slots})")
    q.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per packet (default {DEFAULT.elems} = 1 KiB)")
    q.add_argument("--mode", choices=MODES, default="auto",
                   help="XDP attach mode: auto picks the fastest that works on the interface (generic "
                        "batches on veth, native elsewhere) and says which")
    q.add_argument("--port", type=int, default=DEFAULT.port, help=f"UDP port (default {DEFAULT.port})")
    cli_aggjob.job_arguments(q, load=True)
    q.add_argument("--with-optimizer", action="store_true",
                   help="room for optimizer state (jobs added later may have an optimizer); implied by --optimizer")
    cli_aggopt.optimizer_arguments(q)
    q.add_argument("--json", action="store_true", help="print the status as JSON")
    q.set_defaults(func=_load)


def _register_inspect(asub) -> None:
    """``agg status|stats|slots|unload``."""
    for name, fn, hlp in (("status", _status, "show what is loaded and its configuration"),
                          ("stats", _stats, "show the per-reason counters (of a local aggregator or a service)"),
                          ("slots", _slots, "dump slot state (bitmaps, counts, sets)"),
                          ("unload", _unload, "detach and remove the pins")):
        q = action(asub, name, fn, hlp, _where_or_service if name == "stats" else _where)
        if name == "stats":
            q.add_argument("--job", type=int, default=None,
                           help="one job's counters (default: every row, including traffic of no job)")
            watch_argument(q)
            add_examples(q, "sudo nicoffload agg stats --netns NS --iface eth0",
                         "sudo nicoffload agg stats --netns NS --iface eth0 --watch 0.5",
                         "nicoffload agg stats --service http://10.0.0.100:7470 --token-file token --job 2")
        elif name == "slots":
            q.add_argument("--slot", type=int, action="append", default=None, help="slot to show (repeat)")
            q.add_argument("--busy", action="store_true", help="show only slots that have been used")
            add_examples(q, "sudo nicoffload agg slots --netns NS --iface eth0 --slot 3",
                         "sudo nicoffload agg slots --netns NS --iface eth0 --busy --json")
        else:
            add_examples(q, f"sudo nicoffload agg {name} --netns NS --iface eth0")


def _load(args) -> int:
    from nicoffload.agg.control import Aggregator, AggSpec

    opt = cli_aggopt.optimizer_from(args)
    job = DEFAULT.job if args.job is None else args.job
    if not args.workers and (args.key is not None or args.no_key):
        raise InputError("--key and --no-key are the key of the job --workers registers; give --workers")
    key, drawn = cli_aggjob.job_key(args) if args.workers else (0, False)
    spec = AggSpec(args.netns, args.iface, 0 if opt else args.workers, args.slots, args.elems, args.port, args.mode,
                   job, args.group or DEFAULT.group, list(args.worker_ip), job_slots=args.job_slots,
                   optimizer=bool(opt) or args.with_optimizer, delivery=args.delivery or "multicast", key=key)
    agg = Aggregator.load(spec)
    if opt:  # the first job is an optimizer job
        try:
            agg.add_job(job, args.workers, args.group, args.worker_ip, slots=args.job_slots, optimizer=opt,
                        params=args.params, initial=cli_aggopt.initial_params(args),
                        delivery=args.delivery or "multicast", key=key)
        except BaseException:
            agg.close()
            raise
    st = agg.status()
    # the program stays attached and pinned after this process exits
    agg.release()
    if args.json:
        print(json.dumps({**st, "key": keys.show(key)} if args.workers else st))
        return 0
    print(f"aggregator loaded on {args.iface} ({args.netns or 'root namespace'}): {st['mode_reason']}; "
          f"prog id {st['prog_id']}: a pool of {args.slots} slots x {args.elems} int32, port {args.port}; "
          f"pinned in {st['pins']}")
    for j in st["jobs"]:
        print("  " + cli_aggjob.describe_job(j) + "; " + cli_aggjob.key_note(key, cli_aggjob.how_drawn(drawn)))
    if not st["jobs"]:
        print("  no job yet: register one with 'nicoffload agg job add'")
    return 0


def _status(args) -> int:
    from nicoffload.agg.control import Aggregator

    from nicoffload.agg import fallback

    agg = Aggregator.open(args.netns, args.iface)
    st = agg.status()
    st["stats"] = agg.stats()
    st["afxdp"] = fallback.handed_off(args.netns, args.iface)
    if args.json:
        print(json.dumps(st))
        return 0
    state = "attached" if st["attached"] else "NOT attached (pins only; run unload)"
    print(f"{st['iface']} in {st['netns'] or 'root'}: {state}, {st['mode']} XDP, prog id {st['prog_id']}")
    print(f"  a pool of {st['slots']} slots x {st['elems']} int32 ({st['free_slots']} free), port {st['port']}")
    for j in st["jobs"]:
        print("  " + cli_aggjob.describe_job(j))
    for h in st["afxdp"]:
        alive = f"pid {h['pid']}" if h["alive"] else f"GONE, see {h['log']}"
        print(f"  job {h['job']}: {h['workers']} workers, {h['slots']} slots of the AF_XDP engine beside the pool "
              f"({alive}), results to {h['group']}")
    s = st["stats"]
    print(f"  rx {s['rx']}  completed {s['completed']}  retx answered {s['retx_answered']}  "
          f"dropped (malformed) {sum(v for k, v in s.items() if k.startswith('bad_'))}")
    return 0


def _stats(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = cli_aggjob.service_client(args)
    if client is not None:
        return show_stats(lambda: client.stats(args.job), args.json, args.watch)
    from nicoffload.agg import fallback

    agg = Aggregator.open(args.netns, args.iface)
    if args.job is not None and args.job not in agg.table.entries:
        def handed() -> dict:  # a job the AF_XDP engine serves: its counters, as the engine last wrote them
            for h in fallback.handed_off(args.netns, args.iface):
                if h["job"] == args.job:
                    return h["stats"]
            return agg.stats(args.job)  # not there either: the aggregator says which jobs it has

        return show_stats(handed, args.json, args.watch)
    return show_stats(lambda: agg.stats(args.job), args.json, args.watch)


def _slots(args) -> int:
    from nicoffload.agg.control import Aggregator

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
    from nicoffload.agg.control import unload

    unload(args.netns, args.iface)
    print(f"aggregator unloaded from {args.iface} ({args.netns or 'root namespace'})")
    return 0


def _register_bench(asub) -> None:
    q = asub.add_parser("bench", help="in-kernel cost per packet (BPF_PROG_TEST_RUN and live bpf stats)")
    add_examples(q, "sudo nicoffload agg bench", "sudo nicoffload agg bench --elems 856 --workers 8 --no-live",
                 "sudo nicoffload agg bench --lock-cost --no-live",
                 "sudo nicoffload agg bench --key-cost --no-live   # the key check against a build without it")
    q.add_argument("--workers", type=int, default=4)
    JobSpec.add_arguments(q, only=("elems",))
    q.add_argument("--rounds", type=int, default=2000, help="rounds through BPF_PROG_TEST_RUN")
    q.add_argument("--no-live", action="store_true", help="skip the live testbed measurement")
    q.add_argument("--optimizer", action="store_true", help="also the in-kernel cost of the optimizers' updates (SGD, AdamW)")
    q.add_argument("--lock-cost", action="store_true",
                   help="also what the slot's spin lock costs per record (against a test-only build without it)")
    q.add_argument("--key-cost", action="store_true",
                   help="also what the job's key check costs per record (against a test-only build without it)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_bench)


def _bench(args) -> int:
    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab import xdpbench

    bpf.require_root("nicoffload agg bench")
    elems = JobSpec.from_args(args).elems
    out = {"workers": args.workers, "elems": elems, "test_run_ns": xdpbench.test_run_costs(args.workers, elems,
                                                                                            args.rounds)}
    if args.optimizer:
        out["optimizer"] = xdpbench.optimizer_costs(args.workers, elems)
        if not args.no_live:
            out["optimizer_live"] = [xdpbench.optimizer_live_cost(args.workers, elems=elems, kind=k)
                                     for k in xdpbench.BENCH_SPECS]
    if args.lock_cost:
        out["lock"] = xdpbench.lock_cost(elems=elems, rounds=args.rounds)
    if args.key_cost:
        out["key"] = xdpbench.key_cost(elems=elems, rounds=args.rounds)
    if not args.no_live:
        out["live"] = xdpbench.live_cost(args.workers, elems=elems)
    print(json.dumps(out) if args.json else xdpbench.describe(out))
    return 0
