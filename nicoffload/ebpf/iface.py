"""What the control plane needs to know about an interface inside a namespace: its addresses
and MTU, its driver, and the XDP attach mode that suits it."""
from __future__ import annotations

import ctypes
import fcntl
import socket
import time

from nicoffload.ebpf.loader import ifindex
from nicoffload.ebpf.loader import netns as enter_netns
from nicoffload.errors import NotFoundError, SetupError

#: attach modes: auto picks the fastest that works on the interface (see resolve_mode)
MODES = ("auto", "generic", "native")


def resolve_mode(mode: str, iface: str, netns: str | None) -> tuple[str, str]:
    """(native|generic, why). Generic (skb) XDP sees a worker's UDP_SEGMENT send or a UDP GRO
    batch whole, so one program run aggregates up to 61 records and the result goes back as one
    frame; native XDP sees single datagrams. On veth generic is the fastest (measured: see the
    README); on other drivers native is the default (batches there need UDP GRO forwarding on
    the NIC, which generic mode with `ethtool -K IF rx-udp-gro-forwarding on` can use)."""
    if mode != "auto":
        return mode, f"{mode} XDP, as asked"
    driver = iface_driver(iface, netns)
    if driver == "veth":
        return "generic", "generic XDP (batches): veth hands UDP_SEGMENT sends to generic XDP whole"
    return "native", f"native XDP (per datagram): driver {driver or 'unknown'}; try --mode generic with " \
                     f"rx-udp-gro-forwarding for batches"


def iface_holding(ip: str) -> str:
    """The interface of this thread's network namespace that holds ``ip``."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            if a.get_attr("IFA_ADDRESS") == ip:
                return ipr.get_links(a["index"])[0].get_attr("IFLA_IFNAME")
    raise NotFoundError(f"no interface of this network namespace has the address {ip}")


def rx_queues(iface: str, netns: str | None) -> int:
    """Receive queues of an interface inside a namespace."""
    from pyroute2 import IPRoute

    with enter_netns(netns):
        idx = ifindex(iface, netns)
        with IPRoute() as ipr:
            return ipr.get_links(idx)[0].get_attr("IFLA_NUM_RX_QUEUES") or 1


def iface_addr(iface: str, netns: str | None) -> tuple[str, str, int]:
    """(ipv4, mac, mtu) of an interface inside a namespace."""
    from pyroute2 import IPRoute

    with enter_netns(netns):
        idx = ifindex(iface, netns)
        with IPRoute() as ipr:
            link = ipr.get_links(idx)[0]
            addrs = ipr.get_addr(index=idx, family=socket.AF_INET)
    if not addrs:
        raise NotFoundError(f"interface {iface!r} has no IPv4 address; the aggregator sends results from it")
    return addrs[0].get_attr("IFA_ADDRESS"), link.get_attr("IFLA_ADDRESS"), link.get_attr("IFLA_MTU")


_SIOCETHTOOL = 0x8946
_ETHTOOL_GDRVINFO = 3


class _Drvinfo(ctypes.Structure):
    _fields_ = [("cmd", ctypes.c_uint32), ("driver", ctypes.c_char * 32), ("version", ctypes.c_char * 32),
                ("fw_version", ctypes.c_char * 32), ("bus_info", ctypes.c_char * 32),
                ("erom_version", ctypes.c_char * 32), ("reserved2", ctypes.c_char * 12),
                ("n_priv_flags", ctypes.c_uint32), ("n_stats", ctypes.c_uint32), ("testinfo_len", ctypes.c_uint32),
                ("eedump_len", ctypes.c_uint32), ("regdump_len", ctypes.c_uint32)]


class _Ifreq(ctypes.Structure):
    _fields_ = [("ifr_name", ctypes.c_char * 16), ("ifr_data", ctypes.c_void_p), ("pad", ctypes.c_char * 16)]


def iface_driver(ifname: str, ns: str | None) -> str:
    """The driver of an interface (ethtool's GDRVINFO), e.g. "veth"; "" if it does not say."""
    return iface_drvinfo(ifname, ns)[0]


def iface_drvinfo(ifname: str, ns: str | None) -> tuple[str, str]:
    """(driver, bus_info) of an interface (ethtool's GDRVINFO, ``ethtool -i``), e.g. ("virtio_net",
    "0000:00:03.0"); ("", "") if it does not say."""
    with enter_netns(ns):
        ifindex(ifname, ns)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        info = _Drvinfo(cmd=_ETHTOOL_GDRVINFO)
        req = bytearray(_Ifreq(ifr_name=ifname.encode(), ifr_data=ctypes.addressof(info)))
        try:
            fcntl.ioctl(s.fileno(), _SIOCETHTOOL, req)  # the kernel fills `info` through ifr_data
        except OSError:
            return "", ""
        return info.driver.decode(errors="replace"), info.bus_info.decode(errors="replace")
    finally:
        s.close()


def neighbour_mac(ip: str, iface: str, netns: str | None, timeout: float = 1.0, hint: str = "is it up?") -> str:
    """The MAC address frames to ``ip`` leave ``iface`` with: the neighbour's, or the gateway's
    when a route sends ``ip`` through one (the neighbour table; if it has none, a datagram to the
    discard port makes the kernel resolve it)."""
    from pyroute2 import IPRoute

    deadline = time.monotonic() + timeout
    poked = False
    hop = ip
    with enter_netns(netns), IPRoute() as ipr:
        try:
            for r in ipr.route("get", dst=ip):
                hop = r.get_attr("RTA_GATEWAY") or ip
        except Exception:
            pass
    while True:
        with enter_netns(netns), IPRoute() as ipr:
            idx = ifindex(iface, netns)
            for n in ipr.get_neighbours(dst=hop, ifindex=idx):
                mac = n.get_attr("NDA_LLADDR")
                if mac and n["state"] not in (0x20, 0x01):  # NUD_FAILED, NUD_INCOMPLETE
                    return mac
        if time.monotonic() > deadline:
            via = f" (through {hop})" if hop != ip else ""
            raise SetupError(f"no MAC address for {ip}{via} on {iface} in {netns or 'the root namespace'}: {hint}")
        if not poked:
            with enter_netns(netns):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.sendto(b"\0", (ip, 9))
            except OSError:
                pass
            finally:
                s.close()
            poked = True
        time.sleep(0.02)
