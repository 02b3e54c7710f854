"""Hostile and foreign traffic for the aggregator: malformed packets of every kind (each with
the counter that must count it, and exactly one fault) and foreign traffic that must pass
untouched. Deterministic, like :mod:`nicoffload.packets.generators`, with the same addressing (:mod:`.frames`).
:mod:`nicoffload.packets.attacks` aims all of it at one live job and floods it."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scapy.layers.inet import ICMP, IP, TCP, UDP, IPOption
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

from nicoffload.errors import InputError
from nicoffload.wire import proto

from .frames import AGG_IP, AGG_MAC, PORT, STRANGER_IP, frame, worker_ip, worker_mac
from .generators import record
from .layers import AllReduce


class MalformedCase(NamedTuple):
    """One malformed frame: the counter that must count it (a ``proto.STATS`` name), what is
    wrong, and whether the frame is cut short of its own IP/UDP lengths (``cut``: only an XDP
    program or a raw socket sees such a frame; a UDP socket never receives it)."""

    reason: str
    what: str
    frame: bytes
    cut: bool = False


def malformed_cases(
    *,
    workers: int = 4,
    slots: int = 8,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    epoch: int = 1,
    port: int = PORT,
    rank: int = 1,
    src_ips: Sequence[str] | None = None,
    src_macs: Sequence[str] | None = None,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
) -> list[MalformedCase]:
    """Malformed contributions for a job (``workers`` ranks, ``slots`` slots, ``elems`` per record)
    in ``epoch``, each with exactly one fault, sent by ``rank`` from its registered address unless
    the fault is the address. Every ``bad_*`` counter of the C header is covered (a test checks it).

    Truncation comes two ways: a datagram shorter than one header (its IP and UDP lengths say so;
    ``cut`` False), and a frame cut in transit, shorter than its IP and UDP lengths (``cut`` True),
    at every header field boundary and inside the payload. A datagram whose lengths are consistent
    but that is not a whole number of records is ``bad_len``; so is a count of 0 or above elems.
    """
    if not 0 <= rank < workers <= proto.MAX_WORKERS:
        raise InputError(f"need 0 <= rank < workers <= {proto.MAX_WORKERS}, got rank={rank} workers={workers}")
    if elems < 2:
        raise InputError("malformed cases need elems >= 2 (to cut a payload short)")
    src_ips = list(src_ips or [worker_ip(r) for r in range(workers)])
    src_macs = list(src_macs or [worker_mac(r) for r in range(workers)])
    full_mask = (1 << workers) - 1
    payload = np.arange(1, elems + 1, dtype="<i4").tobytes()
    cases: list[MalformedCase] = []

    def hdr(**over) -> AllReduce:
        f = dict(type=proto.TYPE_CONTRIB, rank=rank, job=job, epoch=epoch, slot=0, set=0, round=0,
                 mask=full_mask, ack=0, exp=0, flags=0, op=proto.OP_SUM)
        f.update(over)
        return AllReduce(**f)

    def framed(dgram: bytes, src_ip: str | None = None) -> bytes:
        return frame(dgram, src_mac=src_macs[rank], dst_mac=dst_mac, src_ip=src_ip or src_ips[rank],
                     dst_ip=dst_ip, sport=port, dport=port)

    def add(reason: str, what: str, dgram: bytes, src_ip: str | None = None) -> None:
        if reason not in proto.STATS:
            raise AssertionError(f"{reason!r} is not a counter of the C header")
        cases.append(MalformedCase(reason, what, framed(dgram, src_ip)))

    good = bytes(hdr() / payload)
    good_frame = framed(good)
    field_at = {off: name for name, off, _ in proto.FIELDS}

    # truncated: short datagrams, cut at every field boundary and inside the first and last field
    for cut in sorted(set(field_at) | {1, proto.HDR_LEN - 1}):
        where = f"before field {field_at[cut]}" if cut in field_at else f"inside a field at byte {cut}"
        add("bad_truncated", f"datagram of {cut} bytes, {where}", good[:cut])
    # truncated: frames cut in transit (IP and UDP lengths of the whole datagram)
    cuts = {off: f"before field {name}" for off, name in field_at.items()}
    cuts.update({
        proto.HDR_LEN: "after the header, no payload",
        proto.HDR_LEN + 4: "after one payload element",
        proto.HDR_LEN + 2 * elems: "in the middle of the payload",
        proto.HDR_LEN + 4 * elems - 1: "one byte short of the payload",
    })
    for cut, where in sorted(cuts.items()):
        cases.append(MalformedCase(
            "bad_truncated", f"frame cut at datagram byte {cut}, {where}",
            good_frame[: proto.L2L4_LEN + cut], cut=True,
        ))

    add("bad_magic", "magic byte-swapped",
        bytes(hdr(magic=((proto.MAGIC & 0xFF) << 8) | proto.MAGIC >> 8) / payload))
    add("bad_magic", "magic zero", bytes(hdr(magic=0) / payload))
    add("bad_version", f"version {proto.VERSION + 1}", bytes(hdr(version=proto.VERSION + 1) / payload))
    add("bad_version", "version 1 (the previous wire format)", bytes(hdr(version=1) / payload))
    types = {v: k[len("AR_TYPE_"):] for k, v in proto.C.items() if k.startswith("AR_TYPE_")}
    for t in (0, max(types) + 1, 0xFF):
        add("bad_type", f"unknown type {t}", bytes(hdr(type=t) / payload))
    for t, name in sorted(types.items()):
        if t not in (proto.TYPE_CONTRIB, proto.TYPE_JOIN, proto.TYPE_ACK):
            add("bad_type", f"a {name} sent to the aggregator", bytes(hdr(type=t) / payload))
    unknown = ~proto.FLAGS_KNOWN & 0xFF
    add("bad_flags", f"lowest unknown flag bit {unknown & -unknown:#x}",
        bytes(hdr(flags=unknown & -unknown) / payload))
    add("bad_flags", "all flag bits", bytes(hdr(flags=0xFF) / payload))
    add("bad_job", f"job {job + 1}, not registered", bytes(hdr(job=(job + 1) & 0xFFFFFFFF) / payload))
    add("bad_rank", f"rank {workers} of {workers} workers", bytes(hdr(rank=workers) / payload))
    add("bad_rank", "rank AGG (0xffff)", bytes(hdr(rank=proto.RANK_AGG) / payload))
    add("bad_slot", f"slot {slots} of {slots}", bytes(hdr(slot=slots) / payload))
    add("bad_slot", "slot 0xffffffff", bytes(hdr(slot=0xFFFFFFFF) / payload))
    add("bad_set", "set 2", bytes(hdr(set=2) / payload))
    add("bad_set", "set 255", bytes(hdr(set=0xFF) / payload))
    add("bad_op", f"op {proto.OP_COUNT}", bytes(hdr(op=proto.OP_COUNT) / payload))
    add("bad_op", "op 255", bytes(hdr(op=0xFF) / payload))
    add("bad_len", f"count {elems + 1} > elems {elems}", bytes(hdr(count=elems + 1) / payload))
    add("bad_len", "count 0xffff", bytes(hdr(count=0xFFFF) / payload))
    add("bad_len", f"SUM16 count {2 * elems + 1} > 2 * elems", bytes(hdr(count=2 * elems + 1, op=proto.OP_SUM16) / payload))
    add("bad_len", "SUM16 count 0", bytes(hdr(count=0, op=proto.OP_SUM16) / payload))
    add("bad_len", "count 0 without the PULL flag", bytes(hdr(count=0) / payload))
    add("bad_len", "a PULL with count 1", bytes(hdr(count=1, flags=proto.FLAG_PULL) / payload))
    add("bad_len", f"count {elems} without payload", bytes(hdr(count=elems)))
    add("bad_len", f"count {elems}, payload of one element", bytes(hdr(count=elems) / payload[:4]))
    add("bad_len", f"count {elems}, payload of {elems // 2} elements",
        bytes(hdr(count=elems) / payload[: 4 * (elems // 2)]))
    add("bad_len", "payload one byte short", bytes(hdr(count=elems) / payload[:-1]))
    add("bad_len", "tail block (count 1) with a payload sized to count, not to elems",
        bytes(hdr(count=1) / payload[:4]))
    add("bad_len", "payload one element longer than elems", bytes(hdr(count=elems) / (payload + payload[:4])))
    add("bad_len", "a JOIN without its nonce table", bytes(hdr(type=proto.TYPE_JOIN, count=0)))
    add("bad_len", "an ACK with a payload", bytes(hdr(type=proto.TYPE_ACK, count=0) / payload))
    if workers < 32:
        add("bad_mask", f"mask has rank {workers} (>= workers)", bytes(hdr(mask=full_mask | 1 << workers) / payload))
        add("bad_mask", "mask 0xffffffff", bytes(hdr(mask=0xFFFFFFFF) / payload))
    add("bad_mask", f"mask without the sender (rank {rank})", bytes(hdr(mask=full_mask & ~(1 << rank)) / payload))
    add("bad_mask", "mask 0", bytes(hdr(mask=0) / payload))
    other = (rank + 1) % workers
    if other != rank:
        add("bad_src", f"from rank {other}'s address", good, src_ip=src_ips[other])
        add("bad_mixed", f"a batch whose second record claims rank {other}",
            good + bytes(hdr(rank=other) / payload))
    add("bad_src", f"from {STRANGER_IP}, no rank's address", good, src_ip=STRANGER_IP)
    add("bad_mixed", f"a batch whose second record is of job {job + 1}",
        good + bytes(hdr(job=(job + 1) & 0xFFFFFFFF) / payload))
    return cases


def malformed(**kwargs) -> list[tuple[str, bytes]]:
    """(reason, frame) for every case of :func:`malformed_cases` (same keyword arguments)."""
    return [(c.reason, c.frame) for c in malformed_cases(**kwargs)]


def foreign(
    *,
    port: int = PORT,
    src_ip: str = "10.0.0.1",
    src_mac: str = "02:00:00:00:00:01",
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
) -> list[tuple[str, bytes]]:
    """Traffic that is not AllReduce and must pass untouched: (name, frame)."""
    ar = bytes(AllReduce(rank=0, job=1, mask=1) / bytes(4 * proto.DEFAULT_ELEMS))
    other = port + 1 if port < 0xFFFF else port - 1
    eth = Ether(src=src_mac, dst=dst_mac)
    return [
        ("arp_request", bytes(Ether(src=src_mac, dst="ff:ff:ff:ff:ff:ff") / ARP(
            op=1, hwsrc=src_mac, psrc=src_ip, hwdst="00:00:00:00:00:00", pdst=dst_ip))),
        ("icmp_echo", bytes(eth / IP(src=src_ip, dst=dst_ip, id=0) / ICMP(id=1, seq=1) / Raw(b"ping"))),
        ("ipv6_udp_to_port", bytes(eth / IPv6(src="fd00::1", dst="fd00::fe") / UDP(sport=port, dport=port) / Raw(ar))),
        ("udp_other_port", bytes(eth / IP(src=src_ip, dst=dst_ip, id=0) / UDP(sport=other, dport=other) / Raw(ar))),
        ("udp_from_port_to_other", bytes(eth / IP(src=src_ip, dst=dst_ip, id=0) / UDP(sport=port, dport=other) / Raw(ar))),
        ("tcp_to_port", bytes(eth / IP(src=src_ip, dst=dst_ip, id=0) / TCP(sport=40000, dport=port, flags="PA", seq=1, ack=1) / Raw(ar))),
        ("ipv4_fragment_to_port", bytes(eth / IP(src=src_ip, dst=dst_ip, id=7, flags="MF") / UDP(sport=port, dport=port) / Raw(ar))),
    ]


def malformed_headers(
    *,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    epoch: int = 1,
    port: int = PORT,
    rank: int = 0,
    workers: int = 1,
    src_ip: str = worker_ip(0),
    src_mac: str = worker_mac(0),
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
) -> list[MalformedCase]:
    """Datagrams to the port whose IPv4 or UDP header is wrong, around a valid record: IP options
    (results are rewritten in place, so only a 20-byte IP header is the aggregator's), IP and UDP
    lengths that disagree, a UDP length below its own header. Each is ``bad_len`` and is rejected
    before any record is read (so it counts in row 0, whoever it claims to come from)."""
    good = record(rank=rank, round=0, slots=1, epoch=epoch, mask=(1 << workers) - 1, elems=elems, job=job)
    eth = Ether(src=src_mac, dst=dst_mac)

    def ip(**over) -> IP:
        return IP(src=src_ip, dst=dst_ip, id=0, ttl=64, **over)

    udp_len = 8 + len(good)
    return [
        MalformedCase("bad_len", "IPv4 header with options (ihl 6)",
                      bytes(eth / ip(options=[IPOption(b"\x01\x01\x01\x01")]) / UDP(sport=port, dport=port)
                            / Raw(good))),
        MalformedCase("bad_len", "IP total length 4 bytes beyond 20 + the UDP length",
                      bytes(eth / ip(len=20 + udp_len + 4) / UDP(sport=port, dport=port, len=udp_len)
                            / Raw(good + bytes(4)))),
        MalformedCase("bad_len", "UDP length 4, below its own header",
                      bytes(eth / ip(len=24) / UDP(sport=port, dport=port, len=4, chksum=0))),
    ]
