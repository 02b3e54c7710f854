"""The ring offload's arithmetic, pure (no root, no sockets): how a call's tensor is cut into
chunks, where each record's journey starts, adds last and ends, in which order a node stages its
own data, where a node asks for a record it misses, and the wire constants of the ring block of
xdp/nicoffload_proto.h. :mod:`nicoffload.ring.kernels` (numba) and xdp/ring.c follow the same
rules; docs/ring.md explains them.

Record k of a call of K records belongs to chunk o with ``bounds[o] <= k < bounds[o + 1]``,
``bounds[o] = o * K // N``: node o is its **origin**. Its reduce visits o+1, o+2, ..., o-1 (each
adds its own record k; o's host sent its own as the start), node o-1 **adds last** and holds the
final sum, which then visits o, o+1, ..., o-2 (each stores it; o-2 **stores last**). Every node
ends up storing every record, so a node expects K stores per call.
"""
from __future__ import annotations

import numpy as np

from nicoffload.wire import proto

C = proto.C
TYPE_REDUCE = C["AR_TYPE_RING_REDUCE"]
TYPE_GATHER = C["AR_TYPE_RING_GATHER"]
TYPE_NACK = C["AR_TYPE_RING_NACK"]
TYPE_PING = C["AR_TYPE_RING_PING"]
TYPE_PONG = C["AR_TYPE_RING_PONG"]
FLAG_RESTART = C["AR_RING_FLAG_RESTART"]
FLAG_SKIP = C["AR_RING_FLAG_SKIP"]
DEFAULT_CAPACITY = C["AR_RING_DEFAULT_CAPACITY"]
#: the ring program's counters, in index order (AR_RING_STAT_*)
STATS: list[str] = proto._named("RING_STAT")
STAT = {name: i for i, name in enumerate(STATS)}
#: every record examined ends in exactly one of these
OUTCOMES = [s for s in STATS if s not in ("rx", "records", "forwarded", "wakeups", "passed")]
# the state words shared by a node's program and its host (AR_RING_ST_*)
ST_CALL = C["AR_RING_ST_CALL"]
ST_EXPECTED = C["AR_RING_ST_EXPECTED"]
ST_STORED = C["AR_RING_ST_STORED"]
ST_HOST_STORED = C["AR_RING_ST_HOST_STORED"]
ST_OWN_STORED = C["AR_RING_ST_OWN_STORED"]
ST_HOST_OWN = C["AR_RING_ST_HOST_OWN"]
ST_OWN_WAKE = C["AR_RING_ST_OWN_WAKE"]
ST_WORDS = C["AR_RING_ST__WORDS"]
EV_DONE = C["AR_RING_EV_DONE"]
EV_WINDOW = C["AR_RING_EV_WINDOW"]


def chunk_bounds(records: int, world: int) -> np.ndarray:
    """bounds[o] .. bounds[o + 1] - 1 are the records of node o's chunk (N + 1 entries)."""
    return np.array([o * records // world for o in range(world + 1)], dtype=np.int64)


def origins(records: int, world: int) -> np.ndarray:
    """The origin (chunk) of every record, as int64."""
    b = chunk_bounds(records, world)
    return (np.searchsorted(b, np.arange(records), side="right") - 1).astype(np.int64)


def origin_masks(records: int, world: int) -> np.ndarray:
    """``1 << origin`` of every record: the ``mask`` field of its records on the wire."""
    return np.left_shift(np.int64(1), origins(records, world))


def last_adder(origin: int, world: int) -> int:
    """The node whose add completes the record's sum (it stores it first)."""
    return (origin - 1) % world


def last_storer(origin: int, world: int) -> int:
    """The node that stores the final last (and sends it nowhere)."""
    return (origin - 2) % world


def masks_of(rank: int, world: int) -> tuple[int, int, int]:
    """(mine, the chunk this node adds last, the chunk this node stores last) as origin masks."""
    return 1 << rank, 1 << (rank + 1) % world, 1 << (rank + 2) % world


def hops_from_origin(origin: int, rank: int, world: int) -> int:
    """How many hops a record of ``origin`` has made when its reduce reaches ``rank``."""
    return (rank - origin) % world


def staging_order(records: int, world: int, rank: int) -> list[tuple[int, int]]:
    """The chunks a node stages, as (first, end) record ranges, in the order their reduces reach
    it (chunk rank-1 after one hop first, rank+1 last), then its own chunk (its host sends that
    itself; the program needs it only to restart a lost reduce). Empty chunks are left out."""
    b = chunk_bounds(records, world)
    order = [(rank - h) % world for h in range(1, world)] + [rank]
    return [(int(b[o]), int(b[o + 1])) for o in order if b[o + 1] > b[o]]


def nack_target(origin: int, rank: int, world: int) -> tuple[int, bool]:
    """Where a node that misses a record of ``origin`` asks for it: (node, restart). The node
    that adds last asks the origin to restart the reduce (nobody holds the final before it does);
    every other node asks its predecessor, which sends its stored final again."""
    if rank == last_adder(origin, world):
        return origin, True
    return (rank - 1) % world, False


def segments(records: int, capacity: int) -> list[tuple[int, int]]:
    """A tensor of ``records`` records in passes of at most ``capacity`` (the maps' size)."""
    if capacity < 1:
        raise ValueError("capacity must be positive")
    return [(s, min(records, s + capacity)) for s in range(0, records, capacity)] or [(0, 0)]


def link_bytes(nbytes: int, world: int) -> float:
    """Payload bytes each link carries in one pass: 2(N-1)/N of the tensor (reduce-scatter and
    all-gather), the minimum of any AllReduce without in-network help."""
    return 2 * (world - 1) * nbytes / world if world > 1 else 0.0
