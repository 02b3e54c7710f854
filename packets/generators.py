"""Deterministic packet generators: contributions of N workers, the results the aggregator must
send, single records, pulls, batches of records in one frame, an optimizer step's frames. The
addressing and framing are :mod:`.frames`, the epoch handshake (JOIN / JOINED) and ACKs
:mod:`.handshake` (both re-exported here); malformed packets and foreign traffic are in
:mod:`nicoffload.packets.hostile`.

Same inputs, same bytes: no randomness (except :func:`sample_arrays`, seeded), no clock, and every
address is explicit (scapy is never asked to resolve a MAC or a route). Frames are returned as
``bytes``; pass ``as_scapy=True`` where offered, or dissect with ``Ether(frame)``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from nicoffload.errors import InputError
from nicoffload.wire import proto
from nicoffload.wire.codec import datagram_size, encode_blocks

from . import layers  # noqa: F401 - registers the AllReduce layer for Ether(frame) dissection
# addressing, framing and the handshake, re-exported: the tests and the lab use them as generators.*
from .frames import (AGG_IP, AGG_MAC, GROUP_IP, KEY, PORT, STRANGER_IP, frame, result_frame,  # noqa: F401
                     unicast_frame, worker_ip, worker_mac)
from .handshake import ack_frame, join_frames, join_record, joined_record, nonce_of  # noqa: F401


def slot_schedule(rounds: int, slots: int, first_round: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SwitchML's schedule of the worker: round i -> slot i % slots, set (i // slots) % 2 (rounds
    count over the epoch, so a tensor that starts at ``first_round`` continues the pattern)."""
    if slots <= 0:
        raise InputError(f"slots must be positive, got {slots}")
    i = np.arange(first_round, first_round + rounds, dtype=np.int64)
    return (i % slots).astype(np.uint32), ((i // slots) % 2).astype(np.uint8)


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
    workers: int
    blocks: dict[int, np.ndarray]  # rank -> (B, elems)
    counts: np.ndarray  # (B,)
    rounds: np.ndarray  # (B,) round numbers on the wire
    slot: np.ndarray
    set: np.ndarray
    masks: np.ndarray  # (B,) contributors of each round


def _plan(arrays, slots, elems, masks, first_round) -> _Plan:
    workers = len(arrays)
    if not 1 <= workers <= proto.MAX_WORKERS:
        raise InputError(f"need 1..{proto.MAX_WORKERS} workers, got {workers}")
    if not 1 <= elems <= 0xFFFF:
        raise InputError(f"elems must be in 1..65535, got {elems}")
    full = (1 << workers) - 1
    present = [r for r in range(workers) if arrays[r] is not None]
    if not present:
        raise InputError("no rank has an array")
    split = {r: split_blocks(arrays[r], elems) for r in present}
    sizes = {int(np.asarray(arrays[r]).size) for r in present}
    if len(sizes) != 1:
        raise InputError(f"the ranks' arrays differ in length: {sorted(sizes)}")
    counts = split[present[0]][1]
    nb = counts.size
    if masks is None:
        masks = np.full(nb, full, dtype=np.int64)
    else:
        masks = np.asarray(masks, dtype=np.int64)
        if masks.ndim > 1 or (masks.ndim == 1 and masks.size != nb):
            raise InputError(f"masks must be one mask or one per round ({nb}), got shape {masks.shape}")
        masks = np.broadcast_to(masks, (nb,)).copy()
    if nb and (masks.min() <= 0 or (masks & ~full).any()):
        raise InputError(f"every round's mask must be a non-empty subset of the {workers} ranks ({full:#x})")
    for r in range(workers):
        if (masks >> r & 1).any() and r not in split:
            raise InputError(f"rank {r} contributes to some round but has no array")
    slot, set_ = slot_schedule(nb, slots, first_round)
    rounds = (np.arange(nb, dtype=np.int64) + first_round) & 0xFFFFFFFF
    return _Plan(workers, {r: split[r][0] for r in split}, counts, rounds, slot, set_, masks)


def contributions(
    arrays: Sequence[np.ndarray | None],
    *,
    slots: int,
    epoch: int,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    port: int = PORT,
    src_ips: Sequence[str] | None = None,
    src_macs: Sequence[str] | None = None,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
    masks=None,
    first_round: int = 0,
    exp: int = 0,
    op: int = proto.OP_SUM,
    retx: bool = False,
    ack: int = 0,
    key: int = KEY,
    as_scapy: bool = False,
) -> list[bytes] | list[Packet]:
    """Contribution frames (one record each) of every rank for every block of the tensor.

    ``arrays[r]`` is rank r's int32 tensor (all the same length; a rank that contributes to no
    round may be None). ``masks``: the contributors of each round (scalar or one per block; None:
    every rank, dense); a rank sends a record for round b only if it is in ``masks[b]``. Blocks
    hold ``elems`` elements; the tail block has ``count`` < elems and a zero-padded payload.
    Block i is round ``first_round + i`` on slot (first_round + i) % slots, set
    ((first_round + i) // slots) % 2, in ``epoch``. Every record carries ``exp``, ``op``, ``ack``
    and the job's ``key``; ``retx`` sets the RETX flag. Order: round-major (the contributors of
    round 0 in rank order, then round 1, ...).
    """
    plan = _plan(arrays, slots, elems, masks, first_round)
    src_ips = src_ips or [worker_ip(r) for r in range(plan.workers)]
    src_macs = src_macs or [worker_mac(r) for r in range(plan.workers)]
    flags = proto.FLAG_RETX if retx else 0
    out = []
    for b in range(plan.counts.size):
        for r in range(plan.workers):
            if not plan.masks[b] >> r & 1:
                continue
            rec = encode_blocks(
                plan.blocks[r][b:b + 1], rank=r, job=job, epoch=epoch, slot=plan.slot[b], set=plan.set[b],
                round=plan.rounds[b], mask=plan.masks[b], ack=ack, count=plan.counts[b], exp=exp, op=op,
                flags=flags, key=key,
            )
            out.append(frame(bytes(rec), src_mac=src_macs[r], dst_mac=dst_mac, src_ip=src_ips[r],
                             dst_ip=dst_ip, sport=port, dport=port))
    return [Ether(f) for f in out] if as_scapy else out


def combine(op: int, payloads: np.ndarray) -> np.ndarray:
    """What the aggregator computes from the (R, elems) int32 payloads of one round's contributors."""
    p = np.asarray(payloads, dtype=np.int32)
    if op in (proto.OP_SUM64, proto.OP_OR) and p.shape[-1] % 2:
        raise InputError(f"{proto.OPS[op].upper()} works on pairs of int32: elems must be even, not {p.shape[-1]}")
    if op == proto.OP_SUM:
        return p.sum(axis=0, dtype=np.int32)  # int32 accumulation wraps modulo 2^32
    if op == proto.OP_SUM64:
        words = p.view("<u8")
        return words.sum(axis=0, dtype=np.uint64).view("<i4")  # wraps modulo 2^64
    if op == proto.OP_MAX:
        return p.max(axis=0)
    if op == proto.OP_OR:
        return np.bitwise_or.reduce(p, axis=0)
    raise InputError(f"unknown op {op}")


def expected_results(
    arrays: Sequence[np.ndarray | None],
    *,
    slots: int,
    epoch: int,
    elems: int = proto.DEFAULT_ELEMS,
    job: int = 1,
    masks=None,
    first_round: int = 0,
    exp: int = 0,
    op: int = proto.OP_SUM,
    gate=0,
    key: int = KEY,
) -> list[bytes]:
    """The RESULT records (UDP payloads) the aggregator sends for :func:`contributions` with the
    same arguments, one per block in block order (frame them with :func:`result_frame`).

    rank AGG, mask = the round's contributors, epoch/slot/set/round/exp/op/key as sent, count as sent,
    flags and detail 0, ack = the job's gate when the round completed (``gate``: one value or one
    per round; the lowest acknowledgement of the job's ranks), payload = :func:`combine` of the
    contributors' payloads.
    """
    plan = _plan(arrays, slots, elems, masks, first_round)
    acc = np.stack([
        combine(op, np.stack([plan.blocks[r][b] for r in range(plan.workers) if plan.masks[b] >> r & 1]))
        for b in range(plan.counts.size)
    ]) if plan.counts.size else np.zeros((0, elems), np.int32)
    return _split(encode_blocks(
        acc, rank=proto.RANK_AGG, job=job, epoch=epoch, mask=plan.masks, exp=exp, op=op,
        type=proto.TYPE_RESULT, slot=plan.slot, set=plan.set, round=plan.rounds, count=plan.counts,
        ack=np.broadcast_to(np.asarray(gate, dtype=np.int64), plan.rounds.shape), key=key,
    ), datagram_size(elems))


def record(*, rank: int, round: int, slots: int, epoch: int, mask: int, elems: int = proto.DEFAULT_ELEMS,  # noqa: A002
           job: int = 1, payload=None, count: int | None = None, flags: int = 0, op: int = proto.OP_SUM,
           exp: int = 0, ack: int = 0, type: int = proto.TYPE_CONTRIB, key: int = KEY) -> bytes:  # noqa: A002
    """One record (header + ``elems`` int32) on the worker's schedule for ``round``."""
    slot, set_ = slot_schedule(1, slots, round)
    data = np.zeros((1, elems), np.int32) if payload is None else np.asarray(payload, np.int32).reshape(1, elems)
    return bytes(encode_blocks(data, rank=rank, job=job, epoch=epoch, slot=slot[0], set=set_[0], round=round,
                               mask=mask, ack=ack, count=elems if count is None else count, flags=flags,
                               op=op, exp=exp, type=type, key=key))


def pull(rank: int, round: int, *, slots: int, epoch: int, mask: int, **kw) -> bytes:  # noqa: A002
    """A PULL record: ``rank`` asks for the result of ``round`` without contributing (full size,
    payload ignored, count 0)."""
    return record(rank=rank, round=round, slots=slots, epoch=epoch, mask=mask, count=0,
                  flags=proto.FLAG_PULL | kw.pop("flags", 0), **kw)


def probe(rank: int, round: int, *, slots: int, epoch: int, mask: int, **kw) -> bytes:  # noqa: A002
    """A PROBE: a PULL of one header, no payload: ``rank`` asks what ``round`` lacks."""
    return pull(rank, round, slots=slots, epoch=epoch, mask=mask, **kw)[:proto.HDR_LEN]


def batch(records: Sequence[bytes], rank: int, **kw) -> bytes:
    """One frame carrying several records back to back (a UDP_SEGMENT send seen whole)."""
    return frame(b"".join(records), src_mac=kw.pop("src_mac", worker_mac(rank)), dst_mac=kw.pop("dst_mac", AGG_MAC),
                 src_ip=kw.pop("src_ip", worker_ip(rank)), dst_ip=kw.pop("dst_ip", AGG_IP), **kw)


def answered(rec: bytes) -> bytes:
    """``rec`` (a RESULT or JOINED record) as the aggregator sends it to answer a retransmission or
    a pull: FLAG_ANSWER set."""
    b = bytearray(rec)
    b[proto.FIELD_OFFSETS["flags"]] |= proto.FLAG_ANSWER
    return bytes(b)


def sample_arrays(
    workers: int, length: int, *, seed: int = 0, elems: int = proto.DEFAULT_ELEMS,
    zero_blocks: float = 0.0, bound: int = 1 << 20,
) -> list[np.ndarray]:
    """Seeded int32 tensors for ``workers`` ranks; a fraction ``zero_blocks`` of each rank's blocks
    is all zero. Values lie in [-bound, bound)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(workers):
        a = rng.integers(-bound, bound, size=length, dtype=np.int32)
        nblocks = -(-length // elems)
        zero = rng.random(nblocks) < zero_blocks
        a[np.repeat(zero, elems)[:length]] = 0
        out.append(a)
    return out


def optimizer_contributions(grads: Sequence[np.ndarray], *, epoch: int, step: int, params: int,
                            elems: int = proto.DEFAULT_ELEMS, job: int = 1, flags: int = 0,
                            src_ips: Sequence[str] | None = None,
                            key: int = KEY) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """The frames of one optimizer step (one record each), per rank: its exponent rounds (op MAX,
    one int32 per block, padded with the MAX identity) and its data rounds (op SGD, pre-averaged
    gradients quantized as the workers do: nicoffload.optim.rank_lanes), on the job's share
    (slot = round mod optim.share). Every record carries ``ack`` = the step's first round."""
    from nicoffload import optim
    from nicoffload.wire import quant

    world, nb, meta = len(grads), optim.blocks(params, elems), optim.meta_slots(params, elems)
    P, base = optim.share(params, elems), step * optim.share(params, elems)
    exps = [quant.block_exponents(optim.padded_blocks(g, nb, elems)) for g in grads]
    shifts = optim.step_shifts(np.max(np.stack(exps), axis=0), world)
    counts = [min(elems, params - b * elems) for b in range(nb)]
    src_ips = src_ips or [worker_ip(r) for r in range(world)]
    mask = (1 << world) - 1

    def frames(rank: int, rows: np.ndarray, first: int, op: int, exp, cnt) -> list[bytes]:
        out = []
        for j in range(len(rows)):
            r = first + j
            rec = encode_blocks(rows[j:j + 1], rank=rank, job=job, epoch=epoch, slot=r % P, set=(r // P) % 2,
                                round=r, mask=mask, count=int(cnt[j]) if np.ndim(cnt) else cnt,
                                exp=int(exp[j]) if np.ndim(exp) else exp, op=op, flags=flags, ack=base, key=key)
            out.append(frame(bytes(rec), src_mac=worker_mac(rank), dst_mac=AGG_MAC, src_ip=src_ips[rank],
                             dst_ip=AGG_IP))
        return out

    meta_frames, data_frames = [], []
    for r in range(world):
        row = np.full(meta * elems, quant.ZERO_EXP, np.int32)
        row[:nb] = exps[r]
        meta_frames.append(frames(r, row.reshape(meta, elems), base, proto.OP_MAX, 0, elems))
        data_frames.append(frames(r, optim.rank_lanes(grads[r], shifts, elems, world), base + meta, proto.OP_SGD,
                                  shifts, counts))
    return meta_frames, data_frames
