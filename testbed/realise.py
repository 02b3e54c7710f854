"""A :class:`~nicoffload.testbed.topology.Topology` made real in network namespaces with
pyroute2, and taken down again from its description alone.

Creation order: namespaces (bridge first), the bridge, per host a veth pair (bridge side p-HOST,
host side eth0) with addresses, the multicast route and static neighbours, shaping, the NAPI
XDP_PASS program on p-agg. Teardown is the reverse, idempotent, tolerant of objects that are
already gone, and driven by the state file only, so another process (``nicoffload testbed
down``) can do it. The object that owns a live testbed is :class:`~nicoffload.testbed.Testbed`.
"""
from __future__ import annotations

import contextlib

from pyroute2.netlink.rtnl.ndmsg import flags as ntf_flags
from pyroute2.netlink.rtnl.ndmsg import states as nud_states

from nicoffload.ebpf import loader as nbpf
from nicoffload.errors import NotFoundError

from . import state as st
from .fabric import drop_multicast
from .napi import attach_napi_pass
from .netlink import (
    create_netns,
    ipr,
    limit,
    link_index,
    netns_exists,
    remove_netns_and_pins,
    set_sysctl,
    tolerant,
    unshape,
    wait_oper_up,
)
from .topology import BRIDGE_IFACE, PREFIXLEN, Host, Topology

MCAST_NET, MCAST_LEN = "224.0.0.0", 4
BRIDGE_NF_SYSCTLS = ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
                     "net.bridge.bridge-nf-call-arptables")


def build(topo: Topology, state: dict) -> None:
    """Create the topology's namespaces, bridge and links (``state``: the testbed's state, which
    records the NAPI program; the caller saves it)."""
    hosts = topo.hosts
    _namespaces(topo)
    _bridge(topo, hosts)
    _hosts(topo, hosts)
    if topo.agg_napi:
        attach_napi_pass(hosts[0].peer, topo.bridge_netns)
        state["napi_xdp"].append(hosts[0].peer)


def _namespaces(topo: Topology) -> None:
    for ns in topo.netns_names():
        create_netns(ns)
        for key, val in (("net.ipv6.conf.all.disable_ipv6", 1), ("net.ipv6.conf.default.disable_ipv6", 1)):
            set_sysctl(ns, key, val)
    # No bridge netfilter on the testbed's bridge: with br_netfilter loaded, every forwarded
    # frame would run the iptables hooks. The per-bridge flag can only add the hooks; the
    # bridge namespace's own sysctls take them away.
    for key in BRIDGE_NF_SYSCTLS:
        with contextlib.suppress(FileNotFoundError):  # br_netfilter not loaded: nothing to do
            set_sysctl(topo.bridge_netns, key, 0)


def _bridge(topo: Topology, hosts: list[Host]) -> None:
    """The bridge, and per host its veth pair (the bridge side enslaved, with a static FDB entry
    and shaping)."""
    with ipr(topo.bridge_netns) as br:
        br.link("set", index=link_index(br, "lo"), state="up")
        # IGMP snooping with the bridge as querier: results of a job's multicast group reach only
        # the ports whose hosts joined it (several jobs on one testbed stay apart). The bridge
        # floods every group until its querier has waited one query response interval: 0.1 s
        # (centiseconds) instead of 10 s, so that a testbed isolates its jobs once it is up.
        br.link("add", ifname=BRIDGE_IFACE, kind="bridge", br_mcast_snooping=1,
                br_mcast_query_response_intvl=10, br_stp_state=0,
                br_nf_call_iptables=0, br_nf_call_ip6tables=0, br_nf_call_arptables=0,
                br_forward_delay=0, mtu=topo.mtu)
        br_idx = link_index(br, BRIDGE_IFACE)
        br.link("set", index=br_idx, state="up")
        br.link("set", index=br_idx, kind="bridge", br_mcast_querier=1)  # after the interval is set
        for h in hosts:
            q = h.link.queues
            br.link("add", ifname=h.peer, kind="veth", mtu=topo.mtu, num_tx_queues=q, num_rx_queues=q,
                    peer={"ifname": h.iface, "net_ns_fd": h.netns, "address": h.mac, "mtu": topo.mtu,
                          "num_tx_queues": q, "num_rx_queues": q})
            idx = link_index(br, h.peer)
            br.link("set", index=idx, master=br_idx)
            # static FDB entry: unicast to a host that has not spoken yet is not flooded
            br.fdb("add", ifindex=idx, lladdr=h.mac, state=nud_states["noarp"], flags=ntf_flags["master"])
            br.link("set", index=idx, state="up")
            limit(br, idx, h.link.rate, topo.mtu)
        if not topo.multicast:
            drop_multicast(br, [link_index(br, h.peer) for h in hosts])


def _hosts(topo: Topology, hosts: list[Host]) -> None:
    """Each host's side: loopback, address, multicast route, static neighbours, shaping; up."""
    permanent = nud_states["permanent"]
    for h in hosts:
        with ipr(h.netns) as sock:
            sock.link("set", index=link_index(sock, "lo"), state="up")
            idx = link_index(sock, h.iface)
            sock.addr("add", index=idx, address=h.ip, prefixlen=PREFIXLEN)
            sock.link("set", index=idx, state="up")
            sock.route("add", dst=MCAST_NET, dst_len=MCAST_LEN, oif=idx)
            for other in hosts:
                if other.name != h.name:
                    sock.neigh("add", dst=other.ip, lladdr=other.mac, ifindex=idx, state=permanent)
            limit(sock, idx, h.link.rate, topo.mtu)
            wait_oper_up(sock, idx, f"{h.iface} of {h.name}")


def teardown(topo: Topology, state: dict) -> list[str]:
    """Reverse of :func:`build`, from the description alone; tolerant of anything missing.
    Returns what was removed."""
    removed: list[str] = []
    hosts = list(reversed(topo.hosts))
    br_ns, peers = topo.bridge_netns, [h.peer for h in hosts]
    # 1. programs and qdiscs on the bridge side (fault injector, shaping, NAPI XDP_PASS)
    _remove_in(br_ns, peers, ("clsact", "tbf"), removed)
    if netns_exists(br_ns):
        for ifname in state.get("napi_xdp", []) or ([topo.hosts[0].peer] if topo.agg_napi else []):
            with contextlib.suppress(Exception):
                if nbpf.detach_xdp(ifname, br_ns, "native"):
                    removed.append(f"{br_ns}/{ifname} xdp")
    # 2. host side: shaping, then the veth pairs (deleting one end deletes both), then the bridge
    for h in hosts:
        _remove_in(h.netns, [h.iface], ("tbf", "link"), removed)
    _remove_in(br_ns, peers + [BRIDGE_IFACE], ("link",), removed)
    # 3. namespaces (hosts, then the bridge), their pins, the state file
    for ns in reversed(topo.netns_names()):
        removed += remove_netns_and_pins(ns)
    if st.remove(topo.name):
        removed.append(str(st.state_path(topo.name)))
    return removed


def _remove_in(ns: str, ifnames: list[str], kinds: tuple[str, ...], removed: list[str]) -> None:
    """In namespace ``ns``, for each of ``ifnames`` that exists, delete in order each of
    ``kinds``: "clsact" (the fault injector's filters), "tbf" (shaping), "link" (the interface);
    append what went to ``removed``."""
    if not netns_exists(ns):
        return
    with contextlib.suppress(NotFoundError), ipr(ns) as sock:
        for ifname in ifnames:
            idx = sock.link_lookup(ifname=ifname)
            for kind in kinds if idx else ():
                delete = {"clsact": lambda: sock.tc("del", "clsact", idx[0]), "tbf": lambda: unshape(sock, idx[0]),
                          "link": lambda: sock.link("del", index=idx[0])}[kind]
                if tolerant(delete):
                    removed.append(f"{ns}/{ifname}" + ("" if kind == "link" else f" {kind}"))
