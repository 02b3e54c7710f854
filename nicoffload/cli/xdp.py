"""What the commands that load an XDP program on an interface share (``nicoffload agg``,
``nicoffload ring``): the attach modes, where the program is (--netns, --iface), the inspection
actions' common flags, and printing counters once or as rates (--watch)."""
from __future__ import annotations

import json
import sys
import time
from typing import Callable

from nicoffload.errors import InputError

MODES = ["auto", "generic", "native"]


def where_arguments(q, iface_help: str) -> None:
    q.add_argument("--netns", default=None, help="network namespace of the interface (default: root)")
    q.add_argument("--iface", required=True, help=iface_help)


def action(xsub, name: str, fn, hlp: str, where: Callable) -> object:
    """The sub-command ``name`` (status, stats, unload, ...): where the program is, and --json
    for all but unload."""
    q = xsub.add_parser(name, help=hlp)
    where(q)
    if name != "unload":
        q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=fn)
    return q


def watch_argument(q) -> None:
    q.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                   help="print rates every SECONDS until interrupted")


def print_stats(stats: dict, prev: dict | None, dt: float) -> None:
    width = max(len(k) for k in stats)
    for k, v in stats.items():
        line = f"{k:<{width}}  {v:>14,}"
        if prev is not None and dt > 0:
            line += f"  {(v - prev[k]) / dt:>14,.0f}/s"
        print(line)


def show_stats(read: Callable[[], dict], as_json: bool, watch: float | None) -> int:
    """The counters ``read()`` returns: once, or every ``watch`` seconds with their rates until
    interrupted (as JSON lines with ``as_json``)."""
    if watch is not None and not (0 < watch < 1e6):
        raise InputError(f"--watch takes seconds between readings, more than 0, not {watch:g}")
    if watch is None:
        s = read()
        if as_json:
            print(json.dumps(s))
        else:
            print_stats(s, None, 0)
        return 0
    prev, t0 = read(), time.monotonic()
    try:
        while True:
            time.sleep(watch)
            cur, t1 = read(), time.monotonic()
            if as_json:
                print(json.dumps({"t": t1, "stats": cur}), flush=True)
            else:
                print(f"--- {time.strftime('%H:%M:%S')}")
                print_stats(cur, prev, t1 - t0)
                sys.stdout.flush()
            prev, t0 = cur, t1
    except KeyboardInterrupt:
        return 0
