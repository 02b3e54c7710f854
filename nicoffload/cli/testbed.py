"""``nicoffload testbed``: bring a namespace testbed up, run commands in its hosts, inject
faults, take it down, and clean up whatever the toolkit left behind.

``down`` and ``clean`` first unload the XDP aggregators and ring programs recorded in the
namespaces that are about to go (through their own APIs: the testbed knows nothing of them), then
take the testbeds down."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from nicoffload.errors import InputError


def _testbed():
    # imported lazily: `nicoffload --help` must not need pyroute2 or root
    from nicoffload import testbed
    return testbed


def _hosts_arg(text: str | None) -> list[str] | None:
    if not text or text == "all":
        return None
    return [h.strip() for h in text.split(",") if h.strip()]


def _prob(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a probability: {text!r}") from None
    if not 0.0 <= p <= 1.0:
        raise argparse.ArgumentTypeError(f"probability {p} outside 0..1")
    return p


def _unload_aggregators(netns_prefix: str) -> list[str]:
    """Unload every aggregator, and every ring program, recorded in a namespace whose name starts
    with ``netns_prefix``."""
    from nicoffload.agg import control as aggregator
    from nicoffload.ring import node as ring

    return [f"{ns}/{iface} aggregator" for ns, iface in aggregator.loaded(netns_prefix)
            if aggregator.unload(ns, iface, missing_ok=True)] + \
        [f"{ns}/{iface} ring program" for ns, iface in ring.loaded(netns_prefix)
         if ring.unload(ns, iface, missing_ok=True)]


def remove_strays(netns_prefix: str) -> list[str]:
    """Remove the files that aggregators and ring programs of namespaces now gone left in their
    state directories (a lock of an AF_XDP engine, say); the paths removed. `testbed clean` and
    the tests' testbed fixture call it once the namespaces are down."""
    from nicoffload.agg.spec import STATE_DIR as AGG_DIR
    from nicoffload.ebpf import loadstate
    from nicoffload.ring.node import STATE_DIR as RING_DIR

    return [f for d in (AGG_DIR, RING_DIR) for f in loadstate.remove_strays(d, netns_prefix)]


def cmd_up(args) -> int:
    tbm = _testbed()
    name = args.name or tbm.new_name()
    port = {} if args.port is None else {"port": args.port}  # default: the topology's (AR_DEFAULT_PORT)
    topo = tbm.Topology.star(name, args.workers, rate=args.rate, queues=args.queues, mtu=args.mtu,
                             agg_napi=args.xdp_mode == "native", multicast=not args.no_multicast,
                             aggregators=args.aggregators, agg_rate=_agg_rate(args), **port)
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise InputError(f"--ranks-per-host must be at least 1, not {args.ranks_per_host}")
    with tbm.Testbed(topo) as tb:
        if args.drop or args.dup:
            tb.faults.configure(_hosts_arg(args.fault_hosts), drop=args.drop, dup=args.dup, seed=args.seed,
                                directions=args.directions.split(","))
        if args.ranks_per_host is not None:
            tb.note(ranks_per_host=args.ranks_per_host)
        tb.keep()
    runs = _torchrun(tb, args)
    if args.json:
        print(json.dumps({**tb.describe(), **({"torchrun": runs} if runs else {})}))
        return 0
    print(f"testbed {tb.name} is up: subnet {tb.subnet}, bridge in netns {tb.bridge_netns}, "
          f"results to {tb.mcast_group}:{tb.port}")
    for h in tb.hosts:
        who = "aggregator" if h.rank is None else f"worker {h.rank}"
        print(f"  {h.name:<4} {who:<10} netns {h.netns:<22} {h.iface} {h.ip:<15} {h.mac}  "
              f"{tbm.format_rate(h.link.rate)}")
    if args.drop or args.dup:
        print(f"  faults: drop {args.drop} dup {args.dup} seed {args.seed} on "
              f"{args.fault_hosts or 'all'} links ({args.directions})")
    if runs:
        _print_torchrun(runs)
    print(f"run a command: nicoffload testbed exec {tb.name} w0 -- CMD ...;  "
          f"take it down: nicoffload testbed down {tb.name}")
    return 0


def _torchrun(tb, args) -> dict | None:
    """With --ranks-per-host K: the torchrun command of every worker host (and the service's)."""
    if args.ranks_per_host is None:
        return None
    from nicoffload.lab.train.torchrun import host_commands

    return host_commands(tb, args.ranks_per_host, script=args.script)


def _print_torchrun(runs: dict) -> None:
    K, N = runs["ranks_per_host"], runs["world"]
    print(f"  torchrun, {K} rank(s) on each worker host ({N} in all), backend 'nicoffload':")
    if runs["service"]:
        print(f"    the service (once; the token file holds any secret): sudo {runs['service']['command']}")
    else:
        print("    one host: shared memory only, no service (NICOFFLOAD_SERVICE unset)")
    for h in runs["hosts"]:
        print(f"    {h['host']}: sudo {h['command']}")
def _agg_rate(args) -> str | None:
    """--agg-rate as Topology.star takes it: a rate, 'unshaped', or NxRATE ('4x': 4 x --rate)."""
    text = (args.agg_rate or "").strip().lower()
    if not text.endswith("x"):
        return args.agg_rate
    tbm = _testbed()
    try:
        k = float(text[:-1])
    except ValueError:
        raise InputError(f"bad --agg-rate {args.agg_rate!r}: a rate (800mbit), 'unshaped', or a multiple of "
                         f"--rate such as 4x") from None
    rate = tbm.parse_rate(args.rate)
    if rate is None or k <= 0:
        raise InputError(f"--agg-rate {args.agg_rate} needs a positive multiple and a shaped --rate")
    return tbm.format_rate(int(k * rate))


def cmd_exec(args) -> int:
    tbm = _testbed()
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise InputError("no command given: nicoffload testbed exec NAME HOST -- CMD ...")
    tb = tbm.Testbed.load(args.name)
    host = tb.host(args.host)
    sys.stdout.flush()
    try:
        return subprocess.run(tb.command(host, cmd)).returncode
    except FileNotFoundError:
        raise InputError("'ip' (iproute2) is not installed; it runs the command inside the namespace") from None


def cmd_down(args) -> int:
    tbm = _testbed()
    removed = _unload_aggregators(tbm.netns_prefix(args.name))
    removed += tbm.down(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "removed": removed}))
    else:
        print(f"testbed {args.name} is down ({len(removed)} objects removed)")
    return 0


def cmd_list(args) -> int:
    beds = _testbed().list_testbeds()
    if args.json:
        print(json.dumps(beds))
        return 0
    if not beds:
        print("no testbeds")
        return 0
    print(f"{'NAME':<13} {'WORKERS':>7} {'RANKS':>5} {'SUBNET':<18} {'MCAST':<15} {'STATUS':<8} FAULTS")
    for b in beds:
        print(f"{b['name']:<13} {b.get('workers', '?'):>7} {'x' + str(b.get('ranks_per_host', 1)):>5} "
              f"{b.get('subnet', '?'):<18} {b.get('mcast_group', '?'):<15} {b['status']:<8} "
              f"{','.join(b.get('faults', [])) or '-'}")
    return 0


def cmd_clean(args) -> int:
    tbm = _testbed()
    prefix = args.name_prefix or ""
    unloaded = _unload_aggregators(tbm.netns_prefix(prefix, whole=False))
    out = tbm.clean(prefix)
    out["removed"] = unloaded + out["removed"] + remove_strays(tbm.netns_prefix(prefix, whole=False))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"removed {len(out['removed'])} objects" + (":" if out["removed"] else ""))
    for r in out["removed"]:
        print(f"  {r}")
    for ns, pids in out["busy"].items():
        print(f"warning: processes {', '.join(map(str, pids))} were still inside {ns}; "
              f"it lives on until they exit", file=sys.stderr)
    return 0


def cmd_faults(args) -> int:
    tb = _testbed().Testbed.load(args.name)
    if args.drop is not None or args.dup is not None:
        tb.faults.configure(_hosts_arg(args.hosts), drop=args.drop or 0.0, dup=args.dup or 0.0, seed=args.seed,
                            directions=args.directions.split(","))
    elif args.off:
        tb.faults.remove(_hosts_arg(args.hosts))
    elif args.reset:
        tb.faults.reset(_hosts_arg(args.hosts))
    stats = tb.faults.stats()
    conf = {h: c.__dict__ for h, c in tb.faults.configured().items()}
    if args.json:
        print(json.dumps({"name": tb.name, "config": conf, "stats": stats}, default=list))
        return 0
    if not stats:
        print(f"no fault injector on testbed {tb.name}")
        return 0
    print(f"{'HOST':<5} {'DIR':<8} {'DROP':>5} {'DUP':>5} {'SEED':>6} {'SEEN':>9} {'DROPPED':>9} {'DUPLICATED':>10} {'PASSED':>9}")
    for h, dirs in stats.items():
        c = tb.faults.configured()[h]
        for d, s in dirs.items():
            drop, dup = c.probabilities(d)
            print(f"{h:<5} {d:<8} {drop:>5.2f} {dup:>5.2f} {c.seed:>6} {s['seen']:>9} {s['dropped']:>9} "
                  f"{s['duplicated']:>10} {s['passed']:>9}")
    return 0


def _action(sub, name: str, help: str, description: str, examples: list[str], func) -> argparse.ArgumentParser:
    from nicoffload.cli.app import add_examples

    p = sub.add_parser(name, help=help, description=description)
    add_examples(p, *examples)
    p.set_defaults(func=func)
    return p


def register(subparsers) -> None:
    from nicoffload.cli.app import add_examples

    p = subparsers.add_parser("testbed", help="N workers and an aggregator in network namespaces",
                              description="A namespace testbed: one bridge namespace, an aggregator (agg) and "
                                          "workers (w0, w1, ...) each in its own namespace, behind veths with "
                                          "optional rate limits and seeded packet loss/duplication.")
    add_examples(p,
                 "sudo nicoffload testbed up --workers 4 --rate 1gbit --json",
                 "sudo nicoffload testbed exec tb1a2b w0 -- python3 train.py",
                 "sudo nicoffload testbed down tb1a2b",
                 "sudo nicoffload testbed clean")
    sub = p.add_subparsers(dest="testbed_command", metavar="ACTION")
    sub.required = True
    _register_up(sub)
    _register_others(sub)
    _register_faults(sub)


def _register_up(sub) -> None:
    up = _action(sub, "up", "create a testbed and leave it running",
                 "Create N workers and an aggregator; the testbed stays up until 'nicoffload testbed down NAME'.",
                 ["sudo nicoffload testbed up --workers 4",
                  "sudo nicoffload testbed up --workers 4 --rate 200mbit --agg-rate 4x   # a dedicated "
                  "aggregator node: its link N x a worker's",
                  "sudo nicoffload testbed up --workers 8 --rate 100mbit --mtu 3000 --name big",
                  "sudo nicoffload testbed up --workers 2 --drop 0.05 --dup 0.01 --seed 7 --json",
                  "sudo nicoffload testbed up --workers 2 --drop 0.1 --fault-hosts agg --directions egress",
                  "sudo nicoffload testbed up --workers 2 --ranks-per-host 2 --script train.py   # torchrun per host",
                  "sudo nicoffload testbed up --workers 1 --ranks-per-host 4 --json"], cmd_up)
    up.add_argument("--workers", "-n", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--rate", default="unshaped", help="per-link rate, both directions: 1gbit, 100mbit, ... "
                                                       "or 'unshaped' (default)")
    up.add_argument("--agg-rate", default=None, metavar="RATE",
                    help="each aggregator's link: a rate, 'unshaped', or a multiple of --rate such as 4x "
                         "(default: --rate, an aggregator with the workers' NIC; the bench's default is "
                         "N x --rate)")
    up.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500; at most 3506 with "
                                                          "the aggregator's NAPI program)")
    up.add_argument("--queues", type=int, default=1, help="tx/rx queues of every veth (default 1)")
    up.add_argument("--port", type=int, default=None, help="AllReduce UDP port (default AR_DEFAULT_PORT)")
    up.add_argument("--drop", type=_prob, default=0.0, help="probability of dropping an AllReduce packet")
    up.add_argument("--dup", type=_prob, default=0.0, help="probability of duplicating an AllReduce packet")
    up.add_argument("--seed", type=int, default=0, help="fault seed: the same seed drops the same packets")
    up.add_argument("--fault-hosts", default=None, help="links that get faults: comma list of hosts (default all)")
    up.add_argument("--directions", default="ingress,egress",
                    help="fault directions: ingress (from the host), egress (towards it); default both")
    up.add_argument("--name", default=None, help="testbed name (default: tbXXXX); namespaces are nco-NAME-HOST")
    up.add_argument("--xdp-mode", choices=["generic", "native"], default="generic",
                    help="prepare the aggregator's link for this XDP mode: native attaches an XDP_PASS "
                         "program to its bridge-side veth (native XDP_TX needs it), generic must not have "
                         "it (it strips GSO, so result batches would be cut into datagrams); default generic")
    up.add_argument("--aggregators", type=int, default=1,
                    help="aggregator hosts (agg, agg1, agg2, ...): a job can span them (default 1)")
    up.add_argument("--no-multicast", action="store_true",
                    help="the fabric drops every multicast frame on its way to a host, as networks without "
                         "multicast do: jobs need unicast delivery (--delivery unicast)")
    up.add_argument("--ranks-per-host", type=int, default=None, metavar="K",
                    help="the ranks each worker host will run (torchrun --nproc-per-node K): recorded with the "
                         "testbed (testbed list) and printed as the torchrun command of every host, with the "
                         "aggregator service to start first where there are several hosts (JSON: 'torchrun')")
    up.add_argument("--script", default="script.py",
                    help="the training script those commands run (default script.py)")
    up.add_argument("--json", action="store_true", help="print the hosts as JSON")


def _register_others(sub) -> None:
    """``testbed exec|down|list|clean``."""
    ex = _action(sub, "exec", "run a command inside a host's namespace",
                 "Run CMD in the network namespace of HOST (agg, w0, w1, ...); exits with the command's exit code.",
                 ["sudo nicoffload testbed exec tb1a2b agg -- ip addr",
                  "sudo nicoffload testbed exec tb1a2b w1 -- nicoffload worker --rank 1"], cmd_exec)
    ex.add_argument("name")
    ex.add_argument("host", help="agg, w0, w1, ...")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")

    dn = _action(sub, "down", "take a testbed down",
                 "Remove a testbed: programs, qdiscs, links, namespaces, pins, state file.",
                 ["sudo nicoffload testbed down tb1a2b"], cmd_down)
    dn.add_argument("name")
    dn.add_argument("--json", action="store_true")

    ls = _action(sub, "list", "list live testbeds", "List testbeds that have a state file.",
                 ["nicoffload testbed list", "nicoffload testbed list --json"], cmd_list)
    ls.add_argument("--json", action="store_true")

    cl = _action(sub, "clean", "remove everything the testbed left behind (prefix nco-)",
                 "Remove every namespace whose name starts with nco-, their BPF pins under "
                 "/sys/fs/bpf/nicoffload/, and every testbed state file. Nothing else.",
                 ["sudo nicoffload testbed clean", "sudo nicoffload testbed clean --name-prefix ci"], cmd_clean)
    cl.add_argument("--name-prefix", default="", help="only testbeds whose name starts with this")
    cl.add_argument("--json", action="store_true")


def _register_faults(sub) -> None:
    fa = _action(sub, "faults", "show or change the fault injector of a testbed",
                 "Show the per-link fault counters; with --drop/--dup reconfigure "
                 "(restarts packet numbering and counters).",
                 ["sudo nicoffload testbed faults tb1a2b",
                  "sudo nicoffload testbed faults tb1a2b --drop 0.1 --seed 3 --hosts w0,w1",
                  "sudo nicoffload testbed faults tb1a2b --off"], cmd_faults)
    fa.add_argument("name")
    fa.add_argument("--hosts", default=None, help="comma list of hosts (default all)")
    fa.add_argument("--drop", type=_prob, default=None)
    fa.add_argument("--dup", type=_prob, default=None)
    fa.add_argument("--seed", type=int, default=0)
    fa.add_argument("--directions", default="ingress,egress")
    fa.add_argument("--off", action="store_true", help="remove the injector from the links")
    fa.add_argument("--reset", action="store_true", help="zero counters and packet numbering")
    fa.add_argument("--json", action="store_true")
