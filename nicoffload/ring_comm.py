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
baseline, :mod:`nicoffload.lab.udpring`): the host receives each record, adds, stores and sends
it on with the very kernels (:mod:`nicoffload.ring_kernels`) that take over parked records.

One call: floats first agree on each block's exponent (a ring pass of op MAX over one int32 per
block), then the data pass sums the fixed point of :mod:`nicoffload.quant` (op SUM64); int32 is
one pass of op SUM. A tensor larger than the maps' ``capacity`` goes in several passes.
"""
from __future__ import annotations

import os
import select
import socket
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import codec, kernels, proto, quant
from . import ring_kernels as rk
from .errors import InputError, TimeoutError_
from .jobspec import DEFAULT
from .pump import KIND_FLOAT32, KIND_FLOAT64, KIND_INT32
from .ring_layout import (DEFAULT_CAPACITY, ST_CALL, ST_EXPECTED, ST_HOST_OWN, ST_HOST_STORED,
                          ST_OWN_STORED, ST_OWN_WAKE, ST_STORED, ST_WORDS, STATS, TYPE_PING, TYPE_PONG, TYPE_REDUCE,
                          chunk_bounds, nack_target, origin_masks, origins, segments, staging_order)
from .transport import MAX_GSO_SEGS, MAX_MSGS, Transport

__all__ = ["RingCommunicator", "RingStats", "WINDOW"]

DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))
_KIND = {np.dtype(np.int32): KIND_INT32, np.dtype(np.float32): KIND_FLOAT32, np.dtype(np.float64): KIND_FLOAT64}
#: records of its own chunk a rank has on the way at most (its send window)
WINDOW = 256
#: a rank stages its records in this many rounds (a slice of every chunk each, at least SLICE
#: records of each) and sends its own slice after each round: a quarter of the staging goes
#: before the first send, and the successor has a quarter's lead to stage what arrives
ROUNDS = 4
SLICE = 64
_NO_WAKE = 0xFFFFFFFF
#: seconds a diagnosis waits for the nodes' PONGs
PING_WAIT = 0.3
_TRACE = bool(os.environ.get("NICOFFLOAD_RING_TRACE"))


def _trace(rank: int, msg: str) -> None:
    print(f"{time.monotonic():.6f} ring rank {rank}: {msg}", file=sys.stderr, flush=True)


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


def iface_of(ip: str) -> str:
    """The interface of this network namespace that holds ``ip``."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            if a.get_attr("IFA_ADDRESS") == ip:
                return ipr.get_links(a["index"])[0].get_attr("IFLA_IFNAME")
    raise InputError(f"no interface of this network namespace has the address {ip}")


class _Layout:
    """The chunks of a call of K records: record indices, origins and their masks, this rank's
    own chunk, and the slices it stages them in: slice j of every chunk (in the order their
    reduces reach the rank, its own last) before slice j + 1 of any."""

    def __init__(self, K: int, world: int, rank: int):
        b = chunk_bounds(K, world)
        self.idx = np.arange(K, dtype=np.int64)
        self.origins = origins(K, world)
        self.masks = origin_masks(K, world)
        self.own = (int(b[rank]), int(b[rank + 1]))
        order = staging_order(K, world, rank)
        longest = max((hi - lo for lo, hi in order), default=0)
        step = max(SLICE, -(-longest // ROUNDS))
        self.slices = [(lo + j, min(hi, lo + j + step)) for j in range(0, longest, step)
                       for lo, hi in order if lo + j < hi]


@dataclass
class RingCommunicator:
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
    stats: RingStats = field(default_factory=RingStats)
    last: RingStats = field(default_factory=RingStats)

    @classmethod
    def from_spec(cls, rank: int, world: int, peers: list[str], spec, **kw) -> "RingCommunicator":
        """A rank of the job ``spec`` describes (its job id, port, record size and timeout)."""
        return cls(rank, world, list(peers), job=spec.job, port=spec.port, elems=spec.elems, timeout=spec.timeout,
                   **kw)

    def __post_init__(self):
        self.peers = list(self.peers)
        if not 0 <= self.rank < self.world <= proto.MAX_WORKERS:
            raise InputError(f"rank {self.rank} / world {self.world}: need 0 <= rank < world <= {proto.MAX_WORKERS}")
        if len(self.peers) != self.world:
            raise InputError(f"a ring of {self.world} ranks needs {self.world} peer addresses, not {len(self.peers)}")
        if self.elems < 2 or self.elems % 2 or proto.record_size(self.elems) * MAX_GSO_SEGS > 1 << 16 \
                and proto.max_records(self.elems) < 1:
            raise InputError(f"elems must be even and fit a datagram, not {self.elems}")
        self.window = max(1, self.window)
        self._rec = proto.record_size(self.elems)
        self._node = None
        self._t = None
        self._closed = False
        self._call = 0
        self._my_ip = self.peers[self.rank]
        try:
            self._open_maps()
            self._t = Transport(self.port, None, self._my_ip, self._rec)
        except BaseException:
            self.close()
            raise
        cap = self.capacity
        self._peer_addrs = np.array([int.from_bytes(socket.inet_aton(ip), "little") for ip in self.peers], np.int64)
        self._out = np.zeros(MAX_MSGS * self._t.per_datagram * self._rec, np.uint8)
        self._late = np.zeros_like(self._out)
        self._stash = np.zeros(cap * self._rec, np.uint8)
        self._stash_src = np.zeros(cap, np.int64)
        self._cnt = np.zeros(len(STATS), np.int64)
        self._pongs = np.zeros((self.world, 4), np.int64)
        self._pings = np.zeros(64, np.int64)
        self._io = np.zeros(rk.IO_WORDS, np.int64)
        self._seen: dict[int, tuple[int, int]] = {}  # rank -> (call, stored) it answered last
        self._layouts: dict[int, _Layout] = {}
        self._missing = np.zeros(cap, np.int64)
        self._tmpl = _template(self.rank, self.job)
        self._nacks = np.zeros(MAX_MSGS * self._t.per_datagram * self._rec, np.uint8)
        kernels.warm_up(self.elems)
        self._warm_up()

    # --- set-up -----------------------------------------------------------------------------
    def _open_maps(self) -> None:
        if not self.offload:
            self._local = np.zeros(self.capacity * self._rec, np.uint8)
            self._result = np.zeros(self.capacity * self._rec, np.uint8)
            self._state = np.zeros(ST_WORDS, np.uint32)
            self._events = None
            return
        from . import ring
        from .errors import NotFoundError

        netns = ring.current_netns()
        self.iface = self.iface or iface_of(self._my_ip)
        try:
            node = ring.RingNode.open(netns, self.iface)
        except NotFoundError:
            spec = ring.RingSpec(netns, self.iface, self.rank, self.world, self.peers, self.job, self.port, self.elems,
                                 self.capacity, self.xdp_mode)
            node = ring.RingNode.load(spec, pin=False, owner=__import__("os").getpid())
        self._node = node
        s = node.spec
        want = dict(rank=self.rank, world=self.world, peers=self.peers, job=self.job, port=self.port, elems=self.elems)
        got = dict(rank=s.rank, world=s.world, peers=s.peers, job=s.job, port=s.port, elems=s.elems)
        if want != got:
            bad = ", ".join(f"{k} {got[k]} (not {want[k]})" for k in want if want[k] != got[k])
            raise InputError(f"the ring program on {self.iface} was loaded for another ring: {bad}; reload it "
                             f"(nicoffload ring unload / load)")
        self.capacity = s.capacity
        m = node.maps
        m.reset()
        self._local, self._result, self._state, self._events = m.local, m.result, m.state, m.events

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
        self._local = self._result = self._state = self._events = None
        if self._node is not None:
            self._node.close()
            self._node = None

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
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Elementwise sum over all ranks. int32: exact, wrapping modulo 2^32 on overflow.
        float32/float64: through the fixed point of nicoffload.quant (the aggregator's, bit for
        bit: integer sums do not depend on their order)."""
        x = np.ascontiguousarray(array)
        if x.dtype not in DTYPES:
            raise InputError(f"allreduce supports int32, float32 and float64, not {x.dtype}")
        if out is None:
            out = np.empty_like(x)
        elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise InputError("out must be a C-contiguous array with the input's shape and dtype")
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
        kind = _KIND[x.dtype]
        if kind == KIND_INT32:
            shifts = np.zeros(nb, np.int32)
        else:
            exps = np.empty(nb, np.int32)
            bad = (kernels.block_meta_f32 if x.dtype == np.float32 else kernels.block_meta_f64)(flat, E, exps)
            if bad >= 0:
                what = "NaN" if np.isnan(flat[bad]) else "Inf"
                raise InputError(f"rank {self.rank}'s input holds a non-finite value ({what} at flat index {bad}); "
                                 f"refusing to sum it")
            gexp = self._values(exps, proto.OP_MAX)
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
                    kernels.encode_int(self._local, self._rec, E, tmpl, flat, lay.idx[lo:hi], 0, 1 << 40, blocks,
                                       masks, proto.OP_SUM, lo)
            else:
                def stage(lo, hi, tmpl):
                    kernels.encode_float(self._local, self._rec, E, tmpl, flat, lay.idx[lo:hi], 0, 1 << 40,
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
                kernels.encode_int(self._local, self._rec, E, tmpl, vals, lay.idx[lo:hi], 0, 1 << 40, lay.idx,
                                   lay.masks, op, lo)
            self._pass(K, stage)
            got = np.empty(K * E, np.int32)
            rk.copy_values(self._result, self._rec, E, K, got)
            out[lo_v:hi_v] = got[:hi_v - lo_v]
        return out

    def _layout(self, K: int) -> "_Layout":
        """A call of K records as this rank sees it (cached: calls repeat their sizes)."""
        lay = self._layouts.get(K)
        if lay is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            lay = self._layouts[K] = _Layout(K, self.world, self.rank)
        return lay

    def _next_call(self) -> int:
        self._call = (self._call + 1) & 0xFFFFFFFF or 1
        return self._call

    def _pass(self, K: int, stage) -> None:
        """One ring pass of K records: stage this rank's records (``stage(lo, hi, template)``),
        send its own chunk within the window, wait until every record's final is stored here,
        taking over what the program parks and asking again for what got lost."""
        st, rec, W, r = self._state, self._rec, self.world, self.rank
        c = self._next_call()
        self.last.passes += 1
        self.last.records += K
        # enter the call: the program stores this call's finals from now on, and adds into a
        # record once its tag says it is staged
        st[ST_EXPECTED] = K
        st[ST_STORED] = st[ST_HOST_STORED] = st[ST_OWN_STORED] = st[ST_HOST_OWN] = 0
        st[ST_OWN_WAKE] = _NO_WAKE
        st[ST_CALL] = c
        if _TRACE:
            _trace(r, f"enter call {c}, {K} records, stash {self._stash_n}")
        tmpl = self._tmpl
        lay = self._layout(K)
        own_lo, own_hi = lay.own
        self._origin = lay.origins
        self._io[:] = 0
        nxt = (self.peers[(r + 1) % W], self.port)
        slices, si, staged = lay.slices, 0, own_lo  # own records staged: [own_lo, staged)
        sent = own_lo
        deadline_idle = time.monotonic() + self.timeout
        rto = self.rto
        last_progress = self._stored()
        retry_at = time.monotonic() + rto
        poll = [self._t.sock] + ([self._events] if self._events is not None else [])
        t1 = time.perf_counter()
        while True:
            # Stage one slice of every chunk (in the order their reduces arrive, this rank's own
            # last) at a time, and send the own part as soon as it is staged: the first records
            # go out long before the whole tensor is staged.
            staging = si < len(slices)
            if staging:
                t0 = time.perf_counter()
                lo, hi = slices[si]
                si += 1
                rk.set_tags(self._local, rec, lo, hi, 0)
                stage(lo, hi, tmpl)
                rk.set_tags(self._local, rec, lo, hi, c)
                if own_lo <= lo < own_hi:
                    staged = hi
                t1 = time.perf_counter()
                self.last.stage_s += t1 - t0
                if si == len(slices) and self._stash_n:
                    # records of this call that arrived before it (kept by the previous call)
                    nst, self._stash_n = self._stash_n, 0
                    self._run_replay(nst, c, K)
            # the send window of this rank's own chunk: at most `window` records without their final back
            if sent < staged:
                acked = int(st[ST_OWN_STORED]) + int(st[ST_HOST_OWN])
                upto = min(staged, own_lo + acked + self.window)
                if upto > sent:
                    self._t.send_records(self._local, sent, upto - sent, nxt)
                    self.last.packets_sent += upto - sent
                    sent = upto
                    if sent < own_hi:
                        st[ST_OWN_WAKE] = max(acked + 1, sent - own_lo - self.window // 2)
                        continue  # the wake-up may have been crossed meanwhile: look again
                    st[ST_OWN_WAKE] = _NO_WAKE
            if staging:
                continue  # the host takes over parked records only once its own are all staged
            done = self._stored()
            if done >= K and rk.count_tagged(self._result, rec, K, c) == K:
                if _TRACE:
                    _trace(r, f"done call {c}: stored {st[ST_STORED]} + host {st[ST_HOST_STORED]}")
                break
            now = time.monotonic()
            if done != last_progress:
                last_progress = done
                deadline_idle = now + self.timeout
                rto = self.rto
                retry_at = now + rto
            elif now >= retry_at:
                if now >= deadline_idle:
                    self._fail(c, K)
                # Ask for missing records again only when the whole ring stands still: a node
                # that has not entered the call yet stalls it (asking would only add traffic), and
                # while other nodes still store finals the records are on their way (a slow
                # ring, e.g. queues of shaped links, is not a lossy one).
                behind, moving = self._ring_state(c, K)
                if not behind and not moving:
                    self._nack_missing(c, K, self.window)
                if _TRACE:
                    _trace(r, f"timeout in call {c}: stored {st[ST_STORED]} + host {st[ST_HOST_STORED]} "
                              f"of {K}, missing {rk.untagged(self._result, rec, 0, K, c, self._missing)}: "
                              f"{self._missing[:8]}, " + (f"behind: {behind}" if behind else
                                                           "moving" if moving else "nacked"))
                self.last.timeouts += 1
                rto = min(rto * 2, self.max_rto)
                retry_at = now + rto
            wait = max(0.0, min(retry_at, deadline_idle) - time.monotonic())
            ready, _, _ = select.select(poll, [], [], wait)
            if self._events is not None and self._events in ready:
                self.last.wakeups += len(self._events.drain())
            if self._t.sock in ready:
                self._take_over(c, K)
        self.last.wait_s += time.perf_counter() - t1

    def _stored(self) -> int:
        st = self._state
        return int(st[ST_STORED]) + int(st[ST_HOST_STORED])

    # --- the host's share -------------------------------------------------------------------
    _stash_n = 0

    def _take_over(self, c: int, K: int) -> None:
        """Process what the socket holds (offload: records the program parked; user space:
        everything) and send what goes on to the next node."""
        t, io = self._t, self._io
        args = t.recv_args()
        while True:
            io[:] = 0
            io[rk.IO_STASH] = self._stash_n
            got = rk.recv_process(*args[:12], args[15], args[16], self._peer_addrs, self._rec, self.elems, self.rank,
                                  self.world, self.job, c, self.capacity, self._local, self._result, self._out,
                                  self._late, self._state, self._cnt, self._stash, self._stash_src, self._pongs,
                                  self._pings, io, MAX_MSGS * t.per_datagram)
            t.syscalls += 1
            self._stash_n = int(io[rk.IO_STASH])
            n = self._send_taken()
            if _TRACE:
                _trace(self.rank, f"took over: {got} datagrams, sent {n}, stash {self._stash_n}, counters "
                                  f"{ {k: int(v) for k, v in zip(STATS, self._cnt) if v} }")
            if io[rk.IO_PINGS]:
                self._answer_pings(c, K)
            if not got or got < MAX_MSGS and not n:
                return

    def _send_taken(self) -> int:
        """Send the records the host processed (io[IO_OUT] in ``out``, io[IO_LATE] in ``late``)."""
        nxt = (self.peers[(self.rank + 1) % self.world], self.port)
        total = 0
        for buf, i in ((self._out, rk.IO_OUT), (self._late, rk.IO_LATE)):
            n = int(self._io[i])
            if n:
                self._t.send_records(buf, 0, n, nxt)
                total += n
        self.last.packets_sent += total
        self.last.taken_over += total
        return total

    def _run_replay(self, nst: int, c: int, K: int) -> None:
        """Process the records the previous call kept for this one, as many at a time as ``out``
        holds, sending what goes on."""
        rec, io = self._rec, self._io
        stash = self._stash[:nst * rec].copy()
        src = self._stash_src[:nst].copy()
        step = len(self._out) // rec
        for j in range(0, nst, step):
            m = min(step, nst - j)
            io[:] = 0
            rk.replay(stash[j * rec:(j + m) * rec], src[j:j + m], m, self._peer_addrs, rec, self.elems, self.rank,
                      self.world, self.job, c, self.capacity, self._local, self._result, self._out, self._late,
                      self._state, self._cnt, self._pongs, self._pings, io)
            self._send_taken()

    def _answer_pings(self, c: int, K: int) -> None:
        for sender in self._pings[:int(self._io[rk.IO_PINGS])]:
            self._t.send_one(self._pong(c, K), (self.peers[int(sender)], self.port))

    def _pong(self, c: int, K: int) -> bytes:
        return bytes(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job, epoch=c,
                                         slot=self._stored(), set=0, round=K, mask=0, count=0, type=TYPE_PONG))

    def _ring_state(self, c: int, K: int) -> tuple[dict[int, int], bool]:
        """Ask every node (PING): ({rank: its call} of the nodes that say they have not entered
        call ``c`` yet, whether any node stored records since the last time it was asked). A node
        that does not answer in time is neither (asking it again costs little; if it is gone, the
        timeout names it)."""
        pongs = self.ping(c, K, wait=min(PING_WAIT, max(4 * self.rto, 0.01)))
        behind = {r: p["call"] for r, p in pongs.items() if (p["call"] - c) & 0x80000000}
        seen = {r: (p["call"], p["stored"]) for r, p in pongs.items()}
        moving = any(self._seen.get(r) not in (None, v) for r, v in seen.items() if v[0] == c)
        self._seen.update(seen)
        return behind, moving

    def _nack_missing(self, c: int, K: int, limit: int) -> None:
        """Ask again for the first ``limit`` records whose final this node has not stored: its
        predecessor sends its stored final again, or (for the records this node adds last) the
        origin restarts the reduce."""
        m = rk.untagged(self._result, self._rec, 0, K, c, self._missing)
        if not m:
            return
        miss = self._missing[:min(m, limit)]
        org = self._origin[miss]
        cap = len(self._nacks) // self._rec
        for o in np.unique(org):
            peer, restart = nack_target(int(o), self.rank, self.world)
            which = miss[org == o]
            for j0 in range(0, len(which), cap):
                part = which[j0:j0 + cap]
                rk.build_nacks(self._local, self._rec, part, restart, self.rank, self._nacks)
                self._t.send_records(self._nacks, 0, len(part), (self.peers[peer], self.port))
                self.last.retransmissions += len(part)
                self.last.packets_sent += len(part)

    # --- when the ring stalls ---------------------------------------------------------------
    def ping(self, c: int = 0, K: int = 0, wait: float = PING_WAIT) -> dict[int, dict]:
        """Every other node's answer to a PING: {rank: {"call", "stored", "expected"}} (ranks that
        do not answer within ``wait`` seconds are missing). The host keeps taking over what its
        socket holds meanwhile."""
        before = self._pongs[:, 0].copy()
        ping = bytes(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=self.rank, job=self.job, epoch=c, slot=0,
                                         set=0, round=0, mask=0, count=0, type=TYPE_PING))
        others = [r for r in range(self.world) if r != self.rank]
        for r in others:
            self._t.send_one(ping, (self.peers[r], self.port))
        until = time.monotonic() + wait
        while not all(self._pongs[r, 0] > before[r] for r in others):
            left = until - time.monotonic()
            if left <= 0:
                break
            if self._t.wait(left):
                self._take_over(c or self._call, K)
        return {r: {"call": int(self._pongs[r, 1]), "stored": int(self._pongs[r, 2]),
                    "expected": int(self._pongs[r, 3])} for r in others if self._pongs[r, 0] > before[r]}

    def _fail(self, c: int, K: int) -> None:
        have = self._stored()
        pongs = self.ping(c, K)
        silent = [r for r in range(self.world) if r != self.rank and r not in pongs]
        behind = {r: p["call"] for r, p in pongs.items() if (p["call"] - c) & 0x80000000}
        head = (f"rank {self.rank}: ring allreduce timed out after {self.timeout:g}s without progress in call {c} "
                f"({have} of {K} records here)")
        parts = []
        if silent:
            parts.append("no answer from rank(s) " + ", ".join(f"{r} ({self.peers[r]})" for r in silent)
                         + ": its ring program is not running there or its link is down")
        if behind:
            parts.append("rank(s) " + ", ".join(f"{r} (in call {p})" for r, p in sorted(behind.items()))
                         + f" never entered call {c}: the process stopped or stalls (it stalls the ring)")
        if not parts:
            low = sorted(pongs.items(), key=lambda kv: kv[1]["stored"])
            parts.append("every rank is in this call; stored: " + ", ".join(
                f"rank {r} {p['stored']}/{p['expected']}" for r, p in low) + " (losses not recovered)")
        raise TimeoutError_(head + "; " + "; ".join(parts))
