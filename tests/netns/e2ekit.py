"""Helpers the end-to-end tests of the collectives share (tests/netns/test_worker_e2e.py,
test_ring_e2e.py, ...): the command line's argv, each rank's input saved as a .npy file, and ranks
run as threads of the test."""
from __future__ import annotations

import sys
import threading

import numpy as np

CLI = [sys.executable, "-m", "nicoffload.cli"]


def save(tmp_path, arrays, tag=""):
    """Rank r's array saved as in<tag><r>.npy; returns (the inputs' paths, the outputs' paths)."""
    ins = [tmp_path / f"in{tag}{r}.npy" for r in range(len(arrays))]
    outs = [tmp_path / f"out{tag}{r}.npy" for r in range(len(arrays))]
    for a, p in zip(arrays, ins):
        np.save(p, a)
    return ins, outs


def run_ranks(fn, world: int, timeout: float = 120.0):
    """``fn(r)`` for every rank r at once, each in a thread; returns (results by rank, the
    (rank, exception) pairs of the ranks that raised)."""
    outs, errs = [None] * world, []

    def one(r):
        try:
            outs[r] = fn(r)
        except BaseException as e:
            errs.append((r, e))

    ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return outs, errs


def xdp_comms(tb, world: int, slots: int, **kw):
    """An XDP aggregator loaded for a job of ``world`` ranks on ``tb`` and a Communicator per
    rank (``kw`` to each): (aggregator, communicators); the caller closes both."""
    from nicoffload.agg import AggSpec, Aggregator
    from nicoffload.worker import Communicator

    agg = Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, world, slots=slots, port=tb.port,
                                  group=tb.mcast_group, worker_ips=[w.ip for w in tb.workers]))
    comms = []
    try:
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(Communicator(r, world, tb.agg.ip, group=tb.mcast_group, local_ip=w.ip, port=tb.port,
                                          slots=slots, timeout=60, **kw))
    except BaseException:
        for c in comms:
            c.close()
        agg.close()
        raise
    return agg, comms
