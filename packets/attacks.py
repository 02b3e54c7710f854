"""An attack on one live job, as a host on the job's L2 segment would mount it: every malformed
kind of :mod:`nicoffload.packets.hostile` (from the ranks' spoofed addresses where the fault
lies behind the source check), foreign traffic, records of unregistered jobs, ranks claimed
from the attacker's own address, and everything a rank sends, from the rank's spoofed address,
with the right job, slot and epoch but not the job's key (:func:`attack`,
:func:`spoofed_keys`), each with the counter that must count it; and :func:`flood`, which sends
such frames through a raw socket, pass after pass."""
from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from nicoffload.errors import InputError
from nicoffload.wire import proto
from nicoffload.wire.codec import encode_blocks

from .frames import AGG_IP, AGG_MAC, KEY, PORT, frame
from .generators import record
from .handshake import join_record
from .hostile import MalformedCase, foreign, malformed_cases, malformed_headers


def first_header_complete(frame_: bytes) -> bool:
    """Does the frame (Ethernet / IPv4 without options / UDP) hold its first record's whole header,
    by its own length and by its UDP length? Until it does, the aggregator cannot read the job
    the record names, and counts the frame in row 0."""
    udp_len = int.from_bytes(frame_[proto.L2L4_LEN - 4:proto.L2L4_LEN - 2], "big")
    return len(frame_) - proto.L2L4_LEN >= proto.HDR_LEN and udp_len - 8 >= proto.HDR_LEN


#: reasons the aggregator finds before it compares the sender with the rank's address
BEFORE_SOURCE_CHECK = ("bad_magic", "bad_version", "bad_job", "bad_key", "bad_rank")


class AttackFrame(NamedTuple):
    """One frame of an attack on a live job and what the aggregator must do with it: count it
    once in ``reason`` (a ``proto.STATS`` name; ``passed`` for foreign traffic, which goes on to
    the stack untouched), in the job's row when ``job_row``, else in row 0 (traffic that names
    no registered job or is rejected before its job is read, and foreign traffic), and once more
    in each counter of ``also`` in the same row (the valid first record of a batch whose epoch
    is not live counts ``stale_epoch``). ``kind``: malformed, foreign, wrong_job, spoofed_rank,
    spoofed_key."""

    kind: str
    reason: str
    what: str
    frame: bytes
    job_row: bool
    also: tuple[str, ...] = ()


def attack(
    *,
    job: int,
    epoch: int,
    worker_ips: Sequence[str],
    slots: int,
    attacker_ip: str,
    attacker_mac: str,
    elems: int = proto.DEFAULT_ELEMS,
    port: int = PORT,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
    other_jobs: Sequence[int] | None = None,
    key: int = KEY,
) -> list[AttackFrame]:
    """Everything an attacker on the L2 segment of a live job can throw at its aggregator
    without contributing: the job has ``len(worker_ips)`` ranks at those addresses, ``slots``
    slots, the live ``epoch`` and its ``key``. The attacker (``attacker_ip``/``attacker_mac``,
    registered in no job) sends every frame from its own MAC. The malformed and spoofed_rank
    frames carry the job's key, as if the attacker had learnt it (what the other checks stop
    even then); the spoofed_key ones do not (what the key stops):

    * malformed: every case of :func:`malformed_cases` for every rank, from the rank's own
      address (the attacker spoofs it: most faults are only looked at once the source checks
      out) and in the live epoch, except the batches whose second record is the fault
      (``bad_mixed``): their first record is valid, so they carry another epoch and that record
      counts ``stale_epoch`` instead of being added; the cases found before the source check
      again from the attacker's own address; and :func:`malformed_headers`;
    * foreign: :func:`foreign` traffic from the attacker (passes untouched);
    * wrong_job: a contribution, a JOIN and an ACK of each job of ``other_jobs`` (default: three
      ids near ``job``; none may be registered), from the attacker and from a rank's address;
    * spoofed_rank: what each rank sends, from the attacker's address in the live epoch: a
      contribution, its retransmission, a pull, a batch of two contributions, a JOIN that would
      end the epoch, an ACK that would move the gate (``bad_src``);
    * spoofed_key: the same from each rank's own address, in the live epoch, on the job's slots,
      with a key that is not the job's (:func:`spoofed_keys`: ``bad_key``).

    Not one of them may reach a slot, the job's epoch or its gate."""
    workers = len(worker_ips)
    if not 1 <= workers <= proto.MAX_WORKERS:
        raise InputError(f"need 1..{proto.MAX_WORKERS} worker addresses, got {workers}")
    if attacker_ip in worker_ips:
        raise InputError(f"the attacker's address {attacker_ip} is a rank's")
    if not 0 < epoch <= 0xFFFFFFFF:
        raise InputError(f"the live epoch is 1..2^32-1, not {epoch}")
    other_jobs = (list(other_jobs) if other_jobs is not None
                  else [(job + d) & 0xFFFFFFFF for d in (1, 0x10000, 0x80000000)])
    if job in other_jobs:
        raise InputError(f"other_jobs holds the live job {job}")
    common = dict(workers=workers, slots=slots, elems=elems, job=job, port=port, dst_ip=dst_ip, dst_mac=dst_mac,
                  key=key)

    def framed(dgram: bytes, src_ip: str = attacker_ip) -> bytes:
        return frame(dgram, src_mac=attacker_mac, dst_mac=dst_mac, src_ip=src_ip, dst_ip=dst_ip, sport=port, dport=port)

    out = _malformed(common, epoch, worker_ips, attacker_ip, attacker_mac)
    out += [AttackFrame("malformed", c.reason, f"rank 0's address: {c.what}", c.frame, False)
            for c in malformed_headers(elems=elems, job=job, epoch=epoch, port=port, workers=workers,
                                       src_ip=worker_ips[0], src_mac=attacker_mac, dst_ip=dst_ip, dst_mac=dst_mac,
                                       key=key)]
    out += [AttackFrame("foreign", "passed", name, f, False)
            for name, f in foreign(port=port, src_ip=attacker_ip, src_mac=attacker_mac, dst_ip=dst_ip, dst_mac=dst_mac)]
    payload = np.full(elems, 7, np.int32)
    out += _wrong_jobs(other_jobs, framed, payload, epoch, worker_ips, slots, elems, attacker_ip)
    out += _spoofed_ranks(framed, payload, job, epoch, workers, slots, elems, key)
    out += spoofed_keys(job=job, epoch=epoch, worker_ips=worker_ips, slots=slots, key=key, attacker_mac=attacker_mac,
                        elems=elems, port=port, dst_ip=dst_ip, dst_mac=dst_mac)
    return out


def _counted_in_job_row(c: MalformedCase) -> bool:
    """Whether the aggregator reads the job a malformed case names (else it counts it in row 0)."""
    return c.reason not in ("bad_magic", "bad_version", "bad_job") and (
        c.reason != "bad_truncated" or first_header_complete(c.frame))


def _malformed(common: dict, epoch: int, worker_ips: Sequence[str], attacker_ip: str,
               attacker_mac: str) -> list[AttackFrame]:
    """Every malformed case for every rank: from the rank's spoofed address in the live epoch (the
    bad_mixed batches in an epoch that is not live), and the cases found before the source check
    again from the attacker's own address."""
    workers, out = len(worker_ips), []
    stale = epoch ^ 0x80000000  # never the live epoch, never 0
    row_of = _counted_in_job_row
    for rank in range(workers):
        spoofed = dict(common, rank=rank, src_ips=list(worker_ips), src_macs=[attacker_mac] * workers)
        for c in malformed_cases(epoch=epoch, **spoofed):
            if c.reason != "bad_mixed":
                out.append(AttackFrame("malformed", c.reason, f"rank {rank}'s address: {c.what}", c.frame, row_of(c)))
        for c in malformed_cases(epoch=stale, **spoofed):
            if c.reason == "bad_mixed":
                out.append(AttackFrame("malformed", c.reason, f"rank {rank}'s address, epoch not live: {c.what}",
                                       c.frame, True, ("stale_epoch",)))
        own = dict(common, rank=rank, src_ips=[attacker_ip] * workers, src_macs=[attacker_mac] * workers)
        for c in malformed_cases(epoch=epoch, **own):
            if c.reason in BEFORE_SOURCE_CHECK or (c.reason == "bad_truncated" and not row_of(c)):
                out.append(AttackFrame("malformed", c.reason, f"the attacker's address: {c.what}", c.frame, row_of(c)))
    return out


def _wrong_jobs(other_jobs: Sequence[int], framed: Callable, payload: np.ndarray, epoch: int,
                worker_ips: Sequence[str], slots: int, elems: int, attacker_ip: str) -> list[AttackFrame]:
    """A contribution, a JOIN and an ACK of each job of ``other_jobs``, from the attacker's and
    from rank 0's address."""
    workers, full, out = len(worker_ips), (1 << len(worker_ips)) - 1, []
    for other in other_jobs:
        for src, whose in ((attacker_ip, "the attacker"), (worker_ips[0], "rank 0")):
            recs = {
                "contribution": record(rank=0, round=1, slots=slots, epoch=epoch, mask=full, elems=elems, job=other,
                                       payload=payload),
                "JOIN": join_record(0, workers, 1 << 62, job=other),
                "ACK": bytes(encode_blocks(np.zeros((1, 0), np.int32), rank=0, job=other, epoch=epoch, slot=0, set=0,
                                           round=0, mask=1, ack=0, count=0, type=proto.TYPE_ACK)),
            }
            for what, rec in recs.items():
                out.append(AttackFrame("wrong_job", "bad_job", f"a {what} of job {other} from {whose}'s address",
                                       framed(rec, src), False))
    return out


def _rank_sends(rank: int, job: int, epoch: int, workers: int, slots: int, elems: int, key: int,
                payload: np.ndarray) -> dict[str, bytes]:
    """What rank ``rank`` sends in the live epoch (each carrying ``key``): a contribution, its
    retransmission, a pull, a batch of two contributions, a JOIN that would end the epoch, an ACK
    that would move the gate."""
    full = (1 << workers) - 1

    def rec(rnd: int, **kw) -> bytes:
        return record(rank=rank, round=rnd, slots=slots, epoch=epoch, mask=full, elems=elems, job=job,
                      payload=payload, key=key, **kw)

    return {
        "a contribution": rec(1),
        "a retransmission": rec(2, flags=proto.FLAG_RETX),
        "a pull": rec(3, flags=proto.FLAG_PULL, count=0),
        "a batch of two contributions": rec(4) + rec(5),
        "a JOIN (would end the epoch)": join_record(rank, workers, (1 << 63) | rank, job=job, key=key),
        "an ACK asking for the gate, far ahead (would move it)": bytes(encode_blocks(
            np.zeros((1, 0), np.int32), rank=rank, job=job, epoch=epoch, slot=0, set=0, round=0, mask=1 << rank,
            ack=0x40000000, count=0, type=proto.TYPE_ACK, flags=proto.FLAG_RETX, key=key)),
    }


def _spoofed_ranks(framed: Callable, payload: np.ndarray, job: int, epoch: int, workers: int, slots: int,
                   elems: int, key: int) -> list[AttackFrame]:
    """What each rank sends, from the attacker's address in the live epoch."""
    out = []
    for rank in range(workers):
        for what, dgram in _rank_sends(rank, job, epoch, workers, slots, elems, key, payload).items():
            out.append(AttackFrame("spoofed_rank", "bad_src", f"rank {rank}'s {what} from the attacker's address",
                                   framed(dgram), True))
    return out


def spoofed_keys(
    *,
    job: int,
    epoch: int,
    worker_ips: Sequence[str],
    slots: int,
    key: int,
    attacker_mac: str,
    elems: int = proto.DEFAULT_ELEMS,
    port: int = PORT,
    dst_ip: str = AGG_IP,
    dst_mac: str = AGG_MAC,
) -> list[AttackFrame]:
    """A host on the job's L2 segment that spoofs each registered rank's source address (from its
    own MAC, ``attacker_mac``) and knows the job, its slots and the live epoch, but not the job's
    ``key``: everything each rank sends (a contribution, a retransmission, a pull, a batch, a
    JOIN that would end the run, an ACK that would move the gate) with a key that is not the
    job's: no key, the key with one bit flipped, and every bit flipped. Each is ``bad_key`` in
    the job's row and touches nothing."""
    workers = len(worker_ips)
    if not 1 <= workers <= proto.MAX_WORKERS:
        raise InputError(f"need 1..{proto.MAX_WORKERS} worker addresses, got {workers}")
    payload = np.full(elems, 0x01000000, np.int32)  # a sum the job would notice
    guesses = {"no key (0)" if key else "a key (the job has none)": 0 if key else 0x5EC2E7,
               "the key with its lowest bit flipped": key ^ 1, "every bit of the key flipped": key ^ (1 << 64) - 1}
    out = []
    for rank, ip in enumerate(worker_ips):
        for guess, wrong in guesses.items():
            for what, dgram in _rank_sends(rank, job, epoch, workers, slots, elems, wrong, payload).items():
                f = frame(dgram, src_mac=attacker_mac, dst_mac=dst_mac, src_ip=ip, dst_ip=dst_ip, sport=port,
                          dport=port)
                out.append(AttackFrame("spoofed_key", "bad_key", f"rank {rank}'s {what} from its address, {guess}",
                                       f, True))
    return out


class Flood(NamedTuple):
    """What :func:`flood` sent: ``passes`` times every frame, ``frames`` in all, between
    ``started`` and ``ended`` (``time.monotonic()``, comparable across processes);
    ``pushed_back``: sends the interface's full queue refused and that were made again."""

    passes: int
    frames: int
    started: float
    ended: float
    pushed_back: int = 0

    @property
    def rate(self) -> float:
        """Frames per second."""
        return self.frames / max(self.ended - self.started, 1e-9)


def flood(
    iface: str,
    frames: Sequence[bytes],
    *,
    min_frames: int,
    stop: Callable[[], bool] = lambda: True,
    seed: int = 0,
    on_start: Callable[[float], None] | None = None,
) -> Flood:
    """Send every frame of ``frames`` once per pass, each pass in a new seeded random order,
    through an AF_PACKET raw socket on ``iface`` (in the calling thread's network namespace),
    until at least ``min_frames`` are sent and ``stop()`` says so (asked after each pass): every
    frame goes out exactly ``passes`` times. A send refused because the interface's queue is
    full (ENOBUFS: the qdisc dropped it) is made again; any other refusal raises (e.g. EMSGSIZE
    for a frame longer than the interface's MTU): nothing is skipped silently. ``on_start`` is
    called with the start time once the socket is ready."""
    if not frames:
        raise InputError("nothing to send")
    rng = np.random.default_rng(seed)
    n = len(frames)
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0) as s:
        s.bind((iface, 0))
        send = s.send
        passes = pushed_back = 0
        started = time.monotonic()
        if on_start is not None:
            on_start(started)
        while True:
            for i in rng.permutation(n).tolist():
                while True:
                    try:
                        sent = send(frames[i])
                        break
                    except OSError as e:  # the interface's queue is full: this frame was not sent
                        if e.errno != errno.ENOBUFS:
                            raise
                        pushed_back += 1
                        time.sleep(0.0005)
                if sent != len(frames[i]):
                    raise OSError(f"{iface}: frame {i} of {len(frames[i])} bytes went out short ({sent})")
            passes += 1
            if passes * n >= min_frames and stop():
                break
        ended = time.monotonic()
    return Flood(passes, passes * n, started, ended, pushed_back)
