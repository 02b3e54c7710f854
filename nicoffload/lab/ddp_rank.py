"""One rank of a DistributedDataParallel training job, and the launcher of N of them on a
namespace testbed. The program (``python -m nicoffload.ddp_rank``) is also the reference of how
a training script uses the nicoffload hook: see :func:`train`.

The job: a small MLP (D -> H -> H -> C, tanh) on seeded synthetic classification data (or
scikit-learn's digits when sklearn is importable and asked for), SGD with momentum, every rank
on its own slice of each global batch. ``--allreduce gloo`` is DDP's default all-reduce over the
gloo process group; ``--allreduce nicoffload`` registers :func:`nicoffload.ddp.nicoffload_hook`.
Either way the gloo process group bootstraps the ranks (MASTER_ADDR/MASTER_PORT, on the interface
GLOO_SOCKET_IFNAME) and DDP broadcasts rank 0's initial parameters.

Each rank writes a JSON report (losses, step times, accuracy, hook counters, or the error that
stopped it) and its final parameters as .npy; the launcher gathers them. Torch is imported only
by the rank program, so the launcher runs without it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import proto
from .errors import NicoffloadError, TimeoutError_

MASTER_PORT = 29500
FEATURES, CLASSES = 64, 10


# --- data ----------------------------------------------------------------------------------
def synthetic(seed: int, train: int = 4096, test: int = 1024, d: int = FEATURES, c: int = CLASSES):
    """Seeded Gaussian clusters, two per class, overlapping enough that the task is not trivial;
    features standardised. Same arrays on every rank and in every run with the same seed."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((2 * c, d)).astype(np.float32) * 0.6
    n = train + test
    y = rng.integers(0, c, n)
    which = y * 2 + rng.integers(0, 2, n)
    x = centers[which] + rng.standard_normal((n, d)).astype(np.float32)
    x = (x - x.mean(0)) / x.std(0)
    return (x[:train].astype(np.float32), y[:train].astype(np.int64),
            x[train:].astype(np.float32), y[train:].astype(np.int64))


def digits(seed: int):
    """scikit-learn's 8x8 digits (shipped with sklearn, 1797 samples), seeded 1397/400 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    p = np.random.default_rng(seed).permutation(len(y))
    tr, te = p[:-400], p[-400:]
    return x[tr], y[tr], x[te], y[te]


def have_sklearn() -> bool:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_data(kind: str) -> str:
    """``auto``: digits if sklearn is importable, else synthetic."""
    if kind == "auto":
        return "digits" if have_sklearn() else "synthetic"
    if kind == "digits" and not have_sklearn():
        raise NicoffloadError("--data digits needs scikit-learn, which is not installed; use --data synthetic")
    return kind


def load_data(kind: str, seed: int):
    return digits(seed) if resolve_data(kind) == "digits" else synthetic(seed)


def batch_indices(step: int, rank: int, world: int, batch: int, n: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s slice of global batch ``step``: a seeded permutation per epoch, cut in
    global batches of world * batch samples (the incomplete tail of an epoch is skipped)."""
    per_epoch = n // (world * batch)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    start = k * world * batch + rank * batch
    return perm[start:start + batch]


# --- the rank program ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nicoffload.ddp_rank",
                                description="one rank of a DDP training job (started by the launcher)")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--allreduce", choices=["gloo", "nicoffload"], required=True)
    p.add_argument("--aggregator", metavar="IP", help="the nicoffload aggregator (with --allreduce nicoffload)")
    p.add_argument("--group", default="239.77.0.1", help="multicast group the results arrive on")
    p.add_argument("--local-ip", default=None, help="this rank's address")
    p.add_argument("--port", type=int, default=proto.DEFAULT_PORT)
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--elems", type=int, default=proto.DEFAULT_ELEMS)
    p.add_argument("--timeout", type=float, default=5.0, help="nicoffload: seconds without progress before failing")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo process group timeout (seconds)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's gradient bucket size (MB)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="synthetic")
    p.add_argument("--out", type=Path, required=True, help="JSON report; parameters go to OUT.npy")
    p.add_argument("--die-at-step", type=int, default=None,
                   help="fault injection: exit abruptly in this step, after forward, before backward")
    return p


def make_model(d: int, h: int, c: int, seed: int):
    """The MLP, seeded. tanh rather than ReLU: a smooth activation keeps two runs whose
    gradients differ by rounding close (a ReLU kink turns a 1e-8 difference in a pre-activation
    into a unit switched on in one run and off in the other)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, c))


def train(args, report: dict) -> None:
    """The training loop; fills ``report`` as it goes (so a failure still reports progress)."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # one core per rank: ranks share the machine
    xtr, ytr, xte, yte = load_data(args.data, args.seed)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    state = None
    try:
        model = DDP(make_model(xtr.shape[1], args.hidden, int(ytr.max()) + 1, args.seed),
                    bucket_cap_mb=args.bucket_cap_mb)
        if args.allreduce == "nicoffload":
            from .ddp import NicoffloadHookState, nicoffload_hook

            state = NicoffloadHookState(args.aggregator, group=args.group, local_ip=args.local_ip,
                                        port=args.port, job=args.job, slots=args.slots, elems=args.elems,
                                        timeout=args.timeout)
            model.register_comm_hook(state, nicoffload_hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
        report.update(losses=[], step_seconds=[], allreduce_seconds=[], grad_max=[], param_max=[],
                      momentum_max=[], parameters=sum(p.numel() for p in model.parameters()),
                      test_samples=len(yte))
        for step in range(args.steps):
            idx = torch.from_numpy(batch_indices(step, args.rank, args.world, args.batch, len(ytr), args.seed))
            xb, yb = xtr_t[idx], ytr_t[idx]
            if state is not None:
                hook_before = state.stats.seconds
                state.stats.input_absmax = 0.0
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            if step == args.die_at_step:
                os._exit(3)  # a crash: no goodbye to anyone
            try:
                loss.backward()
            except RuntimeError as e:
                report["failed_at_step"] = step
                if state is not None:
                    state.reraise(e)  # the Communicator's own error (names the missing ranks)
                raise
            opt.step()
            report["step_seconds"].append(time.perf_counter() - t0)
            report["allreduce_seconds"].append(state.stats.seconds - hook_before if state else None)
            report["losses"].append(float(loss.detach()))
            # the largest gradient of the step, this rank's own before averaging where known
            # (the quantization error bound scales with it; see tests/netns/test_ddp.py)
            report["grad_max"].append(state.stats.input_absmax if state else
                                      max(float(p.grad.abs().max()) for p in model.parameters()))
            report["param_max"].append(max(float(p.detach().abs().max()) for p in model.parameters()))
            report["momentum_max"].append(max((float(st["momentum_buffer"].abs().max())
                                               for st in opt.state.values() if st.get("momentum_buffer") is not None),
                                              default=0.0))
        with torch.no_grad():
            net = model.module.eval()
            logits = net(torch.from_numpy(xte))
            report["accuracy"] = float((logits.argmax(1).numpy() == yte).mean())
            report["test_loss"] = float(F.cross_entropy(logits, torch.from_numpy(yte)))
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
        np.save(params_path(args.out), flat)
        if state is not None:
            report["hook"] = dict(state.stats.__dict__)
        dist.barrier()  # nobody tears the process group down under a rank still evaluating
    finally:
        if state is not None:
            state.close()
    dist.destroy_process_group()


def params_path(out: Path) -> Path:
    return Path(str(out) + ".npy")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.allreduce == "nicoffload" and not args.aggregator:
        print("ddp_rank: --allreduce nicoffload needs --aggregator", file=sys.stderr)
        return 2
    args.data = resolve_data(args.data)
    report: dict = {"rank": args.rank, "world": args.world, "allreduce": args.allreduce, "data": args.data,
                    "steps": args.steps, "batch": args.batch, "hidden": args.hidden, "lr": args.lr,
                    "momentum": args.momentum, "seed": args.seed, "error": None}
    t0 = time.perf_counter()
    rc = 0
    try:
        train(args, report)
    except Exception as e:  # reported, not a traceback: the launcher shows the message
        report["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        report["error_type"] = type(e).__name__
        rc = getattr(e, "exit_code", 1)
    report["seconds"] = time.perf_counter() - t0
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(args.out)
    if rc:
        print(f"rank {args.rank}: {report['error']}", file=sys.stderr, flush=True)
        # The process group's peers may be gone; do not wait for gloo's teardown.
        os._exit(rc)
    return rc


# --- the launcher --------------------------------------------------------------------------
@dataclass
class RankOutcome:
    rank: int
    returncode: int | None          # None: killed at the deadline
    report: dict | None             # the rank's JSON report (None if it wrote none)
    log: str = ""                   # its stdout and stderr
    params: np.ndarray | None = None

    @property
    def error(self) -> str | None:
        if self.returncode is None:
            return "did not finish in time (killed)"
        if self.report and self.report.get("error"):
            return self.report["error"]
        if self.returncode != 0:
            last = (self.log.strip().splitlines() or ["(no message)"])[-1]
            how = f"killed by signal {-self.returncode}" if self.returncode < 0 else \
                f"exited with status {self.returncode}"
            return f"{how}: {last}"
        return None


@dataclass
class Run:
    """One training job: what ran and each rank's outcome (by rank)."""

    allreduce: str                  # "gloo" or "nicoffload"
    aggregator: str | None          # "xdp" | "userspace" for nicoffload
    elems: int | None = None        # float32 elements per packet, for nicoffload
    ranks: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0
    agg_stats: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "gloo" if self.allreduce == "gloo" else f"nicoffload-{self.aggregator}"

    @property
    def ok(self) -> bool:
        return all(r.error is None for r in self.ranks)

    def check(self) -> "Run":
        """Raise one NicoffloadError naming every rank that failed and why."""
        bad = [f"rank {r.rank}: {r.error}" for r in self.ranks if r.error is not None]
        if bad:
            cls = TimeoutError_ if all("TimeoutError" in b or "in time" in b for b in bad) else NicoffloadError
            raise cls(f"{self.label} training failed: " + "; ".join(bad))
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


def launch(tb, allreduce: str, workdir: Path, *, aggregator: str = "xdp", steps: int = 50, seed: int = 0,
           data: str = "synthetic", timeout: float = 5.0, deadline: float | None = None,
           die: dict[int, int] | None = None, master_port: int = MASTER_PORT, extra: list[str] | None = None,
           slots: int = 1024, elems: int = proto.DEFAULT_ELEMS) -> Run:
    """Train once on testbed ``tb``: one rank process per worker host, started inside its
    namespace, with MASTER_ADDR = worker 0's address and GLOO_SOCKET_IFNAME = the rank's own
    interface. For ``allreduce="nicoffload"`` a fresh ``aggregator`` (xdp or userspace) is
    started on the aggregator host for this run and stopped after it.

    ``die``: {rank: step} fault injection. ``deadline``: seconds for the whole run (default
    generous); ranks still running then are killed and reported as such. Returns the
    :class:`Run` (failures inside; ``Run.check()`` raises them)."""
    from .runner import AggregatorProcess, enable_gro

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    world = len(tb.workers)
    nco = allreduce == "nicoffload"
    run = Run(allreduce, aggregator if nco else None, elems if nco else None)
    ap = None
    procs = []
    t0 = time.monotonic()
    limit = t0 + (deadline if deadline is not None else 60.0 + steps * 2.0)
    try:
        if allreduce == "nicoffload":
            enable_gro(tb)
            ap = AggregatorProcess(tb, aggregator, slots, elems)
        for w in tb.workers:
            out = workdir / f"{run.label}-rank{w.rank}.json"
            for stale in (out, params_path(out)):
                stale.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "nicoffload.ddp_rank", "--rank", str(w.rank), "--world", str(world),
                    "--allreduce", allreduce, "--steps", str(steps), "--seed", str(seed), "--data", data,
                    "--out", str(out), "--timeout", str(timeout), "--slots", str(slots), "--elems", str(elems)]
            if allreduce == "nicoffload":
                argv += ["--aggregator", tb.agg.ip, "--group", tb.mcast_group, "--local-ip", w.ip,
                         "--port", str(tb.port)]
            if die and w.rank in die:
                argv += ["--die-at-step", str(die[w.rank])]
            argv += list(extra or [])
            env = dict(os.environ, MASTER_ADDR=tb.workers[0].ip, MASTER_PORT=str(master_port),
                       GLOO_SOCKET_IFNAME=w.iface, RANK=str(w.rank), WORLD_SIZE=str(world),
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
            log = open(workdir / f"{run.label}-rank{w.rank}.log", "w+")
            procs.append((w, out, log, tb.popen(w, argv, env=env, stdout=log, stderr=subprocess.STDOUT)))
        for w, out, log, p in procs:
            try:
                rc = p.wait(timeout=max(0.5, limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = None
            log.seek(0)
            report = json.loads(out.read_text()) if out.exists() else None
            pp = params_path(out)
            run.ranks.append(RankOutcome(w.rank, rc, report, log.read(), np.load(pp) if pp.exists() else None))
    finally:
        for _, _, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        if ap is not None:
            run.agg_stats = ap.close()
    run.seconds = time.monotonic() - t0
    return run


if __name__ == "__main__":
    sys.exit(main())
