"""Addressing and framing of the packet generators: the default addresses of the ranks and the
aggregator (:func:`worker_ip`, :func:`worker_mac`, ``AGG_IP``, ``AGG_MAC``, ``GROUP_IP``) and the
job's key (``KEY``); only a convention of these generators, tests against a real testbed pass their own), and a datagram
wrapped in Ethernet / IPv4 / UDP as a worker sends it (:func:`frame`) or as the XDP aggregator
sends a result (:func:`result_frame`, :func:`unicast_frame`). Every address is explicit: scapy is
never asked to resolve a MAC or a route.
"""
from __future__ import annotations

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from nicoffload.jobspec import DEFAULT
from nicoffload.wire import proto
from nicoffload.wire.addr import multicast_mac

#: defaults equal to ``nicoffload.agg.Aggregator.for_test``'s (a test checks it)
AGG_IP = "10.0.0.100"
AGG_MAC = "02:00:00:00:00:64"
#: IP multicast group of results (a job's default; it is configured per job)
GROUP_IP = DEFAULT.group
#: an address that belongs to no rank (for 'bad_src')
STRANGER_IP = "10.0.0.200"
#: the job's key every generated record carries unless told otherwise (Aggregator.for_test's
#: default too); a test of the key check sends another one
KEY = 0x5EC2E7000000C0DE
#: the aggregator's UDP port (the jobs' default)
PORT = proto.DEFAULT_PORT


def worker_ip(rank: int) -> str:
    """Default address of ``rank``: 10.0.0.(rank + 1)."""
    return f"10.0.0.{rank + 1}"


def worker_mac(rank: int) -> str:
    """Default MAC of ``rank``: 02:00:00:00:00:(rank + 1), locally administered."""
    return f"02:00:00:00:00:{rank + 1:02x}"


def frame(
    udp_payload: bytes,
    *,
    src_mac: str,
    dst_mac: str,
    src_ip: str,
    dst_ip: str,
    sport: int = PORT,
    dport: int = PORT,
) -> bytes:
    """Wrap a datagram in Ethernet / IPv4 (no options, id 0, ttl 64) / UDP, checksums computed."""
    pkt = (
        Ether(src=src_mac, dst=dst_mac)
        / IP(src=src_ip, dst=dst_ip, id=0, ttl=64)
        / UDP(sport=sport, dport=dport)
        / Raw(udp_payload)
    )
    return bytes(pkt)


def result_frame(
    udp_payload: bytes,
    *,
    dst_ip: str = GROUP_IP,
    dst_mac: str | None = None,
    agg_ip: str = AGG_IP,
    agg_mac: str = AGG_MAC,
    port: int = PORT,
    dport: int | None = None,
    checksum: int = 0,
) -> bytes:
    """A datagram framed the way the XDP aggregator sends it: from the aggregator, IPv4 id 0, DF,
    ttl 64, from ``port`` to ``dport`` (the sender's port; default the same), UDP checksum
    ``checksum`` (0 for a single record). ``dst_mac`` defaults to the multicast MAC of
    ``dst_ip`` (so the defaults give the multicast result of a round)."""
    pkt = (
        Ether(src=agg_mac, dst=dst_mac or multicast_mac(dst_ip))
        / IP(src=agg_ip, dst=dst_ip, id=0, ttl=64, flags="DF")
        / UDP(sport=port, dport=port if dport is None else dport, chksum=checksum)
        / Raw(udp_payload)
    )
    return bytes(pkt)


def unicast_frame(udp_payload: bytes, rank: int, **kw) -> bytes:
    """An answer of the aggregator to ``rank`` (default addressing)."""
    return result_frame(udp_payload, dst_ip=kw.pop("dst_ip", worker_ip(rank)),
                        dst_mac=kw.pop("dst_mac", worker_mac(rank)), **kw)
