#!/usr/bin/env python3
"""Train a small MLP with PyTorch DistributedDataParallel on a namespace testbed, twice with the
same seeds: once with DDP's default all-reduce (gloo, TCP between the ranks) and once with every
gradient bucket summed by nicoffload (the XDP aggregator, or the user-space one). Prints both
loss curves and final accuracies side by side, the time per training step of each, and writes a
PNG of the curves.

    sudo .venv/bin/python examples/train_ddp.py                      # 2 ranks, 50 steps, XDP
    sudo .venv/bin/python examples/train_ddp.py --workers 4 --steps 100 --aggregator userspace

Needs root (namespaces, XDP) and the torch extra: pip install 'nicoffload[torch]'.
Same as ``nicoffload train-demo``; this script shows the pieces:

* each rank is ``python -m nicoffload.lab.train.ddp_rank`` started inside its worker's namespace
  (``tb.popen``), with MASTER_ADDR = worker 0's address and GLOO_SOCKET_IFNAME = its own
  interface, so gloo bootstraps the ranks over the testbed, never in the root namespace;
* in the nicoffload run a rank does what any training script would do::

      state = NicoffloadHookState(aggregator, group=..., local_ip=..., port=...)
      ddp_model.register_comm_hook(state, nicoffload_hook)

  (see ``train`` in nicoffload/lab/train/ddp_rank.py);
* each rank writes a JSON report and its final parameters to a temp dir, gathered here.

The data: scikit-learn's digits when sklearn is importable (``--data auto``), otherwise seeded
synthetic classification data (64 features, 10 classes).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--aggregator", choices=["xdp", "userspace"], default="xdp")
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("."), help="directory for train_ddp.png")
    args = p.parse_args()

    from nicoffload.errors import NicoffloadError
    from nicoffload.lab.train.ddp_rank import MASTER_PORT, resolve_data
    from nicoffload.lab.train.ddp_train import format_summary, launch, plot, require_torch, summarize
    from nicoffload.lab.jobs import tempdir
    from nicoffload.testbed.testbed import running

    try:
        require_torch()
        if os.geteuid() != 0:
            raise NicoffloadError("run as root: the testbed needs network namespaces and XDP")
        data = resolve_data(args.data)
        with running(args.workers) as tb, tempdir() as d:
            print(f"testbed {tb.name}: {args.workers} workers, aggregator {tb.agg.ip}", file=sys.stderr)
            runs = []
            for i, kind in enumerate(("gloo", "nicoffload")):
                print(f"training with {kind} ...", file=sys.stderr, flush=True)
                run = launch(tb, kind, Path(d), aggregator=args.aggregator, steps=args.steps, seed=args.seed,
                             data=data, master_port=MASTER_PORT + i)
                runs.append(run.check())  # a failed rank raises, naming it and its error
        summary = summarize(*runs)
    except NicoffloadError as e:
        print(f"train_ddp: {e}", file=sys.stderr)
        return e.exit_code
    print(format_summary(summary))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"curves: {plot(summary, args.out / 'train_ddp.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
