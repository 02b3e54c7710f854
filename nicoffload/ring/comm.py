"""The worker side of the ring AllReduce: :class:`RingCommunicator`, the same API as
:class:`nicoffload.worker.Communicator` (``allreduce(array, out=None)``, ``barrier``, ``close``,
context manager), for a ring of ranks instead of an aggregator.

``offload=True`` (the ring offload, DirectReduce): every rank's interface runs xdp/ring.c. The
host stages its tensor in the program's mmap-ed map ``ring_local`` (records with a tag each),
sends its own chunk, and waits for the program's wake-up; the adds, the forwarding and the
stores of every ring step happen in XDP. The host takes over only what its program could not
do without it (docs/ring.md): records that arrive before the host has staged its own part (the
program parks them in the host's socket) and records lost on the way (after a timeout it asks
for them again; answering is the programs' job).

``offload=False``: the same protocol with every hop in user space (the user-space UDP ring
baseline, :mod:`nicoffload.lab.bench.udpring`): the host receives each record, adds, stores and sends
it on with the very kernels (:mod:`nicoffload.ring.kernels`) that take over parked records.

The pass loop and the host's share of the records are :mod:`nicoffload.ring.passes`, the PING
diagnosis of a stalled ring :mod:`nicoffload.ring.diag`, the maps :mod:`nicoffload.ring.setup`.

One call: floats first agree on each block's exponent (a ring pass of op MAX over one int32 per
block), then the data pass sums the fixed point of :mod:`nicoffload.wire.quant` (op SUM64); int32 is
one pass of op SUM. A tensor larger than the maps' ``capacity`` goes in several passes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from nicoffload import collective
from nicoffload.datapath import encode as enc
from nicoffload.datapath.pump import KIND_FLOAT32, KIND_FLOAT64, KIND_INT32
from nicoffload.datapath.tensors import KIND, block_exponents, call_arrays, refuse_together
from nicoffload.datapath.transport import MAX_GSO_SEGS, MAX_MSGS, Transport
from nicoffload.errors import InputError, NicoffloadError
from nicoffload.jobspec import DEFAULT
from nicoffload.ring import kernels as rk
from nicoffload.ring.diag import RingDiagnosis
from nicoffload.ring.layout import DEFAULT_CAPACITY, STATS, TYPE_REDUCE, segments
from nicoffload.ring.passes import WINDOW, CallLayout, RingPasses
from nicoffload.ring.setup import open_maps
from nicoffload.wire import codec, proto, quant
from nicoffload.wire.addr import ip_net, require_ipv4s

__all__ = ["RingCommunicator", "RingStats", "WINDOW"]


@dataclass
class RingStats:
    """What one rank's calls did (``last``: the last call; ``stats``: every call so far)."""

    seconds: float = 0.0
    passes: int = 0             # ring passes (a float call: the exponents' pass and the data)
    records: int = 0            # records per pass, summed
    packets_sent: int = 0       # records this host sent itself (its own chunk, taken-over records, NACKs)
    taken_over: int = 0         # records the host processed itself (offload: parked by its program)
    retransmissions: int = 0    # records asked for again (NACKs)
    blocks_skipped: int = 0     # always 0: the ring sums every block (the aggregator's API has it)
    timeouts: int = 0           # waits that ended in a request for missing records
    wakeups: int = 0            # events from the program
    syscalls: int = 0
    stage_s: float = 0.0        # staging this rank's records (quantizing into the map)
    wait_s: float = 0.0         # from the first send of its own chunk until every final is stored
    decode_s: float = 0.0       # finals into the output

    def add(self, other: "RingStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


def _template(rank: int, job: int, type_: int = TYPE_REDUCE) -> np.ndarray:
    """A header with this rank's constant fields and tag 0."""
    return np.frombuffer(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=rank, job=job, epoch=0, slot=0, set=0,
                                             round=0, mask=0, count=0, type=type_), dtype=np.uint8).copy()


@dataclass
class RingCommunicator(RingPasses, RingDiagnosis):
    """One rank of a ring: ``peers[r]`` is rank r's IPv4 address (this rank's is ``peers[rank]``,
    on ``iface``). With ``offload`` the ring program on ``iface`` does every step (one that
    another process loaded, e.g. ``nicoffload ring load``; else the communicator loads its own and
    unloads it on close); without, the host does (the user-space UDP ring)."""

    rank: int
    world: int
    peers: list[str]
    job: int = DEFAULT.job
    port: int = DEFAULT.port
    elems: int = DEFAULT.elems
    timeout: float = DEFAULT.timeout
    offload: bool = True
    iface: str | None = None
    capacity: int = DEFAULT_CAPACITY   # records per pass (the maps' size, when this communicator loads them)
    window: int = WINDOW
    rto: float = 0.02
    max_rto: float = 0.5
    xdp_mode: str = "auto"
    capabilities: ClassVar[collective.Capabilities] = collective.RING
    stats: RingStats = field(default_factory=RingStats)
    last: RingStats = field(default_factory=RingStats)

    @classmethod
    def from_spec(cls, rank: int, world: int, peers: list[str], spec, **kw) -> "RingCommunicator":
        """A rank of the job ``spec`` describes (its job id, port, record size and timeout)."""
        if spec.lanes != 32:
            raise InputError("the ring sums in 32-bit lanes only: --lanes 16 is for the aggregator mode")
        return cls(rank, world, list(peers), job=spec.job, port=spec.port, elems=spec.elems, timeout=spec.timeout,
                   **kw)

    def __post_init__(self):
        self.peers = list(self.peers)
        if not 0 <= self.rank < self.world <= proto.MAX_WORKERS:
            raise InputError(f"rank {self.rank} / world {self.world}: need 0 <= rank < world <= {proto.MAX_WORKERS}")
        if len(self.peers) != self.world:
            raise InputError(f"a ring of {self.world} ranks needs {self.world} peer addresses, not {len(self.peers)}")
        require_ipv4s(self.peers, "peer address", "two ranks of the ring have the same peer address")
        if self.elems < 2 or self.elems % 2 or proto.record_size(self.elems) * MAX_GSO_SEGS > 1 << 16 \
                and proto.max_records(self.elems) < 1:
            raise InputError(f"elems must be even and fit a datagram, not {self.elems}")
        self.window = max(1, self.window)
        self._rec = proto.record_size(self.elems)
        self._node = None
        self._lock = None
        self._t = None
        self._closed = False
        self._aborted: BaseException | None = None
        # abort() writes a byte here: the pass's select wakes at once (ring.passes)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._call = 0
        self._my_ip = self.peers[self.rank]
        try:
            m = open_maps(self)
            self._local, self._result, self._state, self._events = m.local, m.result, m.state, m.events
            self._node, self.iface, self.capacity, self._lock = m.node, m.iface, m.capacity, m.lock
            self._t = Transport(self.port, None, self._my_ip, self._rec)
        except BaseException:
            self.close()
            raise
        cap = self.capacity
        self._peer_addrs = np.array([ip_net(ip) for ip in self.peers], np.int64)
        self._out = np.zeros(MAX_MSGS * self._t.per_datagram * self._rec, np.uint8)
        self._late = np.zeros_like(self._out)
        self._stash = np.zeros(cap * self._rec, np.uint8)
        self._stash_src = np.zeros(cap, np.int64)
        self._cnt = np.zeros(len(STATS), np.int64)
        self._pongs = np.zeros((self.world, 4), np.int64)
        self._pings = np.zeros(64, np.int64)
        self._io = np.zeros(rk.IO_WORDS, np.int64)
        self._seen: dict[int, tuple[int, int]] = {}  # rank -> (call, stored) it answered last
        self._layouts: dict[int, CallLayout] = {}
        self._missing = np.zeros(cap, np.int64)
        self._tmpl = _template(self.rank, self.job)
        self._nacks = np.zeros(MAX_MSGS * self._t.per_datagram * self._rec, np.uint8)
        enc.warm_up(self.elems)
        self._warm_up()
        self._mismatch_seen = int(self.counters().get("mismatch", 0))

    def _warm_up(self) -> None:
        """Compile (or load from the on-disk cache) the ring kernels before the first call."""
        io = np.zeros(rk.IO_WORDS, np.int64)
        rk.process_datagram(self._out, 0, 0, 0, self._peer_addrs, self._rec, self.elems, self.rank, self.world,
                            self.job, 0, 0, self._local, self._result, self._out, self._late, self._state, self._cnt,
                            self._stash, self._stash_src, self._pongs, self._pings, io)
        rk.replay(self._stash, self._stash_src, 0, self._peer_addrs, self._rec, self.elems, self.rank, self.world,
                  self.job, 0, 0, self._local, self._result, self._out, self._late, self._state, self._cnt,
                  self._pongs, self._pings, io)
        self._cnt[:] = 0
        rk.set_tags(self._out, self._rec, 0, 0, 0)
        rk.untagged(self._out, self._rec, 0, 0, 0, self._missing)
        rk.count_tagged(self._out, self._rec, 0, 0)
        rk.build_nacks(self._local, self._rec, self._missing[:0], False, self.rank, self._nacks)
        one = np.zeros(1, np.int64)
        for kind, arr in ((KIND_INT32, np.zeros(1, np.int32)), (KIND_FLOAT32, np.zeros(1, np.float32)),
                          (KIND_FLOAT64, np.zeros(1, np.float64))):
            rk.decode(self._result, self._rec, self.elems, 0, kind, np.zeros(1, np.int32), 0, np.zeros(1, np.int32),
                      np.zeros(1, np.float32), np.zeros(1, np.float64), 0)
            del arr
        rk.copy_values(self._result, self._rec, self.elems, 0, np.zeros(1, np.int32))
        del one

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._t is not None:
            self._t.close()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            os.close(fd)
        self._local = self._result = self._state = self._events = None
        if self._node is not None:
            self._node.close()
            self._node = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "RingCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def mode(self) -> str:
        return "xdp" if self.offload else "user"

    def counters(self) -> dict[str, int]:
        """Record counters: the program's (offload) plus this host's own processing."""
        host = {name: int(v) for name, v in zip(STATS, self._cnt)}
        if self._node is None:
            return host
        prog = self._node.stats()
        return {k: prog[k] + host[k] for k in STATS}

    # --- public -----------------------------------------------------------------------------
    def abort(self, error: BaseException) -> None:
        """Make the call in flight (from any thread) and every later one raise ``error``: the
        pass's wait wakes at once (a byte on the wake-up pipe)."""
        self._aborted = error
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass  # closed meanwhile, or already full: the pass wakes anyway

    def _check_abort(self) -> None:
        if self._aborted is not None:
            raise self._aborted

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        """Elementwise sum over all ranks. int32: exact, wrapping modulo 2^32 on overflow.
        float32/float64: through the fixed point of nicoffload.wire.quant (the aggregator's, bit for
        bit: integer sums do not depend on their order). Sums only, in 32-bit lanes."""
        dtype = getattr(array, "dtype", np.dtype(np.float32))
        if not self.capabilities.supports(op, dtype, lanes if lanes != 32 else None):
            raise collective.unsupported("the ring", self.capabilities, op, dtype, lanes)
        self._check_abort()
        if self._closed:
            raise NicoffloadError(f"rank {self.rank}: allreduce on a closed ring communicator")
        if op == "max":  # int32: one pass of op MAX (the exponents' pass)
            x, out = call_arrays(array, out, (np.dtype(np.int32),))
            t0 = time.perf_counter()
            self.last = RingStats()
            if x.size:
                out.reshape(-1)[:] = self._values(x.reshape(-1), proto.OP_MAX) if self.world > 1 else x.reshape(-1)
            self.last.seconds = time.perf_counter() - t0
            self.stats.add(self.last)
            return out
        x, out = call_arrays(array, out)
        t0 = time.perf_counter()
        self.last = RingStats()
        sys0 = self._t.syscalls
        flat, res = x.reshape(-1), out.reshape(-1)
        n, E, W = flat.size, self.elems, self.world
        if n == 0:
            return out
        if W == 1:
            res[:] = flat
            return out
        nb = -(-n // E)
        kind = KIND[x.dtype]
        if kind == KIND_INT32:
            shifts = np.zeros(nb, np.int32)
        else:
            exps = np.empty(nb, np.int32)
            bad = block_exponents(flat, E, exps, self.rank)
            gexp = self._values(exps, proto.OP_MAX)
            refuse_together(gexp, self.rank, flat, bad, E)  # a NaN or an Inf: every rank refuses
            zero = gexp == quant.ZERO_EXP
            shifts = np.where(zero, 0, 30 - quant.headroom_bits(W) - gexp.astype(np.int64)).astype(np.int32)
        bias = 1 << (30 - quant.headroom_bits(W))
        single = x.dtype == np.float32
        for s0, s1 in segments(nb, self.capacity):
            K = s1 - s0
            lay = self._layout(K)
            blocks, masks = lay.idx[:K] + s0, lay.masks
            sh = shifts[s0:s1]
            if kind == KIND_INT32:
                def stage(lo, hi, tmpl):
                    enc.encode_int(self._local, self._rec, E, tmpl, flat, lay.idx[lo:hi], 0, 1 << 40, blocks,
                                       masks, proto.OP_SUM, lo)
            else:
                def stage(lo, hi, tmpl):
                    enc.encode_float(self._local, self._rec, E, tmpl, flat, lay.idx[lo:hi], 0, 1 << 40,
                                         blocks, masks, sh, bias, single, lo, proto.OP_SUM64)
            self._pass(K, stage)
            t2 = time.perf_counter()
            rk.decode(self._result, self._rec, E, K, kind, sh, W * bias, res.view(np.int32) if kind == KIND_INT32
                      else np.empty(0, np.int32), res if kind == KIND_FLOAT32 else np.empty(0, np.float32),
                      res if kind == KIND_FLOAT64 else np.empty(0, np.float64), s0 * E)
            self.last.decode_s += time.perf_counter() - t2
        st = self.last
        st.seconds = time.perf_counter() - t0
        st.syscalls = self._t.syscalls - sys0
        self.stats.add(st)
        return out

    def barrier(self) -> None:
        """Returns once every rank has called it (a one-record pass)."""
        self.allreduce(np.zeros(1, dtype=np.int32))

    # --- passes -----------------------------------------------------------------------------
    def _values(self, v: np.ndarray, op: int) -> np.ndarray:
        """Combine one int32 per block over every rank with ``op`` (MAX of the exponents)."""
        E = self.elems
        out = np.empty(v.size, np.int32)
        per = -(-v.size // E)
        for s0, s1 in segments(per, self.capacity):
            K = s1 - s0
            vals = np.full(K * E, quant.ZERO_EXP if op == proto.OP_MAX else 0, np.int32)
            lo_v = s0 * E
            hi_v = min(v.size, s1 * E)
            vals[:hi_v - lo_v] = v[lo_v:hi_v]
            lay = self._layout(K)

            def stage(lo, hi, tmpl, vals=vals, lay=lay):
                enc.encode_int(self._local, self._rec, E, tmpl, vals, lay.idx[lo:hi], 0, 1 << 40, lay.idx,
                                   lay.masks, op, lo)
            self._pass(K, stage)
            got = np.empty(K * E, np.int32)
            rk.copy_values(self._result, self._rec, E, K, got)
            out[lo_v:hi_v] = got[:hi_v - lo_v]
        return out
