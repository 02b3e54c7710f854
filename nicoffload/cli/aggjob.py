"""``nicoffload agg job add|remove|list``: the jobs of a loaded aggregator, on this host
(``--netns/--iface``) or through an aggregator service (``--service URL --token-file FILE``);
``job add --fallback afxdp`` hands a job the XDP pool refuses to the AF_XDP engine beside it.
Also the ``--service`` options and client that ``agg stats`` shares."""
from __future__ import annotations

import json

from nicoffload.cli import aggopt as cli_aggopt
from nicoffload.cli.app import add_examples
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError
from nicoffload.jobspec import DEFAULT
from nicoffload.wire import keys, proto


def job_arguments(q, load: bool = False) -> None:
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
    k = q.add_mutually_exclusive_group()
    k.add_argument("--key", type=_key_arg, default=None, metavar="HEX",
                   help="the job's key, 16 hex digits, that every record must carry (default: a random one, printed; "
                        "with --service: the service's, derived from its token)")
    k.add_argument("--no-key", action="store_true",
                   help="register the job without a key (its records carry 0): any host that can spoof a rank's "
                        "address can then write into it")


def _key_arg(text: str) -> int:
    import argparse

    try:
        return keys.parse(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def job_key(args) -> tuple[int, bool]:
    """The job's key from --key/--no-key (default: a new one): (key, whether it was drawn here)."""
    if args.no_key:
        return 0, False
    if args.key is not None:
        if not args.key:
            raise InputError("--key 0 means no key: say --no-key")
        return args.key, False
    return keys.new_key(), True


def key_note(key: int, how: str) -> str:
    """What the CLI says about a job's key (``how`` it came): the ranks need it."""
    if not key:
        return "no key (--no-key): any host that can spoof a rank's address can write into this job"
    return (f"key {keys.show(key)} ({how}): every rank needs it (--key, or {keys.ENV} in its environment); "
            f"records without it are dropped as bad_key")


def how_drawn(drawn: bool) -> str:
    return "drawn for it" if drawn else "given"


def describe_job(j: dict) -> str:
    base, n = j["slot_base"], j["slot_count"]
    ips = ", ".join(j["worker_ips"]) if j["worker_ips"] else "sources unchecked"
    to = "each rank's address (unicast)" if j.get("delivery") == "unicast" else j["group"]
    return (f"job {j['job']}: {j['workers']} workers ({ips}), slots {base}..{base + n - 1} of the pool, "
            f"results to {to}")


def register(asub, where) -> None:
    """``agg job``, its options under ``where`` (--netns/--iface, or --service)."""
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
    job_arguments(a)
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
    q.add_argument("--ca-file", default=None, metavar="FILE",
                   help="an https:// service's certificate is verified against this CA (PEM; default: "
                        "$NICOFFLOAD_CA_FILE, else the system's CAs)")


def service_client(args):
    """The service's client when --service is given; else None (and --iface is then needed)."""
    if args.service:
        from nicoffload.service.client import ServiceClient

        return ServiceClient.from_files(args.service, args.token_file, ca_file=args.ca_file)
    if not args.iface:
        raise InputError("give the aggregator's --iface (and --netns), or --service URL --token-file FILE")
    return None


def _job_add(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = service_client(args)
    if client is not None:
        return _job_add_service(args, client)
    from nicoffload.agg import fallback

    args.job = DEFAULT.job if args.job is None else args.job
    agg = Aggregator.open(args.netns, args.iface)
    if any(h["job"] == args.job for h in fallback.handed_off(args.netns, args.iface)):
        raise AlreadyExistsError(f"job {args.job} is served by the AF_XDP engine on {args.iface}; remove it first "
                                 f"(agg job remove --job {args.job})")
    opt = cli_aggopt.optimizer_from(args)
    key, drawn = job_key(args)
    try:
        # a refusal (no room in the pool, no free job entry) raises CapacityError: one line, exit 10
        e = agg.add_job(args.job, args.workers, args.group, args.worker_ip, slots=args.job_slots,
                        optimizer=opt, params=args.params, initial=cli_aggopt.initial_params(args),
                        delivery=args.delivery or "multicast", key=key)
    except CapacityError as refusal:
        if args.fallback != "afxdp":
            raise
        if opt is not None:
            raise InputError(f"{refusal}; an optimizer job cannot fall back to the AF_XDP engine (it has no "
                             f"optimizer): remove a job or load a larger pool") from None
        return _job_fallback(args, agg, str(refusal), key, drawn)
    print(json.dumps({**e.public(), "engine": "xdp", "key": keys.show(key)}) if args.json else
          f"registered on {args.iface}: {describe_job(agg.job_state(e.job) | e.public())}; "
          f"{agg.table.free_slots()} of {agg.spec.slots} slots left; the XDP aggregator took it; "
          f"{key_note(key, how_drawn(drawn))}")
    return 0


def _job_fallback(args, agg, why: str, key: int, drawn: bool) -> int:
    """The XDP pool refused the job: the AF_XDP engine beside it takes it."""
    from nicoffload.agg import fallback
    from nicoffload.agg.jobtable import default_group

    group = args.group or default_group(args.job, agg.table, fallback.groups_in_use(args.netns, args.iface))
    if args.job_slots is not None and args.job_slots < 1:
        raise InputError(f"--slots is at least 1, not {args.job_slots}")
    slots = DEFAULT.slots if args.job_slots is None else args.job_slots
    got = fallback.hand_off(agg, args.job, args.workers, group, list(args.worker_ip), slots,
                            args.delivery or "multicast", key=key)
    if args.json:
        print(json.dumps({"engine": "afxdp", "refused_by_xdp": why, **got, "key": keys.show(key)}))
        return 0
    to = "each rank's address (unicast)" if got["delivery"] == "unicast" else group
    print(f"the XDP pool refused job {args.job} ({why}); the AF_XDP engine took it: {args.workers} workers, "
          f"{slots} slots of its own, results to {to}; engine pid {got['pid']} on {args.iface} "
          f"({got.get('mode', '?')} XDP steering, {'copy' if got.get('copy_mode', True) else 'zero-copy'} mode); "
          f"remove with: nicoffload agg job remove --netns {args.netns} --iface {args.iface} --job {args.job}; "
          f"{key_note(key, how_drawn(drawn))}")
    return 0


def _job_add_service(args, client) -> int:
    import getpass
    import socket

    from nicoffload.service.api import JobRequest

    if args.key is not None or args.no_key:
        raise InputError("a service derives every job's key from its token (and refuses a job without one): "
                         "leave out --key and --no-key with --service")
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
    key = g.spec(DEFAULT.timeout, token=client.token).key  # derived here, as every rank derives it
    if args.json:
        print(json.dumps({**g.to_json(), "key": keys.show(key)}))
        return 0
    lease = f"lease {g.lease_s:g}s (renew: POST /v1/jobs/{g.job}/lease)" if g.lease_s else "no lease"
    span = f"{g.slot_base}..{g.slot_base + g.slots - 1}"
    print(f"registered at {client.url}: job {g.job}: {g.world} workers, slots {span}, results to {g.group}; "
          f"ranks send to {g.aggregator}:{g.port} from port {g.local_port}; {lease}; "
          f"{key_note(key, 'derived from the service token and the grant nonce ' + g.key_nonce)}")
    return 0


def _job_remove(args) -> int:
    from nicoffload.agg.control import Aggregator

    client = service_client(args)
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

    client = service_client(args)
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
