"""What the torch.distributed backend costs over the communicator it drives, measured inside one
job so that the machine's drift cancels: every rank runs, rep after rep and in a shuffled
order, ``dist.all_reduce(t)`` through the backend "nicoffload", the same group's
``Communicator.allreduce`` into a separate output (what ``nicoffload bench``'s xdp system
times), and the same call in place (what the backend does). Rank 0 prints the medians and the
paired ratios of each rep (median and quartiles) as one JSON line.

    python -m nicoffload.lab.train.torchcost --size 16MiB --reps 40     # under torchrun, backend env set
    sudo nicoffload bench --torch-overhead --workers 4 --sizes 16MiB
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = ("torch", "direct", "inplace")


def measure(size: int, reps: int, warmup: int = 3, seed: int = 0) -> dict | None:
    import torch
    import torch.distributed as dist

    import nicoffload.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("nicoffload")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    n = size // 4
    x = np.random.default_rng(seed + rank).standard_normal(n).astype(np.float32)
    out, buf = np.empty_like(x), x.copy()
    t = torch.from_numpy(buf)
    order = np.random.default_rng(seed)  # the same order on every rank
    times = {v: [] for v in VARIANTS}
    for i in range(warmup + reps):
        for v in order.permutation(VARIANTS):
            np.copyto(buf, x)
            dist.barrier()
            t0 = time.perf_counter()
            if v == "torch":
                dist.all_reduce(t)
            elif v == "direct":
                pg.comm.allreduce(x, out=out)
            else:
                pg.comm.allreduce(buf, out=buf)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[v].append(dt)
    # a rep takes as long as its slowest rank
    slowest = {}
    for v in VARIANTS:
        mine = torch.tensor(times[v], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        slowest[v] = mine.numpy()
    dist.destroy_process_group()
    if rank:
        return None

    def spread(r: np.ndarray) -> dict:
        q1, med, q3 = np.percentile(r, [25, 50, 75])
        return {"median": float(med), "q1": float(q1), "q3": float(q3)}

    return {"world": world, "size": size, "reps": reps,
            "median_ms": {v: float(np.median(slowest[v]) * 1e3) for v in VARIANTS},
            "torch_over_direct": spread(slowest["torch"] / slowest["direct"]),
            "torch_over_inplace": spread(slowest["torch"] / slowest["inplace"])}


def run(workers: int, size: int, reps: int, progress=None) -> dict:
    """On a fresh testbed of ``workers``: the service on the aggregator host, one torchrun per
    worker host running :func:`measure`; rank 0's result."""
    import time as _time

    from nicoffload.errors import SetupError
    from nicoffload.lab.jobs import tempdir, testbed
    from nicoffload.lab.launcher import Launch, failure
    from nicoffload.lab.links import enable_gro
    from nicoffload.lab.train.torchrun import ServiceProcess, torchrun_specs, write_token

    with testbed(workers) as tb, tempdir() as d:
        enable_gro(tb)
        with ServiceProcess(tb, write_token(Path(d))) as svc:
            if progress:
                progress(f"{workers} ranks under torchrun, the service at {svc.url}: {reps} reps of each variant")
            specs = torchrun_specs(tb, __file__, ["--size", str(size), "--reps", str(reps)], env=svc.env())
            with Launch(tb, specs) as job:
                outs = job.wait(_time.monotonic() + 120 + reps * 3)
    err = failure(outs, "the backend's overhead run failed: ")
    if err is not None:
        raise err
    lines = [ln for o in outs for ln in o.json_lines()]
    if not lines:
        raise SetupError("the backend's overhead run printed no result")
    return json.loads(lines[0])


def describe(r: dict) -> str:
    from nicoffload.lab.inputs import format_size

    m, a, b = r["median_ms"], r["torch_over_direct"], r["torch_over_inplace"]
    return (f"{r['world']} ranks, {format_size(r['size'])} float32, {r['reps']} reps of each, interleaved:\n"
            f"  dist.all_reduce through the backend   {m['torch']:8.2f} ms\n"
            f"  Communicator.allreduce (out of place) {m['direct']:8.2f} ms   backend/direct   "
            f"{a['median']:.3f} [{a['q1']:.3f}..{a['q3']:.3f}]\n"
            f"  Communicator.allreduce (in place)     {m['inplace']:8.2f} ms   backend/in place "
            f"{b['median']:.3f} [{b['q1']:.3f}..{b['q3']:.3f}]\n"
            f"  (per rep the slowest rank; ratios of the same rep: median [quartiles])")


def main(argv: list[str] | None = None) -> int:
    from nicoffload.lab.inputs import parse_size

    p = argparse.ArgumentParser(prog="python -m nicoffload.lab.train.torchcost")
    p.add_argument("--size", default="16MiB")
    p.add_argument("--reps", type=int, default=40)
    a = p.parse_args(argv)
    r = measure(parse_size(a.size), a.reps)
    if r is not None:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
