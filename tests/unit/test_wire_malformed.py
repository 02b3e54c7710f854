"""Malformed packets: every bad_* counter has a generator case, each case has exactly one fault
(its valid variants are accepted), and foreign traffic is never taken for ours."""
from __future__ import annotations

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from wirecheck import NAMES, header_of, udp_of

from nicoffload.errors import InputError
from nicoffload.packets import generators as g
from nicoffload.packets import hostile
from nicoffload.wire import proto

W, S, E = 4, 8, 256
BAD = {s for s in proto.STATS if s.startswith("bad_")}




# --- malformed and foreign traffic --------------------------------------------------------------


def test_malformed_covers_every_bad_counter():
    cases = hostile.malformed_cases()
    reasons = {c.reason for c in cases}
    assert reasons == BAD
    assert BAD >= {"bad_op", "bad_mixed", "bad_src", "bad_truncated", "bad_len"}
    assert [(c.reason, c.frame) for c in cases] == hostile.malformed()
    assert len({c.what for c in cases}) == len(cases)  # every case says what is wrong, distinctly


def test_malformed_truncation_at_every_field_boundary():
    cases = [c for c in hostile.malformed_cases() if c.reason == "bad_truncated"]
    boundaries = {off for _, off, _ in proto.FIELDS}
    short = {len(c.frame) - proto.L2L4_LEN for c in cases if not c.cut}
    cut = {len(c.frame) - proto.L2L4_LEN for c in cases if c.cut}
    assert boundaries <= short and boundaries <= cut
    assert all(n < proto.HDR_LEN for n in short)
    assert any(proto.HDR_LEN < n < proto.HDR_LEN + 4 * E for n in cut)  # cut inside the payload
    for c in cases:
        p = Ether(c.frame)
        udp_len = p[UDP].len
        if c.cut:  # IP and UDP lengths claim the full datagram; the frame is shorter
            assert udp_len == 8 + proto.record_size(E) and len(c.frame) < 34 + udp_len
        else:
            assert len(c.frame) == 34 + udp_len and p[IP].len == 20 + udp_len


def _valid_variants(good: bytes, case: dict) -> list[tuple[dict, int]]:
    """Valid records near ``good`` (header, datagram length): the contribution itself, the same
    with the case's count if that count is valid, the same in 16-bit lanes (SUM16), a PULL, a JOIN
    and an ACK with this header."""
    h = header_of(good)
    out = [(h, len(good)), ({**h, "op": proto.OP_SUM16}, len(good))]
    if 1 <= case["count"] <= E:
        out.append(({**h, "count": case["count"]}, len(good)))
    if 1 <= case["count"] <= 2 * E:
        out.append(({**h, "op": proto.OP_SUM16, "count": case["count"]}, len(good)))
    out.append(({**h, "flags": proto.FLAG_PULL, "count": 0}, len(good)))
    out.append(({**h, "type": proto.TYPE_JOIN, "count": 0}, proto.HDR_LEN + proto.JOIN_PAYLOAD))
    out.append(({**h, "type": proto.TYPE_ACK, "count": 0}, proto.HDR_LEN))
    return out


@pytest.mark.parametrize("workers,rank", [(W, 1), (1, 0), (32, 31)])
def test_each_malformed_packet_has_exactly_one_fault(workers, rank):
    full = (1 << workers) - 1
    good = g.record(rank=rank, round=0, slots=S, epoch=9, mask=full, payload=np.arange(1, E + 1), elems=E)
    good_frame = g.batch([good], rank)
    size = len(good)
    for c in hostile.malformed_cases(workers=workers, rank=rank, slots=S, elems=E, epoch=9):
        if c.cut:  # a prefix of the good frame
            assert good_frame.startswith(c.frame) and len(c.frame) < len(good_frame), c.what
            continue
        dgram, ip, _ = udp_of(c.frame)
        src_fault = ip != g.worker_ip(rank)
        assert c.frame[:12] == good_frame[:12] and c.frame[30:34] == good_frame[30:34], c.what  # MACs, dst
        if c.reason == "bad_truncated":
            assert good.startswith(dgram) and len(dgram) < proto.HDR_LEN and not src_fault, c.what
            continue
        if len(dgram) > size and len(dgram) % size == 0:  # a batch: a good record, then one bad one
            first, second = dgram[:size], dgram[size:]
            assert len(dgram) == 2 * size and first == good and not src_fault, c.what
            diff = {k for k in NAMES if header_of(second)[k] != header_of(good)[k]}
            assert len(diff) == 1 and second[proto.HDR_LEN:] == good[proto.HDR_LEN:], (c.what, diff)
            continue
        case = header_of(dgram)
        faults = min(
            sum(case[k] != ref[k] for k in NAMES) + (len(dgram) != length) + src_fault
            for ref, length in _valid_variants(good, case)
        )
        assert faults == 1, (c.reason, c.what)
        if len(dgram) == size and case["count"]:  # the payload is the good one
            assert dgram[proto.HDR_LEN:] == good[proto.HDR_LEN:], c.what


@pytest.mark.parametrize("workers,rank", [(1, 0), (32, 31), (2, 0)])
def test_malformed_edge_sizes(workers, rank):
    """One worker (no other rank's address to spoof) and 32 (no rank >= workers fits the mask)."""
    cases = hostile.malformed_cases(workers=workers, rank=rank, elems=2, slots=1)
    assert {c.reason for c in cases} == BAD
    src = [c.what for c in cases if c.reason == "bad_src"]
    assert f"from {hostile.STRANGER_IP}, no rank's address" in src and len(src) == min(workers, 2)
    with pytest.raises(InputError):
        hostile.malformed_cases(workers=2, rank=2)
    with pytest.raises(InputError):
        hostile.malformed_cases(elems=1)


def test_foreign_traffic_is_not_ours():
    names = [n for n, _ in hostile.foreign()]
    assert {"arp_request", "icmp_echo", "ipv6_udp_to_port", "udp_other_port", "udp_from_port_to_other",
            "tcp_to_port", "ipv4_fragment_to_port"} <= set(names)
    assert len(set(names)) == len(names)
    for port in (proto.DEFAULT_PORT, 40000, 0xFFFF):
        for name, f in hostile.foreign(port=port):
            p = Ether(f)
            ours = (p.haslayer(IP) and p.haslayer(UDP) and p[UDP].dport == port
                    and not (p[IP].flags.MF or p[IP].frag))
            assert not ours, (port, name)
