"""``nicoffload train-demo``: PyTorch DistributedDataParallel trained twice on a namespace
testbed with the same seeds, once with DDP's default gloo all-reduce and once through nicoffload
(the DDP hook of :mod:`nicoffload.ddp`), compared side by side: loss curves, final accuracy,
time per training step, how far the parameters drifted apart; a PNG of both curves.

Arguments only; the training and the comparison are :mod:`nicoffload.lab.train.ddp_train`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from nicoffload.cli.app import add_examples
from nicoffload.errors import InputError
from nicoffload.jobspec import JobSpec
from nicoffload.lab.train.ddp_rank import TRAIN_TIMEOUT
from nicoffload.wire import proto


def register(sub) -> None:
    p = sub.add_parser("train-demo", help="DDP training through gloo and through nicoffload, compared (root, torch)")
    add_examples(p, "sudo nicoffload train-demo",
                 "sudo nicoffload train-demo --workers 4 --steps 100 --out results/",
                 "sudo nicoffload train-demo --aggregator userspace --json",
                 "sudo nicoffload train-demo --backend --workers 4        # init_process_group('nicoffload')",
                 "sudo nicoffload train-demo --backend --fsdp",
                 "sudo nicoffload train-demo --lanes 16   # 16-bit lanes against gloo with DDP's bf16_compress_hook")
    p.add_argument("--workers", type=int, default=2, help="ranks (one per testbed worker host)")
    p.add_argument("--steps", type=int, default=50, help="training steps of each run")
    p.add_argument("--aggregator", choices=["xdp", "userspace"], default="xdp",
                   help="where nicoffload sums (the gloo run needs none)")
    p.add_argument("--offload", action="store_true",
                   help="the optimizer in the aggregator (OptimusNIC): no optimizer on the ranks; runs it in the XDP "
                        "and in the user-space aggregator against torch.optim.SGD on every rank")
    p.add_argument("--backend", action="store_true",
                   help="the nicoffload run uses the torch.distributed backend 'nicoffload' as its process group "
                        "(no hook; nicoffload agg serve on the aggregator host grants the job)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard) instead of DDP in both runs (with --backend)")
    p.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                   help="where train_demo.png and train_demo.json go (default: here)")
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="auto",
                   help="auto: scikit-learn's digits if sklearn is importable, else seeded synthetic data")
    p.add_argument("--seed", type=int, default=0)
    JobSpec.add_arguments(p, only=("timeout", "elems", "lanes"), timeout=TRAIN_TIMEOUT)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_train_demo)


def _train_demo(args) -> int:
    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab.train import ddp_train
    from nicoffload.lab.train.ddp_rank import resolve_data
    from nicoffload.lab.jobs import tempdir, testbed

    ddp_train.require_torch()
    if not 1 <= args.workers <= proto.MAX_WORKERS:
        raise InputError(f"--workers must be 1..{proto.MAX_WORKERS}, not {args.workers}")
    if args.steps < 1:
        raise InputError(f"--steps must be at least 1, not {args.steps}")
    if args.fsdp and not args.backend:
        raise InputError("--fsdp goes with --backend (the DDP hook serves DDP only)")
    if args.backend and args.offload:
        raise InputError("--backend and --offload are two different runs: choose one")
    if args.spec_lanes == 16 and (args.offload or args.fsdp):
        raise InputError("--lanes 16 compares gradient all-reduces under DDP: not with --offload or --fsdp")
    spec = JobSpec.from_args(args)
    data = resolve_data(args.data)
    bpf.require_root("nicoffload train-demo (it builds a namespace testbed and loads XDP)")
    args.out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    with testbed(args.workers, spec.elems) as tb, tempdir() as d:
        runs = ddp_train.compare(tb, Path(d), spec, steps=args.steps, aggregator=args.aggregator,
                                 seed=args.seed, data=data, progress=say,
                                 offload=("xdp", "userspace") if args.offload else (), backend=args.backend,
                                 wrap="fsdp" if args.fsdp else "ddp")
    s = ddp_train.summarize(*runs)
    s["png"] = str(ddp_train.plot(s, args.out / "train_demo.png"))
    (args.out / "train_demo.json").write_text(json.dumps(s, indent=1))
    if args.json:
        print(json.dumps(s))
    else:
        print(ddp_train.format_summary(s))
        print(f"curves: {s['png']}; numbers: {args.out / 'train_demo.json'}")
    return 0
