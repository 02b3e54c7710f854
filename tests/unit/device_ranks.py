"""One rank of a group of the backend "nicoffload", for the device path's checks
(tests/unit/test_device_path.py, tests/netns/test_device_netns.py, scripts/gpu-check.sh): on this
machine (every rank at 127.0.0.1: the ranks of one host, summing through shared memory, no
service, no root), or under torchrun on a testbed (the aggregator). Writes OUT/rank{R}.json and
OUT/bits{R}.npz.

    python device_ranks.py --out DIR --rank R --world W --port P --device cpu|cuda --phases bits,ddp,gloo,bench
    torchrun ... device_ranks.py --out DIR --device cuda --phases ...   # as torchrun and NICOFFLOAD_* say

bits   every case through the host path (NICOFFLOAD_DEVICE_PATH=host) and the device path
       (=device on CPU tensors, =auto on CUDA ones): both results kept, to compare bit for bit
ddp    a small model trained with DDP through the device path, through the host path, and
       through the group's gloo (on the same device)
gloo   calls the offload does not take, on the device's tensors (broadcast, all_gather, send/recv)
bench  16 MiB all-reduces, each path and gloo, interleaved and timed; the device path's copy counters
ddpbench  DDP step times on each path and gloo (an 8.4 M-parameter model), interleaved runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import nicoffload.torch  # noqa: F401  (registers the backend)
from nicoffload.torch.device import path as devicepath

if os.environ.get("NICOFFLOAD_BENCH_STAGED_CHUNK"):  # scripts/device_bench.py: the chunk's size, A/B
    devicepath.STAGED_CHUNK = int(os.environ["NICOFFLOAD_BENCH_STAGED_CHUNK"])

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def tensor(case: str, rank: int, n: int, dtype: torch.dtype, dev: str) -> torch.Tensor:
    """Seeded inputs over several decades; ``sparse``: three quarters of the blocks zero."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 4, (n,), generator=g)
    if "sparse" in case:
        blocks = x[: n // 1024 * 1024].view(-1, 1024)
        blocks[torch.rand(blocks.shape[0], generator=g) < 0.75] = 0
        x[n // 4:n // 4 + 40_000] = -0.0  # whole chunks zero everywhere (the sum is +0.0)
    if "nan" in case and rank == 1:
        x[n // 2] = float("nan")
    return x.to(dtype).to(dev)


def run_with(setting: str, fn):
    os.environ["NICOFFLOAD_DEVICE_PATH"] = setting
    try:
        return fn()
    finally:
        os.environ.pop("NICOFFLOAD_DEVICE_PATH", None)


def bits_phase(rank: int, world: int, dev: str, fast: str) -> tuple[dict, dict]:
    """Every case on both paths: (arrays to save, errors by case)."""
    saved, errors = {}, {}
    cases = [(f"{d}-{kind}-{op}", d, kind, op) for d in DTYPES for kind in ("dense", "sparse")
             for op in ("sum", "avg")] + [("float32-nan-sum", "float32", "nan", "sum")]
    for name, d, kind, op in cases:
        for setting in ("host", fast):
            t = tensor(name, rank, 70_000 + 13, DTYPES[d], dev)
            if kind == "dense" and op == "avg":
                t = t.view(-1)[:68_000].view(-1, 17)[:, ::2]  # strided: a copy in and out
            o = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
            try:
                run_with(setting, lambda: dist.all_reduce(t, op=o))
                saved[f"{name}/{setting}"] = t.cpu().contiguous().view(torch.uint8).numpy()
            except Exception as e:
                errors[f"{name}/{setting}"] = f"{type(e).__name__}: {e}"
    for setting in ("host", fast):  # reduce-scatter: the sum of the whole input, this rank's chunk
        t = tensor("rs", rank, world * 5000, torch.float32, dev)
        out = torch.empty(5000, device=dev)
        run_with(setting, lambda: dist.reduce_scatter_tensor(out, t))
        saved[f"reduce_scatter/{setting}"] = out.cpu().view(torch.uint8).numpy()
    return saved, errors


def train(dev: str, rank: int, group=None, steps: int = 12) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    m = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev), process_group=group)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g).to(dev), torch.randint(0, 10, (32,), generator=g).to(dev)
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m


def params(m) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()]).numpy()


def ddp_phase(rank: int, dev: str, fast: str, gloo) -> dict:
    t0 = time.perf_counter()
    dev_p = params(run_with(fast, lambda: train(dev, rank)))
    t1 = time.perf_counter()
    host_p = params(run_with("host", lambda: train(dev, rank)))
    t2 = time.perf_counter()
    gloo_p = params(train(dev, rank, gloo))
    t3 = time.perf_counter()
    return {"ddp_device_equals_host": dev_p.tobytes() == host_p.tobytes(),
            "ddp_vs_gloo": float(np.abs(dev_p - gloo_p).max()),
            "ddp_s": {"device": t1 - t0, "host": t2 - t1, "gloo": t3 - t2}}


def gloo_phase(rank: int, world: int, dev: str) -> dict:
    b = torch.full((1000,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    outs = [torch.empty(10, device=dev) for _ in range(world)]
    dist.all_gather(outs, torch.full((10,), float(rank), device=dev))
    p2p = torch.full((7,), float(rank), device=dev)
    if rank == 0:
        dist.send(p2p, dst=1)
    elif rank == 1:
        dist.recv(p2p, src=0)
    return {"broadcast": bool((b == 1).all()), "all_gather": [float(o[0]) for o in outs],
            "send_recv": float(p2p[0])}


def bench_phase(dev: str, fast: str, reps: int, gloo=None, profile: str | None = None) -> dict:
    """16 MiB all-reduces on each path (and through ``gloo``, the group's gloo, when given),
    interleaved rep by rep in a rotating order, so a drift of the machine weighs on each alike.
    ``profile``: a folder where rank 0 writes profile.txt: each path's cProfile (cumulative, top
    30) and, on CUDA, torch.profiler's tables of five more calls."""
    import cProfile
    import io
    import pstats

    n = 4 << 20  # 16 MiB of float32
    paths = [fast, "host"] + (["gloo"] if gloo is not None else [])
    base = torch.randn(n, device=dev)
    ts = {p: base.clone() for p in paths}
    times: dict = {p: [] for p in paths}
    copies: dict = {p: {} for p in paths}
    profs = {p: cProfile.Profile() for p in paths} if profile and dist.get_rank() == 0 else {}

    def call(p: str) -> None:
        if p == "gloo":
            dist.all_reduce(ts[p], group=gloo)
        else:
            run_with(p, lambda: dist.all_reduce(ts[p]))

    for p in paths:  # untimed: each path's first call loads its kernels and fills the caches
        call(p)
    if dev == "cuda":
        torch.cuda.synchronize()
    for i in range(reps):
        for p in paths[i % len(paths):] + paths[:i % len(paths)]:
            ts[p].copy_(base)
            dist.barrier()
            if dev == "cuda":
                torch.cuda.synchronize()
            before = devicepath.STATS.as_dict()
            prof = profs.get(p)
            if prof:
                prof.enable()
            s = time.perf_counter()
            call(p)
            if dev == "cuda":
                torch.cuda.synchronize()
            times[p].append(time.perf_counter() - s)
            if prof:
                prof.disable()
            after = devicepath.STATS.as_dict()
            for k in after:
                copies[p][k] = copies[p].get(k, 0) + (after[k] - before[k]) / reps
    text = []
    for p, prof in profs.items():
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
        head = f"=== {p}: cProfile of {reps} calls, by cumulative time\n"
        text.append(head + buf.getvalue() + _kernels(p, ts[p], gloo))
    if profs:
        Path(profile, "profile.txt").write_text("\n\n".join(text))
    if profile and not profs:  # the other ranks take part in the profiled calls of _kernels
        for p in paths:
            _kernels(p, ts[p], gloo)
    return {p: {"median_ms": 1e3 * float(np.median(times[p])), "min_ms": 1e3 * min(times[p]),
                "copies": copies[p]} for p in paths}


def _kernels(path: str, t: torch.Tensor, gloo, calls: int = 5) -> str:
    """On CUDA: ``calls`` all-reduces of ``t`` on ``path`` under torch.profiler (the CPU's
    operators and the device's kernels and copies), its table by total time; else ""."""
    if t.device.type != "cuda":
        return ""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            dist.barrier()
            if path == "gloo":
                dist.all_reduce(t, group=gloo)
            else:
                run_with(path, lambda: dist.all_reduce(t))
            torch.cuda.synchronize()
    if dist.get_rank() != 0:
        return ""
    try:
        avg = prof.key_averages()
        return "".join(f"\n\ntorch.profiler, {calls} calls, by {k}:\n"
                       + avg.table(sort_by=k, row_limit=30, max_name_column_width=60)
                       for k in ("cpu_time_total", "self_cuda_time_total"))
    except Exception as e:  # a profiler without the device's counters: the cProfile stands alone
        return f"\n\ntorch.profiler gave no table: {type(e).__name__}: {e}"


def ddp_bench(dev: str, fast: str, gloo, steps: int, rounds: int = 3) -> dict:
    """Step times of DDP on a model of 8.4 M parameters (two buckets' worth and more) through the
    device path, the host path and the group's gloo, in ``rounds`` interleaved runs of ``steps``
    steps each (after two steps of warm-up); the median step of each path, in ms."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model(group):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to(dev)
        return DDP(m, process_group=group)

    rank = dist.get_rank()
    steps_ms: dict = {p: [] for p in (fast, "host", "gloo")}
    for _ in range(rounds):
        for p in steps_ms:
            m = model(gloo if p == "gloo" else None)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank)).to(dev)

            def step():
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
                if dev == "cuda":
                    torch.cuda.synchronize()

            def timed():
                for k in range(steps + 2):
                    s = time.perf_counter()
                    step()
                    if k >= 2:
                        steps_ms[p].append(1e3 * (time.perf_counter() - s))

            if p == "gloo":
                timed()
            else:
                run_with(p, timed)
            dist.barrier()
    return {p: float(np.median(v)) for p, v in steps_ms.items()}


def setup(a) -> tuple[int, int]:
    """Join the group: under torchrun (RANK in the environment) as it says, with its
    NICOFFLOAD_* settings (a service: the aggregator mode); else rank ``--rank`` of ``--world``
    at 127.0.0.1 (the ranks of one host: shared memory, no service)."""
    if a.rank is None and "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        rank, world, local = a.rank, a.world, a.rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), NICOFFLOAD_REQUIRE_OFFLOAD="1")
        os.environ.pop("NICOFFLOAD_SERVICE", None)
    if a.device == "cuda":
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nicoffload", rank=rank, world_size=world)
    return rank, world


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--port", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--phases", default="bits")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", help="bench: rank 0 writes each path's cProfile into this folder")
    ap.add_argument("--chunk", type=int, default=16384, help="elements per chunk of the device path's pipeline "
                    "in the bits and ddp phases (small: several chunks, some zero everywhere)")
    a = ap.parse_args()
    out = Path(a.out)
    report: dict = {"rank": a.rank}
    fast = "device" if a.device == "cpu" else "auto"
    try:
        rank, world = setup(a)
        report["rank"] = rank
        if a.device == "cuda":
            report["gpu"] = torch.cuda.get_device_name()
        report["group"] = repr(dist.distributed_c10d._get_default_group())
        phases = a.phases.split(",")
        chunks = devicepath.CHUNK, devicepath.STAGED_CHUNK
        devicepath.CHUNK = devicepath.STAGED_CHUNK = a.chunk
        if "bits" in phases:
            saved, report["errors"] = bits_phase(rank, world, a.device, fast)
            np.savez(out / f"bits{rank}.npz", **saved)
        gloo = dist.new_group(backend="gloo") if {"ddp", "gloo", "bench", "ddpbench"} & set(phases) else None
        if "ddp" in phases:
            report["ddp"] = ddp_phase(rank, a.device, fast, gloo)
        if "gloo" in phases:
            report["gloo"] = gloo_phase(rank, world, a.device)
        devicepath.CHUNK, devicepath.STAGED_CHUNK = chunks
        if "bench" in phases:
            report["bench"] = bench_phase(a.device, fast, a.reps, gloo, a.profile)
        if "ddpbench" in phases:
            report["ddp_bench"] = ddp_bench(a.device, fast, gloo, a.reps)
        report["stats"] = devicepath.STATS.as_dict()
        dist.destroy_process_group()
    except BaseException as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
