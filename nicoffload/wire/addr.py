"""IPv4 and Ethernet addresses as the wire and the BPF maps hold them."""
from __future__ import annotations

import ipaddress
import socket

from nicoffload.errors import InputError


def multicast_mac(group: str) -> str:
    """The Ethernet address of an IPv4 multicast group: 01:00:5e + its low 23 bits (RFC 1112)."""
    try:
        ip = ipaddress.IPv4Address(group)
    except ValueError:
        raise InputError(f"{group!r} is not an IPv4 address") from None
    if not ip.is_multicast:
        raise InputError(f"{group} is not an IPv4 multicast address")
    v = int(ip)
    return f"01:00:5e:{(v >> 16) & 0x7F:02x}:{(v >> 8) & 0xFF:02x}:{v & 0xFF:02x}"


def mac_bytes(mac: str | bytes) -> bytes:
    """b'\\x02...' from '02:...' (bytes pass through)."""
    if isinstance(mac, bytes):
        return mac
    return bytes(int(x, 16) for x in mac.split(":"))


def require_ipv4s(ips, what: str, twice: str) -> None:
    """Raise InputError unless every entry of ``ips`` is a dotted-quad IPv4 address (``what``
    names one in the message; ``socket.inet_aton``'s shorthands such as ``10.1`` are refused) and
    none appears twice (``twice``: the message)."""
    for ip in ips:
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise InputError(f"{what} {ip!r} is not an IPv4 address") from None
    if len(set(ips)) != len(ips):
        raise InputError(twice)


def ip_net(ip: str) -> int:
    """An IPv4 address as the u32 a BPF map stores (network order bytes, read natively)."""
    return int.from_bytes(socket.inet_aton(ip), "little")


def ip_str(v: int) -> str:
    """The inverse of :func:`ip_net`."""
    return socket.inet_ntoa(int(v).to_bytes(4, "little"))
