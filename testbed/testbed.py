"""Realise a :class:`~nicoffload.testbed.topology.Topology` in network namespaces with pyroute2.

    with Testbed(Topology.star("demo", workers=4, rate="1gbit")) as tb:
        with tb.in_host("w0"):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # lives in w0's namespace
        tb.run("agg", ["ping", "-c1", tb.host("w1").ip])

Creation order: state file (status "creating"), namespaces (bridge first), the bridge, per host a
veth pair (bridge side p-HOST, host side eth0) with addresses, the multicast route and static
neighbours, shaping, the NAPI XDP_PASS program on p-agg; state file (status "up").
Teardown is the reverse, idempotent, tolerant of objects that are already gone, and driven by
the state file only, so another process (``nicoffload testbed down``) can do it. Finding,
listing and cleaning up testbeds by name is the registry's (registry.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from typing import Callable, Iterator

from pyroute2.netlink.rtnl.ndmsg import flags as ntf_flags
from pyroute2.netlink.rtnl.ndmsg import states as nud_states

from nicoffload.ebpf import loader as nbpf
from nicoffload.errors import InputError, NotFoundError, SetupError

from . import state as st
from .fabric import drop_multicast
from .fault import FaultInjector
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
from .signals import SignalGuard, terminated_with
from .topology import BRIDGE_IFACE, PREFIXLEN, Host, Topology, check_name

MCAST_NET, MCAST_LEN = "224.0.0.0", 4
BRIDGE_NF_SYSCTLS = ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
                     "net.bridge.bridge-nf-call-arptables")
def _from_topology(attr: str, doc: str = "") -> property:
    return property(lambda self: getattr(self.topology, attr), doc=doc or f"The topology's {attr}.")


class Testbed:
    """A live (or about to be live) testbed. Use as a context manager, or ``up()`` / ``down()``.

    The ``with`` block tears the testbed down when it ends, when its body raises, and on SIGINT
    or SIGTERM (handlers installed for the block's duration; the signal then surfaces as
    KeyboardInterrupt or SystemExit(128+signum) after teardown). Call ``keep()`` inside the
    block to leave the testbed up after a normal exit (what ``nicoffload testbed up`` does).

    It owns its fault injector, ``faults``, which sees it as a
    :class:`~nicoffload.testbed.fault.FaultSite`: the topology and the saved fault configuration.
    """

    __test__ = False  # not a pytest class, despite the name

    def __init__(self, topology: Topology):
        self.topology = topology
        self._state: dict = {}
        self._is_up = False
        self._keep = False
        self._owned = True
        self._pid = os.getpid()  # forked children (pyroute2 forks) must never tear down
        self._procs: list[subprocess.Popen] = []
        self._signals = SignalGuard(on_signal=self._forget_keep)
        self.faults = FaultInjector(self)

    @classmethod
    def load(cls, name: str, own: bool = False) -> "Testbed":
        """Re-attach to the live testbed ``name`` (made by this or another process).

        With ``own=False`` a ``with`` block on it leaves it up (call ``down()`` to remove it);
        with ``own=True`` the block owns it exactly like one it created."""
        check_name(name)
        s = st.read(name)
        tb = cls(Topology.from_dict(s["topology"]))
        tb._state = s
        tb._is_up = True
        tb._owned = own
        return tb

    # --- description -------------------------------------------------------------------------
    name = _from_topology("name")
    hosts = _from_topology("hosts", "The aggregator first, then the workers by rank.")
    mcast_group = _from_topology("mcast_group")
    port = _from_topology("port")
    bridge_netns = _from_topology("bridge_netns")
    subnet = _from_topology("subnet_cidr", "The subnet, e.g. 10.200.7.0/24.")

    @property
    def agg(self) -> Host:
        return self.hosts[0]

    @property
    def aggs(self) -> list[Host]:
        """Every aggregator host (``agg`` first; more with ``Topology.aggregators``)."""
        return [h for h in self.hosts if h.role == "aggregator"]

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "worker"]

    def host(self, which: str | int | Host) -> Host:
        """A host by name ("agg", "w0", ...), worker rank (int) or Host."""
        return self.topology.host(which)

    def describe(self) -> dict:
        """The JSON shape of ``nicoffload testbed up --json``."""
        return {"name": self.name, "aggregator": self.agg.public(), "aggregators": [a.public() for a in self.aggs],
                "workers": [w.public() for w in self.workers],
                "mcast_group": self.mcast_group, "port": self.port, "bridge_netns": self.bridge_netns,
                "subnet": self.subnet, "mtu": self.topology.mtu}

    # --- the fault injector's view (FaultSite) -----------------------------------------------
    def load_fault_config(self) -> dict[str, dict]:
        return dict(self._state.get("faults", {}))

    def save_fault_config(self, config: dict[str, dict]) -> None:
        if self._state:
            self._state["faults"] = dict(config)
            self._save_state()

    # --- running things inside hosts ---------------------------------------------------------
    def in_host(self, host: str | int | Host):
        """Enter the host's network namespace in this thread (sockets made inside stay there)."""
        return nbpf.netns(self.host(host).netns)

    def call(self, host: str | int | Host, fn: Callable, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` in this thread inside the host's network namespace."""
        with self.in_host(host):
            return fn(*args, **kwargs)

    def socket(self, host: str | int | Host, family: int = socket.AF_INET, type: int = socket.SOCK_DGRAM,
               proto: int = 0) -> socket.socket:
        """A socket that lives in the host's namespace."""
        with self.in_host(host):
            return socket.socket(family, type, proto)

    def command(self, host: str | int | Host, argv: list[str]) -> list[str]:
        """argv wrapped to run inside the host's namespace."""
        if isinstance(argv, str):
            raise InputError("argv must be a list of strings, not one string")
        return ["ip", "netns", "exec", self.host(host).netns, *argv]

    def popen(self, host: str | int | Host, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside the host's namespace. Still running at teardown: terminated.
        It gets SIGTERM when the thread that started it dies, even by SIGKILL (no teardown
        then): no orphan keeps running, or keeps a removed namespace alive."""
        popen_kwargs.setdefault("preexec_fn", terminated_with(os.getpid()))
        p = subprocess.Popen(self.command(host, argv), **popen_kwargs)
        self._procs.append(p)
        return p

    def run(self, host: str | int | Host, argv: list[str], **run_kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside the host's namespace."""
        return subprocess.run(self.command(host, argv), **run_kwargs)

    # --- context manager and signals ---------------------------------------------------------
    def __enter__(self) -> "Testbed":
        if not self._owned:
            return self
        self._signals.install()
        try:
            if not self._is_up:
                self.up()
        except BaseException:
            self._signals.restore()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._owned or os.getpid() != self._pid:
            return
        try:
            if exc_type is not None or not self._keep:
                self.down()
        finally:
            self._signals.restore()

    def keep(self) -> None:
        """Leave the testbed up when the ``with`` block ends normally."""
        self._keep = True

    def _forget_keep(self) -> None:
        self._keep = False

    # --- bring up ----------------------------------------------------------------------------
    def _save_state(self) -> None:
        if self._state:
            st.write(self.name, self._state)

    def up(self) -> "Testbed":
        """Create everything. On any failure (or signal) what was made is torn down again."""
        if self._is_up:
            return self
        nbpf.require_root("creating a testbed")
        self.topology, self._state = st.claim(self.topology)
        self._is_up = True
        try:
            self._build()
        except BaseException:
            if os.getpid() == self._pid:
                self.down()
            raise
        self._state["status"] = "up"
        self._save_state()
        return self

    def _build(self) -> None:
        topo = self.topology
        hosts = self.hosts
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

        if topo.agg_napi:
            attach_napi_pass(self.agg.peer, topo.bridge_netns)
            self._state["napi_xdp"].append(self.agg.peer)
            self._save_state()
        self._wait_forwarding()

    PROBE_TIMEOUT = 5.0  # seconds

    def _wait_forwarding(self) -> None:
        """Return once every link forwards both ways: each worker's probe reaches the aggregator
        and its echo comes back. A qdisc attached to a veth whose carrier is not up yet drops
        until the kernel activates it (asynchronously, from linkwatch), so "oper up" alone is
        not enough; probing is."""
        agg = self.socket(self.agg)
        agg.bind((self.agg.ip, 0))
        agg.setblocking(False)
        port = agg.getsockname()[1]
        socks = {w.rank: self.socket(w) for w in self.workers}
        try:
            for s in socks.values():
                s.setblocking(False)
            pending = set(socks)
            deadline = time.monotonic() + self.PROBE_TIMEOUT
            while pending:
                for r in pending:
                    socks[r].sendto(b"probe", (self.agg.ip, port))
                time.sleep(0.002)
                while True:
                    try:
                        data, addr = agg.recvfrom(64)
                    except BlockingIOError:
                        break
                    agg.sendto(data, addr)
                time.sleep(0.002)
                for r in list(pending):
                    try:
                        socks[r].recvfrom(64)
                        pending.discard(r)
                    except BlockingIOError:
                        pass
                if time.monotonic() > deadline:
                    raise SetupError(f"testbed {self.name}: links of worker(s) {sorted(pending)} do not forward "
                                     f"after {self.PROBE_TIMEOUT:.0f} s")
        finally:
            agg.close()
            for s in socks.values():
                s.close()

    # --- the aggregator's link for native XDP ------------------------------------------------
    def set_agg_napi(self, enabled: bool) -> None:
        """Native XDP_TX from the aggregator's veth needs NAPI on the bridge-side peer (a trivial
        XDP_PASS program there); generic XDP must not have it, because a native program on the
        peer strips GSO from the aggregator's veth and its result batches would be cut into
        datagrams. Idempotent."""
        peer = self.agg.peer
        attached = nbpf.xdp_prog_id(peer, self.bridge_netns) is not None
        if enabled and not attached:
            attach_napi_pass(peer, self.bridge_netns)
            if peer not in self._state.setdefault("napi_xdp", []):
                self._state["napi_xdp"].append(peer)
        elif not enabled and attached:
            nbpf.detach_xdp(peer, self.bridge_netns, "native")
            self._state["napi_xdp"] = [p for p in self._state.get("napi_xdp", []) if p != peer]
        self._save_state()

    # --- tear down ---------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Remove everything of this testbed, in reverse order; safe to call twice and on a
        half-built testbed. Returns what was removed (for messages)."""
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs.clear()
        self.faults.close()
        if not self._state and not self._is_up:
            return []
        removed = teardown(self.topology, self._state)
        self._is_up = False
        self._state = {}
        return removed

    def __repr__(self) -> str:
        return f"Testbed({self.name!r}, workers={self.topology.workers}, subnet={self.subnet}, up={self._is_up})"


def teardown(topo: Topology, state: dict) -> list[str]:
    """Reverse of Testbed._build, from the description alone; tolerant of anything missing.
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


@contextlib.contextmanager
def running(workers: int, name: str | None = None, **kwargs) -> Iterator[Testbed]:
    """Shortcut: ``with running(4, rate="1gbit") as tb:`` (a star topology, torn down after)."""
    with Testbed(Topology.star(name or st.new_name(), workers, **kwargs)) as tb:
        yield tb


__all__ = ["Testbed", "attach_napi_pass", "running", "teardown"]
