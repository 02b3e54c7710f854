"""One rank of a DistributedDataParallel training job (``python -m nicoffload.lab.train.ddp_rank``),
started N times on a testbed by :mod:`nicoffload.lab.train.ddp_train`. It is also the reference of how
a training script uses the nicoffload hook: see :func:`train`.

The job: a small MLP (D -> H -> H -> C, tanh) on seeded synthetic classification data (or
scikit-learn's digits when sklearn is importable and asked for), SGD with momentum; or, with
``--optimizer adamw``, a small transformer on a seeded sequence task with AdamW
(:mod:`nicoffload.lab.train.transformer`). Every rank trains on its own slice of each global
batch. ``--allreduce gloo`` is DDP's default all-reduce over the gloo process group;
``--allreduce nicoffload`` registers :func:`nicoffload.ddp.nicoffload_hook`; ``--allreduce
offload`` keeps no optimizer on the rank: the aggregator holds the parameters and the
optimizer's state and sends the updated parameters back
(:class:`nicoffload.ddp.OffloadedOptimizer`; ``--shadow`` also follows the float64 torch
optimizer on the same averaged gradients, over gloo, to measure the offloaded optimizer's own
error). The gloo process group bootstraps the ranks (MASTER_ADDR/MASTER_PORT, on the interface
GLOO_SOCKET_IFNAME); DDP broadcasts rank 0's initial parameters (the offload job starts from the
same seeded ones, registered by the launcher).

Each rank writes a JSON report (losses, step times, accuracy, hook counters, or the error that
stopped it) and its final parameters as .npy; the launcher gathers them. Torch is imported only
inside :func:`train`, so the launcher imports this module without it. A failed rank exits with
its error class's code (nicoffload.errors), which is how the launcher tells failures apart.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from nicoffload.errors import NicoffloadError
from nicoffload.jobspec import JobSpec
from nicoffload.lab.train import transformer
from nicoffload.lab.train.data import batch_indices, load_data, resolve_data  # noqa: F401 (resolve_data: re-exported)
from nicoffload.lab.train.transformer import Shadow

MASTER_PORT = 29500
#: seconds without progress before a training all-reduce through nicoffload fails
TRAIN_TIMEOUT = 5.0
#: the job fields a rank takes (the nicoffload hook's Communicator)
HOOK_FIELDS = ("job", "port", "group", "slots", "elems", "timeout", "lanes")


# --- the rank program ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nicoffload.lab.train.ddp_rank",
                                description="one rank of a DDP training job (started by the launcher)")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    p.add_argument("--world", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--allreduce", choices=["gloo", "nicoffload", "offload", "backend"], required=True,
                   help="gloo: DDP's default; nicoffload: the DDP hook; offload: the optimizer in the aggregator; "
                        "backend: the torch.distributed backend 'nicoffload' as the process group (no hook; "
                        "NICOFFLOAD_SERVICE and NICOFFLOAD_TOKEN_FILE from the environment)")
    p.add_argument("--wrap", choices=["ddp", "fsdp"], default="ddp",
                   help="DistributedDataParallel, or FSDP2 (fully_shard on every Linear and the model)")
    p.add_argument("--shadow", action="store_true",
                   help="with --allreduce offload: follow the float64 optimizer on the same averaged gradients")
    p.add_argument("--aggregator", metavar="IP", help="the nicoffload aggregator (with --allreduce nicoffload)")
    p.add_argument("--local-ip", default=None, help="this rank's address")
    JobSpec.add_arguments(p, only=HOOK_FIELDS, timeout=TRAIN_TIMEOUT)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo process group timeout (seconds)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's gradient bucket size (MB)")
    transformer.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", choices=["auto", "synthetic", "digits"], default="synthetic")
    p.add_argument("--out", type=Path, required=True,
                   help="JSON report ({rank} in it: the rank's number); parameters go to OUT.npy")
    p.add_argument("--die-at-step", type=int, default=None,
                   help="fault injection: killed (SIGKILL) in this step, after forward, before backward")
    p.add_argument("--failover", type=float, default=0.0, metavar="SECONDS",
                   help="with --allreduce nicoffload: the hook fails over to gloo (the same bits) after this many "
                        "seconds of the aggregator's silence (0: no failover)")
    p.add_argument("--progress", type=Path, default=None,
                   help="rank 0 writes the number of steps it has finished here after each step (the launcher "
                        "acts on it, e.g. train-demo --kill-aggregator-at)")
    return p


def task(args):
    """This run's data (xtr, ytr, xte, yte) and its seeded model (``args`` resolved)."""
    if args.model == "transformer":
        data = transformer.sequences(args.seed, args.seq, args.vocab)
        return data, transformer.make_transformer(args.vocab, args.seq, args.d_model, args.layers, args.heads,
                                                  args.seed)
    data = load_data(args.data, args.seed)
    return data, make_model(data[0].shape[1], args.hidden, int(data[1].max()) + 1, args.seed)


def make_model(d: int, h: int, c: int, seed: int):
    """The MLP, seeded. tanh rather than ReLU: a smooth activation keeps two runs whose
    gradients differ by rounding close (a ReLU kink turns a 1e-8 difference in a pre-activation
    into a unit switched on in one run and off in the other)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, c))


def _offloaded(args, model):
    """With ``--allreduce offload``: the optimizer the aggregator applies."""
    from nicoffload.torch.ddp import OffloadedOptimizer

    spec = JobSpec.from_args(args)
    return OffloadedOptimizer(model.parameters(), args.aggregator, group=spec.group, local_ip=args.local_ip,
                              port=spec.port, job=spec.job, elems=spec.elems, timeout=spec.timeout, rank=args.rank,
                              world=args.world)


def _memory(model, opt) -> dict:
    """Bytes this rank holds, by what they are: parameters, gradients, optimizer state (read from
    the tensors themselves; AdamW's scalar step counters left out), and the process's resident set.
    A sharded tensor (FSDP2's DTensor) counts its local shard: its ``numel`` is the whole tensor's."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(tensors) -> int:
        return int(sum(local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))

    state = 0 if not hasattr(opt, "state") or not isinstance(opt.state, dict) else \
        nbytes(t for st in opt.state.values() for t in st.values() if getattr(t, "ndim", 0))
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"params": nbytes(model.parameters()), "grads": nbytes(p.grad for p in model.parameters()),
            "optimizer_state": state, "rss": rss}


def _fsdp(net):
    """FSDP2: every Linear (the MLP's) or encoder layer (the transformer's) sharded on its own,
    then the model (CPU tensors)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for unit in transformer.shard_units(net) or [m for m in net if isinstance(m, nn.Linear)]:
        fully_shard(unit)
    return fully_shard(net)


def _full(p):
    """A parameter whole (FSDP2 shards them into DTensors)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _hook_state(args, model):
    """With ``--allreduce nicoffload``: the nicoffload hook registered on ``model``, its state."""
    if args.allreduce != "nicoffload":
        return None
    if args.wrap != "ddp":
        raise NicoffloadError("the nicoffload DDP hook needs --wrap ddp (FSDP goes through --allreduce backend)")
    from nicoffload.torch.ddp import NicoffloadHookState, nicoffload_hook

    spec = JobSpec.from_args(args)
    state = NicoffloadHookState(args.aggregator, group=spec.group, local_ip=args.local_ip, port=spec.port,
                                job=spec.job, slots=spec.slots, elems=spec.elems, timeout=spec.timeout,
                                lanes=spec.lanes, failover=args.failover)
    model.register_comm_hook(state, nicoffload_hook)
    return state


def bf16_gloo_hook(process_group, bucket):
    """DDP's ``bf16_compress_hook`` (default_hooks; DDP refuses a hook of that name without CUDA and NCCL):
    the bucket cast to bfloat16 and pre-divided, all-reduced, cast back in place."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _half_gloo(args, model) -> None:
    """``--lanes 16`` on a gloo DDP run: gradients all-reduced as bfloat16, as DDP's
    bf16_compress_hook does (what a user compressing gradients over gloo runs: the baseline of
    16-bit lanes)."""
    if args.allreduce == "gloo" and args.wrap == "ddp" and args.spec_lanes == 16:
        model.register_comm_hook(None, bf16_gloo_hook)


def _record(report: dict, model, opt, state, loss, seconds: float, hook_seconds: float | None) -> None:
    """One step's numbers: its time (and the hook's part), its loss, and the largest gradient,
    parameter and momentum entry (the quantization error bound scales with them; see
    tests/netns/test_ddp.py). The gradient is this rank's own before averaging where known."""
    report["step_seconds"].append(seconds)
    report["allreduce_seconds"].append(hook_seconds)
    report["losses"].append(float(loss.detach()))
    report["grad_max"].append(state.stats.input_absmax if state else
                              max(float(_full(p.grad).abs().max()) for p in model.parameters()))
    report["param_max"].append(max(float(_full(p.detach()).abs().max()) for p in model.parameters()))
    report["momentum_max"].append(max((float(st["momentum_buffer"].abs().max())
                                       for st in getattr(opt, "state", {}).values()
                                       if st.get("momentum_buffer") is not None), default=0.0))


def _step(args, step: int, model, opt, state, xb, yb, report: dict, shadow: Shadow | None = None) -> None:
    import torch.nn.functional as F

    hook_before = state.stats.seconds if state else 0.0
    if state is not None:
        state.stats.input_absmax = 0.0
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(xb).flatten(0, -2), yb.flatten())  # the transformer's: per token
    if step == args.die_at_step:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: no goodbye to anyone
    try:
        loss.backward()
    except RuntimeError as e:
        report["failed_at_step"] = step
        if state is not None:
            state.reraise(e)  # the Communicator's own error (names the missing ranks)
        raise
    if shadow is not None:
        t_shadow = time.perf_counter()
        shadow.step(model)
        t0 += time.perf_counter() - t_shadow  # the check is not part of the step's time
    opt.step()
    _record(report, model, opt, state, loss, time.perf_counter() - t0,
            state.stats.seconds - hook_before if state else None)


def _evaluate(model, xte, yte, report: dict) -> np.ndarray:
    """Test accuracy (per sample, or per token) and loss into ``report``; the final parameters, flat."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        net = getattr(model, "module", model).eval()
        logits = net(torch.from_numpy(xte))
        report["accuracy"] = float((logits.argmax(-1).numpy() == yte).mean())
        report["test_loss"] = float(F.cross_entropy(logits.flatten(0, -2), torch.from_numpy(yte).flatten()))
        return torch.cat([_full(p.detach()).reshape(-1) for p in net.parameters()]).numpy()


def train(args, report: dict) -> None:
    """The training loop; fills ``report`` as it goes (so a failure still reports progress)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)  # one core per rank: ranks share the machine
    (xtr, ytr, xte, yte), net = task(args)
    backend = "nicoffload" if args.allreduce == "backend" else "gloo"
    if backend == "nicoffload":
        import nicoffload.torch  # noqa: F401  (registers the backend, if torch's plugin hook did not)

        os.environ.setdefault("NICOFFLOAD_LANES", str(args.spec_lanes))
    dist.init_process_group(backend, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    if backend == "nicoffload":  # which path the group took (the offload, shared memory, gloo) and why
        report["group"] = repr(dist.distributed_c10d._get_default_group())
    state = opt = shadow = None
    offload = args.allreduce == "offload"
    try:
        if offload:  # no DDP and no optimizer here: the aggregator sums and updates
            model = net
            opt = _offloaded(args, model)
            state = opt
            shadow = Shadow(model, args) if args.shadow else None
        elif args.wrap == "fsdp":
            model = _fsdp(net)
            state = _hook_state(args, model)
            opt = transformer.torch_optimizer(args, model.parameters())
        else:
            model = DDP(net, bucket_cap_mb=args.bucket_cap_mb)
            state = _hook_state(args, model)
            _half_gloo(args, model)
            opt = transformer.torch_optimizer(args, model.parameters())
        xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
        report.update(losses=[], step_seconds=[], allreduce_seconds=[], grad_max=[], param_max=[],
                      momentum_max=[], parameters=sum(p.numel() for p in model.parameters()),
                      test_samples=len(yte))
        for step in range(args.steps):
            idx = torch.from_numpy(batch_indices(step, args.rank, args.world, args.batch, len(ytr), args.seed))
            _step(args, step, model, opt, state, xtr_t[idx], ytr_t[idx], report, shadow)
            if step == 0:
                report["memory"] = _memory(model, opt)
            if args.progress is not None and args.rank == 0:
                tmp = args.progress.with_suffix(".tmp")
                tmp.write_text(str(step + 1))
                tmp.replace(args.progress)
        if shadow is not None:
            report["shadow"] = shadow.report(model)
        np.save(params_path(args.out), _evaluate(model, xte, yte, report))
        if state is not None:
            report["hook"] = dict(state.stats.__dict__)
        if backend == "nicoffload":  # what the group's failover did (train-demo --kill-aggregator-at)
            report["pg_stats"] = dist.distributed_c10d._get_default_group().stats()
        elif args.allreduce == "nicoffload" and state is not None:  # the hook's, with --failover
            from nicoffload.torch.hookfailover import stats as failover_stats

            report["pg_stats"] = failover_stats(state.comm)
        dist.barrier()  # nobody tears the process group down under a rank still evaluating
    finally:
        if state is not None:
            state.close()
    dist.destroy_process_group()


def params_path(out: Path) -> Path:
    return Path(str(out) + ".npy")


def main(argv: list[str] | None = None) -> int:
    args = transformer.resolve(build_parser().parse_args(argv))
    args.out = Path(str(args.out).replace("{rank}", str(args.rank)))  # under torchrun: one --out for the host's ranks
    if args.allreduce not in ("gloo", "backend") and not args.aggregator:
        print(f"ddp_rank: --allreduce {args.allreduce} needs --aggregator", file=sys.stderr, flush=True)
        return 2
    args.data = resolve_data(args.data) if args.model == "mlp" else \
        f"sorting ({args.seq} tokens of {args.vocab})"
    report: dict = {"rank": args.rank, "world": args.world, "allreduce": args.allreduce, "wrap": args.wrap,
                    "data": args.data, "model": args.model, "steps": args.steps, "batch": args.batch,
                    "hidden": args.hidden, **transformer.hyper(args), "seed": args.seed, "error": None}
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


if __name__ == "__main__":
    sys.exit(main())
