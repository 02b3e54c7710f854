"""Realise a :class:`~nicoffload.testbed.topology.Topology` in network namespaces with pyroute2.

    with Testbed(Topology.star("demo", workers=4, rate="1gbit")) as tb:
        with tb.in_host("w0"):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # lives in w0's namespace
        tb.run("agg", ["ping", "-c1", tb.host("w1").ip])

Bringing up: the state file (status "creating", the name and subnet claimed), the namespaces,
bridge and links (realise.py: :func:`~nicoffload.testbed.realise.build`), a probe until every
link forwards, the state file (status "up"). Tearing down is realise.py's too, driven by the
state file only, so another process (``nicoffload testbed down``) can do it. Finding, listing
and cleaning up testbeds by name is the registry's (registry.py).
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from typing import Callable, Iterator

from nicoffload.ebpf import loader as nbpf
from nicoffload.errors import InputError, SetupError

from . import state as st
from .fault import FaultInjector
from .napi import attach_napi_pass
from .realise import build, teardown
from .signals import SignalGuard, terminated_with
from .topology import Host, Topology, check_name


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
        """The JSON shape of ``nicoffload testbed up --json`` (with what :meth:`note` recorded)."""
        return {"name": self.name, "aggregator": self.agg.public(), "aggregators": [a.public() for a in self.aggs],
                "workers": [w.public() for w in self.workers],
                "mcast_group": self.mcast_group, "port": self.port, "bridge_netns": self.bridge_netns,
                "subnet": self.subnet, "mtu": self.topology.mtu, **self.notes}

    @property
    def notes(self) -> dict:
        """What the testbed's owner recorded about its use (e.g. ``ranks_per_host``): the testbed
        has hosts; how many processes each runs is theirs to say, and the state file keeps it."""
        return dict(self._state.get("notes", {}))

    def note(self, **fields) -> None:
        """Record ``fields`` (JSON values) in the state file, for :attr:`notes` and ``testbed list``."""
        if self._state:
            self._state.setdefault("notes", {}).update(fields)
            self._save_state()

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
        build(self.topology, self._state)
        if self.topology.agg_napi:
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


@contextlib.contextmanager
def running(workers: int, name: str | None = None, **kwargs) -> Iterator[Testbed]:
    """Shortcut: ``with running(4, rate="1gbit") as tb:`` (a star topology, torn down after)."""
    with Testbed(Topology.star(name or st.new_name(), workers, **kwargs)) as tb:
        yield tb


__all__ = ["Testbed", "attach_napi_pass", "running"]
