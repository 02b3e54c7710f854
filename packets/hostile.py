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

from .frames import AGG_IP, AGG_MAC, KEY, PORT, STRANGER_IP, frame, worker_ip, worker_mac
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
    key: int = KEY,
) -> list[MalformedCase]:
    """Malformed contributions for a job (``workers`` ranks, ``slots`` slots, ``elems`` per record,
    ``key``) in ``epoch``, each with exactly one fault, sent by ``rank`` from its registered address
    unless the fault is the address, with the job's key unless the fault is the key. Every
    ``bad_*`` counter of the C header is covered (a test checks it).

    Truncation comes two ways: a datagram shorter than one header (its IP and UDP lengths say so;
    ``cut`` False), and a frame cut in transit, shorter than its IP and UDP lengths (``cut`` True),
    at every header field boundary and inside the payload. A datagram whose lengths are consistent
    but that is not a whole number of records is ``bad_len``; so is a count of 0 or above elems.
    """
    if not 0 <= rank < workers <= proto.MAX_WORKERS:
        raise InputError(f"need 0 <= rank < workers <= {proto.MAX_WORKERS}, got rank={rank} workers={workers}")
    if elems < 2:
        raise InputError("malformed cases need elems >= 2 (to cut a payload short)")
    c = _Cases(workers, slots, elems, job, epoch, port, rank, list(src_ips or [worker_ip(r) for r in range(workers)]),
               list(src_macs or [worker_mac(r) for r in range(workers)]), dst_ip, dst_mac, key)
    _truncated(c)
    _bad_fields(c)
    _bad_lengths(c)
    _bad_masks_and_sources(c)
    _bad_keys(c)
    return c.cases


class _Cases:
    """The malformed cases of one job and sender, as they are made: the header every case starts
    from (one field changed), the frame around a datagram, the list they go to."""

    def __init__(self, workers, slots, elems, job, epoch, port, rank, src_ips, src_macs, dst_ip, dst_mac, key):
        self.workers, self.slots, self.elems, self.job, self.epoch, self.port = workers, slots, elems, job, epoch, port
        self.key = key
        self.rank, self.src_ips, self.src_macs, self.dst_ip, self.dst_mac = rank, src_ips, src_macs, dst_ip, dst_mac
        self.full_mask = (1 << workers) - 1
        self.payload = np.arange(1, elems + 1, dtype="<i4").tobytes()
        self.cases: list[MalformedCase] = []
        self.good = bytes(self.hdr() / self.payload)

    def hdr(self, **over) -> AllReduce:
        f = dict(type=proto.TYPE_CONTRIB, rank=self.rank, job=self.job, epoch=self.epoch, slot=0, set=0, round=0,
                 mask=self.full_mask, ack=0, exp=0, flags=0, op=proto.OP_SUM, key=self.key)
        f.update(over)
        return AllReduce(**f)

    def with_payload(self, **over) -> bytes:
        """A whole record whose header differs from the good one in ``over``."""
        return bytes(self.hdr(**over) / self.payload)

    def framed(self, dgram: bytes, src_ip: str | None = None) -> bytes:
        return frame(dgram, src_mac=self.src_macs[self.rank], dst_mac=self.dst_mac,
                     src_ip=src_ip or self.src_ips[self.rank], dst_ip=self.dst_ip, sport=self.port, dport=self.port)

    def add(self, reason: str, what: str, dgram: bytes, src_ip: str | None = None) -> None:
        if reason not in proto.STATS:
            raise AssertionError(f"{reason!r} is not a counter of the C header")
        self.cases.append(MalformedCase(reason, what, self.framed(dgram, src_ip)))


def _truncated(c: _Cases) -> None:
    """Short datagrams, cut at every field boundary and inside the first and last field; frames
    cut in transit (IP and UDP lengths of the whole datagram)."""
    field_at = {off: name for name, off, _ in proto.FIELDS}
    for cut in sorted(set(field_at) | {1, proto.HDR_LEN - 1}):
        where = f"before field {field_at[cut]}" if cut in field_at else f"inside a field at byte {cut}"
        c.add("bad_truncated", f"datagram of {cut} bytes, {where}", c.good[:cut])
    good_frame = c.framed(c.good)
    cuts = {off: f"before field {name}" for off, name in field_at.items()}
    cuts.update({
        proto.HDR_LEN: "after the header, no payload",
        proto.HDR_LEN + 4: "after one payload element",
        proto.HDR_LEN + 2 * c.elems: "in the middle of the payload",
        proto.HDR_LEN + 4 * c.elems - 1: "one byte short of the payload",
    })
    for cut, where in sorted(cuts.items()):
        c.cases.append(MalformedCase(
            "bad_truncated", f"frame cut at datagram byte {cut}, {where}",
            good_frame[: proto.L2L4_LEN + cut], cut=True,
        ))


def _bad_fields(c: _Cases) -> None:
    """One header field out of range: magic, version, type, flags, job, rank, slot, set, op."""
    add, rec = c.add, c.with_payload
    add("bad_magic", "magic byte-swapped", rec(magic=((proto.MAGIC & 0xFF) << 8) | proto.MAGIC >> 8))
    add("bad_magic", "magic zero", rec(magic=0))
    add("bad_version", f"version {proto.VERSION + 1}", rec(version=proto.VERSION + 1))
    add("bad_version", "version 1 (the previous wire format)", rec(version=1))
    types = {v: k[len("AR_TYPE_"):] for k, v in proto.C.items() if k.startswith("AR_TYPE_")}
    for t in (0, max(types) + 1, 0xFF):
        add("bad_type", f"unknown type {t}", rec(type=t))
    for t, name in sorted(types.items()):
        if t not in (proto.TYPE_CONTRIB, proto.TYPE_JOIN, proto.TYPE_ACK):
            add("bad_type", f"a {name} sent to the aggregator", rec(type=t))
    unknown = ~proto.FLAGS_KNOWN & 0xFF
    add("bad_flags", f"lowest unknown flag bit {unknown & -unknown:#x}", rec(flags=unknown & -unknown))
    add("bad_flags", "all flag bits", rec(flags=0xFF))
    add("bad_job", f"job {c.job + 1}, not registered", rec(job=(c.job + 1) & 0xFFFFFFFF))
    add("bad_rank", f"rank {c.workers} of {c.workers} workers", rec(rank=c.workers))
    add("bad_rank", "rank AGG (0xffff)", rec(rank=proto.RANK_AGG))
    add("bad_slot", f"slot {c.slots} of {c.slots}", rec(slot=c.slots))
    add("bad_slot", "slot 0xffffffff", rec(slot=0xFFFFFFFF))
    add("bad_set", "set 2", rec(set=2))
    add("bad_set", "set 255", rec(set=0xFF))
    add("bad_op", f"op {proto.OP_COUNT}", rec(op=proto.OP_COUNT))
    add("bad_op", "op 255", rec(op=0xFF))


def _bad_lengths(c: _Cases) -> None:
    """Counts out of range for the op and type, and payloads that do not match the count."""
    add, hdr, payload, elems = c.add, c.hdr, c.payload, c.elems
    add("bad_len", f"count {elems + 1} > elems {elems}", bytes(hdr(count=elems + 1) / payload))
    add("bad_len", "count 0xffff", bytes(hdr(count=0xFFFF) / payload))
    add("bad_len", f"SUM16 count {2 * elems + 1} > 2 * elems",
        bytes(hdr(count=2 * elems + 1, op=proto.OP_SUM16) / payload))
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


def _bad_masks_and_sources(c: _Cases) -> None:
    """Masks that name no rank, others or not the sender; another rank's or no rank's address;
    batches whose second record is another rank's or another job's."""
    add, rec, workers, rank, full_mask = c.add, c.with_payload, c.workers, c.rank, c.full_mask
    if workers < 32:
        add("bad_mask", f"mask has rank {workers} (>= workers)", rec(mask=full_mask | 1 << workers))
        add("bad_mask", "mask 0xffffffff", rec(mask=0xFFFFFFFF))
    add("bad_mask", f"mask without the sender (rank {rank})", rec(mask=full_mask & ~(1 << rank)))
    add("bad_mask", "mask 0", rec(mask=0))
    other = (rank + 1) % workers
    if other != rank:
        add("bad_src", f"from rank {other}'s address", c.good, src_ip=c.src_ips[other])
        add("bad_mixed", f"a batch whose second record claims rank {other}", c.good + rec(rank=other))
    add("bad_src", f"from {STRANGER_IP}, no rank's address", c.good, src_ip=STRANGER_IP)
    add("bad_mixed", f"a batch whose second record is of job {c.job + 1}", c.good + rec(job=(c.job + 1) & 0xFFFFFFFF))


def _bad_keys(c: _Cases) -> None:
    """Records that do not carry their job's key: another key, no key (0), every bit flipped; the
    same for a JOIN and an ACK (a host that lacks the key can neither end the job's epoch nor
    move its gate). Every case is one record (a batch whose later record alone has another key:
    tests/bpf/test_keys.py)."""
    add, rec, hdr, key = c.add, c.with_payload, c.hdr, c.key
    wrong = [(key ^ 1, "the key with its lowest bit flipped"),
             (key ^ 0xFFFFFFFFFFFFFFFF, "every bit of the key flipped")]
    wrong.append((0, "no key (0)") if key else (0x5EC2E7, "a key where the job has none"))
    for k, what in wrong:
        add("bad_key", f"a contribution with {what}", rec(key=k))
    join = hdr(type=proto.TYPE_JOIN, count=0, key=key ^ 1)
    add("bad_key", "a JOIN with another key", bytes(join / bytes(proto.JOIN_PAYLOAD)))
    add("bad_key", "an ACK with another key", bytes(hdr(type=proto.TYPE_ACK, count=0, key=key ^ 1)))


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
    key: int = KEY,
) -> list[MalformedCase]:
    """Datagrams to the port whose IPv4 or UDP header is wrong, around a valid record: IP options
    (results are rewritten in place, so only a 20-byte IP header is the aggregator's), IP and UDP
    lengths that disagree, a UDP length below its own header. Each is ``bad_len`` and is rejected
    before any record is read (so it counts in row 0, whoever it claims to come from)."""
    good = record(rank=rank, round=0, slots=1, epoch=epoch, mask=(1 << workers) - 1, elems=elems, job=job, key=key)
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
