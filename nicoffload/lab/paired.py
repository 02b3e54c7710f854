"""Two variants of a job measured against each other inside one run, so that the machine's drift
between them cancels: one XDP aggregator holds two jobs that differ in one setting (the delivery,
multicast or unicast) or in their input (sparsity: dense gradients against gradients with a
fraction of zero blocks), every rank runs both with a communicator each, and the reps alternate
A, B, B, A, ... Each rep is timed at its slowest rank; the ratio of every pair of neighbouring
reps gives the spread (median and quartiles), as issue 19 asks of every ratio.

    sudo nicoffload bench --paired delivery --workers 4 --sizes 16MiB --reps 40
    sudo nicoffload bench --paired sparsity --sparsity 0.75 [--zero-run 64] --workers 4 --sizes 16MiB
    python -m nicoffload.lab.paired ...      # one rank (started by :func:`run`)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

#: what can be paired: name -> (the job setting, variant A, variant B); sparsity changes the
#: input instead (A dense, B with the run's sparsity), the jobs are alike
PAIRS = {"delivery": ("delivery", "multicast", "unicast"), "sparsity": (None, "dense", "sparse")}


def rank_main(argv: list[str] | None = None) -> int:
    """One rank: both jobs, alternating reps; rank 0 prints the summary as one JSON line."""
    from nicoffload.jobspec import JobSpec
    from nicoffload.worker.comm import Communicator

    p = argparse.ArgumentParser(prog="python -m nicoffload.lab.paired")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--aggregator", required=True)
    p.add_argument("--local-ip", required=True)
    p.add_argument("--specs", required=True, help="JSON: the two JobSpecs")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--inputs", default=None, metavar="A.npy,B.npy", help="this rank's input of each variant")
    a = p.parse_args(argv)
    specs = [JobSpec.from_dict(d) for d in json.loads(a.specs)]
    comms = [Communicator.from_spec(a.rank, a.world, a.aggregator, s, local_ip=a.local_ip) for s in specs]
    try:
        if a.inputs:
            xs = [np.load(f) for f in a.inputs.split(",")]
        else:
            xs = [np.random.default_rng(a.rank).standard_normal(a.size // 4).astype(np.float32)] * 2
        out = np.empty_like(xs[0])
        times = np.zeros((2, a.reps), np.float32)
        results = [0, 0]
        for i in range(a.warmup + a.reps):
            for v in ((0, 1) if i % 2 == 0 else (1, 0)):  # A B, B A, ...: neither always goes first
                comms[v].barrier()
                t0 = time.perf_counter()
                comms[v].allreduce(xs[v], out=out)
                if i >= a.warmup:
                    times[v, i - a.warmup] = time.perf_counter() - t0
                results[v] = comms[v].last.results
        slowest = comms[0].allreduce(times.reshape(-1), op="max").reshape(2, -1).astype(np.float64)
    finally:
        for c in comms:
            c.close()
    if a.rank == 0:
        ratio = slowest[1] / slowest[0]
        q1, med, q3 = np.percentile(ratio, [25, 50, 75])
        print(json.dumps({"world": a.world, "size": a.size, "reps": a.reps,
                          "median_ms": [float(np.median(s) * 1e3) for s in slowest],
                          "min_ms": [float(s.min() * 1e3) for s in slowest],
                          "results": results,  # rank 0's results of each variant's last call
                          "ratio_b_over_a": {"median": float(med), "q1": float(q1), "q3": float(q3)}}), flush=True)
    return 0


def run(pair: str, workers: int, size: int, reps: int, multicast: bool = True, progress=None,
        sparsity: float = 0.75, zero_run: int = 1, seed: int = 0, spec=None) -> dict:
    """On a fresh testbed of ``workers`` (``multicast`` False: a fabric without it, where only
    unicast runs): the two jobs of ``pair`` on one XDP aggregator, interleaved. Pair sparsity:
    seeded gradients, dense against ``sparsity`` zero blocks in runs of ``zero_run``. ``spec``
    (default: DEFAULT) gives both jobs their record size and slots."""
    from nicoffload.agg.control import AggSpec, Aggregator
    from nicoffload.errors import InputError, SetupError
    from nicoffload.jobspec import DEFAULT
    from nicoffload.lab.inputs import format_size, make_gradients
    from nicoffload.lab.jobs import tempdir, testbed
    from nicoffload.lab.launcher import Launch, RankSpec, failure, program
    from nicoffload.lab.links import enable_gro

    base = DEFAULT if spec is None else spec
    setting, va, vb = PAIRS[pair]
    if pair == "sparsity" and not 0 < sparsity < 1:
        raise InputError(f"--paired sparsity measures dense inputs against a sparsity in (0, 1), not {sparsity}")
    if pair == "sparsity":
        vb = f"sparse {sparsity:g}" + (f", zero runs of {zero_run}" if zero_run > 1 else "")
    with testbed(workers, base.elems, multicast=multicast) as tb, tempdir() as d:
        inputs = [[]] * workers
        if pair == "sparsity":
            n = max(1, size // 4)
            variants = [make_gradients(workers, n, sp, seed, base.elems, zero_run) for sp in (0.0, sparsity)]
            inputs = [[f"{d}/v{v}-r{r}.npy" for v in range(2)] for r in range(workers)]
            for r in range(workers):
                for v in range(2):
                    np.save(inputs[r][v], variants[v][r])
            del variants
        enable_gro(tb)
        ips = [w.ip for w in tb.workers]
        slots = base.slots
        specs = [base.replace(job=j + 1, port=tb.port, group=tb.topology.group_of(j + 1), slots=slots,
                                 local_port=tb.port + 1 + j, timeout=30, **({setting: v} if setting else {}))
                 for j, v in enumerate((va, vb))]
        with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, 0, 2 * slots, base.elems, port=tb.port)) as agg:
            for s in specs:
                agg.add_job(s.job, workers, s.group, ips, slots=slots, delivery=s.delivery, key=s.key)
            if progress:
                progress(f"{workers} ranks, {format_size(size)}: {setting or pair} {va} against {vb}, {reps} reps "
                         f"each, interleaved on one aggregator")
            arg = json.dumps([s.to_dict() for s in specs])
            ranks = [RankSpec(f"rank {w.rank}", w, program("nicoffload.lab.paired") +
                              ["--rank", str(w.rank), "--world", str(workers), "--aggregator", tb.agg.ip,
                               "--local-ip", w.ip, "--specs", arg, "--size", str(size), "--reps", str(reps)]
                              + (["--inputs", ",".join(inputs[w.rank])] if inputs[w.rank] else []))
                     for w in tb.workers]
            with Launch(tb, ranks) as job:
                outs = job.wait(time.monotonic() + 120 + reps * 5)
    err = failure(outs, f"the paired {pair} run failed: ")
    if err is not None:
        raise err
    lines = [ln for o in outs for ln in o.json_lines()]
    if not lines:
        raise SetupError("the paired run printed no result")
    return {"pair": pair, "a": va, "b": vb, **json.loads(lines[0])}


def describe(r: dict) -> str:
    from nicoffload.lab.inputs import format_size

    q = r["ratio_b_over_a"]
    w = max(10, len(r["a"]), len(r["b"]))
    res = r.get("results") or [None, None]
    rows = [f"  {r[k]:<{w}} median {r['median_ms'][i]:8.2f} ms (min {r['min_ms'][i]:.2f})"
            + (f", {res[i]} results per call" if res[i] is not None else "") for i, k in enumerate("ab")]
    return (f"{r['world']} ranks, {format_size(r['size'])} float32, {r['reps']} reps of each, interleaved on one "
            f"aggregator:\n" + "\n".join(rows) + "\n"
            f"  {r['b']}/{r['a']} per pair of reps: median {q['median']:.3f} [{q['q1']:.3f}..{q['q3']:.3f}]\n")


if __name__ == "__main__":
    sys.exit(rank_main())
