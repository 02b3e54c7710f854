"""The testbeds of this machine, found by name or name prefix from their state files and from
what carries the toolkit prefix: list them, take one down, clean up after crashes.

These work from any process (the one that made a testbed may be gone). They touch only objects
named with the toolkit prefix ``nco-``: namespaces, the BPF pins kept for those namespaces under
/sys/fs/bpf/nicoffload/, and testbed state files. Whatever else runs inside a testbed (an XDP
aggregator, say) is its owner's to stop first; ``nicoffload testbed down/clean`` does that.
"""
from __future__ import annotations

from pyroute2.netns import ns_pids

from nicoffload.errors import NotFoundError

from . import state as st
from .netlink import list_netns, netns_exists, pinned_netns, remove_netns_and_pins, remove_pins
from .realise import teardown
from .topology import Topology, check_name, netns_prefix


def live_netns(name: str, whole: bool = True) -> list[str]:
    """Namespaces that exist now for testbed ``name`` (``whole``), or for every testbed whose
    name starts with ``name`` (``whole=False``), state file or not."""
    prefix = netns_prefix(name, whole)
    return sorted(ns for ns in list_netns() if ns.startswith(prefix))


def list_testbeds() -> list[dict]:
    """One summary per state file: name, workers, subnet, status, which namespaces exist."""
    out = []
    for s in st.all_states():
        try:
            topo = Topology.from_dict(s["topology"])
        except Exception:
            out.append({"name": s.get("name", "?"), "status": "corrupt"})
            continue
        present = [ns for ns in topo.netns_names() if netns_exists(ns)]
        status = s.get("status", "?")
        if len(present) != len(topo.netns_names()):
            status = "partial" if present else "gone"
        out.append({"name": topo.name, "workers": topo.workers, "subnet": topo.subnet_cidr,
                    "mcast_group": topo.mcast_group, "port": topo.port, "status": status,
                    "pid": s.get("pid"), "created": s.get("created"),
                    "faults": sorted(s.get("faults", {})), **s.get("notes", {})})
    return out


def down(name: str) -> list[str]:
    """Take down the testbed ``name`` from its state file (any process); without one, remove
    the namespaces a crash left under its name. Returns what was removed."""
    check_name(name)
    try:
        s = st.read(name)
    except NotFoundError:
        leftovers = live_netns(name)
        if not leftovers:
            raise
        return [r for ns in leftovers for r in remove_netns_and_pins(ns)]
    return teardown(Topology.from_dict(s["topology"]), s)


def clean(name_prefix: str = "") -> dict:
    """Remove every testbed object carrying the toolkit prefix ``nco-`` (optionally only of
    testbeds whose name starts with ``name_prefix``): namespaces, their BPF pins under
    /sys/fs/bpf/nicoffload/, and state files. Nothing else is touched.

    Returns {"removed": [...], "busy": {netns: [pids]}}; "busy" lists namespaces that processes
    still use (they stay alive, invisibly, until those processes end)."""
    removed: list[str] = []
    # who is inside, before anything goes (a namespace that is gone can no longer be asked)
    try:
        pids = ns_pids()
    except Exception:
        pids = {}
    busy = {ns: pids[ns] for ns in live_netns(name_prefix, whole=False) if pids.get(ns)}
    # testbeds with a state file: the orderly way first
    for n in st.names():
        if n.startswith(name_prefix):
            try:
                removed += down(n)
            except Exception:
                if st.remove(n):
                    removed.append(str(st.state_path(n)))
    # whatever is left: namespaces carrying the prefix, pins of such namespaces
    for ns in live_netns(name_prefix, whole=False):
        removed += remove_netns_and_pins(ns)
    prefix = netns_prefix(name_prefix, whole=False)
    for ns in pinned_netns():
        if ns.startswith(prefix) and not netns_exists(ns):
            removed += remove_pins(ns)
    return {"removed": removed, "busy": busy}
