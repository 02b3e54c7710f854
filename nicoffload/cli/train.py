"""``nicoffload train-demo``: PyTorch DistributedDataParallel trained twice on a namespace
testbed with the same seeds, once with DDP's default gloo all-reduce and once through nicoffload
(the DDP hook of :mod:`nicoffload.ddp`), compared side by side: loss curves, final accuracy,
time per training step, how far the parameters drifted apart; a PNG of both curves. The MLP with
SGD by default; ``--optimizer adamw``: a small transformer on a sorting task with AdamW.

Arguments only; the training and the comparison are :mod:`nicoffload.lab.train.ddp_train`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from nicoffload.cli.app import add_examples
from nicoffload.errors import InputError
from nicoffload.jobspec import JobSpec
from nicoffload.lab.train import transformer
from nicoffload.lab.train.ddp_rank import TRAIN_TIMEOUT
from nicoffload.wire import proto


def register(sub) -> None:
    p = sub.add_parser("train-demo", help="DDP training through gloo and through nicoffload, compared (root, torch)")
    add_examples(p, "sudo nicoffload train-demo",
                 "sudo nicoffload train-demo --workers 4 --steps 100 --out results/",
                 "sudo nicoffload train-demo --aggregator userspace --json",
                 "sudo nicoffload train-demo --backend --workers 4        # init_process_group('nicoffload')",
                 "sudo nicoffload train-demo --backend --fsdp",
                 "sudo nicoffload train-demo --backend --workers 3 --steps 60 --kill-aggregator-at 20   # failover",
                 "sudo nicoffload train-demo --workers 3 --steps 60 --kill-aggregator-at 20   # the DDP hook's",
                 "sudo nicoffload train-demo --backend --workers 2 --nproc-per-node 2   # torchrun, 2 hosts x 2 ranks",
                 "sudo nicoffload train-demo --lanes 16   # 16-bit lanes against gloo with DDP's bf16_compress_hook",
                 "sudo nicoffload train-demo --offload --optimizer adamw   # a transformer, AdamW in the aggregator",
                 "sudo nicoffload train-demo --offload --optimizer adamw --aggregator userspace --steps 20")
    p.add_argument("--workers", type=int, default=2, help="testbed worker hosts, a rank each (or --nproc-per-node)")
    p.add_argument("--steps", type=int, default=50, help="training steps of each run")
    p.add_argument("--aggregator", choices=["xdp", "afxdp", "userspace"], default=None,
                   help="where nicoffload sums (the gloo run needs none; default xdp; afxdp: the AF_XDP engine); "
                        "with --offload: only this aggregator, xdp or userspace (without it, --offload runs both "
                        "with SGD, the XDP one alone with AdamW)")
    p.add_argument("--offload", action="store_true",
                   help="the optimizer in the aggregator (OptimusNIC): no optimizer on the ranks; runs it in the XDP "
                        "and in the user-space aggregator (with AdamW in the XDP one only, unless --aggregator "
                        "names one) against the torch optimizer on every rank")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="sgd: an MLP with torch.optim.SGD (momentum 0.9); adamw: a transformer (1.6M parameters) "
                        "on a sorting task with torch.optim.AdamW, on the ranks or in the aggregator")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.05 with sgd, 1e-3 with adamw)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="weight decay (default 0 with sgd, 0.01 with adamw: decoupled, as AdamW's)")
    p.add_argument("--betas", type=transformer.betas, default=None, metavar="B1,B2",
                   help="AdamW's betas (default 0.9,0.999)")
    p.add_argument("--backend", action="store_true",
                   help="the nicoffload run uses the torch.distributed backend 'nicoffload' as its process group "
                        "(no hook; nicoffload agg serve on the aggregator host grants the job)")
    p.add_argument("--kill-aggregator-at", type=int, default=None, metavar="STEP",
                   help="detach the aggregator's XDP program once rank 0 has finished STEP steps; the group (with "
                        "--backend) or the DDP hook (failover=3) fails over to gloo over the same fixed-point "
                        "integers and training goes on; the summary shows the step times before and after")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                   help="ranks per worker host, started by torchrun --nproc-per-node K in each (with --backend: "
                        "the group reduces inside a host through shared memory, each local rank's share across "
                        "hosts through its own lane; gloo runs with the same placement; default 1)")
    p.add_argument("--pairs", type=int, default=1, metavar="N",
                   help="run the two systems N times each, the order alternating, and report each pair's step-time "
                        "ratio with the median and quartiles (drift between runs cancels; the curves are the first "
                        "pair's)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 (fully_shard) instead of DDP in both runs (with --backend)")
    p.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                   help="where train_demo.png and train_demo.json go (default: here)")
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="auto",
                   help="the MLP's: scikit-learn's digits if sklearn is importable (auto), or seeded synthetic data")
    p.add_argument("--seed", type=int, default=0)
    JobSpec.add_arguments(p, only=("timeout", "elems", "lanes"), timeout=TRAIN_TIMEOUT)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_train_demo)


def _train_demo(args) -> int:
    from nicoffload.ebpf import loader as bpf
    from nicoffload.lab.train import ddp_train, pairs
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
    if args.aggregator == "afxdp" and (args.offload or args.backend):
        raise InputError("the AF_XDP engine sums gradients only: --offload (the optimizer in the aggregator) runs "
                         "in the xdp or the userspace aggregator, --backend through the XDP aggregator's service")
    if args.nproc_per_node < 1 or args.workers * args.nproc_per_node > proto.MAX_WORKERS:
        raise InputError(f"--nproc-per-node must be at least 1, and workers x it at most {proto.MAX_WORKERS}")
    if args.nproc_per_node > 1 and not args.backend:
        raise InputError("--nproc-per-node goes with --backend (the DDP hook and --offload take one rank per host)")
    if args.kill_aggregator_at is not None:
        if not 1 <= args.kill_aggregator_at < args.steps:
            raise InputError(f"--kill-aggregator-at takes a step in 1..{args.steps - 1} (--steps {args.steps}), "
                             f"not {args.kill_aggregator_at}")
        if args.offload or args.aggregator not in (None, "xdp") or args.nproc_per_node > 1 and not args.backend:
            raise InputError("--kill-aggregator-at shows a failover: the backend's (--backend) or the DDP hook's "
                             "through the XDP aggregator, not --offload (its state lived in the aggregator)")
    if args.pairs < 1:
        raise InputError(f"--pairs must be at least 1, not {args.pairs}")
    if args.pairs > 1 and (args.kill_aggregator_at is not None or args.offload and not args.aggregator):
        raise InputError("--pairs compares two runs: not with --kill-aggregator-at, and --offload needs --aggregator")
    if args.betas is not None and args.optimizer != "adamw":
        raise InputError("--betas goes with --optimizer adamw")
    train_args = _train_args(args)
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
        runs, rows = pairs.interleaved(
            lambda **kw: ddp_train.compare(tb, spec=spec, **kw), Path(d), args.pairs, progress=say,
            steps=args.steps, aggregator=args.aggregator or "xdp", seed=args.seed, data=data,
            offload=_offload(args), backend=args.backend, wrap="fsdp" if args.fsdp else "ddp",
            train_args=train_args, nproc=args.nproc_per_node, kill_at=args.kill_aggregator_at)
    s = ddp_train.summarize(*runs)
    s["pairs"], s["pair_ratio"] = rows, pairs.summary(rows)
    s["png"] = str(ddp_train.plot(s, args.out / "train_demo.png"))
    (args.out / "train_demo.json").write_text(json.dumps(s, indent=1))
    if args.json:
        print(json.dumps(s))
    else:
        print(ddp_train.format_summary(s))
        if args.pairs > 1:
            print(pairs.line(rows))
        print(f"curves: {s['png']}; numbers: {args.out / 'train_demo.json'}")
    return 0


def _offload(args) -> tuple[str, ...]:
    """The aggregators an --offload run trains in: the one --aggregator names, or both with SGD and
    the XDP one alone with AdamW (the user-space one updates each block in numpy as its round
    completes: 2.0 s per step for the transformer's 1.6M parameters on 2 ranks, against 0.23 s
    through XDP and 0.08-0.1 s for torch.optim.AdamW over gloo)."""
    if not args.offload:
        return ()
    if args.aggregator:
        return (args.aggregator,)
    return ("xdp",) if args.optimizer == "adamw" else ("xdp", "userspace")


def _train_args(args) -> list[str]:
    """The ranks' optimizer arguments; with --offload checked here against what the aggregator
    takes (a bad value is one line, not every rank failing)."""
    from nicoffload.lab.train.ddp_train import rank_args

    out = ["--optimizer", args.optimizer]
    for flag, v in (("--lr", args.lr), ("--weight-decay", args.weight_decay),
                    ("--betas", ",".join(map(str, args.betas)) if args.betas else None)):
        if v is not None:
            out += [flag, str(v)]
    if args.offload:
        transformer.optimizer_spec(transformer.hyper(rank_args(out))).validate()
    return out
