"""The ring offload on a namespace testbed: a ring program on every worker's interface, loaded
and pinned from this process (:class:`RingPrograms`, the ring's counterpart of
:class:`~nicoffload.lab.aggregators.AggregatorProcess`), and a job of ``nicoffload worker
--mode ring`` processes through it (:func:`run_ring_job`), or through the user-space UDP ring.

Native XDP_TX on a veth needs NAPI on its peer: in native mode every worker's bridge-side veth
gets the testbed's XDP_PASS program for the job's duration (generic mode must not have it: it
would strip GSO from the worker's veth and cut its batches into datagrams)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import numpy as np

from nicoffload.ebpf import loader as bpf
from nicoffload.wire import proto

from ..errors import InputError
from ..jobspec import DEFAULT, JobSpec
from . import counters
from .jobs import JobResult, run_workers
from .links import enable_gro

#: systems of the bench and engines of a ring job: the ring offload and the user-space UDP ring
ENGINES = ("xdp", "userspace")


def capacity_for(nbytes: int, elems: int = DEFAULT.elems) -> int:
    """Records a ring program must hold for tensors of up to ``nbytes`` bytes (int32 or float32):
    one pass per call. Floats also run a pass of one exponent per record, which fits too."""
    return max(1, -(-max(4, nbytes) // 4 // elems))


def on_testbed(tb, spec: JobSpec) -> JobSpec:
    """``spec`` as a ring job on the testbed (its port, the ring mode)."""
    return spec.replace(port=tb.port, group=tb.mcast_group, mode="ring")


class RingPrograms:
    """A ring program on every worker of testbed ``tb`` for the job ``spec`` (XDP ``mode``:
    auto, generic, native), each holding ``capacity`` records per call. Context manager; close()
    unloads them all (and removes native mode's NAPI programs)."""

    def __init__(self, tb, spec: JobSpec = DEFAULT, mode: str = "auto", capacity: int | None = None):
        from nicoffload.ebpf.iface import resolve_mode
        from nicoffload.ring.node import RingNode, RingSpec

        self.tb, self.spec = tb, on_testbed(tb, spec)
        self.nodes: list = []
        self._napi: list[str] = []
        w0 = tb.workers[0]
        self.mode, self.mode_reason = resolve_mode(mode, w0.iface, w0.netns)
        peers = [w.ip for w in tb.workers]
        cap = capacity or proto.C["AR_RING_DEFAULT_CAPACITY"]
        try:
            if self.mode == "native":
                self._set_napi(True)
            for w in tb.workers:
                s = self.spec
                self.nodes.append(RingNode.load(RingSpec(w.netns, w.iface, w.rank, len(tb.workers), peers, s.job,
                                                         s.port, s.elems, cap, self.mode)))
        except BaseException:
            self.close()
            raise

    def _set_napi(self, on: bool) -> None:
        from nicoffload.testbed.testbed import attach_napi_pass

        for w in self.tb.workers:
            if on:
                attach_napi_pass(w.peer, self.tb.bridge_netns)
                self._napi.append(w.peer)
        if not on:
            for peer in self._napi:
                with contextlib.suppress(Exception):
                    bpf.detach_xdp(peer, self.tb.bridge_netns, "native")
            self._napi = []

    @property
    def prog_ids(self) -> list[int]:
        return [n.spec.prog_id for n in self.nodes]

    def bpf_runtime(self) -> tuple[int, int] | None:
        """(run_time_ns, run_cnt) of every node's program together (bpf stats)."""
        got = [counters.bpf_runtime(p) for p in self.prog_ids]
        if not got or any(g is None for g in got):
            return None
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def stats(self) -> dict[str, int]:
        """Every node's counters, summed."""
        out: dict[str, int] = {}
        for n in self.nodes:
            for k, v in n.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> dict[str, int]:
        """Unload every node; their counters summed."""
        st: dict[str, int] = {}
        with contextlib.suppress(Exception):
            st = self.stats()
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.close()
        from nicoffload.ring.node import unload

        for n in self.nodes:
            with contextlib.suppress(Exception):
                unload(n.spec.netns, n.spec.iface, missing_ok=True)
        self.nodes = []
        self._set_napi(False)
        return st

    def __enter__(self) -> "RingPrograms":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_ring_job(tb, inputs: Sequence[Path], outputs: Sequence[Path | None], engine: str = "xdp",
                 spec: JobSpec | None = None, *, mode: str = "auto", reps: int = 1, capacity: int | None = None,
                 **kw) -> JobResult:
    """A ring AllReduce job on testbed ``tb``: ring programs on every worker (``engine`` xdp; none
    for the user-space UDP ring), then one ``nicoffload worker --mode ring`` per worker."""
    if engine not in ENGINES:
        raise InputError(f"a ring's hops run in XDP (xdp) or in user space (userspace), not {engine!r}"
                         + (": the AF_XDP engine is an aggregator (--mode aggregator)" if engine == "afxdp" else ""))
    fields = {k: kw.pop(k) for k in list(kw) if k in DEFAULT.to_dict()}
    spec = on_testbed(tb, (spec or DEFAULT).replace(**fields))
    enable_gro(tb)
    if capacity is None:
        capacity = capacity_for(max(np.load(p, mmap_mode="r").nbytes for p in inputs), spec.elems)
    stats: dict = {}
    before = after = None
    mode_used = None
    if engine == "xdp":
        with RingPrograms(tb, spec, mode, capacity) as rp:
            before = rp.bpf_runtime()
            reports = run_workers(tb, inputs, outputs, spec, reps=reps, **kw)
            after = rp.bpf_runtime()
            mode_used = rp.mode
            stats = rp.close()
    else:
        reports = run_workers(tb, inputs, outputs, spec, reps=reps, ring_userspace=True, capacity=capacity, **kw)
    nrep = len(reports[0]["times"])
    rep_seconds = [max(r["times"][i] for r in reports) for i in range(nrep)]
    res = JobResult(f"{engine} ring", len(tb.workers), rep_seconds, sorted(reports, key=lambda r: r["rank"]), stats,
                    mode=mode_used)
    ran = counters.delta(after, before)
    if ran:
        res.agg_bpf_ns, res.agg_bpf_cnt = ran
    return res
