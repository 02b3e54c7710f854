"""How train-demo shows a comparison (:func:`nicoffload.lab.train.ddp_train.summarize`'s dict):
the summary as text, and the loss and step-time curves as a PNG."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from nicoffload.lab.train.transformer import torch_name

WARMUP = 3  # steps left out of the timing: DDP's lazy set-up (step 0) and bucket rebuild (step 1)
FINAL = 5   # the final training loss: the mean over the last FINAL steps (of the same batches in every run)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _kib(v: int | None, params: int | None = None) -> str:
    per = f" ({v / params:.0f} B/p)" if v is not None and params else ""
    return "-" if v is None else f"{v / 1024:.0f} KiB{per}"


def format_summary(s: dict, rows: int = 10) -> str:
    runs = list(s["runs"].items())
    labels = [lb for lb, _ in runs]
    steps = len(runs[0][1]["losses"])
    w = max(max(len(lb) for lb in labels), 12)
    elems = next((r["elems"] for _, r in runs if r.get("elems")), None)
    per = f"; nicoffload packets carry {elems} floats" if elems else ""
    model, data = ("transformer", s["data"]) if s.get("model") == "transformer" else ("MLP", f"{s['data']} data")
    k = s.get("ranks_per_host", 1)
    hosts = f" ({s['workers'] // k} hosts x {k}, torchrun --nproc-per-node {k})" if k > 1 else ""
    lines = [f"{s['workers']} ranks{hosts}, {steps} steps, {model} with {s['parameters']} parameters on {data}{per}",
             *(f"{lb}: {r['optimizer']}" for lb, r in runs if r.get("optimizer")),
             *(f"{lb}: {r['group']}" for lb, r in runs if r.get("group")),
             "", f"{'step':>5}" + "".join(f"  {'loss ' + lb:>{w + 5}}" for lb in labels)]
    for k in sorted(set(np.linspace(0, steps - 1, min(rows, steps)).round().astype(int))):
        lines.append(f"{k:>5}" + "".join(f"  {r['losses'][k]:>{w + 5}.4f}" for _, r in runs))

    def row(name: str, fmt) -> str:
        return f"{name:<26}" + "".join(f"  {fmt(r):>{w}}" for _, r in runs)

    def mem(key: str | None, where: str = "memory"):
        """A memory row's cell: bytes ``key`` of the run's ``where`` (None: all of them)."""
        def fmt(r: dict) -> str:
            d = r.get(where)
            return _kib(None if not d else sum(d.values()) if key is None else d.get(key), s["parameters"])
        return fmt

    w = max(w, 20)
    lines += ["", f"{'':<26}" + "".join(f"  {lb:>{w}}" for lb in labels),
              row(f"final training loss (last {s.get('final_loss_steps', FINAL)})",
                  lambda r: f"{r['final_loss']:.4f}" if "final_loss" in r else "-"),
              row(f"  relative to {labels[0]}", lambda r: "-" if r.get("final_loss_rel") is None or r is runs[0][1]
                  else f"{100 * r['final_loss_rel']:+.3g}%"),
              row("final test accuracy" + (" (token)" if model == "transformer" else ""),
                  lambda r: f"{r['accuracy']:.4f}"),
              row("final test loss", lambda r: f"{r['test_loss']:.4f}"),
              row("time per step (median)", lambda r: _ms(r["step_ms"])),
              row("  of it in nicoffload", lambda r: _ms(r["allreduce_ms"]))]
    if any(r.get("memory") for _, r in runs):
        lines += [row("rank memory: parameters", mem("params")), row("  gradients", mem("grads")),
                  row("  optimizer state", mem("optimizer_state"))]
    if any(r.get("aggregator_memory") for _, r in runs):
        lines.append(row("aggregator: optimizer state", mem(None, "aggregator_memory")))
    lines.append(f"(step times: slowest rank per step, median over steps {s['warmup_steps_excluded']}.."
                 f"{steps - 1}; the gloo all-reduce is not timed separately; the final training loss is "
                 f"the mean over the last steps' global batches)")
    for label, d in (s.get("param_diff") or {}).items():
        if d is not None:
            lines.append(f"largest parameter difference after {steps} steps, {label} vs {labels[0]}: {d:.3g}")
    for label, r in runs:
        if r.get("failover"):
            lines.append(_failover_line(label, r["failover"]))
        if r.get("shadow"):
            sh = r["shadow"]
            name = torch_name(s.get("hyperparameters", {}).get("optimizer", "sgd"))
            lines.append(f"{label}: against float64 {name} on the same gradients {sh['max_diff']:.3g} "
                         f"(derived bound {sh.get('bound', float('nan')):.3g})")
    return "\n".join(lines)


def _failover_line(label: str, f: dict) -> str:
    """--kill-aggregator-at's line: what happened, how long the group took, the step times."""
    head = f"{label}: the aggregator's program detached after step {f['at_step']}"
    if not f.get("killed") or f.get("error"):
        return f"{head}: not done ({f.get('error') or 'the run ended before that step'})"
    n = sorted(set(f.get("failovers") or []))
    took = f"{f['recovery_s']:.2f} s from the kill to the first call done on the fallback" \
        if f.get("recovery_s") is not None else "no failover recorded"
    return (f"{head}: failovers per rank {n}, cause {f.get('cause')}; {took}; step time "
            f"{_ms(f.get('step_ms_before'))} on the aggregator, {_ms(f.get('cut_step_ms'))} for the cut step ({f.get('cut_step')}), "
            f"{_ms(f.get('step_ms_after'))} on the fallback" + ("" if f.get("on_fallback") else " (rejoined)"))


def plot(s: dict, path: Path) -> Path:
    """Loss per step of both runs, and time per step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [dict(lw=2.5, alpha=0.6), dict(lw=1.2, ls="--"), dict(lw=1.2, ls=":")]
    for (label, r), st in zip(s["runs"].items(), styles):
        a.plot(r["losses"], label=f"{label} (test acc {r['accuracy']:.3f})", **st)
        b.plot(r["step_ms_each"], label=f"{label} (median {r['step_ms']:.2f} ms)", **st)
    a.set(xlabel="step", ylabel="training loss (global batch)",
          title=f"{s.get('wrap', 'ddp').upper()}, {s['workers']} ranks, {s.get('model', 'mlp')}, "
                f"{s.get('hyperparameters', {}).get('optimizer', 'sgd')}: loss per step")
    b.set(xlabel="step", ylabel="ms", title="time per training step (slowest rank)", yscale="log")
    for r in s["runs"].values():
        if (r.get("failover") or {}).get("killed"):
            for ax in (a, b):
                ax.axvline(r["failover"]["at_step"], color="red", lw=0.8, ls="-.", label="aggregator killed")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
