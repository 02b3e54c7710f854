"""The user-space aggregator: the same protocol and slot algorithm as xdp/aggregator.c, in numpy.
The baseline the XDP path is measured against, and the fallback where XDP cannot be loaded.

A datagram holds one or more records (a worker's UDP_SEGMENT batch arrives whole with UDP_GRO).
Results go out once per round to the job's multicast group; retransmissions, pulls and the
epoch handshake are answered by unicast to the sender's address and port.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from nicoffload import optim
from nicoffload.datapath.transport import Transport
from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT
from nicoffload.optim import OptimizerSpec
from nicoffload.userspace.epochs import EpochState
from nicoffload.userspace.slots import SlotRules, SetState
from nicoffload.wire import codec, proto


@dataclass
class UserspaceAggregator(SlotRules, EpochState):
    workers: int
    port: int = DEFAULT.port
    slots: int = DEFAULT.slots
    elems: int = DEFAULT.elems
    job: int = DEFAULT.job
    group: str = DEFAULT.group
    local_ip: str | None = None
    worker_ips: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=lambda: {k: 0 for k in proto.STATS})
    #: an optimizer job (the CPU-offload baseline of the XDP aggregator's): the optimizer, and
    #: the initial parameters (their count fixes the share: slots = optim.share(len, elems))
    optimizer: OptimizerSpec | None = None
    params: np.ndarray | None = None
    #: how results reach the ranks: one datagram to the group, or one to each rank's address
    delivery: str = "multicast"
    #: the job's key: every record must carry it (``bad_key`` otherwise); 0: a job without one
    key: int = 0

    def __post_init__(self):
        if self.elems < 2 or self.elems % 2:
            raise InputError(f"elems must be even and at least 2 (SUM64 and OR work on pairs of int32), "
                             f"not {self.elems}")
        if not 1 <= self.workers <= proto.MAX_WORKERS:
            raise InputError(f"workers must be 1..{proto.MAX_WORKERS}, not {self.workers}")
        if self.delivery not in ("multicast", "unicast"):
            raise InputError(f"delivery must be multicast or unicast, not {self.delivery!r}")
        if self.delivery == "unicast" and len(self.worker_ips) != self.workers:
            raise InputError("unicast delivery sends each rank its copy at its address: give every rank's "
                             "address (--worker-ip)")
        self._opt = None
        if self.optimizer is not None:
            if self.params is None:
                raise InputError("an optimizer job needs its initial parameters")
            self._opt = optim.JobModel(self.optimizer, np.asarray(self.params).reshape(-1), self.workers, self.elems)
            self._meta = optim.meta_slots(self._opt.n, self.elems)
            self._hyper = self.optimizer.fixed()
            self.slots = optim.share(self._opt.n, self.elems)
        self._rsize = proto.record_size(self.elems)
        self._t = Transport(self.port, None, self.local_ip, self._rsize)
        s = self._t.sock
        if self.local_ip:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(self.local_ip))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 0)
        self._acc = np.zeros((self.slots, 2, self.elems), dtype=np.int32)
        self._sets = [[SetState(), SetState()] for _ in range(self.slots)]
        self._mask_all = (1 << self.workers) - 1
        self._ips = [socket.inet_aton(ip) for ip in self.worker_ips]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hdt = codec.header_dtype()
        self._init_epochs()

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
        buf = bytearray(1 << 17)
        view = memoryview(buf)
        while not self._stop.is_set():
            if until is not None and time.monotonic() > until:
                return
            if not self._t.wait(0.1):
                continue
            while True:
                n, _seg, addr = self._t.recv_into(buf)
                if not n:
                    break
                self.handle_datagram(view[:n], addr)

    # --- one datagram (mirrors ar_aggregate) -------------------------------------------------
    def _reject(self, reason: str) -> None:
        self.stats["records"] += 1
        self.stats[reason] += 1

    def handle_datagram(self, dgram: memoryview, addr) -> None:
        st = self.stats
        st["rx"] += 1
        n = dgram.nbytes
        if n < proto.HDR_LEN:
            return self._reject("bad_truncated")
        h = np.frombuffer(dgram[:proto.HDR_LEN], dtype=self._hdt)[0]
        if int(h["magic"]) != proto.MAGIC:
            return self._reject("bad_magic")
        if int(h["version"]) != proto.VERSION:
            return self._reject("bad_version")
        if int(h["job"]) != self.job:
            return self._reject("bad_job")
        if int(h["key"]) != self.key:  # before anything else of it: a JOIN, an ACK, a record
            return self._reject("bad_key")
        rank = int(h["rank"])
        if rank >= self.workers:
            return self._reject("bad_rank")
        if self._ips and socket.inet_aton(addr[0]) != self._ips[rank]:
            return self._reject("bad_src")
        flags = int(h["flags"])
        if flags & ~proto.FLAGS_KNOWN:
            return self._reject("bad_flags")
        t = int(h["type"])
        if t == proto.TYPE_JOIN:
            if n != proto.HDR_LEN + proto.JOIN_PAYLOAD:
                return self._reject("bad_len")
            st["records"] += 1
            return self._join(bytearray(dgram), h, rank, addr)
        if t == proto.TYPE_ACK:
            if n != proto.HDR_LEN:
                return self._reject("bad_len")
            if not self.live or int(h["epoch"]) != self.live:
                return self._reject("stale_epoch")
            st["records"] += 1
            st["ack"] += 1
            self._ack(rank, int(h["ack"]))
            if int(h["flags"]) & proto.FLAG_RETX:  # asks for the gate
                out = bytearray(dgram)
                r = np.frombuffer(out, dtype=self._hdt, count=1)[0]
                r["rank"], r["flags"], r["ack"] = proto.RANK_AGG, 0, self._job_gate()
                self._send(out, addr[0], addr[1])
            return
        if t != proto.TYPE_CONTRIB:
            return self._reject("bad_type")
        if n == proto.HDR_LEN:  # a PROBE: what its round lacks, in a header-only STATUS
            out = bytearray(dgram)
            if self._probe(np.frombuffer(out, dtype=self._hdt, count=1)[0], rank):
                self._send(out, addr[0], addr[1])
            return
        if n % self._rsize or n // self._rsize > proto.max_records(self.elems):
            return self._reject("bad_len")
        if self.live and int(h["epoch"]) == self.live:
            self._ack(rank, int(h["ack"]))
        out = bytearray(dgram)
        recs = np.frombuffer(out, dtype=codec.datagram_dtype(self.elems))
        mcast = answer = False
        self._gate = self._job_gate()
        for i in range(len(recs)):
            o = self._record(recs[i], recs, i, rank, flags_first=flags)
            mcast |= o == "mcast"
            answer |= o == "answer"
        if not (mcast or answer):
            return
        # as the XDP program: the answers move to the front and the datagram ends after them
        kept = recs[recs["type"] != proto.TYPE_NOP].tobytes()
        if mcast:
            st["result_sent"] += 1
            self._to_ranks(kept, addr[1])
        else:
            self._send(kept, addr[0], addr[1])

    @property
    def master_weights(self) -> np.ndarray:
        """The optimizer job's parameters (float64)."""
        return optim.from_fixed(self._opt.w)

    def _to_ranks(self, data: bytes | bytearray, port: int) -> None:
        """A frame for every rank: to the group, or (unicast delivery) a copy to each address."""
        if self.delivery == "unicast":
            for ip in self.worker_ips:
                self._send(data, ip, port)
                self.stats["copies"] += 1
        else:
            self._send(data, self.group, port)

    def _send(self, data: bytes | bytearray, dst: str, port: int) -> None:
        try:
            if len(data) > self._rsize and len(data) % self._rsize == 0:
                self._t.send_records(np.frombuffer(data, np.uint8), 0, len(data) // self._rsize, (dst, port))
            else:
                self._t.send_one(data, (dst, port))
        except OSError:
            self.stats["tx_failed"] += 1
