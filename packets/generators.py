"""Deterministic packet generators: contributions of N workers, the results the aggregator must
send, malformed packets of every kind (with the counter that must count them) and foreign traffic
that must pass untouched.

Same inputs, same bytes: no randomness (except :func:`sample_arrays`, seeded), no clock, and every
address is explicit (scapy is never asked to resolve a MAC or a route). Frames are returned as
``bytes``; pass ``as_scapy=True`` where offered, or dissect with ``Ether(frame)``.

The default addressing (:func:`worker_ip`, :func:`worker_mac`, ``AGG_IP``, ``AGG_MAC``,
``GROUP_IP``) is only a convention of these generators; tests against a real testbed pass their own.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet, Raw

from nicoffload import proto
from nicoffload.codec import NEXT_NZ_NONE, datagram_size, encode_blocks, encode_nulls
from nicoffload.errors import InputError

from . import layers  # noqa: F401 - registers the AllReduce layer for Ether(frame) dissection
from .layers import AllReduce

#: defaults equal to ``nicoffload.aggregator.Aggregator.for_test``'s (a test checks it)
AGG_IP = "10.0.0.100"
AGG_MAC = "02:00:00:00:00:64"
#: IP multicast group of results (the control plane's default; it is configured per job)
GROUP_IP = "239.77.0.1"
#: an address that belongs to no rank (for 'bad_src')
STRANGER_IP = "10.0.0.200"


def worker_ip(rank: int) -> str:
    """Default address of ``rank``: 10.0.0.(rank + 1)."""
    return f"10.0.0.{rank + 1}"


def worker_mac(rank: int) -> str:
    """Default MAC of ``rank``: 02:00:00:00:00:(rank + 1), locally administered."""
    return f"02:00:00:00:00:{rank + 1:02x}"


def multicast_mac(group_ip: str) -> str:
    """Ethernet address of an IPv4 multicast group (01:00:5e + low 23 bits, RFC 1112)."""
    a, b, c, d = (int(x) for x in group_ip.split("."))
    if not 224 <= a <= 239:
        raise InputError(f"{group_ip} is not an IPv4 multicast address")
    return f"01:00:5e:{b & 0x7F:02x}:{c:02x}:{d:02x}"


def frame(
    udp_payload: bytes,
    *,
    src_mac: str,
    dst_mac: str,
    src_ip: str,
    dst_ip: str,
    sport: int = proto.DEFAULT_PORT,
    dport: int = proto.DEFAULT_PORT,
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
    port: int = proto.DEFAULT_PORT,
) -> bytes:
    """A RESULT or STATUS datagram framed the way the XDP aggregator sends it: from the
    aggregator, IPv4 id 0, DF, ttl 64, UDP checksum 0, port to port. ``dst_mac`` defaults to the
    multicast MAC of ``dst_ip`` (so the defaults give the multicast result of a round)."""
    pkt = (
        Ether(src=agg_mac, dst=dst_mac or multicast_mac(dst_ip))
        / IP(src=agg_ip, dst=dst_ip, id=0, ttl=64, flags="DF")
        / UDP(sport=port, dport=port, chksum=0)
        / Raw(udp_payload)
    )
    return bytes(pkt)


def slot_schedule(nblocks: int, slots: int, first_use: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SwitchML slot schedule: block i -> slot i % slots, set (first_use + i // slots) % 2.

    ``first_use`` is how many times each slot was used before this tensor (every slot the same
    number of times, as when the previous tensors filled whole rows of the pool).
    """
    if slots <= 0:
        raise InputError(f"slots must be positive, got {slots}")
    i = np.arange(nblocks, dtype=np.int64)
    return (i % slots).astype(np.uint32), ((first_use + i // slots) % 2).astype(np.uint8)


def split_blocks(array: np.ndarray, elems: int) -> tuple[np.ndarray, np.ndarray]:
    """Split a 1-D int32 array into zero-padded blocks: (blocks (B, elems), counts (B,))."""
    a = _as_int32(array, "array")
    nblocks = -(-a.size // elems)
    blocks = np.zeros((nblocks, elems), dtype=np.int32)
    blocks.reshape(-1)[: a.size] = a
    counts = np.full(nblocks, elems, dtype=np.uint16)
    if nblocks and a.size % elems:
        counts[-1] = a.size % elems
    return blocks, counts


def next_nonzero(blocks: np.ndarray) -> np.ndarray:
    """For each block i, the index of the next block after i with a non-zero element (or NONE)."""
    nz = np.flatnonzero(np.any(blocks != 0, axis=1))
    pos = np.searchsorted(nz, np.arange(blocks.shape[0]), side="right")
    padded = np.append(nz, NEXT_NZ_NONE).astype(np.uint32)
    return padded[pos]


def _split(buf, size: int) -> list[bytes]:
    """Cut a batch from the codec into its datagrams."""
    return [bytes(buf[i:i + size]) for i in range(0, len(buf), size)]


def _as_int32(a, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise InputError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int32:
        if arr.dtype.kind not in "iu" or (arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31)):
            raise InputError(f"{what} must hold int32 values (quantize first), got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    return arr


class _Plan(NamedTuple):
    ranks: list[int]
    mask: int
    blocks: dict[int, np.ndarray]  # rank -> (B, elems)
    ids: np.ndarray  # (B,) block ids on the wire
    counts: np.ndarray  # (B,)
    slot: np.ndarray
    set: np.ndarray
    nonnull: dict[int, np.ndarray]  # rank -> (B,) bool: sends a payload (False: null contribution)
    next_nz: dict[int, np.ndarray]  # rank -> (B,) next non-zero block id, or NONE


def _plan(arrays, slots, elems, mask, first_use, first_block, sparse) -> _Plan:
    workers = len(arrays)
    if not 1 <= workers <= proto.MAX_WORKERS:
        raise InputError(f"need 1..{proto.MAX_WORKERS} workers, got {workers}")
    if not 1 <= elems <= 0xFFFF:
        raise InputError(f"elems must be in 1..65535, got {elems}")
    full = (1 << workers) - 1
    mask = full if mask is None else int(mask)
    if mask == 0 or mask & ~full:
        raise InputError(f"mask {mask:#x} must be a non-empty subset of the {workers} ranks ({full:#x})")
    ranks = [r for r in range(workers) if mask >> r & 1]
    split = {r: split_blocks(arrays[r], elems) for r in ranks}
    sizes = {int(np.asarray(arrays[r]).size) for r in ranks}
    if len(sizes) != 1:
        raise InputError(f"the contributing ranks' arrays differ in length: {sorted(sizes)}")
    counts = split[ranks[0]][1]
    slot, set_ = slot_schedule(counts.size, slots, first_use)
    blocks = {r: split[r][0] for r in ranks}
    nonnull = {
        r: (np.any(blocks[r] != 0, axis=1) if sparse else np.ones(counts.size, bool)) for r in ranks
    }
    ids = np.arange(counts.size, dtype=np.int64) + first_block
    if counts.size and (first_block < 0 or ids[-1] >= NEXT_NZ_NONE):
        raise InputError(f"block ids {first_block}..{int(ids[-1])} do not fit below {NEXT_NZ_NONE:#x}")

    def next_ids(r: int) -> np.ndarray:
        nxt = next_nonzero(blocks[r]).astype(np.int64)
        return np.where(nxt == NEXT_NZ_NONE, NEXT_NZ_NONE, nxt + first_block)

    return _Plan(ranks, mask, blocks, ids, counts, slot, set_, nonnull, {r: next_ids(r) for r in ranks})


def contributions(
    arrays: Sequence[np.ndarray | None],
    *,
    slots: int,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    port: int = proto.DEFAULT_PORT,
    src_ips: Sequence[str] | None = None,
    src_macs: Sequence[str] | None = None,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
    mask: int | None = None,
    first_use: int = 0,
    first_block: int = 0,
    exp: int = 0,
    op_max: bool = False,
    retx: bool = False,
    sparse: bool = False,
    as_scapy: bool = False,
) -> list[bytes] | list[Packet]:
    """Contribution frames of every rank in ``mask`` for every block of the tensor.

    ``arrays[r]`` is rank r's int32 tensor (all the same length; entries of ranks outside ``mask``
    may be None). ``mask=None`` is dense mode: every rank contributes to every round. Blocks hold
    ``elems`` elements; the tail block has ``count`` < elems and a zero-padded payload. Block i goes
    to slot i % slots, set (first_use + i // slots) % 2, with block id ``first_block + i`` on the
    wire. ``next_nz`` is the id of the sender's next non-zero block. ``sparse=True``: a rank whose
    block is all zero sends a null contribution (count 0, no payload) instead. Every contribution
    carries ``exp`` and the op (``op_max``); ``retx`` sets the RETX flag. Order: block-major (all
    ranks of block 0 in rank order, then block 1, ...).
    """
    plan = _plan(arrays, slots, elems, mask, first_use, first_block, sparse)
    flags = (proto.FLAG_OP_MAX if op_max else 0) | (proto.FLAG_RETX if retx else 0)
    nb = plan.counts.size
    per_rank: dict[int, list[bytes]] = {}
    for r in plan.ranks:
        nn = plan.nonnull[r]
        common = dict(rank=r, job=job, mask=plan.mask, exp=exp, flags=flags, type=proto.TYPE_CONTRIB)
        full = iter(_split(encode_blocks(
            plan.blocks[r][nn], slot=plan.slot[nn], set=plan.set[nn], block=plan.ids[nn],
            next_nz=plan.next_nz[r][nn], count=plan.counts[nn], **common,
        ), datagram_size(elems)))
        null = iter(_split(encode_nulls(
            int((~nn).sum()), slot=plan.slot[~nn], set=plan.set[~nn], block=plan.ids[~nn],
            next_nz=plan.next_nz[r][~nn], **common,
        ), datagram_size(0)))
        per_rank[r] = [next(full) if nn[b] else next(null) for b in range(nb)]

    src_ips = src_ips or [worker_ip(r) for r in range(len(arrays))]
    src_macs = src_macs or [worker_mac(r) for r in range(len(arrays))]
    out = [
        frame(
            per_rank[r][b], src_mac=src_macs[r], dst_mac=dst_mac, src_ip=src_ips[r], dst_ip=dst_ip,
            sport=port, dport=port,
        )
        for b in range(nb)
        for r in plan.ranks
    ]
    return [Ether(f) for f in out] if as_scapy else out


def expected_results(
    arrays: Sequence[np.ndarray | None],
    *,
    slots: int,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    mask: int | None = None,
    first_use: int = 0,
    first_block: int = 0,
    exp: int = 0,
    op_max: bool = False,
    sparse: bool = False,
) -> list[bytes]:
    """The RESULT datagrams (UDP payloads) the aggregator sends for :func:`contributions` with the
    same arguments, one per block in block order (frame them with :func:`result_frame`).

    rank AGG, mask = the contributors, next_nz = their minimum, slot/set/block/exp as sent, count =
    the largest count of the round, flags = the op (OP_MAX or none; never RETX), payload = the
    element-wise int32 sum wrapping modulo 2^32 (or max) of the contributions that carry data. A
    result always carries the full payload: for a round in which every contributor was null it is
    the identity of the op (0 for sum, INT32_MIN for max) and count is 0.
    """
    plan = _plan(arrays, slots, elems, mask, first_use, first_block, sparse)
    stack = np.stack([plan.blocks[r] for r in plan.ranks])  # (R, B, elems)
    live = np.stack([plan.nonnull[r] for r in plan.ranks])  # (R, B)
    if op_max:  # null contributions take no part in the max
        acc = np.where(live[:, :, None], stack, np.iinfo(np.int32).min).max(axis=0)
    else:  # null contributions are all zero (sparse mode): they add nothing
        acc = stack.sum(axis=0, dtype=np.int32)  # int32 accumulation wraps modulo 2^32
    any_data = live.any(axis=0)
    return _split(encode_blocks(
        acc, rank=proto.RANK_AGG, job=job, mask=plan.mask, exp=exp,
        flags=proto.FLAG_OP_MAX if op_max else 0, type=proto.TYPE_RESULT,
        slot=plan.slot, set=plan.set, block=plan.ids,
        next_nz=np.min(np.stack([plan.next_nz[r] for r in plan.ranks]), axis=0),
        count=np.where(any_data, plan.counts, 0),
    ), datagram_size(elems))


def sample_arrays(
    workers: int, length: int, *, seed: int = 0, elems: int = proto.DEFAULT_ELEMS,
    zero_blocks: float = 0.0, bound: int = 1 << 20,
) -> list[np.ndarray]:
    """Seeded int32 tensors for ``workers`` ranks; a fraction ``zero_blocks`` of each rank's blocks
    is all zero (for sparse mode). Values lie in [-bound, bound)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(workers):
        a = rng.integers(-bound, bound, size=length, dtype=np.int32)
        nblocks = -(-length // elems)
        zero = rng.random(nblocks) < zero_blocks
        a[np.repeat(zero, elems)[:length]] = 0
        out.append(a)
    return out


# --- malformed and foreign traffic -------------------------------------------------------------


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
    port: int = proto.DEFAULT_PORT,
    rank: int = 1,
    src_ips: Sequence[str] | None = None,
    src_macs: Sequence[str] | None = None,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
) -> list[MalformedCase]:
    """Malformed contributions for a job (``workers`` ranks, ``slots`` slots, ``elems`` per packet),
    each with exactly one fault, sent by ``rank`` from its registered address unless the fault is
    the address. Every ``bad_*`` counter of the C header is covered (a test checks it).

    Truncation comes two ways: a datagram shorter than the header (its IP and UDP lengths say so;
    ``cut`` False), and a frame cut in transit, shorter than its IP and UDP lengths (``cut`` True),
    at every header field boundary and inside the payload. A datagram whose lengths are consistent
    but whose payload is not exactly ``elems`` int32 (or absent when count is 0) is ``bad_len``.
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
        f = dict(type=proto.TYPE_CONTRIB, rank=rank, job=job, slot=0, set=0, block=0, mask=full_mask,
                 next_nz=NEXT_NZ_NONE, exp=0, flags=0)
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
    add("bad_version", "version 0", bytes(hdr(version=0) / payload))
    types = {v: k[len("AR_TYPE_"):] for k, v in proto.C.items() if k.startswith("AR_TYPE_")}
    for t in (0, max(types) + 1, 0xFF):
        add("bad_type", f"unknown type {t}", bytes(hdr(type=t) / payload))
    for t, name in sorted(types.items()):
        if t != proto.TYPE_CONTRIB:
            add("bad_type", f"a {name} sent to the aggregator", bytes(hdr(type=t) / payload))
    unknown = ~proto.FLAGS_KNOWN & 0xFF
    add("bad_flags", f"lowest unknown flag bit {unknown & -unknown:#x}",
        bytes(hdr(flags=unknown & -unknown) / payload))
    add("bad_flags", "all flag bits", bytes(hdr(flags=0xFF) / payload))
    add("bad_job", f"job {job + 1} instead of {job}", bytes(hdr(job=(job + 1) & 0xFFFFFFFF) / payload))
    add("bad_rank", f"rank {workers} of {workers} workers", bytes(hdr(rank=workers) / payload))
    add("bad_rank", "rank AGG (0xffff)", bytes(hdr(rank=proto.RANK_AGG) / payload))
    add("bad_slot", f"slot {slots} of {slots}", bytes(hdr(slot=slots) / payload))
    add("bad_slot", "slot 0xffffffff", bytes(hdr(slot=0xFFFFFFFF) / payload))
    add("bad_set", "set 2", bytes(hdr(set=2) / payload))
    add("bad_set", "set 255", bytes(hdr(set=0xFF) / payload))
    add("bad_len", f"count {elems + 1} > elems {elems}", bytes(hdr(count=elems + 1) / payload))
    add("bad_len", "count 0xffff", bytes(hdr(count=0xFFFF) / payload))
    add("bad_len", f"count {elems} without payload", bytes(hdr(count=elems)))
    add("bad_len", "count 0 with a payload that is neither empty nor full padding",
        bytes(hdr(count=0) / payload[:4 * (elems // 2)]))
    add("bad_len", f"count {elems}, payload of one element", bytes(hdr(count=elems) / payload[:4]))
    add("bad_len", f"count {elems}, payload of {elems // 2} elements",
        bytes(hdr(count=elems) / payload[: 4 * (elems // 2)]))
    add("bad_len", "payload one byte short", bytes(hdr(count=elems) / payload[:-1]))
    add("bad_len", "tail block (count 1) with a payload sized to count, not to elems",
        bytes(hdr(count=1) / payload[:4]))
    add("bad_len", "payload one element longer than elems", bytes(hdr(count=elems) / (payload + payload[:4])))
    if workers < 32:
        add("bad_mask", f"mask has rank {workers} (>= workers)", bytes(hdr(mask=full_mask | 1 << workers) / payload))
        add("bad_mask", "mask 0xffffffff", bytes(hdr(mask=0xFFFFFFFF) / payload))
    add("bad_mask", f"mask without the sender (rank {rank})", bytes(hdr(mask=full_mask & ~(1 << rank)) / payload))
    add("bad_mask", "mask 0", bytes(hdr(mask=0) / payload))
    other = (rank + 1) % workers
    if other != rank:
        add("bad_src", f"from rank {other}'s address", good, src_ip=src_ips[other])
    add("bad_src", f"from {STRANGER_IP}, no rank's address", good, src_ip=STRANGER_IP)
    return cases


def malformed(**kwargs) -> list[tuple[str, bytes]]:
    """(reason, frame) for every case of :func:`malformed_cases` (same keyword arguments)."""
    return [(c.reason, c.frame) for c in malformed_cases(**kwargs)]


def foreign(
    *,
    port: int = proto.DEFAULT_PORT,
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
    ]
