"""A bare communicator's failover (``communicator(..., fallback="ring")``): 3 ranks of 1 MiB
float32 calls, the aggregator's program unloaded before call 20 of 40; the time from the unload
to the last rank's result of the cut call, and a call's time on the aggregator and on the ring
fallback (medians, slowest rank). Root: ``sudo .venv/bin/python scripts/fallback_cost.py
[FAILOVER_SECONDS]`` (docs/torchrun.md, Failover)."""
import sys, threading, time
import numpy as np
from nicoffload.agg import AggSpec, Aggregator
from nicoffload.communicators import communicator
from nicoffload.jobspec import DEFAULT
from nicoffload.testbed import Testbed, Topology

W, CALLS, CUT = 3, 40, 20
tb = Testbed(Topology.star("fbcost", W)).up()
try:
    agg = Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, W, slots=64, port=tb.port, group=tb.mcast_group,
                                  worker_ips=[w.ip for w in tb.workers]))
    spec = DEFAULT.replace(port=tb.port, group=tb.mcast_group, slots=64, timeout=30)
    peers = [w.ip for w in tb.workers]
    comms = []
    for r, w in enumerate(tb.workers):
        with tb.in_host(w):
            comms.append(communicator(r, W, aggregator=tb.agg.ip, spec=spec, local_ip=w.ip, peers=peers,
                                      fallback="ring", failover=float(sys.argv[1]) if len(sys.argv) > 1 else 3.0))
    x = [np.random.default_rng(r).standard_normal(1 << 18).astype(np.float32) for r in range(W)]
    times = [[0.0] * CALLS for _ in range(W)]
    kill = {}
    def rank(r):
        for n in range(CALLS):
            if r == 0 and n == CUT:
                kill["t"] = time.time(); agg.close()
            t = time.perf_counter(); comms[r].allreduce(x[r]); times[r][n] = time.perf_counter() - t
    errs = []
    def guarded(r):
        try:
            rank(r)
        except BaseException as e:
            errs.append((r, e))
    ts = [threading.Thread(target=guarded, args=(r,)) for r in range(W)]
    for th in ts: th.start()
    for th in ts: th.join(120)
    assert not errs, errs
    s = [c.summary() for c in comms]
    rec = max(q["recovered_at"] for q in s) - kill["t"]
    t = np.max(np.array(times), axis=0) * 1e3
    print(f"failover {s[0]['path']}: recovery {rec:.2f} s (kill to the last rank's cut-call result); "
          f"call ms median on the aggregator {np.median(t[2:CUT]):.2f}, on the ring {np.median(t[CUT+1:]):.2f}")
    for c in comms: c.close()
finally:
    tb.down()
