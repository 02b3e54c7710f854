"""What the doctor reads about one interface, inside its network namespace and read-only:
netlink (flags, MTU, kind, queues, addresses, an XDP program already attached), the netdev
family's XDP feature bits (Linux 6.3+), ethtool (driver, bus, offload features), the interface's
sysctls (rp_filter, force_igmp_version) and its IGMP state.

The namespace is entered in this thread only (setns on /run/netns/NAME): sockets made there and
per-thread /proc files (``/proc/thread-self/net``, ``/proc/sys/net``) see the interface's
namespace; /sys/class/net would not (sysfs shows the namespace it was mounted in)."""
from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from nicoffload.ebpf.iface import iface_drvinfo
from nicoffload.ebpf.loader import netns as enter_netns
from nicoffload.errors import NotFoundError, PrivilegeError

#: enum netdev_xdp_act (uapi/linux/netdev.h)
XDP_ACT = {"basic": 1, "redirect": 2, "ndo-xmit": 4, "xsk-zerocopy": 8, "hw-offload": 16, "rx-sg": 32,
           "ndo-xmit-sg": 64}
#: IFLA_XDP_ATTACHED
XDP_ATTACHED = {0: "", 1: "native", 2: "generic", 3: "offloaded", 4: "several modes"}
IFF_UP, IFF_LOOPBACK, IFF_MULTICAST = 0x1, 0x8, 0x1000


@dataclass
class LinkFacts:
    name: str
    netns: str | None = None
    exists: bool = False
    error: str = ""                  # why it could not be read (a missing interface or namespace, no privilege)
    missing: str = ""                # what does not exist: "interface" or "namespace" ("" if both do)
    index: int = 0
    kind: str = ""                   # IFLA_INFO_KIND (veth, dummy, bridge, ...); "" for a NIC
    driver: str = ""
    bus: str = ""                    # ethtool's bus_info, e.g. 0000:00:03.0
    mtu: int = 0
    flags: int = 0
    operstate: str = ""
    ipv4: list = field(default_factory=list)
    rx_queues: int = 1
    xdp_features: int | None = None  # netdev XDP_ACT bits; None where the kernel does not say
    xdp_attached: str = ""           # the mode of a program already attached, "" for none
    xdp_prog: int = 0
    features: dict = field(default_factory=dict)  # ethtool feature -> active
    rp_filter: tuple | None = None   # (net.ipv4.conf.all, net.ipv4.conf.IF)
    force_igmp: int = 0
    igmp: dict | None = None         # {"groups": n, "querier": "V1"|"V2"|"V3"} (/proc/net/igmp)
    default_route: bool = False      # the main table's default route leaves this interface

    def xdp_can(self, act: str) -> bool | None:
        return None if self.xdp_features is None else bool(self.xdp_features & XDP_ACT[act])


def parse_igmp(text: str, ifname: str) -> dict | None:
    """The interface's row of /proc/net/igmp: ``{"groups", "querier"}`` (the querier column says
    V1 or V2 when such a querier was heard on the link, V3 otherwise), or None."""
    for line in text.splitlines()[1:]:
        if not line[:1].isdigit():
            continue
        head, _, rest = line.partition(":")
        parts = head.split()
        if len(parts) >= 2 and parts[1] == ifname:
            cols = rest.split()
            return {"groups": int(cols[0]) if cols else 0, "querier": cols[1] if len(cols) > 1 else ""}
    return None


def _netlink(f: LinkFacts) -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=f.name)
        if not idx:
            return
        f.exists, f.index = True, idx[0]
        link = ipr.get_links(f.index)[0]
        f.flags, f.mtu = link["flags"], link.get_attr("IFLA_MTU") or 0
        f.operstate = link.get_attr("IFLA_OPERSTATE") or ""
        f.rx_queues = link.get_attr("IFLA_NUM_RX_QUEUES") or 1
        info = link.get_attr("IFLA_LINKINFO")
        f.kind = (info.get_attr("IFLA_INFO_KIND") if info else None) or ""
        xdp = link.get_attr("IFLA_XDP")
        if xdp:
            f.xdp_attached = XDP_ATTACHED.get(xdp.get_attr("IFLA_XDP_ATTACHED") or 0, "?")
            f.xdp_prog = xdp.get_attr("IFLA_XDP_PROG_ID") or 0
        f.ipv4 = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=f.index, family=socket.AF_INET)]
        f.default_route = any(r.get_attr("RTA_OIF") == f.index for r in ipr.get_default_routes(family=socket.AF_INET))


def xdp_features(index: int) -> int | None:
    """The netdev family's NETDEV_A_DEV_XDP_FEATURES of interface ``index``; None where the
    kernel has no such family (before 6.3) or does not answer."""
    from pyroute2.netlink import NLM_F_REQUEST, genlmsg
    from pyroute2.netlink.generic import GenericNetlinkSocket

    class devmsg(genlmsg):
        nla_map = (("NETDEV_A_DEV_UNSPEC", "none"), ("NETDEV_A_DEV_IFINDEX", "uint32"),
                   ("NETDEV_A_DEV_PAD", "none"), ("NETDEV_A_DEV_XDP_FEATURES", "uint64"))

    s = GenericNetlinkSocket()
    try:
        s.bind("netdev", devmsg)
        m = devmsg()
        m["cmd"], m["version"] = 1, 1  # NETDEV_CMD_DEV_GET
        m["attrs"] = [("NETDEV_A_DEV_IFINDEX", index)]
        for r in s.nlm_request(m, msg_type=s.prid, msg_flags=NLM_F_REQUEST):
            v = r.get_attr("NETDEV_A_DEV_XDP_FEATURES")
            if v is not None:
                return int(v)
        return None
    except Exception:  # no netdev family (an older kernel), or it refused
        return None
    finally:
        s.close()


def _ethtool(f: LinkFacts) -> None:
    from pyroute2.ethtool.ioctl import IoctlEthtool

    f.driver, f.bus = iface_drvinfo(f.name, None)
    e = IoctlEthtool(f.name)
    try:
        feats = e.get_features()
        f.features = {k: bool(feats.is_active(k)) for k in feats.keys() if k}
    except OSError:
        f.features = {}
    finally:
        e.close()


def _read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def gather(name: str, netns: str | None = None) -> LinkFacts:
    """Everything the interface checks need, read inside ``netns``; ``exists`` False (and
    ``error`` saying why) for a missing interface or namespace."""
    f = LinkFacts(name, netns)
    try:
        with enter_netns(netns):
            _netlink(f)
            if not f.exists:
                where = f"namespace {netns}" if netns else "the root namespace"
                f.error = f"no interface {name!r} in {where} (ip {'-n ' + netns + ' ' if netns else ''}link)"
                f.missing = "interface"
                return f
            _ethtool(f)
            f.xdp_features = xdp_features(f.index)
            conf = "/proc/sys/net/ipv4/conf"
            f.rp_filter = (_read_int(f"{conf}/all/rp_filter") or 0, _read_int(f"{conf}/{name}/rp_filter") or 0)
            f.force_igmp = _read_int(f"{conf}/{name}/force_igmp_version") or 0
            try:
                f.igmp = parse_igmp(Path("/proc/thread-self/net/igmp").read_text(), name)
            except OSError:
                f.igmp = None
    except NotFoundError as e:
        f.exists, f.missing, f.error = False, "namespace", str(e)
    except PrivilegeError as e:
        f.exists, f.error = False, str(e)
    return f
