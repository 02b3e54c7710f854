"""The namespace testbed: N workers and one aggregator on one machine, each in its own network
namespace, behind a Linux bridge in a namespace of its own, with shaped links and seeded faults.

    from nicoffload.testbed import Testbed, Topology
    with Testbed(Topology.star("demo", workers=4, rate="1gbit")) as tb:
        tb.agg.ip, tb.agg.mac, tb.agg.netns, tb.agg.iface, tb.mcast_group, tb.port
        tb.faults.configure(["w0"], drop=0.1, seed=1)

Pieces: topology (pure data), testbed (realisation, teardown, state), fault (the injector),
state (the JSON files that let other processes find a live testbed), netlink (pyroute2 helpers).
"""
from .fault import DIRECTIONS, FaultConfig, FaultInjector, decide, fault_hash
from .testbed import Testbed, clean, down, list_testbeds, new_name, running, teardown
from .topology import AGG, PREFIX, Host, Link, Topology, format_rate, parse_rate

__all__ = [
    "AGG", "DIRECTIONS", "FaultConfig", "FaultInjector", "Host", "Link", "PREFIX", "Testbed", "Topology",
    "clean", "decide", "down", "fault_hash", "format_rate", "list_testbeds", "new_name", "parse_rate",
    "running", "teardown",
]
