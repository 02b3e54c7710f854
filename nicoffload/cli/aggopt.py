"""``nicoffload agg opt``: the optimizer of a job the aggregator holds (OptimusNIC): show its
state, read its parameters back, upload parameters, change the learning rate, checkpoint and
restore. Also the optimizer options of ``agg load`` and ``agg job add``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nicoffload.cli.app import add_examples
from nicoffload.errors import InputError
from nicoffload.optim import KINDS, OptimizerSpec

_DEFAULT = OptimizerSpec()
_ADAMW = OptimizerSpec.adamw()


def _betas(text: str) -> tuple[float, float]:
    try:
        b = tuple(float(x) for x in text.split(","))
    except ValueError:
        b = ()
    if len(b) != 2:
        raise InputError(f"--betas takes two numbers, B1,B2 (like 0.9,0.999), not {text!r}")
    return b


def optimizer_arguments(q) -> None:
    """--optimizer and its hyperparameters, --params and --init (agg load, agg job add)."""
    q.add_argument("--optimizer", choices=sorted(KINDS), default=None,
                   help="the aggregator keeps the job's parameters and applies this optimizer (torch.optim.SGD's "
                        "or torch.optim.AdamW's update): workers send gradients (Communicator.step) and get the "
                        "updated parameters back")
    q.add_argument("--lr", type=float, default=None,
                   help=f"learning rate, 0..1 (default {_DEFAULT.lr} for sgd, {_ADAMW.lr} for adamw; adamw: at most "
                        "1 - beta1)")
    q.add_argument("--momentum", type=float, default=_DEFAULT.momentum, help="sgd: 0..1 (default 0)")
    q.add_argument("--dampening", type=float, default=_DEFAULT.dampening, help="sgd: 0..1 (default 0)")
    q.add_argument("--weight-decay", type=float, default=None,
                   help=f"0..1 (default {_DEFAULT.weight_decay} for sgd, {_ADAMW.weight_decay} for adamw: decoupled)")
    q.add_argument("--nesterov", action="store_true", help="sgd: Nesterov momentum (torch.optim.SGD's)")
    q.add_argument("--betas", type=str, default=None, metavar="B1,B2",
                   help=f"adamw: the moments' decay rates (default {_ADAMW.betas[0]},{_ADAMW.betas[1]})")
    q.add_argument("--eps", type=float, default=_ADAMW.eps, help=f"adamw: 1e-10..1 (default {_ADAMW.eps:g})")
    q.add_argument("--amsgrad", action="store_true", help="adamw: the running maximum of the second moment")
    q.add_argument("--maximize", action="store_true", help="adamw: ascend instead of descend")
    q.add_argument("--params", type=int, default=0, help="parameters of the job (an optimizer job's share follows)")
    q.add_argument("--init", type=Path, default=None, help=".npy with the initial parameters (default: zeros)")


def optimizer_from(args) -> OptimizerSpec | None:
    if args.optimizer is None:
        for flag in ("params", "init"):
            if getattr(args, flag):
                raise InputError(f"--{flag} belongs to an optimizer job: give --optimizer too")
        return None
    if args.optimizer == "adamw":
        if args.momentum or args.dampening or args.nesterov:
            raise InputError("--momentum, --dampening and --nesterov are sgd's: adamw takes --betas")
        return OptimizerSpec.adamw(lr=_ADAMW.lr if args.lr is None else args.lr,
                                   betas=_ADAMW.betas if args.betas is None else _betas(args.betas), eps=args.eps,
                                   weight_decay=_ADAMW.weight_decay if args.weight_decay is None else args.weight_decay,
                                   amsgrad=args.amsgrad, maximize=args.maximize)
    if args.betas is not None or args.amsgrad or args.maximize or args.eps != _ADAMW.eps:
        raise InputError("--betas, --eps, --amsgrad and --maximize are adamw's (--optimizer adamw)")
    return OptimizerSpec(args.optimizer, _DEFAULT.lr if args.lr is None else args.lr, args.momentum, args.dampening,
                         _DEFAULT.weight_decay if args.weight_decay is None else args.weight_decay,
                         args.nesterov).validate()


def _load(path) -> np.ndarray:
    """Parameters from a .npy file, or a one-line InputError saying why not."""
    from nicoffload.lab.inputs import load_input

    a = load_input(path)
    if a.dtype.kind != "f":
        raise InputError(f"{path}: parameters are float32 or float64, not {a.dtype}")
    return a


def initial_params(args) -> np.ndarray | None:
    if args.init is None:
        return None
    a = _load(args.init)
    if a.size != args.params:
        raise InputError(f"{args.init} holds {a.size} values, --params is {args.params}")
    return a


def register(asub, where) -> None:
    q = asub.add_parser("opt", help="the optimizer of a job: state, parameters, learning rate, checkpoints")
    add_examples(q, "sudo nicoffload agg opt show --netns NS --iface eth0 --job 1",
                 "sudo nicoffload agg opt params --netns NS --iface eth0 --job 1 -o params.npy",
                 "sudo nicoffload agg opt set-lr --netns NS --iface eth0 --job 1 --lr 0.01",
                 "sudo nicoffload agg opt save --netns NS --iface eth0 --job 1 --file ckpt.npz",
                 "sudo nicoffload agg opt restore --netns NS --iface eth0 --job 1 --file ckpt.npz")
    osub = q.add_subparsers(dest="opt_command", metavar="ACTION")
    osub.required = True
    for name, fn, hlp in (("show", _show, "hyperparameters, updates applied, parameter and momentum statistics"),
                          ("params", _params, "read the master weights back (.npy)"),
                          ("upload", _upload, "write parameters (momentum reset: the next update is the first)"),
                          ("set-lr", _set_lr, "a new learning rate from the next update on (a schedule)"),
                          ("save", _save, "checkpoint the optimizer state to a file"),
                          ("restore", _restore, "restore a checkpoint into a registered job of the same shape")):
        p = osub.add_parser(name, help=hlp)
        where(p)
        p.add_argument("--job", type=int, required=True)
        if name == "show":
            p.add_argument("--json", action="store_true")
        elif name == "params":
            p.add_argument("-o", "--output", type=Path, required=True)
        elif name == "set-lr":
            p.add_argument("--lr", type=float, required=True)
        else:
            p.add_argument("--file", type=Path, required=True)
        p.set_defaults(func=fn)


def _open(args):
    from nicoffload.agg.control import Aggregator

    return Aggregator.open(args.netns, args.iface)


def _show(args) -> int:
    st = _open(args).optimizer_state(args.job)
    out = {"job": args.job, "optimizer": st["optimizer"], "params": st["params"], "frac_bits": st["frac_bits"],
           "updates": {"min": int(st["steps"].min()), "max": int(st["steps"].max())},
           "w": {"min": float(st["w"].min()), "max": float(st["w"].max()), "norm": float(np.linalg.norm(st["w"]))},
           "momentum": {"norm": float(np.linalg.norm(st["m"]))}}
    if "s" in st:
        out["second_moment_sqrt"] = {"norm": float(np.linalg.norm(st["s"])), "max": float(st["s"].max())}
    if args.json:
        print(json.dumps(out))
    else:
        spec = OptimizerSpec(**out["optimizer"])
        print(f"job {args.job}: {spec.describe()}; {out['params']} parameters (int64, {out['frac_bits']} fractional bits)")
        m = "first moment" if spec.kind == "adamw" else "momentum"
        extra = f", |sqrt(v)| {out['second_moment_sqrt']['norm']:.6g}" if "second_moment_sqrt" in out else ""
        print(f"  updates applied per block: {out['updates']['min']}..{out['updates']['max']}; "
              f"w in [{out['w']['min']:.6g}, {out['w']['max']:.6g}], |w| {out['w']['norm']:.6g}, "
              f"|{m}| {out['momentum']['norm']:.6g}{extra}")
    return 0


def _params(args) -> int:
    from nicoffload.lab.inputs import check_output, save_output

    check_output(args.output)
    w = _open(args).params(args.job)
    save_output(args.output, w)
    print(f"{w.size} parameters of job {args.job} -> {args.output}")
    return 0


def _upload(args) -> int:
    a = _load(args.file)
    _open(args).set_params(args.job, a)
    print(f"{a.size} parameters of {args.file} -> job {args.job} (momentum reset)")
    return 0


def _set_lr(args) -> int:
    _open(args).set_lr(args.job, args.lr)
    print(f"job {args.job}: learning rate {args.lr:g} from the next update on")
    return 0


def _save(args) -> int:
    path = _open(args).save_optimizer(args.job, args.file)
    print(f"job {args.job}: optimizer state -> {path}")
    return 0


def _restore(args) -> int:
    _open(args).load_optimizer(args.job, args.file)
    print(f"job {args.job}: optimizer state <- {args.file}")
    return 0
