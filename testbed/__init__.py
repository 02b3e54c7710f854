"""The namespace testbed: N workers and one aggregator on one machine, each in its own network
namespace, behind a Linux bridge in a namespace of its own, with shaped links and seeded faults.

    from nicoffload.testbed import Testbed, Topology
    with Testbed(Topology.star("demo", workers=4, rate="1gbit")) as tb:
        tb.agg.ip, tb.agg.mac, tb.agg.netns, tb.agg.iface, tb.mcast_group, tb.port
        tb.faults.configure(["w0"], drop=0.1, seed=1)

Pieces, each importing only those listed before it: topology (pure data), netlink (pyroute2
helpers, shaping), state (the JSON files that let other processes find a live testbed; name and
subnet claims), fault (the injector, owned by a testbed through a small protocol), signals
(SIGINT/SIGTERM become teardown), fabric and napi (the bridge side's tc and XDP programs),
realise (namespaces, bridge and links of one topology made, and taken down from the state
alone), testbed (the Testbed object: a live testbed's life, its hosts), registry (list, down
and clean testbeds by name or prefix, from any process).
"""
from .fault import DIRECTIONS, FaultConfig, FaultInjector, FaultSite, decide, fault_hash
from .realise import teardown
from .registry import clean, down, list_testbeds, live_netns
from .state import new_name
from .testbed import Testbed, running
from .topology import AGG, PREFIX, Host, Link, Topology, format_rate, netns_prefix, parse_rate

__all__ = [
    "AGG", "DIRECTIONS", "FaultConfig", "FaultInjector", "FaultSite", "Host", "Link", "PREFIX", "Testbed",
    "Topology", "clean", "decide", "down", "fault_hash", "format_rate", "list_testbeds", "live_netns", "netns_prefix",
    "new_name", "parse_rate", "running", "teardown",
]
