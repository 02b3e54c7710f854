"""PyTorch DistributedDataParallel on a namespace testbed: N ranks of
:mod:`nicoffload.lab.train.ddp_rank` (one per worker host), trained once with DDP's default gloo
all-reduce and once through nicoffload with the same seeds, compared side by side: loss curves,
final accuracy, time per training step, how far the parameters drifted apart; a PNG of both.
What ``nicoffload train-demo`` and ``examples/train_ddp.py`` run. The model and the optimizer come
with the ranks' arguments: the MLP with SGD by default, a transformer with AdamW after
``--optimizer adamw`` (:mod:`nicoffload.lab.train.transformer`)."""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from nicoffload.errors import InputError, SetupError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.lab.aggregators import AggregatorProcess, on_testbed
from nicoffload.lab.train import ddp_rank, transformer
from nicoffload.lab.train.ddp_rank import HOOK_FIELDS, MASTER_PORT, TRAIN_TIMEOUT, build_parser, params_path
from nicoffload.lab.train.kill import AggregatorKiller
from nicoffload.lab.train.ddp_report import FINAL, WARMUP, format_summary, plot  # noqa: F401 (re-exported)
from nicoffload.lab.launcher import Launch, Outcome, RankSpec, error_class, failure, program
from nicoffload.lab.links import enable_gro
from nicoffload.lab.train.torchrun import ServiceProcess, torchrun_specs, write_token

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

    allreduce: str                  # "gloo", "nicoffload" (all-reduce in the hook) or "offload" (optimizer too)
    aggregator: str | None          # "xdp" | "userspace" for nicoffload and offload
    elems: int | None = None        # float32 elements per packet, for nicoffload
    ranks: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0
    lanes: int = 32                 # 16: gloo with DDP's bf16_compress_hook, nicoffload in 16-bit lanes
    aggregator_memory: dict | None = None  # an offload run's: bytes the aggregator holds for the optimizer
    nproc: int = 1                  # ranks per worker host (torchrun --nproc-per-node)
    failover: dict | None = None    # --kill-aggregator-at: what the kill did (AggregatorKiller.summary)

    @property
    def label(self) -> str:
        if self.allreduce == "offload":
            return f"optimizer-in-{self.aggregator}"
        half = self.lanes == 16
        if self.allreduce == "backend":
            return "nicoffload-backend" + ("-16bit" if half else "")
        if self.allreduce == "gloo":
            return "gloo-bf16" if half else "gloo"
        return f"nicoffload-{self.aggregator}" + ("-16bit" if half else "")

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


def _rank_spec(tb, w, run: Run, out: Path, spec: JobSpec, argv: list[str], master_port: int,
               service_env: dict | None = None) -> RankSpec:
    argv = program("nicoffload.lab.train.ddp_rank") + ["--rank", str(w.rank), "--out", str(out), *argv,
                                                 *spec.argv(HOOK_FIELDS)]
    if run.allreduce not in ("gloo", "backend"):
        argv += ["--aggregator", tb.agg.ip, "--local-ip", w.ip]
    env = dict(os.environ, MASTER_ADDR=tb.workers[0].ip, MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME=w.iface,
               RANK=str(w.rank), WORLD_SIZE=str(len(tb.workers)), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"), **(service_env or {}))
    return RankSpec(f"rank {w.rank}", w, argv, env)


def _gather(rank: int, out: Path, process: Outcome) -> RankOutcome:
    report = json.loads(out.read_text()) if out.exists() else None
    pp = params_path(out)
    return RankOutcome(rank, process, report, np.load(pp) if pp.exists() else None)


def _torchrun_specs(tb, run: Run, workdir: Path, spec: JobSpec, argv: list[str], master_port: int, nproc: int,
                    service_env: dict | None) -> list[RankSpec]:
    """One ``torchrun --nproc-per-node nproc`` per worker host running the ranks of ``run``
    (torchrun sets RANK and WORLD_SIZE; each rank writes its report to its own file). The
    backend's group must take the offload: NICOFFLOAD_REQUIRE_OFFLOAD=1, never silently gloo."""
    out = workdir / f"{run.label}-rank{{rank}}.json"
    env = dict(service_env or {})
    if run.allreduce == "backend":
        env["NICOFFLOAD_REQUIRE_OFFLOAD"] = "1"
    return torchrun_specs(tb, Path(ddp_rank.__file__), ["--out", str(out), *argv, *spec.argv(HOOK_FIELDS)],
                          env=env, master_port=master_port, nproc=nproc)


def launch(tb, allreduce: str, workdir: Path, *, aggregator: str = "xdp", steps: int = 50, seed: int = 0,
           data: str = "synthetic", deadline: float | None = None, die: dict[int, int] | None = None,
           master_port: int = MASTER_PORT, extra: list[str] | None = None, spec: JobSpec | None = None,
           nproc: int = 1, kill_at: int | None = None, **fields) -> Run:
    """Train once on testbed ``tb``: one rank process per worker host, started inside its
    namespace, with MASTER_ADDR = worker 0's address and GLOO_SOCKET_IFNAME = the rank's own
    interface; ``nproc`` > 1 (gloo and the backend): ``torchrun --nproc-per-node nproc`` in
    each host instead (ranks hK..hK+K-1 in worker h; one host needs no service). For
    ``allreduce="nicoffload"`` a fresh ``aggregator`` (xdp or userspace) runs the job ``spec``
    (``fields`` changed) on the aggregator host for this run.

    ``die``: {rank: step} fault injection. ``kill_at`` (the backend): the aggregator's program
    detached once rank 0 has finished that many steps (:mod:`nicoffload.lab.train.kill`). ``deadline``: seconds for the whole run (default
    generous); ranks still running then are killed and reported as such. Returns the
    :class:`Run` (failures inside; ``Run.check()`` raises them)."""
    spec = on_testbed(tb, (spec or TRAIN_SPEC).replace(**fields))
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    nco = allreduce != "gloo"
    if kill_at is not None and not (allreduce == "backend" or (allreduce == "nicoffload" and aggregator == "xdp")):
        raise InputError("killing the aggregator mid-run shows a failover: the backend's, or the DDP hook's through "
                         "the XDP aggregator")
    if nproc > 1 and (die or allreduce not in ("gloo", "backend")):
        raise InputError("several ranks per host (torchrun --nproc-per-node) train through gloo or the backend, "
                         "without fault injection")
    run = Run(allreduce, aggregator if nco else None, spec.elems if nco else None,
              lanes=spec.lanes if allreduce != "offload" else 32, nproc=nproc)
    t0 = time.monotonic()
    limit = t0 + (deadline if deadline is not None else 60.0 + steps * 2.0)
    world = len(tb.workers) * nproc
    common = ["--world", str(world), "--allreduce", allreduce, "--steps", str(steps), "--seed", str(seed),
              "--data", data, *(extra or [])]
    progress = workdir / f"{run.label}-progress"
    if kill_at is not None:
        common += ["--progress", str(progress)] + (["--failover", "3"] if allreduce == "nicoffload" else [])
    outs = [workdir / f"{run.label}-rank{r}.json" for r in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
        params_path(out).unlink(missing_ok=True)
    die = die or {}
    ap = svc = None
    try:
        if allreduce == "backend" and (nproc == 1 or len(tb.workers) > 1):  # the backend asks the service
            svc = ServiceProcess(tb, write_token(workdir / "service")).start()
        if nproc > 1:
            ranks = _torchrun_specs(tb, run, workdir, spec, common, master_port, nproc, svc.env() if svc else None)
        else:
            ranks = [_rank_spec(tb, w, run, out, spec,
                                common + (["--die-at-step", str(die[w.rank])] if w.rank in die else []), master_port,
                                svc.env() if svc else None) for w, out in zip(tb.workers, outs)]
        if nco:
            enable_gro(tb)
            if allreduce == "offload":
                ap = OptimizerAggregator(tb, aggregator, spec, seed, data, extra or [])
                run.aggregator_memory = ap.memory()
            elif allreduce == "nicoffload":
                ap = AggregatorProcess(tb, aggregator, spec)
        killer = AggregatorKiller(tb, progress, kill_at) if kill_at is not None else None
        with killer or contextlib.nullcontext(), Launch(tb, ranks) as job:
            processes = job.wait(limit)
    finally:
        if ap is not None:
            ap.close()
        if svc is not None:
            svc.stop()
    run.ranks = [_gather(r, out, processes[r // nproc]) for r, out in enumerate(outs)]
    if killer is not None:
        run.failover = killer.summary([(r.report or {}).get("pg_stats") or {} for r in run.ranks])
    run.seconds = time.monotonic() - t0
    return run


class OptimizerAggregator:
    """The aggregator of an offloaded-optimizer run: the job holds the model's seeded initial
    parameters and the ranks' optimizer with their hyperparameters (torch.optim.SGD's lr and
    momentum, or AdamW's lr, betas, eps and weight decay). ``xdp``: loaded here with optimizer
    state; ``userspace``: a user-space aggregator thread in the aggregator's namespace (the
    CPU-offload baseline)."""

    def __init__(self, tb, kind: str, spec: JobSpec, seed: int, data: str, extra: list[str]):
        from nicoffload.torch.ddp import flat_params

        from nicoffload.optim import share
        from nicoffload.lab.train.ddp_rank import task

        a = rank_args(["--seed", str(seed), "--data", data, *extra])
        init = flat_params(task(a)[1].parameters())
        opt = transformer.optimizer_spec(transformer.hyper(a))
        self.params, self.kind, self.agg, self.ua, self.optimizer = init.size, kind, None, None, opt
        ips = [w.ip for w in tb.workers]
        if kind == "xdp":
            from nicoffload.agg.control import Aggregator, AggSpec

            self.agg = Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=share(init.size, spec.elems),
                                               elems=spec.elems, port=spec.port, optimizer=True))
            self.agg.add_job(spec.job, len(ips), spec.group, ips, optimizer=opt, params=init.size, initial=init)
        else:
            from nicoffload.userspace.aggregator import UserspaceAggregator

            with tb.in_host(tb.agg):
                self.ua = UserspaceAggregator(len(ips), port=spec.port, elems=spec.elems, job=spec.job,
                                              group=spec.group, local_ip=tb.agg.ip, worker_ips=ips, optimizer=opt,
                                              params=init)
            self.ua.start()

    def memory(self) -> dict:
        """Bytes the aggregator holds for the job's optimizer, int64 each: master weights and the
        momentum (SGD); master weights, the first moment and the square root of the second
        (AdamW; with amsgrad also its running maximum)."""
        n = self.params
        if self.optimizer.kind == "adamw":
            out = {"master_weights": 8 * n, "exp_avg": 8 * n, "sqrt_exp_avg_sq": 8 * n}
            return {**out, "max_sqrt_exp_avg_sq": 8 * n} if self.optimizer.amsgrad else out
        return {"master_weights": 8 * n, "momentum": 8 * n}

    def close(self) -> None:
        if self.agg is not None:
            self.agg.close()
        if self.ua is not None:
            self.ua.stop()


def rank_args(argv):
    """A rank's arguments (its defaults resolved) for ``argv`` (model, optimizer, seed, ...)."""
    return transformer.resolve(build_parser().parse_args(["--allreduce", "offload", "--out", "x", *argv]))


def compare(tb, workdir: Path, spec: JobSpec = TRAIN_SPEC, *, steps: int = 50, aggregator: str = "xdp",
            seed: int = 0, data: str = "synthetic", progress: Callable[[str], None] | None = None,
            offload: tuple[str, ...] = (), backend: bool = False, wrap: str = "ddp",
            train_args: list[str] | tuple[str, ...] = (), nproc: int = 1,
            kill_at: int | None = None, reverse: bool = False) -> tuple[Run, ...]:
    """Runs on testbed ``tb`` with the same seeds, each checked (a failed rank raises, naming it):
    (gloo, nicoffload through ``aggregator``), or with ``offload`` (aggregators), (gloo, the
    optimizer in each of them) — the offloaded runs also follow the float64 torch optimizer on
    their gradients. ``backend``: the nicoffload run uses the torch.distributed backend
    "nicoffload" (no hook; the aggregator as a service); ``wrap``: ddp or fsdp (FSDP2) in both
    runs; ``train_args``: the ranks' model and optimizer arguments (``--optimizer adamw --lr
    3e-4 --d-model 64 ...``, see ``python -m nicoffload.lab.train.ddp_rank --help``); ``nproc``:
    ranks per host, under torchrun (gloo and the backend); ``kill_at``: the backend run's
    aggregator program detached after that many steps (its failover shown); ``reverse``: the
    runs in the opposite order (returned in the usual one: gloo first)."""
    name = transformer.torch_name(rank_args(train_args).optimizer)
    plan = [("gloo", None)] + ([("offload", a) for a in offload] if offload else
                               [("backend", "xdp")] if backend else [("nicoffload", aggregator)])
    runs = []
    order = list(enumerate(plan))
    for i, (kind, agg) in (order[::-1] if reverse else order):
        if progress:
            half = " (bf16_compress_hook)" if spec.lanes == 16 else ""
            what = {"gloo": f"{wrap.upper()} over gloo{half}, {name} on every rank",
                    "nicoffload": f"nicoffload ({agg})", "offload": f"the optimizer in the {agg} aggregator",
                    "backend": f"{wrap.upper()} over the torch.distributed backend 'nicoffload' (the service)"}[kind]
            where = f" ({len(tb.workers)} hosts x {nproc}, torchrun)" if nproc > 1 else ""
            progress(f"training {len(tb.workers) * nproc} ranks{where} x {steps} steps with {what} ...")
        runs.append(launch(tb, kind, workdir, aggregator=agg or aggregator, steps=steps, seed=seed, data=data,
                           spec=spec, master_port=MASTER_PORT + i, nproc=nproc,
                           kill_at=kill_at if kind in ("backend", "nicoffload") else None,
                           extra=(["--shadow"] if kind == "offload" else []) + ["--wrap", wrap, *train_args]).check())
    return tuple(runs[::-1] if reverse else runs)


# --- the comparison ---------------------------------------------------------------------------
def _median_ms(x: np.ndarray | None) -> float | None:
    if x is None or not len(x):
        return None
    tail = x[WARMUP:] if len(x) > 2 * WARMUP else x
    return float(np.median(tail) * 1e3)


def _run_summary(run: Run) -> dict:
    r0 = run.ranks[0].report
    hook = r0.get("hook") or {}
    losses = run.mean_losses()
    name = transformer.torch_name(r0.get("optimizer", "sgd"))
    return {"allreduce": run.allreduce, "aggregator": run.aggregator, "elems": run.elems,
            "optimizer": f"the optimizer ({name.split('.')[-1]}) in the {run.aggregator} aggregator"
            if run.allreduce == "offload" else f"{name} on every rank",
            "losses": [float(v) for v in losses], "final_loss": float(np.mean(losses[-FINAL:])),
            "accuracy": run.accuracy, "test_loss": r0["test_loss"],
            "step_ms": _median_ms(run.step_seconds()),
            "step_ms_each": [float(v * 1e3) for v in run.step_seconds()],
            "allreduce_ms": _median_ms(run.allreduce_seconds()),
            "packets_sent": hook.get("packets_sent"), "retransmissions": hook.get("retransmissions"),
            "spec_blocks": hook.get("spec_blocks"), "spec_missed": hook.get("spec_missed"),
            "memory": r0.get("memory"), "aggregator_memory": run.aggregator_memory,
            "shadow": transformer.shadow_bound(r0),
            "param_max": max(r0["param_max"]) if r0.get("param_max") else None,
            "group": r0.get("group"), "seconds": run.seconds, "failover": _failover(run)}


def _failover(run: Run) -> dict | None:
    """--kill-aggregator-at: the kill's record, and the step times on the aggregator (before it),
    in the cut step, and on the fallback (after it)."""
    if run.failover is None:
        return None
    t, at = run.step_seconds(), run.failover["at_step"]
    if at >= len(t):
        return {**run.failover, "step_ms_before": _median_ms(t), "cut_step": None}
    cut = at + int(np.argmax(t[at:]))  # the step that waited out the silence (the kill lands in step at or later)
    return {**run.failover, "step_ms_before": _median_ms(t[:at]), "cut_step": cut, "cut_step_ms": float(t[cut] * 1e3),
            "step_ms_after": _median_ms(t[cut + 1:]) if cut + 1 < len(t) else None}


def summarize(reference: Run, *others: Run) -> dict:
    """Everything worth showing, JSON-able; parameter differences are against ``reference``."""
    r0 = reference.ranks[0]
    diffs = {}
    for run in others:
        p = run.ranks[0].params
        diffs[run.label] = float(np.max(np.abs(r0.params.astype(np.float64) - p))) \
            if r0.params is not None and p is not None else None
    runs = {run.label: _run_summary(run) for run in (reference, *others)}
    ref = runs[reference.label]["final_loss"]
    for r in runs.values():  # the measure: final loss within 1% of the reference's
        r["final_loss_rel"] = r["final_loss"] / ref - 1.0 if ref else None
    rep = r0.report
    return {"workers": len(reference.ranks), "ranks_per_host": reference.nproc, "steps": rep["steps"],
            "data": rep["data"],
            "wrap": rep.get("wrap", "ddp"), "model": rep.get("model", "mlp"),
            "hyperparameters": {k: rep[k] for k in ("optimizer", "lr", "momentum", "betas", "eps", "weight_decay")
                                if k in rep},
            "parameters": rep["parameters"], "warmup_steps_excluded": WARMUP, "final_loss_steps": FINAL,
            "max_param_diff": next(iter(diffs.values()), None), "param_diff": diffs, "runs": runs}
