"""PyTorch DistributedDataParallel on a namespace testbed: N ranks of
:mod:`nicoffload.lab.ddp_rank` (one per worker host), trained once with DDP's default gloo
all-reduce and once through nicoffload with the same seeds, compared side by side: loss curves,
final accuracy, time per training step, how far the parameters drifted apart; a PNG of both.
What ``nicoffload train-demo`` and ``examples/train_ddp.py`` run."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import SetupError
from ..jobspec import DEFAULT, JobSpec
from .aggregators import AggregatorProcess, on_testbed
from .ddp_rank import HOOK_FIELDS, MASTER_PORT, TRAIN_TIMEOUT, params_path
from .launcher import Launch, Outcome, RankSpec, error_class, failure, program
from .links import enable_gro

WARMUP = 3  # steps left out of the timing: DDP's lazy set-up (step 0) and bucket rebuild (step 1)
#: the nicoffload job of a training run, unless the caller gives one
TRAIN_SPEC = DEFAULT.replace(timeout=TRAIN_TIMEOUT)


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


# --- one run ----------------------------------------------------------------------------------
@dataclass
class RankOutcome:
    rank: int
    process: Outcome                # how its process ended
    report: dict | None             # the rank's JSON report (None if it wrote none)
    params: np.ndarray | None = None

    @property
    def returncode(self) -> int | None:  # None: killed at the deadline
        return self.process.returncode

    @property
    def log(self) -> str:
        return "\n".join(self.process.stdout + [self.process.stderr])

    @property
    def error(self) -> str | None:
        if self.process.ok:
            return None
        if self.returncode is not None and self.report and self.report.get("error"):
            return self.report["error"]
        return self.process.reason

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def error_class(self):
        return error_class(self.returncode)

    def describe(self) -> str:
        return f"rank {self.rank}: {self.error}"


@dataclass
class Run:
    """One training job: what ran and each rank's outcome (by rank)."""

    allreduce: str                  # "gloo" or "nicoffload"
    aggregator: str | None          # "xdp" | "userspace" for nicoffload
    elems: int | None = None        # float32 elements per packet, for nicoffload
    ranks: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return "gloo" if self.allreduce == "gloo" else f"nicoffload-{self.aggregator}"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    def check(self) -> "Run":
        """Raise one error naming every rank that failed and why (of their class, by exit code)."""
        err = failure(self.ranks, f"{self.label} training failed: ")
        if err is not None:
            raise err
        return self

    def mean_losses(self) -> np.ndarray:
        """Loss of each global batch (mean of the ranks' slice losses)."""
        return np.mean([r.report["losses"] for r in self.ranks], axis=0)

    def step_seconds(self) -> np.ndarray:
        """Per step, the slowest rank's time (a step ends when every rank has its gradients)."""
        return np.max([r.report["step_seconds"] for r in self.ranks], axis=0)

    def allreduce_seconds(self) -> np.ndarray | None:
        vals = [r.report["allreduce_seconds"] for r in self.ranks]
        if any(v is None for row in vals for v in row):
            return None
        return np.max(vals, axis=0)

    @property
    def accuracy(self) -> float:
        return self.ranks[0].report["accuracy"]


def _rank_spec(tb, w, run: Run, out: Path, spec: JobSpec, argv: list[str], master_port: int) -> RankSpec:
    argv = program("nicoffload.lab.ddp_rank") + ["--rank", str(w.rank), "--out", str(out), *argv,
                                                 *spec.argv(HOOK_FIELDS)]
    if run.allreduce == "nicoffload":
        argv += ["--aggregator", tb.agg.ip, "--local-ip", w.ip]
    env = dict(os.environ, MASTER_ADDR=tb.workers[0].ip, MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME=w.iface,
               RANK=str(w.rank), WORLD_SIZE=str(len(tb.workers)), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    return RankSpec(f"rank {w.rank}", w, argv, env)


def _gather(w, out: Path, process: Outcome) -> RankOutcome:
    report = json.loads(out.read_text()) if out.exists() else None
    pp = params_path(out)
    return RankOutcome(w.rank, process, report, np.load(pp) if pp.exists() else None)


def launch(tb, allreduce: str, workdir: Path, *, aggregator: str = "xdp", steps: int = 50, seed: int = 0,
           data: str = "synthetic", deadline: float | None = None, die: dict[int, int] | None = None,
           master_port: int = MASTER_PORT, extra: list[str] | None = None, spec: JobSpec | None = None,
           **fields) -> Run:
    """Train once on testbed ``tb``: one rank process per worker host, started inside its
    namespace, with MASTER_ADDR = worker 0's address and GLOO_SOCKET_IFNAME = the rank's own
    interface. For ``allreduce="nicoffload"`` a fresh ``aggregator`` (xdp or userspace) runs the
    job ``spec`` (``fields`` changed) on the aggregator host for this run.

    ``die``: {rank: step} fault injection. ``deadline``: seconds for the whole run (default
    generous); ranks still running then are killed and reported as such. Returns the
    :class:`Run` (failures inside; ``Run.check()`` raises them)."""
    spec = on_testbed(tb, (spec or TRAIN_SPEC).replace(**fields))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    nco = allreduce == "nicoffload"
    run = Run(allreduce, aggregator if nco else None, spec.elems if nco else None)
    t0 = time.monotonic()
    limit = t0 + (deadline if deadline is not None else 60.0 + steps * 2.0)
    common = ["--world", str(len(tb.workers)), "--allreduce", allreduce, "--steps", str(steps), "--seed", str(seed),
              "--data", data, *(extra or [])]
    outs = [workdir / f"{run.label}-rank{w.rank}.json" for w in tb.workers]
    for out in outs:
        out.unlink(missing_ok=True)
        params_path(out).unlink(missing_ok=True)
    die = die or {}
    ranks = [_rank_spec(tb, w, run, out, spec, common + (["--die-at-step", str(die[w.rank])] if w.rank in die else []),
                        master_port) for w, out in zip(tb.workers, outs)]
    ap = None
    try:
        if nco:
            enable_gro(tb)
            ap = AggregatorProcess(tb, aggregator, spec)
        with Launch(tb, ranks) as job:
            processes = job.wait(limit)
    finally:
        if ap is not None:
            ap.close()
    run.ranks = [_gather(w, out, p) for w, out, p in zip(tb.workers, outs, processes)]
    run.seconds = time.monotonic() - t0
    return run


def compare(tb, workdir: Path, spec: JobSpec = TRAIN_SPEC, *, steps: int = 50, aggregator: str = "xdp",
            seed: int = 0, data: str = "synthetic", progress: Callable[[str], None] | None = None) -> tuple[Run, Run]:
    """Both runs on testbed ``tb`` with the same seeds: (gloo Run, nicoffload Run), each
    checked (a failed rank raises, naming it)."""
    runs = []
    for i, kind in enumerate(("gloo", "nicoffload")):
        if progress:
            progress(f"training {len(tb.workers)} ranks x {steps} steps with "
                     f"{'DDP default (gloo)' if kind == 'gloo' else f'nicoffload ({aggregator})'} ...")
        runs.append(launch(tb, kind, workdir, aggregator=aggregator, steps=steps, seed=seed, data=data, spec=spec,
                           master_port=MASTER_PORT + i).check())
    return runs[0], runs[1]


# --- the comparison ---------------------------------------------------------------------------
def _median_ms(x: np.ndarray | None) -> float | None:
    if x is None or not len(x):
        return None
    tail = x[WARMUP:] if len(x) > 2 * WARMUP else x
    return float(np.median(tail) * 1e3)


def _run_summary(run: Run) -> dict:
    hook = run.ranks[0].report.get("hook") or {}
    return {"allreduce": run.allreduce, "aggregator": run.aggregator, "elems": run.elems,
            "losses": [float(v) for v in run.mean_losses()],
            "accuracy": run.accuracy, "test_loss": run.ranks[0].report["test_loss"],
            "step_ms": _median_ms(run.step_seconds()),
            "step_ms_each": [float(v * 1e3) for v in run.step_seconds()],
            "allreduce_ms": _median_ms(run.allreduce_seconds()),
            "packets_sent": hook.get("packets_sent"), "retransmissions": hook.get("retransmissions"),
            "seconds": run.seconds}


def summarize(gloo: Run, nco: Run) -> dict:
    """Everything worth showing, JSON-able."""
    r0g, r0n = gloo.ranks[0], nco.ranks[0]
    diff = float(np.max(np.abs(r0g.params.astype(np.float64) - r0n.params))) if \
        r0g.params is not None and r0n.params is not None else None
    return {"workers": len(gloo.ranks), "steps": r0g.report["steps"], "data": r0g.report["data"],
            "parameters": r0g.report["parameters"], "warmup_steps_excluded": WARMUP, "max_param_diff": diff,
            "runs": {run.label: _run_summary(run) for run in (gloo, nco)}}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def format_summary(s: dict, rows: int = 10) -> str:
    (lg, g), (ln, n) = s["runs"].items()
    steps = len(g["losses"])
    w = max(len(lg), len(ln), 12)
    per = f"; nicoffload packets carry {n['elems']} floats" if n.get("elems") else ""
    lines = [f"{s['workers']} ranks, {steps} steps, MLP with {s['parameters']} parameters on {s['data']} data{per}",
             "", f"{'step':>5}  {'loss ' + lg:>{w + 5}}  {'loss ' + ln:>{w + 5}}"]
    for k in sorted(set(np.linspace(0, steps - 1, min(rows, steps)).round().astype(int))):
        lines.append(f"{k:>5}  {g['losses'][k]:>{w + 5}.4f}  {n['losses'][k]:>{w + 5}.4f}")
    lines += ["",
              f"{'':<26}{lg:>{w}}  {ln:>{w}}",
              f"{'final test accuracy':<26}{g['accuracy']:>{w}.4f}  {n['accuracy']:>{w}.4f}",
              f"{'final test loss':<26}{g['test_loss']:>{w}.4f}  {n['test_loss']:>{w}.4f}",
              f"{'time per step (median)':<26}{_ms(g['step_ms']):>{w}}  {_ms(n['step_ms']):>{w}}",
              f"{'  of it in the all-reduce':<26}{_ms(g['allreduce_ms']):>{w}}  {_ms(n['allreduce_ms']):>{w}}",
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
    a.set(xlabel="step", ylabel="training loss (global batch)", title=f"DDP, {s['workers']} ranks: loss per step")
    b.set(xlabel="step", ylabel="ms", title="time per training step (slowest rank)", yscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
