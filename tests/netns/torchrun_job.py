"""A training script's collectives under torchrun, with the backend "nicoffload" as the default
group (``import nicoffload.torch`` and ``dist.init_process_group("nicoffload")``), checked on every rank
against what each rank can compute itself (every rank's inputs come from seeded generators).
Writes ``OUT/rank{R}.json``: one entry per check (name, ok, detail) and timings.

    torchrun ... torchrun_job.py --out DIR --phases collectives,ddp,fsdp,optimizer
    torchrun ... torchrun_job.py --out DIR --phases train --die-rank 2 --die-at 5   # a rank dies
    NICOFFLOAD_METRICS_PORT=P torchrun ... torchrun_job.py --out DIR --phases metrics   # scrapes
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import nicoffload.torch  # noqa: F401  (registers the backend)
from torchrun_checks import CHECKS, REPORT, check, collectives, inputs, within  # noqa: E402  (this script's folder)

def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(steps)]


def train(wrap, rank: int, steps: int, die: tuple[int, int] | None = None):
    m = wrap(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    t0 = time.perf_counter()
    for s, (x, y) in enumerate(batches(rank, steps)):
        if rank == 0 and os.environ.get("TORCHRUN_JOB_PROGRESS"):  # the test acts at a step it picks
            Path(REPORT["out"], "progress").write_text(str(s))
        if die and die == (rank, s):  # a rank dies mid-training: no clean-up, no goodbye
            (Path(REPORT["out"]) / f"died{rank}").write_text(str(time.time()))
            os._exit(3)
        loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m, loss.item(), (time.perf_counter() - t0) / steps


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def compare(name: str, a: nn.Module, b: nn.Module, tol: float) -> None:
    d = max(float((full(x) - full(y)).abs().max()) for x, y in zip(a.parameters(), b.parameters()))
    check(name, d <= tol, f"max parameter difference {d:.3g} (tolerance {tol:g})")


def ddp(rank: int, world: int, gloo) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    m1, _, t1 = train(lambda m: DDP(m), rank, 20)
    m2, _, t2 = train(lambda m: DDP(m, process_group=gloo), rank, 20)
    compare("ddp-vs-gloo", m1, m2, 1e-4)

    def powersgd(group):  # torch's PowerSGD hook: its all-reduces chained through futures
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        def wrap(m):
            d = DDP(m, process_group=group)
            d.register_comm_hook(ps.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                                  start_powerSGD_iter=2, min_compression_rate=1.0), ps.powerSGD_hook)
            return d
        return wrap

    p1, _, _ = within("ddp-powersgd", 120, lambda: train(powersgd(None), rank, 8))
    p2, _, _ = train(powersgd(gloo), rank, 8)
    compare("ddp-powersgd-vs-gloo", p1, p2, 1e-4)
    return {"ddp_step_s": t1, "ddp_gloo_step_s": t2}


def fsdp(rank: int, world: int, gloo) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    def two(group):
        def wrap(m):
            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in m:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            return fully_shard(m, mesh=mesh)
        return wrap

    f1, _, t1 = train(two(dist.group.WORLD), rank, 10)
    f2, _, t2 = train(two(gloo), rank, 10)
    compare("fsdp2-vs-gloo", f1, f2, 1e-4)
    g1, _, t3 = train(lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")), rank, 10)
    g2, _, t4 = train(lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu"), process_group=gloo),
                      rank, 10)
    with FullyShardedDataParallel.summon_full_params(g1), FullyShardedDataParallel.summon_full_params(g2):
        compare("fsdp1-vs-gloo", g1, g2, 1e-4)
    return {"fsdp2_step_s": t1, "fsdp2_gloo_step_s": t2, "fsdp1_step_s": t3, "fsdp1_gloo_step_s": t4}


def offloaded_vs_torch(name: str, rank: int, world: int, gloo, optimizer: dict, reference, tol: float) -> None:
    """8 steps with the optimizer in the aggregator (a job the service grants) against the torch
    optimizer ``reference(params)`` on gloo-averaged gradients, from the same parameters."""
    from nicoffload.ddp import OffloadedOptimizer

    m, ref = model(), model()
    opt = OffloadedOptimizer(m.parameters(), optimizer=optimizer)
    torch_opt = reference(ref.parameters())
    for x, y in batches(rank, 8):
        for net in (m, ref):
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        for p in ref.parameters():
            dist.all_reduce(p.grad, group=gloo)
            p.grad /= world
        torch_opt.step()
    compare(name, m, ref, tol)
    opt.close()


def optimizer(rank: int, world: int, gloo) -> dict:
    offloaded_vs_torch("optimizer-offload-vs-sgd", rank, world, gloo, dict(lr=0.05, momentum=0.9),
                       lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 1e-3)
    offloaded_vs_torch("optimizer-offload-vs-adamw", rank, world, gloo, dict(kind="adamw", lr=1e-2),
                       lambda ps: torch.optim.AdamW(ps, lr=1e-2), 1e-4)
    return {}


def bits(rank: int, world: int, out: Path) -> dict:
    """The raw bytes of all-reduces of fixed inputs (every rank's input depends on its rank only),
    saved for a comparison between placements: 2 hosts x 2 ranks against 4 hosts x 1."""
    got = {}
    for dtype in (torch.int32, torch.float32, torch.bfloat16, torch.float64):
        for sparse in (False, True):
            x = inputs(f"bits-{dtype}", rank, (256 * 97 + 13,), dtype)
            if sparse:  # zero blocks: some on every rank, some on this rank only
                x.view(-1)[: 256 * 30] = 0
                x.view(-1)[256 * (40 + rank * 5): 256 * (45 + rank * 5)] = 0
            dist.all_reduce(x)
            got[f"{dtype}-{'sparse' if sparse else 'dense'}"] = x.view(torch.uint8).numpy().copy() \
                if dtype != torch.bfloat16 else x.view(torch.int16).numpy().copy()
    np.savez(out / f"bits{rank}.npz", **got)
    return {"path": repr(dist.distributed_c10d._get_default_group())}


def metrics(rank: int, world: int) -> dict:
    """Known calls on each path (NICOFFLOAD_METRICS_PORT set): 7 offloaded all-reduces of 1000
    float32, an int64 all-reduce (the gloo fallback), a broadcast (gloo), a barrier (offload);
    then every rank's /metrics (its address, port P + its local rank) and the service's, scraped
    while every rank is still up."""
    import urllib.request

    for i in range(7):
        dist.all_reduce(torch.full((1000,), float(rank + i)))
    dist.all_reduce(torch.ones(10, dtype=torch.int64))
    dist.broadcast(torch.zeros(10), 0)
    dist.barrier()
    port = int(os.environ["NICOFFLOAD_METRICS_PORT"])
    pg = dist.distributed_c10d._get_default_group()

    def get(url: str) -> str:
        return urllib.request.urlopen(url, timeout=10).read().decode()

    ips = pg.addresses  # rank r serves on P + its local rank: the ranks before it on its host
    out = {"rank_metrics": {str(r): get(f"http://{ip}:{port + ips[:r].count(ip)}/metrics") for r, ip in enumerate(ips)},
           "job": pg.grant.job if pg.grant is not None else None}
    if rank == 0:
        out["service_metrics"] = get(os.environ["NICOFFLOAD_SERVICE"].split(",")[0] + "/metrics")
    dist.barrier()  # nobody leaves before every rank has scraped
    return out


def slow_setup(seconds: float) -> None:
    """This rank's group set-up takes ``seconds`` longer (as a first run's compiling does)."""
    from nicoffload.torch.paths import GroupPaths

    setup = GroupPaths._setup_offload

    def slow(self):
        time.sleep(seconds)
        setup(self)

    GroupPaths._setup_offload = slow


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="collectives")
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--slow-setup", default="", help="RANK:SECONDS: that rank's group set-up takes so much longer")
    a = p.parse_args()
    if a.slow_setup and a.slow_setup.split(":")[0] == os.environ.get("RANK"):
        slow_setup(float(a.slow_setup.split(":")[1]))
    t0 = time.perf_counter()
    dist.init_process_group("nicoffload")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = REPORT
    report |= {"rank": rank, "world": world, "init_s": time.perf_counter() - t0, "out": a.out,
               "backend": dist.get_backend(), "group": repr(dist.distributed_c10d._get_default_group())}
    out = Path(a.out)
    try:
        phases = a.phases.split(",")
        gloo = dist.new_group(backend="gloo") if set(phases) & {"ddp", "fsdp", "optimizer"} else None
        for ph in phases:
            if ph == "collectives":
                collectives(rank, world)
            elif ph == "ddp":
                report |= ddp(rank, world, gloo)
            elif ph == "fsdp":
                report |= fsdp(rank, world, gloo)
            elif ph == "bits":
                report |= bits(rank, world, out)
            elif ph == "optimizer":
                report |= optimizer(rank, world, gloo)
            elif ph == "metrics":
                report |= metrics(rank, world)
            elif ph == "train":
                from torch.nn.parallel import DistributedDataParallel as DDP

                m, loss, step = train(lambda m: DDP(m), rank, a.steps, die=(a.die_rank, a.die_at))
                report |= {"loss": loss, "step_s": step, "stats": dist.distributed_c10d._get_default_group().stats()}
                (out / f"params{rank}.bin").write_bytes(b"".join(p.detach().numpy().tobytes() for p in m.parameters()))
        dist.destroy_process_group()
        if "collectives" in phases:  # the group made again in the same process: a job of its own
            dist.init_process_group("nicoffload")
            t = torch.full((5000,), float(rank))
            dist.all_reduce(t)
            check("init-again-after-destroy", torch.equal(t, torch.full((5000,), float(sum(range(world))))))
            dist.destroy_process_group()
    except Exception as e:
        report["error_at"] = time.time()
        report["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        report["error_type"] = type(e).__name__
    report["checks"] = CHECKS
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(1 if "error" in report or not all(c["ok"] for c in CHECKS) else 0)


if __name__ == "__main__":
    main()
