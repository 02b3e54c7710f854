"""The testbed topology as pure data: who exists, with which names, addresses and link shapes.

Nothing here touches the system. :class:`~nicoffload.testbed.testbed.Testbed` realises a
:class:`Topology` in network namespaces.

Layout (one testbed called NAME, subnet index X)::

    netns nco-NAME-br:   br0 (Linux bridge, multicast snooping off)
                          |-- p-agg  <veth>  eth0 in netns nco-NAME-agg  10.200.X.1
                          |-- p-w0   <veth>  eth0 in netns nco-NAME-w0   10.200.X.10
                          '-- p-w1   <veth>  eth0 in netns nco-NAME-w1   10.200.X.11 ...

Nothing lives in the root namespace. Every namespace carries the toolkit prefix ``nco-``.
Results are multicast to 239.77.X.1. MACs are fixed and locally administered:
02:6e:63:X:00:01 for the aggregator, 02:6e:63:X:01:RR for worker rank RR. With ``aggregators``
K > 1 (jobs sharded over several aggregators), aggregator k >= 1 is host ``aggK`` at
10.200.X.(1+k), 02:6e:63:X:00:(1+k).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Iterable

from nicoffload.errors import InputError
from nicoffload.wire.proto import DEFAULT_PORT, MAX_MTU

#: every object the toolkit creates carries this prefix (namespaces, pin directories)
PREFIX = "nco-"
#: the aggregator's host name; workers are "w0", "w1", ...
AGG = "agg"
#: interface name of every host inside its own namespace
HOST_IFACE = "eth0"
#: the bridge, inside the bridge namespace
BRIDGE_IFACE = "br0"
#: subnet indices X in 10.200.X.0/24 and 239.77.X.1
SUBNET_MIN, SUBNET_MAX = 1, 254
SUBNET_FMT = "10.200.{x}.0"
PREFIXLEN = 24
GROUP_FMT = "239.77.{x}.{job}"
AGG_HOST_OCTET = 1
WORKER_HOST_OCTET0 = 10
#: aggregator hosts of one testbed at most (their addresses sit below the workers')
MAX_AGGREGATORS = WORKER_HOST_OCTET0 - AGG_HOST_OCTET - 1
#: worker hosts at most: the /24 above the aggregators (a job of more than AR_MAX_WORKERS ranks
#: spans several aggregator jobs, nicoffload.worker.hier)
MAX_HOSTS = 200
MAX_NAME = 12
MIN_MTU, MAX_PLAIN_MTU = 576, 9000

_NAME = re.compile(r"^[a-z0-9][a-z0-9_]*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_RATE_MULT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
#: tbf keeps the rate in a u32 of bytes per second
MAX_RATE_BPS = (2**32 - 1) * 8


def parse_rate(rate: str | int | None) -> int | None:
    """'100mbit' -> 100_000_000 (bits/s); None, '', 'unshaped', 0 -> None (no shaping).

    Units: bit (default), kbit, mbit, gbit, tbit; 'bps' suffixes mean bytes per second."""
    if rate is None:
        return None
    if isinstance(rate, int):
        bps = rate
    else:
        text = rate.strip().lower()
        if text in ("", "unshaped", "none", "0"):
            return None
        m = _RATE.match(text)
        if not m:
            raise InputError(f"bad rate {rate!r}: use e.g. 100mbit, 1gbit, 500kbit or 'unshaped'")
        value, mult, unit = float(m.group(1)), _RATE_MULT[m.group(2).lower()], (m.group(3) or "bit").lower()
        bps = int(value * mult * (8 if unit == "bps" else 1))
    if bps <= 0:
        return None
    if bps < 8000 or bps > MAX_RATE_BPS:
        raise InputError(f"rate {rate!r} out of range: between 8kbit and {MAX_RATE_BPS // 10**9}gbit, or 'unshaped'")
    return bps


def format_rate(bps: int | None) -> str:
    if not bps:
        return "unshaped"
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % mult == 0:
            return f"{bps // mult}{unit}"
    return f"{bps}bit"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME:
        raise InputError(
            f"bad testbed name {name!r}: 1-{MAX_NAME} characters of a-z, 0-9 and _, starting with a letter or digit")
    return name


def netns_prefix(name: str, whole: bool = True) -> str:
    """How the namespace names of testbed ``name`` start (``whole``), or those of every testbed
    whose name starts with ``name`` (``whole=False``: ``name`` is a name prefix, may be empty)."""
    return f"{PREFIX}{check_name(name)}-" if whole else f"{PREFIX}{name}"


def derived_subnet(name: str) -> int:
    """The subnet index a name maps to when it is free (stable across runs)."""
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big")
    return SUBNET_MIN + h % (SUBNET_MAX - SUBNET_MIN + 1)


@dataclass(frozen=True)
class Link:
    """The veth between one host and the bridge. ``rate`` in bits/s (None: unshaped), applied
    in both directions; ``queues``: tx and rx queues of both veth ends."""

    rate: int | None = None
    queues: int = 1

    def __post_init__(self):
        if self.rate is not None and not isinstance(self.rate, int):
            object.__setattr__(self, "rate", parse_rate(self.rate))
        if not (1 <= int(self.queues) <= 64):
            raise InputError(f"bad queue count {self.queues}: 1..64")


@dataclass(frozen=True)
class Host:
    """One host of a topology, fully derived: everything a worker or aggregator needs."""

    name: str  # "agg", "w0", ...
    role: str  # "aggregator" | "worker"
    rank: int | None  # worker rank; None for the aggregator
    netns: str  # its network namespace
    iface: str  # its interface inside netns
    peer: str  # the bridge-side veth (in the bridge namespace)
    ip: str
    mac: str
    link_id: int  # 0 for the aggregator, rank + 1 for workers (fault injector stream id)
    link: Link

    def public(self) -> dict:
        """The JSON shape of ``testbed up --json``."""
        d = {"netns": self.netns, "iface": self.iface, "ip": self.ip, "mac": self.mac}
        if self.rank is not None:
            d = {"rank": self.rank, **d}
        return d


@dataclass(frozen=True)
class Topology:
    """N workers and one aggregator behind one bridge.

    ``subnet``: X of 10.200.X.0/24 and 239.77.X.1; None means "derive from the name, or the
    next free one" (resolved by Testbed.up, which never lets two live testbeds share one).
    ``links``: per-host overrides, e.g. ``{"w0": Link(rate=100_000_000)}``; hosts not listed use
    ``default_link``. ``agg_napi``: attach an XDP_PASS program to the bridge-side peer of the
    aggregator's link at build time (native XDP_TX from the aggregator's veth needs it; generic
    XDP must not have it; ``Testbed.set_agg_napi`` changes it on a live testbed). ``multicast``
    False: the fabric drops every multicast frame on its way to a host (testbed/fabric.py), as
    networks without multicast do.
    """

    name: str
    workers: int
    mtu: int = 1500
    default_link: Link = field(default_factory=Link)
    links: dict[str, Link] = field(default_factory=dict)
    port: int = DEFAULT_PORT
    subnet: int | None = None
    agg_napi: bool = False
    multicast: bool = True
    aggregators: int = 1

    def __post_init__(self):
        check_name(self.name)
        if not (1 <= self.workers <= MAX_HOSTS):
            raise InputError(f"bad worker count {self.workers}: 1..{MAX_HOSTS}")
        if not (1 <= self.aggregators <= MAX_AGGREGATORS):
            raise InputError(f"bad aggregator count {self.aggregators}: 1..{MAX_AGGREGATORS}")
        top = MAX_MTU if self.agg_napi else MAX_PLAIN_MTU
        if not (MIN_MTU <= self.mtu <= top):
            why = " (native XDP on veth refuses larger MTUs)" if self.agg_napi else ""
            raise InputError(f"bad MTU {self.mtu}: {MIN_MTU}..{top}{why}")
        if not (1 <= self.port <= 65535):
            raise InputError(f"bad port {self.port}")
        if self.subnet is not None and not (SUBNET_MIN <= self.subnet <= SUBNET_MAX):
            raise InputError(f"bad subnet index {self.subnet}: {SUBNET_MIN}..{SUBNET_MAX}")
        names = set(self.host_names())
        for h in self.links:
            if h not in names:
                raise InputError(f"link override for unknown host {h!r}; hosts are {', '.join(self.host_names())}")

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def star(cls, name: str, workers: int, *, rate: str | int | None = None, queues: int = 1,
             mtu: int = 1500, port: int = DEFAULT_PORT, subnet: int | None = None,
             agg_napi: bool = False, links: dict[str, Link] | None = None, multicast: bool = True,
             aggregators: int = 1, agg_rate: str | int | None = None) -> "Topology":
        """The usual shape: ``workers`` workers, ``aggregators`` aggregators (one by default),
        every link at ``rate``; each aggregator's link at ``agg_rate`` when given ('unshaped':
        none), which ``links`` may still override per host."""
        over = {}
        if agg_rate is not None:
            over = {a: Link(parse_rate(agg_rate), queues) for a in [AGG] + [f"{AGG}{k}" for k in range(1, aggregators)]}
        return cls(name=name, workers=workers, mtu=mtu, default_link=Link(parse_rate(rate), queues),
                   links={**over, **(links or {})}, port=port, subnet=subnet, agg_napi=agg_napi,
                   multicast=multicast, aggregators=aggregators)

    def with_subnet(self, subnet: int) -> "Topology":
        return dataclasses.replace(self, subnet=subnet)

    # --- derived names -----------------------------------------------------------------------
    @property
    def bridge_netns(self) -> str:
        return netns_prefix(self.name) + "br"

    def netns_of(self, host: str) -> str:
        return netns_prefix(self.name) + host

    def agg_names(self) -> list[str]:
        """The aggregator hosts: "agg", then "agg1", "agg2", ..."""
        return [AGG] + [f"{AGG}{k}" for k in range(1, self.aggregators)]

    def host_names(self) -> list[str]:
        return self.agg_names() + [f"w{r}" for r in range(self.workers)]

    def netns_names(self) -> list[str]:
        """Every namespace of this testbed, in creation order (bridge first)."""
        return [self.bridge_netns] + [self.netns_of(h) for h in self.host_names()]

    def link_of(self, host: str) -> Link:
        return self.links.get(host, self.default_link)

    def _x(self) -> int:
        return self.subnet if self.subnet is not None else derived_subnet(self.name)

    @property
    def mcast_group(self) -> str:
        return self.group_of(1)

    def group_of(self, job: int) -> str:
        """The multicast group of job ``job`` (1..254) on this testbed: 239.77.X.job (job 1's is
        :attr:`mcast_group`); the bridge snoops IGMP, so a group reaches only the hosts that joined it."""
        if not 1 <= job <= 254:
            raise InputError(f"testbed groups exist for jobs 1..254, not {job}")
        return GROUP_FMT.format(x=self._x(), job=job)

    @property
    def subnet_cidr(self) -> str:
        return f"{SUBNET_FMT.format(x=self._x())}/{PREFIXLEN}"

    @property
    def hosts(self) -> list[Host]:
        """The aggregators first, then workers by rank."""
        x = self._x()
        out = [Host(a, "aggregator", None, self.netns_of(a), HOST_IFACE, f"p-{a}", f"10.200.{x}.{AGG_HOST_OCTET + k}",
                    f"02:6e:63:{x:02x}:00:{k + 1:02x}", 0 if k == 0 else self.workers + k, self.link_of(a))
               for k, a in enumerate(self.agg_names())]
        for r in range(self.workers):
            h = f"w{r}"
            out.append(Host(h, "worker", r, self.netns_of(h), HOST_IFACE, f"p-{h}",
                            f"10.200.{x}.{WORKER_HOST_OCTET0 + r}", f"02:6e:63:{x:02x}:01:{r:02x}",
                            r + 1, self.link_of(h)))
        return out

    def host(self, which: str | int | Host) -> Host:
        """A host by name ("agg", "w0", ...), worker rank (int) or Host."""
        if isinstance(which, Host):
            which = which.name
        if isinstance(which, int) and not isinstance(which, bool):
            which = f"w{which}"
        for h in self.hosts:
            if h.name == which:
                return h
        raise InputError(f"no host {which!r} in testbed {self.name!r}; hosts are {', '.join(self.host_names())}")

    def hosts_of(self, which: Iterable[str | int | Host] | str | int | Host | None) -> list[Host]:
        """Several hosts as :meth:`host` names them; None: every host."""
        if which is None:
            return self.hosts
        if isinstance(which, (str, int, Host)):
            which = [which]
        return [self.host(h) for h in which]

    # --- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "name": self.name, "workers": self.workers, "mtu": self.mtu, "port": self.port,
            "subnet": self.subnet, "agg_napi": self.agg_napi, "multicast": self.multicast,
            "aggregators": self.aggregators,
            "default_link": dataclasses.asdict(self.default_link),
            "links": {h: dataclasses.asdict(lk) for h, lk in self.links.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Topology":
        return cls(name=d["name"], workers=int(d["workers"]), mtu=int(d["mtu"]), port=int(d["port"]),
                   subnet=d.get("subnet"), agg_napi=bool(d.get("agg_napi", False)),
                   multicast=bool(d.get("multicast", True)), aggregators=int(d.get("aggregators", 1)),
                   default_link=Link(**d.get("default_link", {})),
                   links={h: Link(**lk) for h, lk in d.get("links", {}).items()})
