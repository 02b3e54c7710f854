"""The compute floor of `train-demo --backend`'s step: W processes train the demo's model with
its defaults (one thread each, the same batches) and no AllReduce at all, side by side as the
ranks of a run share the machine. Any collective adds to this, so a step time below it is out
of reach on this machine whatever the backend does.

    .venv/bin/python scripts/ddp_floor.py [--workers 4] [--steps 30] [--no-step] [-- RANK_ARGS]

RANK_ARGS are train-demo's rank flags (``-- --optimizer adamw``: the transformer with AdamW);
``--no-step`` leaves the optimizer's step out (what a rank does with the optimizer in the
aggregator: forward and backward only).

Prints each process's median step (steps 3.. like train-demo) and the median over steps of the
slowest process, which is what train-demo reports."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def _rank(rank: int, world: int, steps: int, extra: list[str], with_step: bool, q) -> None:
    import torch
    import torch.nn.functional as F

    from nicoffload.lab.train import transformer
    from nicoffload.lab.train.data import batch_indices
    from nicoffload.lab.train.ddp_rank import build_parser, task

    torch.set_num_threads(1)  # as every rank of train-demo
    args = build_parser().parse_args(["--rank", str(rank), "--world", str(world), "--allreduce", "gloo",
                                      "--out", "/dev/null", "--steps", str(steps), *extra])
    args = transformer.resolve(args)
    (xtr, ytr, _, _), model = task(args)
    opt = transformer.torch_optimizer(args, model.parameters())
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    times = []
    for step in range(steps):
        idx = torch.from_numpy(batch_indices(step, rank, world, args.batch, len(ytr), args.seed))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xtr_t[idx]).flatten(0, -2), ytr_t[idx].flatten())
        loss.backward()
        if with_step:
            opt.step()
        times.append(time.perf_counter() - t0)
    q.put((rank, times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-step", action="store_true", help="forward and backward only")
    p.add_argument("rank_args", nargs="*", help="train-demo's rank flags, after --")
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a.workers, a.steps, a.rank_args, not a.no_step, q))
             for r in range(a.workers)]
    for pr in procs:
        pr.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for pr in procs:
        pr.join()
    per_step = [max(got[r][s] for r in got) for s in range(3, a.steps)]
    each = {r: sorted(t[3:])[len(t[3:]) // 2] * 1e3 for r, t in sorted(got.items())}
    slowest = sorted(per_step)[len(per_step) // 2] * 1e3
    print(json.dumps({"workers": a.workers, "rank_args": a.rank_args, "step": not a.no_step,
                      "rank_median_ms": each, "slowest_rank_median_ms": slowest}))


if __name__ == "__main__":
    main()
