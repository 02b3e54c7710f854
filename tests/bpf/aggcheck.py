"""Reading the XDP aggregator's output in tests/bpf (imported by the test modules)."""
from __future__ import annotations

import struct

from nicoffload.wire import proto

NONE = 0xFFFFFFFF


def hdr_of(frame: bytes, offset: int = 0) -> dict:
    at = proto.L2L4_LEN + offset
    vals = struct.unpack(proto.HDR_STRUCT, frame[at:at + proto.HDR_LEN])
    return dict(zip([f[0] for f in proto.FIELDS], vals))


def run_all(agg, frames):
    return [agg.run(f) for f in frames]


def outcome_total(st: dict) -> int:
    """Every record ends in exactly one of these counters."""
    keys = ["aggregated", "retx_answered", "pull_answered", "status_sent", "dup_dropped", "join", "ack",
            "stale_epoch", "stale_round", "stale_join", "early", "mismatch"]
    return sum(st[k] for k in keys) + sum(v for k, v in st.items() if k.startswith("bad_"))
