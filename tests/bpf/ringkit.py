"""Building and reading the ring program's frames in tests/bpf (imported by test_ring.py and
conftest.py): a ring of three (rank 1 the node under test, rank 0 its predecessor, rank 2 its
successor), records as a rank sends them, a node's own staged records, and the fields, payloads,
tags and counters of what comes out."""
from __future__ import annotations

import struct

import numpy as np

from nicoffload.datapath import encode
from nicoffload.packets import generators as gen
from nicoffload.ring import kernels as rk
from nicoffload.ring.layout import OUTCOMES, ST_CALL, ST_EXPECTED, ST_OWN_WAKE, TYPE_REDUCE
from nicoffload.wire import codec, proto

E = 32  # records small enough that a batch fits the one page BPF_PROG_TEST_RUN gives a frame
REC = proto.record_size(E)
WORLD = 3
CALL = 7
PEERS = [gen.worker_ip(r) for r in range(WORLD)]
MACS = [gen.worker_mac(r) for r in range(WORLD)]
NAMES = [f[0] for f in proto.FIELDS]
O = proto.FIELD_OFFSETS


def fresh(n, call=CALL, expected=64):
    n.maps.reset()
    n.maps.reset_stats()
    n.maps.events.drain()
    n.maps.state[ST_EXPECTED] = expected
    n.maps.state[ST_OWN_WAKE] = 0xFFFFFFFF
    n.maps.state[ST_CALL] = call


def template(rank, call, type_=TYPE_REDUCE):
    return np.frombuffer(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=rank, job=1, epoch=call, slot=0, set=0,
                                             round=0, mask=0, count=0, type=type_), np.uint8).copy()


def records(rank, ks, values, origin, call=CALL, type_=TYPE_REDUCE, op=proto.OP_SUM, count=E):
    """Records of ``ks`` (record k's payload = values[k]) as ``rank`` sends them."""
    ks = np.asarray(ks, np.int64)
    x = np.asarray(values, np.int32).reshape(-1)
    n = int(ks.max()) + 1
    buf = np.zeros(len(ks) * REC, np.uint8)
    masks = np.full(n, 1 << origin, np.int64)
    encode.encode_int(buf, REC, E, template(rank, call, type_), x[:n * E] if count == E else x, ks, 0, 1 << 40,
                       np.arange(n), masks, op, 0)
    if count != E:
        for j in range(len(ks)):
            buf[j * REC + O["count"]:j * REC + O["count"] + 2] = np.frombuffer(struct.pack("!H", count), np.uint8)
    return buf


def frame(payload, src=0, dst=1, sport=proto.DEFAULT_PORT):
    return gen.frame(bytes(payload), src_mac=MACS[src], dst_mac=MACS[dst], src_ip=PEERS[src], dst_ip=PEERS[dst],
                     sport=sport)


def stage(n, values, ks, rank=1, call=CALL, op=proto.OP_SUM, origin_of=None):
    """Stage ``values`` (record k = values[k]) as node ``rank``'s own data for records ``ks``."""
    x = np.asarray(values, np.int32).reshape(-1)
    k_max = int(max(ks)) + 1
    masks = np.array([1 << (origin_of(k) if origin_of else 0) for k in range(k_max)], np.int64)
    for k in ks:
        rk.set_tags(n.maps.local, REC, k, k + 1, 0)
        encode.encode_int(n.maps.local, REC, E, template(rank, 0), x, np.array([k]), 0, 1 << 40, np.arange(k_max),
                           masks, op, k)
        rk.set_tags(n.maps.local, REC, k, k + 1, call)


def hdr(data, i=0):
    at = proto.L2L4_LEN + i * REC
    return dict(zip(NAMES, struct.unpack(proto.HDR_STRUCT, data[at:at + proto.HDR_LEN])))


def payload(data, i=0, dtype="<i4"):
    at = proto.L2L4_LEN + i * REC + proto.HDR_LEN
    return np.frombuffer(data[at:at + 4 * E], dtype)


def stored(n, k):
    return np.frombuffer(bytes(n.maps.result[k * REC + proto.HDR_LEN:(k + 1) * REC]), "<i4")


def tag(buf, k):
    return struct.unpack("!I", bytes(buf[k * REC + O["epoch"]:k * REC + O["epoch"] + 4]))[0]


def nonzero(stats):
    return {k: v for k, v in stats.items() if v}


def conserved(stats):
    """Every record examined ends in exactly one outcome."""
    return stats["records"] == sum(stats[k] for k in OUTCOMES)


def rand(shape, seed=0, lo=-(1 << 31), hi=(1 << 31) - 1):
    return np.random.default_rng(seed).integers(lo, hi, shape, dtype=np.int64).astype(np.int32)
