"""A training script for torchrun whose only nicoffload change is the backend's name.

On the aggregator host (once, as root; see docs/service.md and examples/systemd/):
    sudo nicoffload agg serve --iface eth1 --listen 10.0.0.100:7470 --token-file /etc/nicoffload/token

On every worker host R of N (the master on host 0):
    NICOFFLOAD_SERVICE=http://10.0.0.100:7470 NICOFFLOAD_TOKEN_FILE=/etc/nicoffload/token \\
    torchrun --nnodes N --nproc-per-node 1 --node-rank R --master-addr HOST0 --master-port 29500 \\
        examples/train_torchrun.py

``--backend gloo`` trains the same model over gloo, for comparison. The gradients' all-reduce
(DDP's buckets) goes through the XDP aggregator; the parameters' broadcast at start-up, the
accuracy's all_reduce and the object collectives below go where the backend sends them (the
README's table). ``import nicoffload.torch`` registers the backend.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nicoffload.torch  # noqa: F401  (registers the backend "nicoffload")


def data(seed: int, n: int = 8192, d: int = 64, classes: int = 10):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * 0.8
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="nicoffload")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    dist.init_process_group(a.backend)  # the one line that differs from a gloo script
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = data(seed=1)
    mine = torch.arange(rank, len(y), world)  # this rank's share of every epoch
    t0 = time.perf_counter()
    steps = 0
    for epoch in range(a.epochs):
        perm = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(perm) - a.batch + 1, a.batch):
            idx = perm[i:i + a.batch]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        with torch.no_grad():
            correct = (model(x[mine]).argmax(1) == y[mine]).sum()
        stats = torch.tensor([float(correct), float(len(mine))])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, accuracy {stats[0] / stats[1]:.4f}", flush=True)
    seen = [None] * world
    dist.all_gather_object(seen, {"rank": rank, "steps": steps})
    if rank == 0:
        print(f"{world} ranks, {a.backend}: {(time.perf_counter() - t0) / steps * 1e3:.2f} ms per step; {seen}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
