"""``nicoffload ring``: load, inspect and unload the ring offload (DirectReduce) on one worker's
interface; one node of a ring per call (``load`` on every worker of the ring)."""
from __future__ import annotations

import json

from nicoffload.cli.app import add_examples
from nicoffload.cli.xdp import MODES, action, show_stats, watch_argument, where_arguments
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT
from nicoffload.ring.layout import DEFAULT_CAPACITY


def _where(q) -> None:
    where_arguments(q, "the worker's interface")


def register(sub) -> None:
    p = sub.add_parser("ring", help="load, inspect and unload the ring offload (DirectReduce) on a worker")
    add_examples(
        p,
        "sudo nicoffload ring load --netns nco-tb-w1 --iface eth0 --rank 1 --peers 10.200.7.10,10.200.7.11,10.200.7.12",
        "sudo nicoffload ring status --netns nco-tb-w1 --iface eth0 --json",
        "sudo nicoffload ring stats --netns nco-tb-w1 --iface eth0 --watch 1",
        "sudo nicoffload ring unload --netns nco-tb-w1 --iface eth0",
    )
    rsub = p.add_subparsers(dest="ring_command", metavar="ACTION")
    rsub.required = True

    q = rsub.add_parser("load", help="compile, configure, attach and pin one node of a ring")
    add_examples(q, "sudo nicoffload ring load --netns NS --iface eth0 --rank 0 --peers IP0,IP1,IP2",
                 "sudo nicoffload ring load --netns NS --iface eth0 --rank 2 --peers IP0,IP1,IP2,IP3 --capacity 65536 "
                 "--mode generic")
    _where(q)
    q.add_argument("--rank", type=int, required=True, help="this node's rank in the ring")
    q.add_argument("--peers", required=True, metavar="IP,IP,...",
                   help="every rank's address, in rank order (this node's is on --iface)")
    q.add_argument("--peer-macs", default=None, metavar="MAC,MAC,...",
                   help="every rank's MAC address, in rank order (default: from the neighbour table)")
    q.add_argument("--job", type=int, default=DEFAULT.job, help=f"job id of the ring's records (default {DEFAULT.job})")
    q.add_argument("--port", type=int, default=DEFAULT.port, help=f"UDP port of the ring (default {DEFAULT.port})")
    q.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per record (default {DEFAULT.elems} = 1 KiB)")
    q.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY,
                   help=f"records per call the maps hold (default {DEFAULT_CAPACITY}; a larger tensor goes in several "
                        f"passes; the maps take 2 x capacity x record size of kernel memory)")
    q.add_argument("--mode", choices=MODES, default="auto",
                   help="XDP attach mode: auto picks generic on veth (batches whole), native elsewhere")
    q.add_argument("--json", action="store_true", help="print the status as JSON")
    q.set_defaults(func=_load)

    for name, fn, hlp in (("status", _status, "show what is loaded, its ring and its call"),
                          ("stats", _stats, "show the per-reason counters"),
                          ("unload", _unload, "detach and remove the pins and the state file")):
        q = action(rsub, name, fn, hlp, _where)
        if name == "stats":
            watch_argument(q)
        add_examples(q, f"sudo nicoffload ring {name} --netns NS --iface eth0")


def _list(text: str | None) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()] if text else []


def _load(args) -> int:
    from nicoffload.ring.node import RingNode, RingSpec

    peers = _list(args.peers)
    if not peers:
        raise InputError("--peers names no address")
    spec = RingSpec(args.netns, args.iface, args.rank, len(peers), peers, args.job, args.port, args.elems,
                    args.capacity, args.mode, peer_macs=_list(args.peer_macs))
    node = RingNode.load(spec)
    st = node.status()
    node.release()  # it stays attached and pinned after this process exits
    node.close()
    if args.json:
        print(json.dumps(st))
        return 0
    print(f"ring node {args.rank} of {len(peers)} loaded on {args.iface} ({args.netns or 'root namespace'}): "
          f"{st['mode_reason']}; prog id {st['prog_id']}; {st['capacity']} records of {st['elems']} int32 per call, "
          f"port {st['port']}; pinned in {st['pins']}")
    return 0


def _status(args) -> int:
    from nicoffload.ring.node import RingNode

    with RingNode.open(args.netns, args.iface) as node:
        st = node.status()
        st["stats"] = node.stats()
    if args.json:
        print(json.dumps(st))
        return 0
    state = "attached" if st["attached"] else "NOT attached (run unload)"
    owner = ""
    if st["owner"]:
        owner = f", loaded by process {st['owner']} for itself" + ("" if st["owner_alive"] else " (gone: run unload)")
    print(f"{st['iface']} in {st['netns'] or 'root'}: {state}, {st['mode']} XDP, prog id {st['prog_id']}{owner}")
    print(f"  node {st['rank']} of a ring of {st['world']}: {', '.join(st['peers'])} (job {st['job']}, port "
          f"{st['port']}); {st['capacity']} records of {st['elems']} int32 per call")
    c, s = st["state"], st["stats"]
    print(f"  call {c['call']}: {c['stored']} of {c['expected']} records stored ({c['host_stored']} by the host)")
    bad = sum(v for k, v in s.items() if k.startswith("bad_"))
    print(f"  reduced {s['reduced']}  final {s['final']}  gathered {s['gathered']}  parked {s['parked']}  "
          f"restarted {s['restarted']}  resent {s['resent']}  dropped (malformed) {bad}")
    return 0


def _stats(args) -> int:
    from nicoffload.ring.node import RingNode

    with RingNode.open(args.netns, args.iface) as node:
        return show_stats(node.stats, args.json, args.watch)


def _unload(args) -> int:
    from nicoffload.ring.node import unload

    unload(args.netns, args.iface)
    print(f"ring program unloaded from {args.iface} ({args.netns or 'root namespace'})")
    return 0
