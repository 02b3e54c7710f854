"""A host on the workers' network sends forged RESULT records (the right job, the live epoch,
every round, garbage payloads) to the job's multicast group and to each worker's port while the
job runs: the workers take results only from the aggregator's address and port, so every sum is
exact and the forgeries are counted as foreign."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from nicoffload.agg.control import Aggregator, AggSpec
from nicoffload.wire import codec, proto
from nicoffload.worker.comm import Communicator


def forge(job: int, epoch: int, rounds: int, slots: int, workers: int, rng) -> list[bytes]:
    out = []
    for r in range(rounds):
        payload = rng.integers(-2**31, 2**31 - 1, (1, proto.DEFAULT_ELEMS), dtype=np.int64).astype(np.int32)
        out.append(bytes(codec.encode_blocks(payload, rank=proto.RANK_AGG, job=job, epoch=epoch, slot=r % slots,
                                             set=(r // slots) % 2, round=r, mask=(1 << workers) - 1,
                                             count=proto.DEFAULT_ELEMS, type=proto.TYPE_RESULT)))
    return out


def test_forged_results_from_another_host_change_nothing(make_testbed):
    tb = make_testbed(3)
    w0, w1, attacker = tb.workers
    group, job, slots, n = tb.topology.group_of(1), 1, 64, 64 * proto.DEFAULT_ELEMS * 20
    rng = np.random.default_rng(3)
    xs = [rng.integers(-1000, 1000, n, dtype=np.int32) for _ in range(2)]
    want = xs[0] + xs[1]
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=slots)) as agg:
        agg.add_job(job, 2, group, [w0.ip, w1.ip])
        comms = []
        for r, h in enumerate((w0, w1)):
            with tb.in_host(h):
                comms.append(Communicator(r, 2, tb.agg.ip, group=group, local_ip=h.ip, job=job, slots=slots,
                                          timeout=20))
        stop, sent, errors, outs = threading.Event(), [0], [], [[], []]

        def attack():
            with tb.in_host(attacker):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(attacker.ip))
            try:
                while not stop.is_set():
                    epoch = agg.job_state(job)["epoch"]
                    if not epoch:
                        time.sleep(0.001)
                        continue
                    for rec in forge(job, epoch, 64, slots, 2, rng):
                        for dst in (group, w0.ip, w1.ip):
                            s.sendto(rec, (dst, proto.DEFAULT_PORT))
                            sent[0] += 1
            finally:
                s.close()

        # both ranks run the same number of calls: at least 5, and on until the attacker has sent
        # 1,000 forgeries (a fast machine finishes 5 calls before that), at most 60
        calls = threading.Barrier(2)
        more = [True]

        def work(r):
            try:
                for i in range(60):
                    outs[r].append(comms[r].allreduce(xs[r]).copy())
                    if calls.wait(30) == 0:
                        more[0] = i < 4 or sent[0] <= 1000
                    calls.wait(30)
                    if not more[0]:
                        break
            except BaseException as e:
                errors.append(e)
                calls.abort()

        a = threading.Thread(target=attack)
        a.start()
        ts = [threading.Thread(target=work, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        stop.set()
        a.join(10)
        foreign = [c.stats.foreign for c in comms]
        for c in comms:
            c.close()
    assert not errors, errors
    for r in range(2):
        assert len(outs[r]) >= 5 and all(np.array_equal(o, want) for o in outs[r]), f"rank {r}"
    assert sent[0] > 1000 and min(foreign) > 0, (sent, foreign)
