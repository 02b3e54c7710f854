"""A job nobody else can write into (issue 32): a host on the same bridge that spoofs the
registered ranks' source addresses, with the right job, slots and live epoch but not the job's
key, sends everything a rank sends (contributions, retransmissions, pulls, batches, a JOIN that
would end the run, an ACK that would move the gate; packets/attacks.py ``spoofed_keys``) while
the job runs, through the XDP aggregator, the AF_XDP engine and the user-space aggregator: every
result is exact, the run's epoch never changes, and every spoofed frame is counted once as
``bad_key`` in the job's row, and nothing else is. And results forged from the aggregator's own
address without the key: the workers take none of them (``foreign``)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest
from e2ekit import run_ranks

from nicoffload.packets import attacks
from nicoffload.packets.frames import frame
from nicoffload.wire import codec, keys, proto
from nicoffload.worker.comm import Communicator

W, JOB, SLOTS, E = 2, 5, 64, proto.DEFAULT_ELEMS
#: the largest spoofed frame is a batch of two records
MTU = 20 + 8 + 2 * proto.record_size(E)
PASSES = 12
BAD = [s for s in proto.STATS if s.startswith("bad_")]


class Served:
    """The job on one kind of aggregator, started in the testbed's aggregator namespace: its
    counters (the job's row) and its live epoch, whatever the kind."""

    def __init__(self, stack: contextlib.ExitStack, tb, kind: str, key: int, ips: list[str], group: str):
        self.kind = kind
        if kind == "xdp":
            from nicoffload.agg.control import Aggregator, AggSpec

            self.agg = stack.enter_context(Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=SLOTS,
                                                                   port=tb.port)))
            self.agg.add_job(JOB, W, group, ips, slots=SLOTS, key=key)
        elif kind == "afxdp":
            from nicoffload.afxdp.engine import AfxdpEngine

            self.agg = stack.enter_context(AfxdpEngine(port=tb.port, netns=tb.agg.netns, local_ip=tb.agg.ip))
            self.agg.add_job(JOB, W, SLOTS, group, ips, key=key)
        else:
            from nicoffload.userspace.aggregator import UserspaceAggregator

            with tb.in_host(tb.agg):
                self.agg = UserspaceAggregator(W, port=tb.port, slots=SLOTS, job=JOB, group=group, local_ip=tb.agg.ip,
                                               worker_ips=ips, key=key)
            stack.enter_context(self.agg)

    def stats(self) -> dict:
        return dict(self.agg.stats) if self.kind == "userspace" else self.agg.stats(JOB)

    def epoch(self) -> int:
        if self.kind == "xdp":
            return self.agg.job_state(JOB)["epoch"]
        if self.kind == "afxdp":
            return self.agg.job_state(JOB)["live_epoch"]
        return self.agg.live


def _send_all(tb, host, frames: list[bytes], passes: int, done: threading.Event) -> None:
    """Every frame, ``passes`` times, through a raw socket in ``host``'s namespace, paced (a
    datagram socket's buffer must not be what stops them)."""
    with tb.in_host(host):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    try:
        s.bind((host.iface, 0))
        for _ in range(passes):
            for f in frames:
                s.send(f)
                time.sleep(0.0005)
    finally:
        s.close()
        done.set()


@pytest.mark.parametrize("kind", ["xdp", "afxdp", "userspace"])
def test_a_host_that_spoofs_the_ranks_without_the_key_changes_nothing(make_testbed, kind):
    tb = make_testbed(W + 1, mtu=MTU)
    ranks, attacker = tb.workers[:W], tb.workers[W]
    ips, group, key = [h.ip for h in ranks], tb.topology.group_of(JOB), keys.new_key()
    rng = np.random.default_rng(32)
    xs = [rng.integers(-(2**28), 2**28, 40 * E + 3, dtype=np.int32) for _ in range(W)]
    want = (xs[0].astype(np.int64) + xs[1]).astype(np.int32)
    with contextlib.ExitStack() as stack:
        served = Served(stack, tb, kind, key, ips, group)
        comms = []
        for r, h in enumerate(ranks):
            with tb.in_host(h):
                comms.append(stack.enter_context(Communicator(r, W, tb.agg.ip, group=group, local_ip=h.ip, job=JOB,
                                                              port=tb.port, slots=SLOTS, timeout=20, key=key)))
        outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), W)
        assert not errs and all(np.array_equal(o, want) for o in outs), errs
        epoch = served.epoch()
        assert epoch and all(c.epoch == epoch for c in comms)

        frames = attacks.spoofed_keys(job=JOB, epoch=epoch, worker_ips=ips, slots=SLOTS, key=key,
                                      attacker_mac=attacker.mac, port=tb.port, dst_ip=tb.agg.ip, dst_mac=tb.agg.mac)
        assert {f.reason for f in frames} == {"bad_key"} and all(f.job_row for f in frames)
        before, done = served.stats(), threading.Event()
        flood = threading.Thread(target=_send_all, args=(tb, attacker, [f.frame for f in frames], PASSES, done))
        flood.start()
        calls = 0
        while not done.is_set() or calls < 3:  # the job goes on under the spoofed frames, exact
            outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), W)
            assert not errs and all(np.array_equal(o, want) for o in outs), errs
            calls += 1
        flood.join(30)
        sent = PASSES * len(frames)
        deadline = time.monotonic() + 5
        while served.stats()["bad_key"] - before["bad_key"] < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        after = served.stats()
        d = {k: after[k] - before[k] for k in after}
        assert d["bad_key"] == sent, (d["bad_key"], sent)
        assert {k: d[k] for k in BAD if k != "bad_key" and d[k]} == {}, d
        assert d["join"] == d["epoch_formed"] == d["stale_join"] == 0 and d["stale_epoch"] == 0, d
        assert served.epoch() == epoch and all(c.epoch == epoch for c in comms)
    print(f"\n{kind}: {sent} spoofed frames ({len(frames)} distinct) during {calls} exact AllReduces, "
          f"every one counted as bad_key")


def test_results_forged_from_the_aggregators_address_without_the_key_are_foreign(make_testbed):
    """The attacker sends RESULT records of every round, from the aggregator's address and port
    (spoofed, from its own MAC), to the group and to each rank: they pass the workers' source
    check, and the key stops them."""
    from nicoffload.agg.control import Aggregator, AggSpec
    from nicoffload.wire.addr import multicast_mac

    tb = make_testbed(W + 1)
    ranks, attacker = tb.workers[:W], tb.workers[W]
    ips, group, key = [h.ip for h in ranks], tb.topology.group_of(JOB), keys.new_key()
    rng = np.random.default_rng(33)
    xs = [rng.integers(-1000, 1000, SLOTS * E * 4, dtype=np.int32) for _ in range(W)]
    want = (xs[0].astype(np.int64) + xs[1]).astype(np.int32)
    with contextlib.ExitStack() as stack:
        agg = stack.enter_context(Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=SLOTS, port=tb.port)))
        agg.add_job(JOB, W, group, ips, slots=SLOTS, key=key)
        comms = []
        for r, h in enumerate(ranks):
            with tb.in_host(h):
                comms.append(stack.enter_context(Communicator(r, W, tb.agg.ip, group=group, local_ip=h.ip, job=JOB,
                                                              port=tb.port, slots=SLOTS, timeout=20, key=key)))
        run_ranks(lambda r: comms[r].join(), W)
        epoch = agg.job_state(JOB)["epoch"]
        garbage = rng.integers(-2**31, 2**31 - 1, (4 * SLOTS, E), dtype=np.int64).astype(np.int32)
        rounds = np.arange(4 * SLOTS)
        recs = codec.encode_blocks(garbage, rank=proto.RANK_AGG, job=JOB, epoch=epoch, slot=rounds % SLOTS,
                                   set=(rounds // SLOTS) % 2, round=rounds, mask=(1 << W) - 1, type=proto.TYPE_RESULT,
                                   key=key ^ 1)
        size = proto.record_size(E)
        dests = [(group, multicast_mac(group))] + [(h.ip, h.mac) for h in ranks]
        forged = [frame(bytes(recs[i:i + size]), src_mac=attacker.mac, dst_mac=mac, src_ip=tb.agg.ip, dst_ip=ip,
                        sport=tb.port, dport=tb.port) for i in range(0, len(recs), size) for ip, mac in dests]
        done = threading.Event()
        flood = threading.Thread(target=_send_all, args=(tb, attacker, forged, 2, done))
        flood.start()
        calls = 0
        while not done.is_set() or calls < 3:
            outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), W)
            assert not errs and all(np.array_equal(o, want) for o in outs), errs
            calls += 1
        flood.join(30)
        foreign = [c.stats.foreign for c in comms]
    assert min(foreign) > 0, foreign
    print(f"\n{len(forged) * 2} forged results from the aggregator's address during {calls} exact AllReduces; "
          f"taken as foreign by the ranks: {foreign}")
