"""One rank of a group whose hosts run several ranks each: :class:`HostCommunicator`.

Inside a host the K local ranks reduce through shared memory (:mod:`~nicoffload.local.segment`):
every rank writes its part, local rank j sums the j-th share of the blocks from all K buffers (a
reduce-scatter), and every rank copies the whole result out (an all-gather). Across hosts, local
rank j of every host sums its share through its *lane*: a collective of one rank per host (a job
at the aggregator, a ring of the hosts), so every CPU of the host encodes and decodes, and every
host still sends the tensor's bytes once. A group of one host needs no lane at all.

Floats are summed in the fixed point of :mod:`~nicoffload.local.fixed`, with the block exponents
of the whole group (a MAX round: the host's, then the lanes' over the hosts) and a scale for
W = the group's ranks: the bits an aggregator job of one rank per host gets, however the ranks
are placed (hosts of unequal rank counts too). int32 sums are exact;
MAX/MIN go through order-preserving int32 keys, as the aggregator takes them.

One call, for a chunk of at most CHUNK elements at a time (whole blocks: the same bits):
    1. every rank: its block exponents, its floats copied into the segment (one pass)  | barrier
    2. lane j: the host's MAX of its share's exponents, then the hosts'                | barrier
       (one host: every rank takes the MAX of every block itself; no step, no barrier)
    3. every rank: refuse a NaN/Inf together
    4. lane j: its share quantized from every local rank's floats and summed as int32
       in one pass (fixed.quantize_sum), the hosts' sum, decode                        | barrier
    5. every rank: the result, copied out
Per rank that is three passes over the tensor's bytes and one over its share of every rank's
(a separate exponent pass, and each rank's quantized copy written and read back, cost 10% more
CPU and time at 1 host x 4 ranks, 16 MiB).

A lane that loses the aggregator (the failover's cue) makes no more lane calls in the call, but
the host's ranks go on to its end: each copies out the blocks its host's lanes got (marked in the
segment), then every rank raises AggregatorLost and ``final_blocks()`` says which blocks those
are, as a Communicator's does. So when another host has returned from the call (its lanes'
gates passed: every host's lanes hold all of it), every rank here holds all of it too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from nicoffload import collective
from nicoffload.collective import Collective
from nicoffload.datapath.tensors import DTYPES, call_arrays, refuse_together
from nicoffload.errors import AggregatorLost, InputError, RefusedError
from nicoffload.local import fixed
from nicoffload.local.calls import CALL_DTYPES, OPS, HostStats, describe
from nicoffload.local.segment import HostGroup
from nicoffload.wire import quant

#: elements per chunk of a call (the data segment holds K buffers of a chunk's lanes, and its result)
CHUNK = 4 << 20
def _assign(src: np.ndarray, dst: np.ndarray) -> None:
    dst[...] = src


def _align(n: int) -> int:
    return -(-n // 64) * 64


@dataclass
class HostCommunicator:
    """Group rank ``rank`` of ``world``: local rank ``host.me`` of the ``host.K`` ranks of host
    ``host_index`` (of ``hosts``). ``lane``: this rank's collective of one rank per host (local
    ranks below ``lanes`` have one where there are several hosts), summing int32 exactly and
    taking int32 MAX."""

    rank: int
    world: int
    host: HostGroup
    hosts: int
    host_index: int
    lanes: int
    elems: int = 256
    lane: Collective | None = None
    # 16-bit lanes where the path across hosts has them (the aggregator's); False: floats in
    # 32-bit lanes only (a ring across hosts: the bits of the ring's own one-rank-per-host jobs)
    half_lanes: bool = True
    capabilities = collective.Capabilities(ops=frozenset({"sum", "max", "min"}),
                                           extreme_dtypes=collective.EXTREME_DTYPES, lanes=(32, 16))
    stats: HostStats = field(default_factory=HostStats)
    last: HostStats = field(default_factory=HostStats)

    def __post_init__(self):
        if not self.half_lanes:
            self.capabilities = dataclasses.replace(type(self).capabilities, lanes=(32,))
        me, K = self.host.me, self.host.K
        if not 1 <= self.lanes <= K:
            raise InputError(f"{self.lanes} lanes and a host of {K} ranks")
        if self.hosts > 1 and me < self.lanes:
            if self.lane is None:
                raise InputError(f"rank {self.rank}: local rank {me} of a group of {self.hosts} hosts needs its lane")
            caps = self.lane.capabilities
            if not (caps.supports("sum", np.int32) and caps.supports("max", np.int32)):
                raise InputError(f"rank {self.rank}: the lane across hosts must sum int32 and take its MAX")
        self.host.describe = describe
        self._closed = False
        self._lane_calls = 0
        self._lost: AggregatorLost | None = None  # this rank's lane lost the aggregator in this call
        self._final: np.ndarray | None = None     # after a call the aggregator was lost in: its final blocks
        fixed.warm_up()

    # --- the Collective API ---------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, op: str = "sum",
                  lanes: int | None = None) -> np.ndarray:
        """The elementwise sum (int32 exact; floats in the aggregator's fixed point, 32- or 16-bit
        lanes) or MAX/MIN (int32, float32) over every rank of the group."""
        if op not in ("sum", "max", "min"):
            raise InputError(f"op must be sum, max or min, not {op!r}")
        if lanes not in (None, 16, 32):
            raise InputError(f"lanes must be 16 or 32, not {lanes!r}")
        dtypes = DTYPES if op == "sum" else (np.dtype(np.int32), np.dtype(np.float32))
        x, out = call_arrays(array, out, dtypes)
        if lanes == 16 and not self.half_lanes:
            raise InputError("16-bit lanes are for the aggregator mode: this group sums across hosts in 32-bit lanes")
        if lanes == 16 and x.dtype.kind != "f":
            raise InputError("16-bit lanes carry floats (fixed point); int32 sums are exact only in 32-bit lanes")
        flat, res = x.reshape(-1), out.reshape(-1)
        bits = 16 if lanes == 16 else 32

        def chunk(lo: int, hi: int) -> np.ndarray | None:
            xc, oc = flat[lo:hi], res[lo:hi]
            if op != "sum":
                return self._extreme(xc, oc, op)
            if x.dtype.kind == "f":
                return self._sum_float(xc, oc, bits)
            return self._sum_int(hi - lo, lambda row: np.copyto(row, xc), lambda s, a, z: np.copyto(oc[a:z], s))

        first = "max" if op != "sum" or x.dtype.kind == "f" else "sum"  # the lanes' first round
        U = quant.block_elems(self.elems, bits) if op == "sum" and x.dtype.kind == "f" else self.elems
        self._call(op, x.dtype.name, flat.size, bits, U, first, chunk)
        return out

    def sum_staged(self, n: int, fill, take) -> None:
        """The int32 SUM over the group of ``n`` words that pass through no array of the caller's:
        ``fill(row, lo, hi)`` writes input words [lo, hi) into ``row``, this rank's row of the
        shared segment, and ``take(src, lo, hi)`` reads result words [lo, hi) out of ``src`` in
        it; both finish before they return (the device path copies straight from the GPU into the
        segment and back: torch/device/path.py). Otherwise allreduce(op="sum") of int32, the
        aggregator's loss included (``take`` then sees only the final blocks)."""
        def chunk(lo: int, hi: int) -> np.ndarray | None:
            return self._sum_int(hi - lo, lambda row: fill(row, lo, hi), lambda s, a, z: take(s, lo + a, lo + z))

        self._call("sum", "int32", n, 32, self.elems, "sum", chunk)

    def data_segment(self):
        """The shared segment the last call ran in (a device path registers it with the GPU)."""
        return self.host.data

    def _call(self, op: str, dtype: str, n: int, bits: int, U: int, first: str, chunk) -> None:
        """One call of ``n`` elements, ``chunk(lo, hi)`` at a time (whole blocks of ``U``)."""
        st = self.last = HostStats(calls=1)
        t0 = time.perf_counter()
        step = CHUNK // (2 * self.elems) * (2 * self.elems)  # whole blocks of both lane widths
        self._lost, self._final = None, None
        final = np.ones(-(-n // U), bool)  # the blocks whose output is final (all, unless lost)
        with self._failing(first):
            self.host.lost(None)
            # every local rank must make the same call: checked before anything is shared
            self._wait(sig=(OPS[op], CALL_DTYPES[dtype], n, bits))
            for lo in range(0, n, step):
                fin = chunk(lo, min(n, lo + step))
                if fin is not None:
                    final[lo // U:lo // U + fin.size] = fin
            lost = self.host.who_lost() if self.hosts > 1 else None
            if lost is not None:
                self._final = final
                raise self._lost or lost
        st.seconds = time.perf_counter() - t0
        self.stats.add(st)

    @contextlib.contextmanager
    def _failing(self, first: str):
        """A rank that fails its part of a call tells the host's other ranks at once (they raise
        naming it instead of waiting at a step it will not reach), and a lane that has not yet
        taken part in the call spoils its first round for the other hosts (``first``: that
        round's op; it takes the other one), so that the aggregator fails theirs at once too
        (MISMATCH), as it fails the ranks of one job given different shapes. A refusal (a NaN, an
        Inf) is every rank's at the same step: the group goes on."""
        lane_calls = self._lane_calls
        try:
            yield
        except RefusedError:
            raise
        except BaseException as e:
            if self._final is not None:  # the aggregator lost, every local rank raising at the same point
                self.host.abort(e)       # (told no one: a failure now would race their last barrier)
                raise
            self.host.fail(e)
            # the aggregator lost: the other hosts' lanes find it so themselves
            if self.lane is not None and self._lane_calls == lane_calls and not isinstance(e, AggregatorLost):
                try:
                    self.lane.allreduce(np.zeros(1, np.int32), op="sum" if first == "max" else "max")
                except Exception:
                    pass  # the MISMATCH it causes, or the lane's own failure: not the news
            raise

    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""
        with self._failing("sum"):
            self._wait(sig=(OPS["barrier"],))
            if self.host.me == 0 and self.hosts > 1:
                self._lane(lambda: self.lane.barrier())
            self._wait()

    def final_blocks(self) -> np.ndarray | None:
        """After a call that raised AggregatorLost: which blocks of its output (of the
        fixed point's blocks for float sums, of ``elems`` otherwise) hold their result, every
        local rank alike; the others still hold the input of an in-place call. None otherwise."""
        return self._final

    def abort(self, error: BaseException) -> None:
        self.host.abort(error)
        if self.lane is not None:
            self.lane.abort(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.lane is not None:
            self.lane.close()
        self.host.close()

    def __enter__(self) -> "HostCommunicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------
    def _wait(self, sig: tuple[int, ...] | None = None) -> None:
        t = time.perf_counter()
        self.host.barrier(sig)
        self.last.wait_s += time.perf_counter() - t

    def _lane(self, fn):
        self._lane_calls += 1
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.last.lane_s += time.perf_counter() - t
            lst = getattr(self.lane, "last", None)
            self.last.packets_sent += getattr(lst, "packets_sent", 0)
            self.last.retransmissions += getattr(lst, "retransmissions", 0)

    def _lane_call(self, fn, count: int) -> np.ndarray | None:
        """The lane's call ``fn`` over ``count`` of its blocks: None when it returned; else which
        of them hold their result, the aggregator lost in it (or earlier in this call: then no
        call is made, and none does)."""
        if self._lost is None:
            try:
                self._lane(fn)
                return None
            except AggregatorLost as e:
                self._lost = e
                self.host.lost(e)
                got = getattr(self.lane, "final_blocks", lambda: None)()
                if got is not None and len(got) == count:
                    return np.asarray(got, bool)
        return np.zeros(count, bool)

    def _share(self, nb: int) -> tuple[int, int] | None:
        """The blocks [lo, hi) this rank sums for its host (None: not a lane)."""
        j, L = self.host.me, self.lanes
        return (j * nb // L, (j + 1) * nb // L) if j < L else None

    def _buffers(self, parts: list[tuple[str, object, int]]) -> dict[str, np.ndarray]:
        """Views of the data segment, laid out in order (name, dtype, count), 64-byte aligned."""
        sizes, off = [], 0
        for name, dtype, count in parts:
            sizes.append((name, dtype, count, off))
            off += _align(count * np.dtype(dtype).itemsize)
        seg = self.host.ensure(off)
        return {name: seg.array(o, dtype, count) for name, dtype, count, o in sizes}

    # --- the three kinds of call (each returns which of its blocks are final, or None: all) -------
    def _sum_float(self, x: np.ndarray, out: np.ndarray, bits: int) -> np.ndarray | None:
        K, me, n = self.host.K, self.host.me, x.size
        E = quant.block_elems(self.elems, bits)
        wpb = E * bits // 32                       # int32 words per block
        nb = -(-n // E)
        b = self._buffers([("ex", np.int32, K * nb), ("gexp", np.int32, nb), ("xs", x.dtype, K * n),
                           ("q", np.int32, nb * wpb), ("out", x.dtype, n), ("fin", np.bool_, nb)])
        ex, xs, q, fin = b["ex"].reshape(K, nb), b["xs"].reshape(K, n), b["q"], b["fin"]
        bad = fixed.exponents_and_copy(x, E, ex[me], xs[me], self.rank)           # 1.
        self._wait()
        share = self._share(nb)
        agreed = True  # this rank's share of the exponents is every host's (the lane's MAX came back)
        if self.hosts == 1:  # every rank takes the MAX of every block itself: no step, no barrier
            gexp = np.empty(nb, np.int32)
            fixed.max_exps(ex, 0, nb, gexp)
        else:                                                                      # 2.
            gexp = b["gexp"]
            if share is not None:
                lo, hi = share
                fixed.max_exps(ex, lo, hi, gexp)
                if hi > lo:
                    got = self._lane_call(lambda: self.lane.allreduce(gexp[lo:hi], out=gexp[lo:hi], op="max"),
                                          -(-(hi - lo) // self.elems))
                    agreed = got is None or bool(got.all())
            self._wait()
        refuse_together(gexp, self.rank, x, bad, E)                                # 3.
        top = quant.top_bits(bits) - quant.headroom_bits(self.world)  # room for every rank's, no more
        bias = quant.bias(self.world, bits)
        if share is not None:                                                      # 4.
            lo, hi = share
            lanes = q if bits == 32 else q.view(np.int16)
            fixed.quantize_sum(xs, n, lo, hi, E, gexp, top, bias, x.dtype == np.float32, 0, lanes)
            if self.hosts > 1:
                fin[lo:hi] = self._across(q.reshape(nb, wpb), gexp, lo, hi) if agreed else False
            fixed.decode(q, E, gexp, top, self.world * bias, bits == 16, lo, hi, n, b["out"])
        self._wait()
        return self._copy_out(b["out"], fin, E, lambda s, a, z: _assign(s, out[a:z]))  # 5.

    def _across(self, rows: np.ndarray, gexp: np.ndarray, lo: int, hi: int) -> np.ndarray | bool:
        """The hosts' int32 sum of blocks [lo, hi) of ``rows`` (in place): blocks zero on every
        rank of the group are not sent (their exponent says so). Returns which are final (True:
        all)."""
        active = np.flatnonzero(gexp[lo:hi] != quant.ZERO_EXP) + lo
        self.last.blocks_skipped += (hi - lo) - len(active)
        got = None
        if len(active) == hi - lo and hi > lo:
            seg = rows[lo:hi].reshape(-1)
            got = self._lane_call(lambda: self.lane.allreduce(seg, out=seg), hi - lo)
        elif len(active):
            packed = np.ascontiguousarray(rows[active]).reshape(-1)
            got = self._lane_call(lambda: self.lane.allreduce(packed, out=packed), len(active))
            rows[active] = packed.reshape(len(active), -1)
        if got is None:
            return True
        fin = np.ones(hi - lo, bool)
        fin[active - lo] = got
        return fin

    def _sum_int(self, n: int, fill, take) -> np.ndarray | None:
        K, me = self.host.K, self.host.me
        nb = -(-n // self.elems)
        b = self._buffers([("q", np.int32, K * n), ("fin", np.bool_, nb)])
        q, fin = b["q"].reshape(K, n), b["fin"]
        fill(q[me])
        self._wait()
        share = self._share(nb)
        if share is not None:
            lo, hi = (min(n, s * self.elems) for s in share)
            fixed.sum_rows(q, lo, hi, 0, q[0])
            if self.hosts > 1:
                fin[share[0]:share[1]] = self._lane_rows(q[0, lo:hi], share, "sum")
        self._wait()
        got = self._copy_out(q[0], fin, self.elems, take)
        self._wait()  # q[0] is read by every rank before the next call writes it
        return got

    def _extreme(self, x: np.ndarray, out: np.ndarray, op: str) -> np.ndarray | None:
        K, me, n = self.host.K, self.host.me, x.size
        nb = -(-n // self.elems)
        b = self._buffers([("q", np.int32, K * n), ("fin", np.bool_, nb)])
        q, fin = b["q"].reshape(K, n), b["fin"]
        fixed.to_keys(x, op, q[me])
        self._wait()
        share = self._share(nb)
        if share is not None:
            lo, hi = (min(n, s * self.elems) for s in share)
            fixed.max_rows(q, lo, hi, q[0])
            if self.hosts > 1:
                fin[share[0]:share[1]] = self._lane_rows(q[0, lo:hi], share, "max")
        self._wait()
        got = self._copy_out(q[0], fin, self.elems, lambda s, a, z: fixed.from_keys(s, op, x.dtype, out[a:z]))
        self._wait()
        return got

    def _lane_rows(self, seg: np.ndarray, share: tuple[int, int], op: str) -> np.ndarray | bool:
        """The hosts' int32 ``op`` of ``seg`` (this rank's share of the blocks, in place): which
        of its blocks are final (True: all)."""
        if not seg.size:
            return True
        got = self._lane_call(lambda: self.lane.allreduce(seg, out=seg, op=op), share[1] - share[0])
        return True if got is None else got

    def _copy_out(self, src: np.ndarray, fin: np.ndarray, U: int, copy) -> np.ndarray | None:
        """Step 5: ``copy(src[a:z], a, z)`` of the chunk's result, all of it, or, where a lane lost
        the aggregator, of its final blocks only (of ``U`` elements; the others keep what they
        hold). Returns which are final (None: all)."""
        if self.hosts == 1 or fin.all():
            copy(src, 0, src.size)
            return None
        edges = np.flatnonzero(np.diff(np.concatenate(([0], fin.view(np.int8), [0]))))
        for a, z in zip(edges[::2] * U, edges[1::2] * U):
            z = min(z, src.size)
            copy(src[a:z], a, z)
        return fin  # a view of the segment: the caller keeps it before the next chunk
