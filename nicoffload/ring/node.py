"""Control plane of the ring offload (DirectReduce): compile xdp/ring.c with the record size and
capacity, configure one node of a ring (its rank, every node's address), attach it to the
node's interface inside its network namespace, pin program and maps, and record what is loaded
in a state file so that other processes find it: the node's host (a
:class:`~nicoffload.ring.RingCommunicator`, which maps the maps into its address space) and
``nicoffload ring status|stats|unload``.

Processes started with ``ip netns exec`` see a /sys of their own without the BPF filesystem, so
they cannot open pins: the state file (under /run, which they share) records the maps' ids, and
they open the maps by id. A communicator that finds no ring program on its interface loads one
for itself (``owner`` = its pid, not pinned) and unloads it when it closes. The maps themselves
(mapped, read, reset) are :mod:`nicoffload.ring.maps`; the state file's plumbing, shared with the
aggregator, :mod:`nicoffload.ebpf.loadstate`.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nicoffload.ebpf import libbpf, linker, loadstate
from nicoffload.ebpf import loader as bpf
from nicoffload.ebpf.iface import MODES, iface_addr, resolve_mode
from nicoffload.ebpf.iface import neighbour_mac as _neighbour_mac
from nicoffload.errors import AlreadyExistsError, InputError, MapError, NotFoundError
from nicoffload.jobspec import DEFAULT
from nicoffload.ring import nodelock
from nicoffload.ring.layout import DEFAULT_CAPACITY, masks_of
from nicoffload.ring.maps import MAPS, RingMaps
from nicoffload.wire import proto
from nicoffload.wire.addr import ip_net, mac_bytes, require_ipv4s

STATE_DIR = Path("/run/nicoffload/rings")
SOURCE = "ring.c"
ENTRY, CALLBACKS = "ring_xdp", ("ring_record",)
#: records per call a ring program may hold at most (its two maps hold 2 x capacity records)
MAX_CAPACITY = 1 << 20


def pin_dir(netns: str | None, iface: str) -> Path:
    loadstate.check_names(netns, iface)
    return bpf.PIN_ROOT / (netns or "root") / f"ring-{iface}"


def state_file(netns: str | None, iface: str) -> Path:
    return loadstate.state_file(STATE_DIR, netns, iface)


def current_netns() -> str | None:
    """The name (under /run/netns) of this process's network namespace; None for the root one
    (or one without a name)."""
    try:
        me = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    if bpf.NETNS_DIR.is_dir():
        for p in sorted(bpf.NETNS_DIR.iterdir()):
            try:
                if os.stat(p).st_ino == me:
                    return p.name
            except OSError:
                continue
    return None


def record_bytes(elems: int) -> int:
    return proto.record_size(elems)


@dataclass
class RingSpec:
    """One node of a ring: where it is loaded, its place in the ring and the job's shape. Saved
    in the state file with what the load resolved (addresses, the program and map ids)."""

    netns: str | None
    iface: str
    rank: int
    world: int
    peers: list[str]                     # every node's IPv4 address, by rank
    job: int = DEFAULT.job
    port: int = DEFAULT.port
    elems: int = DEFAULT.elems
    capacity: int = DEFAULT_CAPACITY     # records per call (a tensor of more goes in several passes)
    mode: str = "auto"
    peer_macs: list[str] = field(default_factory=list)
    my_ip: str = ""
    my_mac: str = ""
    prog_id: int | None = None
    map_ids: dict = field(default_factory=dict)
    mode_reason: str = ""
    owner: int = 0                       # pid of the communicator that loaded it for itself; 0: to stay
    pinned: bool = False

    def validate(self) -> "RingSpec":
        if not 1 <= self.world <= proto.MAX_WORKERS:
            raise InputError(f"--world must be 1..{proto.MAX_WORKERS}, not {self.world}")
        if not 0 <= self.rank < self.world:
            raise InputError(f"--rank must be 0..{self.world - 1}, not {self.rank}")
        if len(self.peers) != self.world:
            raise InputError(f"--peers names {len(self.peers)} addresses; a ring of {self.world} needs one per rank")
        require_ipv4s(self.peers, "--peers:", "--peers names an address twice: every rank needs its own")
        if self.peer_macs and len(self.peer_macs) != self.world:
            raise InputError(f"--peer-macs names {len(self.peer_macs)} addresses, the ring has {self.world} ranks")
        DEFAULT.replace(job=self.job, port=self.port, elems=self.elems).validate()
        if not 1 <= self.capacity <= MAX_CAPACITY:
            raise InputError(f"--capacity must be 1..{MAX_CAPACITY} records, not {self.capacity}")
        if self.mode not in MODES:
            raise InputError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        return self

    def defines(self) -> dict[str, int]:
        return {"AR_ELEMS": self.elems, "AR_PORT": self.port, "AR_RING_CAP": self.capacity}

    @property
    def record_size(self) -> int:
        return record_bytes(self.elems)


# --- the node -------------------------------------------------------------------------------
class RingNode:
    """A ring program on one interface. :meth:`load` (attach, pin, record), :meth:`open` (find
    one another process loaded), :meth:`for_test` (load only, for BPF_PROG_TEST_RUN). Context
    manager; :meth:`close` unloads only what this object loaded to own."""

    def __init__(self, spec: RingSpec, maps: RingMaps, b=None, prog: linker.LoadedProgram | None = None,
                 owner: bool = False):
        self.spec, self.maps, self.b, self.prog = spec, maps, b, prog
        self._owner = owner
        self._closed = False

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, spec: RingSpec, pin: bool = True, owner: int = 0) -> "RingNode":
        """Compile, configure, attach and record; pinned under /sys/fs/bpf/nicoffload unless
        ``pin`` is false. ``owner``: the pid that unloads it when it closes (0: it stays)."""
        spec.validate()
        bpf.require_root("loading the ring program")
        where = f"{spec.iface} in {spec.netns or 'the root namespace'}"
        spec.my_ip, spec.my_mac, mtu = iface_addr(spec.iface, spec.netns)
        if spec.peers[spec.rank] != spec.my_ip:
            raise InputError(f"rank {spec.rank}'s address in --peers is {spec.peers[spec.rank]}, but {where} has "
                             f"{spec.my_ip}")
        if bpf.xdp_prog_id(spec.iface, spec.netns) is not None:
            raise AlreadyExistsError(f"{where} already has an XDP program attached; run: nicoffload ring unload "
                                     f"--netns {spec.netns} --iface {spec.iface} (or agg unload)")
        if state_file(spec.netns, spec.iface).exists() or pin_dir(spec.netns, spec.iface).exists():
            raise AlreadyExistsError(f"a ring program is already recorded for {where}; run: nicoffload ring "
                                     f"unload --netns {spec.netns} --iface {spec.iface}")
        need = proto.mtu_for_elems(spec.elems)
        if mtu < need:
            raise InputError(f"{spec.elems} elements per record need an MTU of {need}, {spec.iface} has {mtu}")
        if not spec.peer_macs:
            spec.peer_macs = [spec.my_mac if r == spec.rank else neighbour_mac(ip, spec.iface, spec.netns)
                              for r, ip in enumerate(spec.peers)]
        spec.mode, spec.mode_reason = resolve_mode(spec.mode, spec.iface, spec.netns)
        spec.owner, spec.pinned = owner, pin
        pdir = pin_dir(spec.netns, spec.iface)
        if pin:
            bpf.ensure_bpffs()
            bpf.make_pin_dir(pdir)
        node = attachment = None
        try:
            b = bpf.compile_bpf(SOURCE, spec.defines())
            prog = linker.load_linked(b, ENTRY, CALLBACKS, source_name=SOURCE)
            node = cls(spec, _bcc_maps(b, spec), b, prog, owner=bool(owner))
            node._configure()
            node.maps.reset()
            node.maps.reset_stats()
            spec.map_ids = {name: libbpf.map_info(fd)["id"] for name, fd in node.maps.fds.items()}
            attachment = bpf.attach_xdp_fd(prog.fd, spec.iface, spec.netns, spec.mode)
            if pin:
                libbpf.pin(prog.fd, pdir / "prog")
                for name, fd in node.maps.fds.items():
                    libbpf.pin(fd, pdir / name)
            spec.prog_id = bpf.xdp_prog_id(spec.iface, spec.netns)
            _save(spec)
        except BaseException:
            if attachment is not None:
                attachment.detach()
            if node is not None:
                node._release()
            if pin:
                bpf.remove_pin_dir(pdir)
            state_file(spec.netns, spec.iface).unlink(missing_ok=True)
            raise
        return node

    @classmethod
    def for_test(cls, rank: int, world: int, peers: list[str], peer_macs: list[str], *, elems: int = DEFAULT.elems,
                 capacity: int = 64, job: int = DEFAULT.job, port: int = DEFAULT.port) -> "RingNode":
        """Load (not attach, not pin) for BPF_PROG_TEST_RUN."""
        spec = RingSpec(None, "", rank, world, list(peers), job, port, elems, capacity, "generic",
                        peer_macs=list(peer_macs), my_ip=peers[rank], my_mac=peer_macs[rank]).validate()
        b = bpf.compile_bpf(SOURCE, spec.defines())
        prog = linker.load_linked(b, ENTRY, CALLBACKS, source_name=SOURCE)
        node = cls(spec, _bcc_maps(b, spec), b, prog)
        node._configure()
        node.maps.reset()
        node.maps.reset_stats()
        return node

    @classmethod
    def open(cls, netns: str | None, iface: str) -> "RingNode":
        """The ring program another process loaded on ``iface`` (its maps opened by id)."""
        spec = read_spec(netns, iface)
        attached = bpf.xdp_prog_id(iface, netns)
        if spec.prog_id is not None and attached != spec.prog_id:
            what = "no program" if attached is None else f"program {attached}"
            raise NotFoundError(f"the ring program recorded for {iface} in {netns or 'the root namespace'} "
                                f"(prog {spec.prog_id}) is gone ({what} attached); run: nicoffload ring unload "
                                f"--netns {netns} --iface {iface}")
        return cls(spec, RingMaps.by_id(spec.map_ids, spec.capacity, spec.elems))

    def _configure(self) -> None:
        s = self.spec
        t = self.b["ring_cfg"]
        v = t.Leaf()
        v.rank, v.world, v.job = s.rank, s.world, socket.htonl(s.job)
        v.next, v.prev = (s.rank + 1) % s.world, (s.rank - 1) % s.world
        me, nxt, last = masks_of(s.rank, s.world)
        v.bit_me, v.bit_next, v.bit_last = socket.htonl(me), socket.htonl(nxt), socket.htonl(last)
        v.world_mask = (1 << s.world) - 1
        v.my_ip = ip_net(s.my_ip)
        v.my_mac[:6] = list(mac_bytes(s.my_mac))
        for r, (ip, mac) in enumerate(zip(s.peers, s.peer_macs)):
            v.peer_ip[r] = ip_net(ip)
            v.peer_mac[8 * r:8 * r + 6] = list(mac_bytes(mac))
        v.configured = 1
        try:
            t[t.Key(0)] = v
        except Exception as e:  # bcc raises plain Exception
            raise MapError(f"writing ring_cfg failed: {e}") from e

    # --- inspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return self.maps.stats()

    def reset_stats(self) -> None:
        self.maps.reset_stats()

    def state(self) -> dict[str, int]:
        from nicoffload.ring import layout as L

        w = self.maps.state
        return {"call": int(w[L.ST_CALL]), "expected": int(w[L.ST_EXPECTED]),
                "stored": int(w[L.ST_STORED]) + int(w[L.ST_HOST_STORED]), "host_stored": int(w[L.ST_HOST_STORED]),
                "own_stored": int(w[L.ST_OWN_STORED]) + int(w[L.ST_HOST_OWN])}

    def status(self) -> dict:
        s = self.spec
        attached = bool(s.iface) and bpf.xdp_prog_id(s.iface, s.netns) is not None
        owner_alive = bool(s.owner) and Path(f"/proc/{s.owner}").exists()
        return {"netns": s.netns, "iface": s.iface, "attached": attached, "mode": s.mode, "mode_reason": s.mode_reason,
                "prog_id": s.prog_id, "rank": s.rank, "world": s.world, "peers": s.peers, "peer_macs": s.peer_macs,
                "job": s.job, "port": s.port, "elems": s.elems, "capacity": s.capacity, "owner": s.owner,
                "owner_alive": owner_alive, "pins": str(pin_dir(s.netns, s.iface)) if s.pinned else None,
                "map_ids": s.map_ids, "state": self.state()}

    def run(self, packet: bytes, repeat: int = 1) -> libbpf.TestRunResult:
        if self.prog is None:
            raise MapError("this ring program was opened for inspection; it has no program to run")
        return libbpf.test_run(self.prog.fd, packet, repeat=repeat)

    # --- teardown --------------------------------------------------------------------------
    def release(self) -> None:
        """Leave the program loaded when this object goes away (``ring load`` exits after this)."""
        self._owner = False

    def _release(self) -> None:
        self.maps.close()
        loadstate.release(self.prog, self.b)
        self.prog = self.b = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        if self._owner:
            unload(self.spec.netns, self.spec.iface, missing_ok=True)

    def __enter__(self) -> "RingNode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bcc_maps(b, spec: RingSpec) -> RingMaps:
    # the bcc module owns these fds (b.cleanup closes them)
    return RingMaps({name: b[name.encode()].map_fd for name in MAPS}, spec.capacity, spec.elems, owned=False)


def neighbour_mac(ip: str, iface: str, netns: str | None, timeout: float = 1.0) -> str:
    """A ring peer's MAC (:func:`nicoffload.ebpf.iface.neighbour_mac`)."""
    return _neighbour_mac(ip, iface, netns, timeout, hint="is it up? (or give --peer-macs)")


def _save(spec: RingSpec) -> None:
    loadstate.save(state_file(spec.netns, spec.iface), asdict(spec))


def read_spec(netns: str | None, iface: str) -> RingSpec:
    try:
        return RingSpec(**json.loads(state_file(netns, iface).read_text()))
    except FileNotFoundError:
        raise NotFoundError(f"no ring program is loaded on {iface} in {netns or 'the root namespace'}") from None


def unload(netns: str | None, iface: str, missing_ok: bool = False) -> bool:
    """Detach the ring program from ``iface``, remove its pins and state. Returns whether anything
    was there; without ``missing_ok`` nothing there is a NotFoundError."""
    bpf.require_root("unloading the ring program")
    sf = state_file(netns, iface)
    spec = None
    if sf.exists():
        try:
            spec = RingSpec(**json.loads(sf.read_text()))
        except (ValueError, TypeError):
            pass
    found = sf.exists() or sf.with_suffix(".tmp").exists() or pin_dir(netns, iface).exists()
    detached = False
    try:
        attached = bpf.xdp_prog_id(iface, netns)
        # only ours: an aggregator loaded on the interface since is not the ring's to remove
        if attached is not None and (spec is None or spec.prog_id in (None, attached)):
            detached = bpf.detach_xdp(iface, netns, spec.mode if spec else "generic")
    except NotFoundError:
        pass
    bpf.remove_pin_dir(pin_dir(netns, iface))
    for f in (sf, sf.with_suffix(".tmp")):
        f.unlink(missing_ok=True)
    nodelock.remove_unheld(sf.with_suffix(".lock"))
    if not (found or detached) and not missing_ok:
        raise NotFoundError(f"no ring program is loaded on {iface} in {netns or 'the root namespace'}")
    return found or detached


def loaded(netns_prefix: str = "") -> list[tuple[str | None, str]]:
    """(netns, iface) of every ring program recorded on this machine (optionally only in
    namespaces whose name starts with ``netns_prefix``), also those whose load was killed while it
    wrote the state file."""
    return loadstate.recorded(STATE_DIR, netns_prefix)
