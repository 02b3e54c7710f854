"""``nicoffload agg``: load, inspect and unload the XDP aggregator on an interface."""
from __future__ import annotations

import json

from nicoffload.cli import aggopt as cli_aggopt
from nicoffload.cli.app import add_examples
from nicoffload.cli.xdp import MODES, action, show_stats, watch_argument, where_arguments
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.wire import proto


def _job_arguments(q, load: bool = False) -> None:
    """The options of a job entry (``agg load`` registers one when --workers is given)."""
    q.add_argument("--workers", type=int, required=not load, default=0,
                   help=f"ranks in the job (1..{proto.MAX_WORKERS})" + ("; without it no job is registered" if load
                                                                      else ""))
    q.add_argument("--job", type=int, default=None,
                   help=f"job id carried in every packet (default {DEFAULT.job}; with --service: the lowest free one)")
    q.add_argument("--group", default=None,
                   help=f"IP multicast group of the job's results (default: {DEFAULT.group}, or the next one no job uses)")
    q.add_argument("--worker-ip", action="append", default=[], metavar="IP",
                   help="registered source address of rank 0, 1, ... (repeat; default: unchecked)")
    q.add_argument("--job-slots" if load else "--slots", dest="job_slots", type=int, default=None,
                   help="the job's share of the pool (default: the largest free range)")
    q.add_argument("--delivery", choices=["multicast", "unicast"], default=None,
                   help="how results reach the ranks: multicast (to the job's group; the default) or unicast (a "
                        "copy to each rank's --worker-ip, cloned in the aggregator's kernel: networks without "
                        "multicast; with --service, the service's default)")


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
        where_arguments(q, "interface the aggregator runs on")

    q = asub.add_parser("load", help="compile, attach and pin the aggregator (and register a first job)")
    add_examples(q, "sudo nicoffload agg load --netns nco-tb-agg --iface eth0 --workers 4",
                 "sudo nicoffload agg load --netns NS --iface eth0 --slots 4096   # jobs come with 'agg job add'",
                 "sudo nicoffload agg load --netns NS --iface eth0 --workers 8 --slots 2048 --elems 512 --mode generic")
    where(q)
    q.add_argument("--slots", type=int, default=DEFAULT.slots,
                   help=f"aggregation slots in the pool, shared by the jobs (default {DEFAULT.slots})")
    q.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per packet (default {DEFAULT.elems} = 1 KiB)")
    q.add_argument("--mode", choices=MODES, default="auto",
                   help="XDP attach mode: auto picks the fastest that works on the interface (generic "
                        "batches on veth, native elsewhere) and says which")
    q.add_argument("--port", type=int, default=DEFAULT.port, help=f"UDP port (default {DEFAULT.port})")
    _job_arguments(q, load=True)
    q.add_argument("--with-optimizer", action="store_true",
                   help="room for optimizer state (jobs added later may have an optimizer); implied by --optimizer")
    cli_aggopt.optimizer_arguments(q)
    q.add_argument("--json", action="store_true", help="print the status as JSON")
    q.set_defaults(func=_load)

    def where_or_service(q):
        where_arguments(q, "interface the aggregator runs on (or --service)")
        q._option_string_actions["--iface"].required = False
        service_arguments(q)

    _register_jobs(asub, where_or_service)
    cli_aggopt.register(asub, where)
    _register_bench(asub)
    _register_serve(asub)

    for name, fn, hlp in (("status", _status, "show what is loaded and its configuration"),
                          ("stats", _stats, "show the per-reason counters (of a local aggregator or a service)"),
                          ("slots", _slots, "dump slot state (bitmaps, counts, sets)"),
                          ("unload", _unload, "detach and remove the pins")):
        q = action(asub, name, fn, hlp, where_or_service if name == "stats" else where)
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
    spec = AggSpec(args.netns, args.iface, 0 if opt else args.workers, args.slots, args.elems, args.port, args.mode,
                   job, args.group or DEFAULT.group, list(args.worker_ip), job_slots=args.job_slots,
                   optimizer=bool(opt) or args.with_optimizer, delivery=args.delivery or "multicast")
    agg = Aggregator.load(spec)
    if opt:  # the first job is an optimizer job
        try:
            agg.add_job(job, args.workers, args.group, args.worker_ip, slots=args.job_slots, optimizer=opt,
                        params=args.params, initial=cli_aggopt.initial_params(args),
                        delivery=args.delivery or "multicast")
        except BaseException:
            agg.close()
            raise
    st = agg.status()
    # the program stays attached and pinned after this process exits
    agg.release()
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"aggregator loaded on {args.iface} ({args.netns or 'root namespace'}): {st['mode_reason']}; "
          f"prog id {st['prog_id']}: a pool of {args.slots} slots x {args.elems} int32, port {args.port}; "
          f"pinned in {st['pins']}")
    for j in st["jobs"]:
        print("  " + _describe_job(j))
    if not st["jobs"]:
        print("  no job yet: register one with 'nicoffload agg job add'")
    return 0


def _describe_job(j: dict) -> str:
    base, n = j["slot_base"], j["slot_count"]
    ips = ", ".join(j["worker_ips"]) if j["worker_ips"] else "sources unchecked"
    to = "each rank's address (unicast)" if j.get("delivery") == "unicast" else j["group"]
    return (f"job {j['job']}: {j['workers']} workers ({ips}), slots {base}..{base + n - 1} of the pool, "
            f"results to {to}")


def _register_jobs(asub, where) -> None:
    q = asub.add_parser("job", help="register, remove and list the jobs of a loaded aggregator")
    add_examples(q, "sudo nicoffload agg job add --netns NS --iface eth0 --job 2 --workers 4 --slots 256 "
                    "--group 239.77.0.2 --worker-ip 10.0.0.1 --worker-ip 10.0.0.2 ...",
                 "nicoffload agg job add --service http://10.0.0.100:7470 --token-file token --workers 4",
                 "nicoffload agg job list --service http://10.0.0.100:7470 --token-file token",
                 "sudo nicoffload agg job list --netns NS --iface eth0",
                 "sudo nicoffload agg job remove --netns NS --iface eth0 --job 2")
    jsub = q.add_subparsers(dest="job_command", metavar="ACTION")
    jsub.required = True
    a = jsub.add_parser("add", help="register a job with its ranks, addresses, group and share of the pool")
    where(a)
    _job_arguments(a)
    cli_aggopt.optimizer_arguments(a)
    a.add_argument("--lease", type=float, default=0.0, metavar="SECONDS",
                   help="with --service: the job's lease (0, the default: none, the job stays until removed)")
    a.add_argument("--fallback", choices=["afxdp"], default=None,
                   help="when the XDP pool refuses the job (no free slots or job entry), serve it with the AF_XDP "
                        "engine beside the aggregator: the XDP program steers its frames to the engine's sockets")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_job_add)
    r = jsub.add_parser("remove", help="unregister a job (its packets are then counted as no job's)")
    where(r)
    r.add_argument("--job", type=int, required=True)
    r.set_defaults(func=_job_remove)
    ls = jsub.add_parser("list", help="the registered jobs with their epoch state and counters")
    where(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_job_list)


def service_arguments(q) -> None:
    q.add_argument("--service", default=None, metavar="URL",
                   help="talk to an aggregator service (nicoffload agg serve) instead of a local aggregator")
    q.add_argument("--token-file", default=None, metavar="FILE", help="the service's bearer token")


def _client(args):
    """The service's client when --service is given; else None (and --iface is then needed)."""
    if args.service:
        from nicoffload.service.client import ServiceClient

        return ServiceClient.from_files(args.service, args.token_file)
    if not args.iface:
        raise InputError("give the aggregator's --iface (and --netns), or --service URL --token-file FILE")
    return None


def _job_add(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = _client(args)
    if client is not None:
        return _job_add_service(args, client)
    from nicoffload.agg import fallback

    args.job = DEFAULT.job if args.job is None else args.job
    agg = Aggregator.open(args.netns, args.iface)
    if any(h["job"] == args.job for h in fallback.handed_off(args.netns, args.iface)):
        raise AlreadyExistsError(f"job {args.job} is served by the AF_XDP engine on {args.iface}; remove it first "
                                 f"(agg job remove --job {args.job})")
    opt = cli_aggopt.optimizer_from(args)
    try:
        # a refusal (no room in the pool, no free job entry) raises CapacityError: one line, exit 10
        e = agg.add_job(args.job, args.workers, args.group, args.worker_ip, slots=args.job_slots,
                        optimizer=opt, params=args.params, initial=cli_aggopt.initial_params(args),
                        delivery=args.delivery or "multicast")
    except CapacityError as refusal:
        if args.fallback != "afxdp":
            raise
        if opt is not None:
            raise InputError(f"{refusal}; an optimizer job cannot fall back to the AF_XDP engine (it has no "
                             f"optimizer): remove a job or load a larger pool") from None
        return _job_fallback(args, agg, str(refusal))
    print(json.dumps({**e.to_dict(), "engine": "xdp"}) if args.json else
          f"registered on {args.iface}: {_describe_job(agg.job_state(e.job) | e.to_dict())}; "
          f"{agg.table.free_slots()} of {agg.spec.slots} slots left; the XDP aggregator took it")
    return 0


def _job_fallback(args, agg, why: str) -> int:
    """The XDP pool refused the job: the AF_XDP engine beside it takes it."""
    from nicoffload.agg import fallback
    from nicoffload.agg.jobtable import default_group

    group = args.group or default_group(args.job, agg.table, fallback.groups_in_use(args.netns, args.iface))
    if args.job_slots is not None and args.job_slots < 1:
        raise InputError(f"--slots is at least 1, not {args.job_slots}")
    slots = DEFAULT.slots if args.job_slots is None else args.job_slots
    got = fallback.hand_off(agg, args.job, args.workers, group, list(args.worker_ip), slots,
                            args.delivery or "multicast")
    if args.json:
        print(json.dumps({"engine": "afxdp", "refused_by_xdp": why, **got}))
        return 0
    to = "each rank's address (unicast)" if got["delivery"] == "unicast" else group
    print(f"the XDP pool refused job {args.job} ({why}); the AF_XDP engine took it: {args.workers} workers, "
          f"{slots} slots of its own, results to {to}; engine pid {got['pid']} on {args.iface} "
          f"({got.get('mode', '?')} XDP steering, {'copy' if got.get('copy_mode', True) else 'zero-copy'} mode); "
          f"remove with: nicoffload agg job remove --netns {args.netns} --iface {args.iface} --job {args.job}")
    return 0


def _job_add_service(args, client) -> int:
    import getpass
    import socket

    from nicoffload.service.api import JobRequest

    opt = cli_aggopt.optimizer_from(args)
    req = JobRequest(world=args.workers, workers=list(args.worker_ip), job=args.job, slots=args.job_slots,
                     group=args.group, lease_s=args.lease, optimizer=opt, params=args.params if opt else 0,
                     delivery=args.delivery,
                     owner=f"nicoffload agg job add ({getpass.getuser()}@{socket.gethostname()})")
    initial = cli_aggopt.initial_params(args)  # a bad file is refused before the job exists
    g = client.create_job(req)
    if initial is not None:
        try:
            client.set_params(g.job, initial)
        except BaseException:
            client.remove_job(g.job)  # no job left behind without its parameters
            raise
    if args.json:
        print(json.dumps(g.to_json()))
        return 0
    lease = f"lease {g.lease_s:g}s (renew: POST /v1/jobs/{g.job}/lease)" if g.lease_s else "no lease"
    span = f"{g.slot_base}..{g.slot_base + g.slots - 1}"
    print(f"registered at {client.url}: job {g.job}: {g.world} workers, slots {span}, results to {g.group}; ranks send to {g.aggregator}:{g.port} from port {g.local_port}; {lease}")
    return 0


def _job_remove(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = _client(args)
    if client is not None:
        d = client.remove_job(args.job)
        print(f"job {d['job']} removed from {client.url}; slots {d['slot_base']}..{d['slot_base'] + d['slots'] - 1} "
              f"are free")
        return 0
    from nicoffload.agg import fallback

    agg = Aggregator.open(args.netns, args.iface)
    if any(h["job"] == args.job for h in fallback.handed_off(args.netns, args.iface)):
        got = fallback.take_back(agg, args.job)
        done = got.get("last", {}).get("completed", 0)
        print(f"job {args.job} removed from {args.iface}: its AF_XDP engine (pid {got['pid']}) stopped after "
              f"{done} rounds")
        return 0
    e = agg.remove_job(args.job)
    print(f"job {e.job} removed from {args.iface}; slots {e.slot_base}..{e.slot_base + e.slot_count - 1} are free")
    return 0


def _job_list(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = _client(args)
    if client is not None:
        d = client.jobs()
        jobs, free, slots, u = d["jobs"], d["free_slots"], d["slots"], d["unattributed"]
        handed = []
    else:
        from nicoffload.agg import fallback

        agg = Aggregator.open(args.netns, args.iface)
        jobs, free, slots, u = agg.jobs(), agg.table.free_slots(), agg.spec.slots, agg.unattributed()
        handed = fallback.handed_off(args.netns, args.iface)
    if args.json:
        print(json.dumps({"jobs": jobs, "free_slots": free, "slots": slots, "unattributed": u, "afxdp": handed}))
        return 0
    print(f"{'job':>6} {'workers':>7} {'slots':>13} {'group':>15} {'epoch':>10} {'joined':>10} {'completed':>10} "
          f"{'rx':>10} {'dropped':>8}")
    for j in jobs:
        s = j["stats"]
        span = f"{j['slot_base']}..{j['slot_base'] + j['slots'] - 1}"
        bad = sum(v for k, v in s.items() if k.startswith("bad_"))
        print(f"{j['job']:>6} {j['workers']:>7} {span:>13} {j['group']:>15} {j['epoch']:>10} {j['joined']:>#10x} "
              f"{s['completed']:>10} {s['rx']:>10} {bad:>8}")
        if j.get("lease_remaining_s") is not None:
            print(f"{'':>6} lease {j['lease_s']:g}s, {j['lease_remaining_s']:.0f}s left; owner {j['owner']}")
    for h in handed:
        s = h["stats"]
        bad = sum(v for k, v in s.items() if k.startswith("bad_"))
        state = f"engine pid {h['pid']}" if h["alive"] else f"ENGINE GONE (pid {h['pid']}; log {h['log']})"
        print(f"{h['job']:>6} {h['workers']:>7} {'afxdp ' + str(h['slots']):>13} {h['group']:>15} {'':>10} {'':>10} "
              f"{s.get('completed', 0):>10} {s.get('rx', 0):>10} {bad:>8}  AF_XDP engine, {state}")
    print(f"free slots: {free} of {slots}; traffic of no job: {u['rx']} frames, {u['bad_job']} of an unregistered job")
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
        print("  " + _describe_job(j))
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

    client = _client(args)
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
    add_examples(q, "sudo nicoffload agg bench", "sudo nicoffload agg bench --elems 858 --workers 8 --no-live",
                 "sudo nicoffload agg bench --lock-cost --no-live")
    q.add_argument("--workers", type=int, default=4)
    JobSpec.add_arguments(q, only=("elems",))
    q.add_argument("--rounds", type=int, default=2000, help="rounds through BPF_PROG_TEST_RUN")
    q.add_argument("--no-live", action="store_true", help="skip the live testbed measurement")
    q.add_argument("--optimizer", action="store_true", help="also the in-kernel cost of the optimizers' updates (SGD, AdamW)")
    q.add_argument("--lock-cost", action="store_true",
                   help="also what the slot's spin lock costs per record (against a test-only build without it)")
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
    if not args.no_live:
        out["live"] = xdpbench.live_cost(args.workers, elems=elems)
    print(json.dumps(out) if args.json else xdpbench.describe(out))
    return 0


def _register_serve(asub) -> None:
    q = asub.add_parser("serve", help="run the aggregator as a service: jobs over an HTTP API, leases, metrics",
                        description="Load the XDP aggregator on --iface as a shared pool (or take over the one an "
                                    "earlier service left there) and serve its jobs over an authenticated HTTP API "
                                    "until SIGTERM/SIGINT; then unload and leave nothing (docs/service.md).")
    add_examples(q, "sudo nicoffload agg serve --iface eth0 --listen 10.0.0.100:7470 "
                    "--token-file /etc/nicoffload/token",
                 "sudo nicoffload agg serve --netns nco-tb-agg --iface eth0 --listen 10.199.0.100:7470 "
                 "--token-file token --slots 8192",
                 "curl -H \"Authorization: Bearer $(cat token)\" http://10.0.0.100:7470/v1/jobs")
    where_arguments(q, "interface the aggregator runs on")
    q.add_argument("--listen", required=True, metavar="ADDR:PORT",
                   help="where the HTTP API listens (inside --netns when given)")
    q.add_argument("--token-file", required=True, metavar="FILE",
                   help="the bearer token every control request must carry (one word, 16+ characters)")
    q.add_argument("--slots", type=int, default=4096, help="slots of the shared pool (default 4096)")
    q.add_argument("--job-slots", type=int, default=DEFAULT.slots,
                   help=f"a job's share unless it asks for one (default {DEFAULT.slots}; less if less is free)")
    q.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per packet (default {DEFAULT.elems})")
    q.add_argument("--port", type=int, default=DEFAULT.port, help=f"the aggregator's UDP port (default {DEFAULT.port})")
    q.add_argument("--mode", choices=MODES, default="auto", help="XDP attach mode")
    q.add_argument("--lease", type=float, default=30.0, metavar="SECONDS",
                   help="a job whose owner neither renews nor sends for this long is removed (default 30)")
    q.add_argument("--no-optimizer", action="store_true",
                   help="no room for optimizer state (jobs cannot carry an optimizer)")
    q.add_argument("--keep-loaded", action="store_true",
                   help="on SIGTERM/SIGINT leave the aggregator and its jobs pinned for the next service")
    q.add_argument("--no-multicast", action="store_true",
                   help="the network carries no multicast: every job gets unicast delivery (a copy of each result "
                        "to every rank's address, cloned in the aggregator's kernel)")
    q.add_argument("--fallback", choices=["afxdp"], default=None,
                   help="a job the XDP pool refuses (no free slots or job entry) is served by the AF_XDP engine "
                        "beside the aggregator instead of refused (its grant says engine \"afxdp\"; optimizer "
                        "jobs are still refused)")
    q.add_argument("--verbose", action="store_true")
    q.set_defaults(func=_serve)


def _serve(args) -> int:
    from nicoffload.service.run import ServeOptions, configure_logging, serve

    configure_logging(args.verbose)
    o = ServeOptions(iface=args.iface, netns=args.netns, listen=args.listen, token_file=args.token_file,
                     slots=args.slots, job_slots=args.job_slots, elems=args.elems, port=args.port, mode=args.mode,
                     lease_s=args.lease, optimizer=not args.no_optimizer, keep_loaded=args.keep_loaded,
                     multicast=not args.no_multicast, fallback=args.fallback)
    if args.fallback == "afxdp":
        from nicoffload.afxdp import build

        build.library_path()  # built (or found) now: a host that cannot build it says so before serving
    return serve(o, ready=lambda url: print(f"nicoffload agg serve: ready at {url}", flush=True))
