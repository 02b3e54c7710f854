"""The user-space aggregator: the same protocol and slot algorithm as xdp/aggregator.c, in numpy.
The baseline the XDP path is measured against, and the fallback where XDP cannot be loaded.
Results go out once per round to the multicast group; retransmissions are answered by unicast."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import codec, proto
from .transport import UdpTransport


@dataclass
class _Set:
    used: bool = False
    block: int = 0
    bitmap: int = 0
    mask: int = 0
    flags: int = 0
    exp: int = 0
    count: int = 0
    next_nz: int = proto.NEXT_NZ_NONE
    complete: bool = False


@dataclass
class UserspaceAggregator:
    workers: int
    port: int = proto.DEFAULT_PORT
    slots: int = 1024
    elems: int = proto.DEFAULT_ELEMS
    job: int = 1
    group: str = "239.77.0.1"
    local_ip: str | None = None
    worker_ips: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {k: 0 for k in proto.STATS})

    def __post_init__(self):
        self._t = UdpTransport(self.port, None, self.local_ip)
        s = self._t.sock
        if self.local_ip:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self.local_ip))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
        self._acc = np.zeros((self.slots, 2, self.elems), dtype=np.int32)
        self._sets = [[_Set(), _Set()] for _ in range(self.slots)]
        self._mask_all = (1 << self.workers) - 1
        self._dsize = codec.datagram_size(self.elems)
        self._ips = [socket.inet_aton(ip) for ip in self.worker_ips]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hdt = codec.header_dtype()
        self._ddt = codec.datagram_dtype(self.elems)

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> "UserspaceAggregator":
        self._thread = threading.Thread(target=self.serve, name="nicoffload-userspace-agg", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Make serve() return soon (safe from a signal handler)."""
        self._stop.set()

    def close(self) -> None:
        self._t.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._t.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def serve(self, until: float | None = None) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        while not self._stop.is_set():
            if until is not None and time.monotonic() > until:
                return
            if not self._t.wait(0.1):
                continue
            while True:
                n, seg, addr = self._t.recv_into(buf)
                if not n:
                    break
                off = 0
                while off < n:
                    k = min(seg, n - off)
                    self.handle(view[off:off + k], addr)
                    off += k

    # --- the slot algorithm (mirrors xdp/aggregator.c) --------------------------------------
    def _drop(self, reason: str) -> None:
        self.stats[reason] += 1

    def handle(self, pkt: memoryview, addr) -> None:
        st = self.stats
        st["rx"] += 1
        if pkt.nbytes < proto.HDR_LEN:
            return self._drop("bad_truncated")
        h = np.frombuffer(pkt[:proto.HDR_LEN], dtype=self._hdt)[0]
        if int(h["magic"]) != proto.MAGIC:
            return self._drop("bad_magic")
        if int(h["version"]) != proto.VERSION:
            return self._drop("bad_version")
        if int(h["type"]) != proto.TYPE_CONTRIB:
            return self._drop("bad_type")
        flags = int(h["flags"])
        if flags & ~proto.FLAGS_KNOWN:
            return self._drop("bad_flags")
        if int(h["job"]) != self.job:
            return self._drop("bad_job")
        rank = int(h["rank"])
        if rank >= self.workers:
            return self._drop("bad_rank")
        slot = int(h["slot"])
        if slot >= self.slots:
            return self._drop("bad_slot")
        v = int(h["set"])
        if v > 1:
            return self._drop("bad_set")
        mask = int(h["mask"])
        bit = 1 << rank
        if mask & ~self._mask_all or not mask & bit:
            return self._drop("bad_mask")
        if self._ips and socket.inet_aton(addr[0]) != self._ips[rank]:
            return self._drop("bad_src")
        cnt = int(h["count"])
        if cnt > self.elems or not (pkt.nbytes == self._dsize or (cnt == 0 and pkt.nbytes == proto.HDR_LEN)):
            return self._drop("bad_len")
        if cnt == 0:
            st["null"] += 1
        block, exp, op = int(h["block"]), int(h["exp"]), flags & proto.FLAG_OP_MAX
        s = self._sets[slot][v]
        acc = self._acc[slot, v]
        if s.used and s.block == block and s.bitmap & bit:
            if s.complete:
                self._send(slot, v, s, addr[0], unicast=True)
                st["retx_answered"] += 1
            elif flags & proto.FLAG_RETX:
                self._send(slot, v, s, addr[0], unicast=True, status=True)
                st["status_sent"] += 1
            else:
                st["dup_dropped"] += 1
            return
        if not s.used or s.block != block:
            s.used, s.block, s.bitmap, s.mask, s.flags, s.exp = True, block, 0, mask, op, exp
            s.count, s.next_nz, s.complete = 0, proto.NEXT_NZ_NONE, False
        elif s.mask != mask or s.flags != op or s.exp != exp or (cnt and s.count and s.count != cnt):
            return self._drop("mismatch")
        first = s.bitmap == 0
        s.bitmap |= bit
        self._sets[slot][1 - v].bitmap &= ~bit
        s.count = max(s.count, cnt)
        s.next_nz = min(s.next_nz, int(h["next_nz"]))
        if cnt:
            payload = np.frombuffer(pkt[proto.HDR_LEN:], dtype="<i4")
            if first:
                acc[:] = payload
            elif op:
                np.maximum(acc, payload, out=acc)
            else:
                acc += payload  # int32 wraps modulo 2^32, like the XDP program
        elif first:
            acc[:] = np.iinfo(np.int32).min if op else 0
        st["aggregated"] += 1
        if s.bitmap == s.mask:
            s.complete = True
            st["completed"] += 1
            self._send(slot, v, s, self.group, unicast=False)
            st["result_sent"] += 1

    def _send(self, slot: int, v: int, s: _Set, dst: str, unicast: bool, status: bool = False) -> None:
        hdr = np.zeros(1, dtype=self._hdt)
        hdr["magic"], hdr["version"] = proto.MAGIC, proto.VERSION
        hdr["type"] = proto.TYPE_STATUS if status else proto.TYPE_RESULT
        hdr["flags"], hdr["set"], hdr["rank"], hdr["job"] = s.flags, v, proto.RANK_AGG, self.job
        hdr["slot"], hdr["block"], hdr["mask"], hdr["next_nz"] = slot, s.block, s.bitmap, s.next_nz
        hdr["count"], hdr["exp"] = (0 if status else s.count), s.exp
        data = hdr.tobytes() if status else hdr.tobytes() + self._acc[slot, v].astype("<i4").tobytes()
        try:
            self._t.sock.sendto(data, (dst, self.port))
        except (BlockingIOError, OSError):
            self.stats["tx_failed"] += 1
