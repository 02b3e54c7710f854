"""``nicoffload train-demo``: PyTorch DistributedDataParallel trained twice on a namespace
testbed with the same seeds, once with DDP's default gloo all-reduce and once through nicoffload
(the DDP hook of :mod:`nicoffload.ddp`), compared side by side: loss curves, final accuracy,
time per training step, how far the parameters drifted apart; a PNG of both curves.

The comparison itself (:func:`compare`, :func:`summarize`, :func:`format_summary`,
:func:`plot`) is also what ``examples/train_ddp.py`` uses."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from . import proto
from .cli import add_examples
from .errors import InputError, SetupError

WARMUP = 3  # steps left out of the timing: DDP's lazy set-up (step 0) and bucket rebuild (step 1)


def require_torch() -> None:
    """Raise SetupError (one line) unless PyTorch with gloo is importable."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise SetupError(f"train-demo needs PyTorch, which is not importable ({e}); install the extra: "
                         f"pip install 'nicoffload[torch]' (torch==2.13.0, the CPU wheel)") from None
    if not (dist.is_available() and dist.is_gloo_available()):
        raise SetupError(f"train-demo needs torch.distributed with gloo; this torch {torch.__version__} has none")


def register(sub) -> None:
    p = sub.add_parser("train-demo", help="DDP training through gloo and through nicoffload, compared (root, torch)")
    add_examples(p, "sudo nicoffload train-demo",
                 "sudo nicoffload train-demo --workers 4 --steps 100 --out results/",
                 "sudo nicoffload train-demo --aggregator userspace --json")
    p.add_argument("--workers", type=int, default=2, help="ranks (one per testbed worker host)")
    p.add_argument("--steps", type=int, default=50, help="training steps of each run")
    p.add_argument("--aggregator", choices=["xdp", "userspace"], default="xdp",
                   help="where nicoffload sums (the gloo run needs none)")
    p.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                   help="where train_demo.png and train_demo.json go (default: here)")
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="auto",
                   help="auto: scikit-learn's digits if sklearn is importable, else seeded synthetic data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds without progress before a nicoffload all-reduce fails")
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS,
                   help="float32 elements per packet (the testbed's MTU follows; "
                        f"up to {proto.max_elems_for_mtu(proto.MAX_MTU)} on veth)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_train_demo)


# --- the comparison -------------------------------------------------------------------------
def compare(tb, workdir: Path, *, steps: int = 50, aggregator: str = "xdp", seed: int = 0,
            data: str = "synthetic", timeout: float = 5.0, elems: int = proto.DEFAULT_ELEMS, progress=None):
    """Both runs on testbed ``tb`` with the same seeds: (gloo Run, nicoffload Run), each
    checked (a failed rank raises, naming it)."""
    from .ddp_rank import MASTER_PORT, launch

    runs = []
    for i, kind in enumerate(("gloo", "nicoffload")):
        if progress:
            progress(f"training {len(tb.workers)} ranks x {steps} steps with "
                     f"{'DDP default (gloo)' if kind == 'gloo' else f'nicoffload ({aggregator})'} ...")
        runs.append(launch(tb, kind, workdir, aggregator=aggregator, steps=steps, seed=seed, data=data,
                           timeout=timeout, elems=elems, master_port=MASTER_PORT + i).check())
    return runs[0], runs[1]


def _median_ms(x: np.ndarray | None) -> float | None:
    if x is None or not len(x):
        return None
    tail = x[WARMUP:] if len(x) > 2 * WARMUP else x
    return float(np.median(tail) * 1e3)


def summarize(gloo, nco) -> dict:
    """Everything worth showing, JSON-able."""
    r0g, r0n = gloo.ranks[0], nco.ranks[0]
    diff = float(np.max(np.abs(r0g.params.astype(np.float64) - r0n.params))) if \
        r0g.params is not None and r0n.params is not None else None
    out = {"workers": len(gloo.ranks), "steps": r0g.report["steps"], "data": r0g.report["data"],
           "parameters": r0g.report["parameters"], "warmup_steps_excluded": WARMUP, "max_param_diff": diff,
           "runs": {}}
    for run in (gloo, nco):
        ar = run.allreduce_seconds()
        hook = run.ranks[0].report.get("hook") or {}
        out["runs"][run.label] = {
            "allreduce": run.allreduce, "aggregator": run.aggregator, "elems": run.elems,
            "losses": [float(v) for v in run.mean_losses()],
            "accuracy": run.accuracy, "test_loss": run.ranks[0].report["test_loss"],
            "step_ms": _median_ms(run.step_seconds()),
            "step_ms_each": [float(v * 1e3) for v in run.step_seconds()],
            "allreduce_ms": _median_ms(ar),
            "packets_sent": hook.get("packets_sent"), "retransmissions": hook.get("retransmissions"),
            "seconds": run.seconds,
        }
    return out


def format_summary(s: dict, rows: int = 10) -> str:
    (lg, g), (ln, n) = s["runs"].items()
    steps = len(g["losses"])
    w = max(len(lg), len(ln), 12)
    per = f"; nicoffload packets carry {n['elems']} floats" if n.get("elems") else ""
    lines = [f"{s['workers']} ranks, {steps} steps, MLP with {s['parameters']} parameters on {s['data']} data{per}",
             "", f"{'step':>5}  {'loss ' + lg:>{w + 5}}  {'loss ' + ln:>{w + 5}}"]
    for k in sorted(set(np.linspace(0, steps - 1, min(rows, steps)).round().astype(int))):
        lines.append(f"{k:>5}  {g['losses'][k]:>{w + 5}.4f}  {n['losses'][k]:>{w + 5}.4f}")

    def ms(v):
        return "-" if v is None else f"{v:.2f} ms"

    lines += ["",
              f"{'':<26}{lg:>{w}}  {ln:>{w}}",
              f"{'final test accuracy':<26}{g['accuracy']:>{w}.4f}  {n['accuracy']:>{w}.4f}",
              f"{'final test loss':<26}{g['test_loss']:>{w}.4f}  {n['test_loss']:>{w}.4f}",
              f"{'time per step (median)':<26}{ms(g['step_ms']):>{w}}  {ms(n['step_ms']):>{w}}",
              f"{'  of it in the all-reduce':<26}{ms(g['allreduce_ms']):>{w}}  {ms(n['allreduce_ms']):>{w}}",
              f"(step times: slowest rank per step, median over steps {s['warmup_steps_excluded']}.."
              f"{steps - 1}; the gloo all-reduce is not timed separately)"]
    if s["max_param_diff"] is not None:
        lines.append(f"largest parameter difference after {steps} steps: {s['max_param_diff']:.3g}")
    return "\n".join(lines)


def plot(s: dict, path: Path) -> Path:
    """Loss per step of both runs, and time per step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [dict(lw=2.5, alpha=0.6), dict(lw=1.2, ls="--")]
    for (label, r), st in zip(s["runs"].items(), styles):
        a.plot(r["losses"], label=f"{label} (test acc {r['accuracy']:.3f})", **st)
        b.plot(r["step_ms_each"], label=f"{label} (median {r['step_ms']:.2f} ms)", **st)
    a.set(xlabel="step", ylabel="training loss (global batch)",
          title=f"DDP, {s['workers']} ranks: loss per step")
    b.set(xlabel="step", ylabel="ms", title="time per training step (slowest rank)", yscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the command ----------------------------------------------------------------------------
def _train_demo(args) -> int:
    require_torch()
    from . import bpf
    from .ddp_rank import resolve_data
    from .runner import tempdir

    if not 1 <= args.workers <= proto.MAX_WORKERS:
        raise InputError(f"--workers must be 1..{proto.MAX_WORKERS}, not {args.workers}")
    if args.steps < 1:
        raise InputError(f"--steps must be at least 1, not {args.steps}")
    max_e = proto.max_elems_for_mtu(proto.MAX_MTU)
    if not 1 <= args.elems <= max_e:
        raise InputError(f"--elems must be 1..{max_e} (the largest MTU native XDP on veth takes), not {args.elems}")
    data = resolve_data(args.data)
    bpf.require_root("nicoffload train-demo (it builds a namespace testbed and loads XDP)")
    args.out.mkdir(parents=True, exist_ok=True)
    from nicoffload.testbed.testbed import running

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    with running(args.workers, mtu=max(1500, proto.mtu_for_elems(args.elems))) as tb, tempdir() as d:
        gloo, nco = compare(tb, Path(d), steps=args.steps, aggregator=args.aggregator, seed=args.seed,
                            data=data, timeout=args.timeout, elems=args.elems, progress=say)
    s = summarize(gloo, nco)
    png = plot(s, args.out / "train_demo.png")
    s["png"] = str(png)
    (args.out / "train_demo.json").write_text(json.dumps(s, indent=1))
    if args.json:
        print(json.dumps(s))
    else:
        print(format_summary(s))
        print(f"curves: {png}; numbers: {args.out / 'train_demo.json'}")
    return 0
