"""Two jobs of 2 ranks each share one aggregator whose link runs at the workers' rate (200 Mbit/s),
16 MiB float32 per rank: each job alone, then both at once (twice); per call, each job's
slowest rank, and the last call's retransmissions. Root; ``sudo .venv/bin/python
scripts/two_jobs.py [REPS]`` (docs/bench/numbers.md, "Congestion control")."""
import json, sys, time
from pathlib import Path
import numpy as np
from nicoffload.lab.jobs import testbed, tempdir
from nicoffload.lab.launcher import CLI, Launch, RankSpec
from nicoffload.lab.links import enable_gro
from nicoffload.agg.control import Aggregator
from nicoffload.agg.spec import AggSpec
from nicoffload.jobspec import DEFAULT
from nicoffload.wire import keys

RATE, MiB, REPS = "200mbit", 1 << 20, int(sys.argv[1]) if len(sys.argv) > 1 else 4
size = 16 * MiB
with testbed(4, rate=RATE, agg_rate=RATE) as tb, tempdir() as d:
    enable_gro(tb)
    d = Path(d)
    rng = np.random.default_rng(5)
    ins = []
    for w in tb.workers:
        p = d / f"in{w.rank}.npy"; np.save(p, rng.standard_normal(size // 4).astype(np.float32)); ins.append(p)
    agg = Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, 0, 2 * DEFAULT.slots, DEFAULT.elems, tb.port, "auto"))
    specs = {}
    try:
        for j, (hosts, group) in {1: (tb.workers[:2], "239.77.9.1"), 2: (tb.workers[2:], "239.77.9.2")}.items():
            k = keys.new_key()
            agg.add_job(j, 2, group, [h.ip for h in hosts], slots=DEFAULT.slots, key=k)
            spec = DEFAULT.replace(job=j, group=group, key=k, port=tb.port, timeout=30.0)
            specs[j] = [RankSpec(f"job {j} rank {r}", h,
                                 CLI + ["worker", "--rank", str(r), "--world", "2", "--aggregator", tb.agg.ip,
                                        "--local-ip", h.ip, "--input", str(ins[h.rank]), "--reps", str(REPS),
                                        "--json", *spec.argv()]) for r, h in enumerate(hosts)]

        def run(jobs):
            with Launch(tb, [s for j in jobs for s in specs[j]]) as launch:
                outs = launch.wait(time.monotonic() + 600)
            res = {}
            for j in jobs:
                reps = [json.loads(o.json_lines()[-1]) for o in outs if o.label.startswith(f"job {j}")]
                times = [max(r["times"][i] for r in reps) for i in range(REPS)]
                res[j] = {"times": [round(t, 3) for t in times],
                          "retx_last_call": sum(r["stats"]["retransmissions"] for r in reps)}
            return res
        for jobs in ([1], [2], [1, 2], [1, 2]):
            print(jobs, json.dumps(run(jobs)), flush=True)
    finally:
        agg.close()
