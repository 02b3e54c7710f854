"""Seeded, replayable loss and duplication of AllReduce packets on testbed links.

This kernel has no netem (and no fq), so faults come from an eBPF program (xdp/fault.c)
attached with tc clsact (cls_bpf, direct-action) to the bridge-side veth of a link:

* ``ingress``: packets coming FROM the host (its transmissions),
* ``egress``: packets going TOWARDS the host (what it receives).

The decision for the n-th AllReduce packet on a link in a direction is a pure function of
(seed, link id, direction, n): :func:`decide` below computes exactly what the kernel does, so a
lossy run can be replayed, and a test can predict which packets vanish.

The program and its maps are pinned under /sys/fs/bpf/nicoffload/<bridge netns>/fault/, so any
process (the CLI after ``testbed up --drop``, a test, a benchmark) can read the counters or
reconfigure the links of a live testbed; teardown removes the pins.

The injector belongs to a testbed (``tb.faults``) and knows it only through :class:`FaultSite`:
the topology (bridge namespace, hosts and their links, port) and a place to keep the
configuration where other processes find it (the testbed's state file).
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Protocol

from pyroute2 import NetlinkError

from nicoffload.ebpf import libbpf
from nicoffload.ebpf import loader as nbpf
from nicoffload.errors import InputError, NotFoundError
from nicoffload.wire.proto import DEFAULT_PORT, FAULTS, C

from .netlink import ipr, link_index, tolerant
from .topology import Host, Topology

SOURCE = "fault.c"
DIRECTIONS = ("ingress", "egress")  # 0: from the host, 1: towards the host
MAX_LINKS = 64  # slots; slot = Host.link_id (aggregator 0, worker r -> r + 1)
FAULT_MARK = 0x6E636F66
#: layout of the fault_cfg map: Python is the source, fault.c gets these as -D values
CFG_WORDS = 8
W_SEED, W_LINK_ID, W_PORT, W_DROP, W_DUP = 0, 1, 2, 3, 5  # W_DROP + dir, W_DUP + dir
DEFINES = {
    "FAULT_MAX_LINKS": MAX_LINKS, "FAULT_MARK": FAULT_MARK, "FAULT_CFG_WORDS": CFG_WORDS,
    "FAULT_W_SEED": W_SEED, "FAULT_W_LINK_ID": W_LINK_ID, "FAULT_W_PORT": W_PORT,
    "FAULT_W_DROP": W_DROP, "FAULT_W_DUP": W_DUP,
}
PROGS = ("fault_ingress", "fault_egress")
MAPS = ("fault_link", "fault_cfg", "fault_seq", "fault_stats")
TC_PARENT = {"ingress": "ffff:fff2", "egress": "ffff:fff3"}
FAULT__COUNT = C["AR_FAULT__COUNT"]

# --- the decision function (mirror of fault_hash in xdp/fault.c) ----------------------------
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def fault_hash(seed: int, link_id: int, direction: int, n: int) -> int:
    s = _mix64((seed + _GOLDEN) & _M64)
    s = _mix64(s ^ ((link_id << 1) | direction))
    return _mix64((s + (n + 1) * _GOLDEN) & _M64)


def threshold(p: float) -> int:
    """Probability -> parts per 2^32 (1.0 -> 2^32: always)."""
    if not (0.0 <= p <= 1.0):
        raise InputError(f"bad probability {p}: 0..1")
    return min(1 << 32, round(p * (1 << 32)))


def _dir_index(direction: str | int) -> int:
    if direction in (0, 1):
        return int(direction)
    try:
        return DIRECTIONS.index(direction)
    except ValueError:
        raise InputError(f"bad direction {direction!r}: ingress (from the host) or egress (towards it)") from None


def decide(seed: int, link_id: int, direction: str | int, n: int, drop: float, dup: float) -> str:
    """What the injector does to the n-th AllReduce packet: 'drop', 'dup' or 'pass'."""
    h = fault_hash(seed, link_id, _dir_index(direction), n)
    if (h >> 32) < threshold(drop):
        return "drop"
    if (h & 0xFFFFFFFF) < threshold(dup):
        return "dup"
    return "pass"


@dataclass(frozen=True)
class FaultConfig:
    """Faults on one link. ``directions`` get ``drop``/``dup``; the others are only counted."""

    drop: float = 0.0
    dup: float = 0.0
    seed: int = 0
    directions: tuple[str, ...] = DIRECTIONS
    port: int = DEFAULT_PORT

    def __post_init__(self):
        threshold(self.drop), threshold(self.dup)
        object.__setattr__(self, "directions", tuple(DIRECTIONS[_dir_index(d)] for d in self.directions))
        if not (0 <= self.seed < 1 << 64):
            raise InputError(f"bad seed {self.seed}: 0..2^64-1")
        if not (1 <= self.port <= 65535):
            raise InputError(f"bad port {self.port}")

    def probabilities(self, direction: str) -> tuple[float, float]:
        return (self.drop, self.dup) if direction in self.directions else (0.0, 0.0)


class FaultSite(Protocol):
    """What the injector needs from the testbed that owns it (``Testbed`` is one)."""

    @property
    def topology(self) -> Topology:
        """Read at every use: the bridge namespace, the hosts, their links and the port."""

    def load_fault_config(self) -> dict[str, dict]:
        """Host name -> its configuration as JSON, as last saved (by this or another process)."""

    def save_fault_config(self, config: dict[str, dict]) -> None:
        """Keep ``config`` where :meth:`load_fault_config` and other processes find it."""


def pin_dir(bridge_netns: str) -> Path:
    return nbpf.PIN_ROOT / bridge_netns / "fault"


class FaultInjector:
    """The fault injector of one testbed (``tb.faults``).

    >>> tb.faults.configure(["w0"], drop=0.2, seed=7)          # both directions of w0's link
    >>> tb.faults.stats("w0")["ingress"]["dropped"]
    >>> tb.faults.predict("w0", "ingress", 100)                 # ['pass', 'drop', ...]
    """

    def __init__(self, site: FaultSite):
        self.site = site
        self._maps: dict[str, libbpf.Map] | None = None
        self._progs: dict[str, int] | None = None

    # --- where things live -------------------------------------------------------------------
    @property
    def pin_dir(self) -> Path:
        return pin_dir(self.site.topology.bridge_netns)

    def configured(self) -> dict[str, FaultConfig]:
        """Host name -> its fault configuration, as recorded by the testbed."""
        raw = self.site.load_fault_config()
        return {h: FaultConfig(**{**c, "directions": tuple(c["directions"])}) for h, c in raw.items()}

    def _hosts(self, hosts) -> list[Host]:
        return self.site.topology.hosts_of(hosts)

    # --- loading -----------------------------------------------------------------------------
    def _load(self) -> None:
        if self._maps is not None:
            return
        nbpf.require_root("the fault injector")
        nbpf.ensure_bpffs()
        if not all((self.pin_dir / n).exists() for n in PROGS + MAPS):
            shutil.rmtree(self.pin_dir, ignore_errors=True)
            b = nbpf.compile_bpf(SOURCE, DEFINES)
            try:
                for p in PROGS:
                    fn = nbpf.load_func(b, p, "SCHED_CLS", SOURCE)
                    libbpf.pin(fn.fd, self.pin_dir / p)
                for m in MAPS:
                    libbpf.pin(b[m.encode()].map_fd, self.pin_dir / m)
            except BaseException:
                shutil.rmtree(self.pin_dir, ignore_errors=True)
                raise
            finally:
                b.cleanup()
        self._progs = {p: libbpf.obj_get(self.pin_dir / p) for p in PROGS}
        self._maps = {
            "fault_link": libbpf.Map.pinned(self.pin_dir / "fault_link", ctypes.c_uint32),
            "fault_cfg": libbpf.Map.pinned(self.pin_dir / "fault_cfg", ctypes.c_uint64),
            "fault_seq": libbpf.Map.pinned(self.pin_dir / "fault_seq", ctypes.c_uint64),
            "fault_stats": libbpf.Map.pinned(self.pin_dir / "fault_stats", ctypes.c_uint64, percpu=True),
        }

    def close(self) -> None:
        """Release this process's file descriptors (the pins keep everything alive)."""
        for m in (self._maps or {}).values():
            m.close()
        for fd in (self._progs or {}).values():
            os.close(fd)
        self._maps = self._progs = None

    # --- configuration -----------------------------------------------------------------------
    def configure(self, hosts: Iterable[str] | str | None = None, *, drop: float = 0.0, dup: float = 0.0,
                  seed: int = 0, directions: Iterable[str] = DIRECTIONS, port: int | None = None) -> None:
        """Inject faults on the links of ``hosts`` (default: every host).

        ``drop``/``dup``: probabilities in [0, 1] applied in ``directions`` ("ingress" = from the
        host, "egress" = towards it); ``seed`` makes the run replayable; ``port``: the AllReduce
        UDP port (default: the testbed's). Reconfiguring restarts the packet numbering (n = 0)
        and zeroes the counters of those links."""
        topo = self.site.topology
        cfg = FaultConfig(drop, dup, seed, tuple(directions), port or topo.port)
        self._load()
        record = self.site.load_fault_config()
        with ipr(topo.bridge_netns) as sock:
            for h in self._hosts(hosts):
                idx = link_index(sock, h.peer)
                self._attach_filters(sock, idx)
                self._write_cfg(h.link_id, h.link_id, cfg)
                self._maps["fault_link"].update(idx, h.link_id)
                record[h.name] = {**asdict(cfg), "directions": list(cfg.directions)}
        self.site.save_fault_config(record)

    def _attach_filters(self, sock, idx: int) -> None:
        try:
            sock.tc("add", "clsact", idx)
        except NetlinkError as e:
            if e.code != errno.EEXIST:  # there from an earlier configure: fine
                raise
        for d, prog in zip(DIRECTIONS, PROGS):
            sock.tc("replace-filter", "bpf", idx, 1, fd=self._progs[prog], name=prog, parent=TC_PARENT[d],
                    classid=1, direct_action=True, prio=1)

    def _write_cfg(self, slot: int, link_id: int, cfg: FaultConfig) -> None:
        if not (0 <= slot < MAX_LINKS):
            raise InputError(f"link id {slot} out of range for the fault injector (< {MAX_LINKS})")
        cm = self._maps["fault_cfg"]
        base = slot * CFG_WORDS
        cm.update(base + W_SEED, cfg.seed)
        cm.update(base + W_LINK_ID, link_id)
        cm.update(base + W_PORT, cfg.port)
        for di, d in enumerate(DIRECTIONS):
            drop, dup = cfg.probabilities(d)
            cm.update(base + W_DROP + di, threshold(drop))
            cm.update(base + W_DUP + di, threshold(dup))
        self._reset_slot(slot)

    def _reset_slot(self, slot: int) -> None:
        for di in range(2):
            self._maps["fault_seq"].update(slot * 2 + di, 0)
            for c in range(FAULT__COUNT):
                self._maps["fault_stats"].update((slot * 2 + di) * FAULT__COUNT + c, 0)

    def reset(self, hosts: Iterable[str] | str | None = None) -> None:
        """Restart the packet numbering (n = 0) and zero the counters of configured links."""
        self._load()
        conf = self.configured()
        for h in self._hosts(hosts):
            if h.name in conf:
                self._reset_slot(h.link_id)

    def remove(self, hosts: Iterable[str] | str | None = None) -> None:
        """Take the injector off the links of ``hosts`` (default: every configured link)."""
        record = self.site.load_fault_config()
        targets = [h for h in self._hosts(hosts if hosts is not None else list(record)) if h.name in record]
        if not targets:
            return
        with ipr(self.site.topology.bridge_netns) as sock:
            for h in targets:
                idx = sock.link_lookup(ifname=h.peer)
                if idx:
                    tolerant(sock.tc, "del", "clsact", idx[0])
                    if self._maps is not None or self.pin_dir.exists():
                        self._load()
                        self._maps["fault_link"].delete(idx[0])
                record.pop(h.name, None)
        self.site.save_fault_config(record)

    # --- reading -----------------------------------------------------------------------------
    def stats(self, host: str | int | None = None) -> dict:
        """Counters of one host's link: {"ingress": {"seen", "dropped", "duplicated", "passed"},
        "egress": {...}}; without ``host``: {host name: that} for every configured link."""
        if host is None:
            return {h: self.stats(h) for h in self.configured()}
        h = self.site.topology.host(host)
        if h.name not in self.configured():
            raise NotFoundError(f"no fault injector on the link of {h.name} in testbed {self.site.topology.name!r}")
        self._load()
        out = {}
        for di, d in enumerate(DIRECTIONS):
            base = (h.link_id * 2 + di) * FAULT__COUNT
            out[d] = {name: self._maps["fault_stats"].lookup(base + i) or 0 for i, name in enumerate(FAULTS)}
        return out

    def predict(self, host: str | int, direction: str, count: int, start: int = 0) -> list[str]:
        """Decisions for packets n = start .. start+count-1 under the link's current configuration."""
        h = self.site.topology.host(host)
        conf = self.configured().get(h.name)
        if conf is None:
            return ["pass"] * count
        drop, dup = conf.probabilities(DIRECTIONS[_dir_index(direction)])
        return [decide(conf.seed, h.link_id, direction, n, drop, dup) for n in range(start, start + count)]
