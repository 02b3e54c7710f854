"""The model of ``train-demo --optimizer adamw``: a small transformer encoder on a seeded synthetic
sequence task; and the rank's optimizer, SGD or AdamW: its flags and hyperparameters, the torch
optimizer, the aggregator's OptimizerSpec, and the float64 :class:`Shadow` an offloaded run is
measured against (with AdamW, the bound of the aggregator's fixed point).

The task: sort a sequence of ``seq`` tokens drawn uniformly from ``vocab`` symbols; the target of
position i is the i-th smallest token. The encoder is bidirectional (no mask), so every position
sees the whole sequence; it is learnable in about 100 steps (token accuracy ~0.9 at the default
size, single-threaded CPU) and not solved in the first few, so the loss falls over the whole run.

The model: token embedding + learned positional embedding (unit scale: the position is as loud
as the token, which the task needs), ``torch.nn.TransformerEncoder`` (batch_first, pre-norm,
dropout 0 for determinism, GELU: smooth, like the MLP's tanh, so that two runs whose gradients
differ by rounding stay close) with a final LayerNorm, and a linear head over the vocabulary:
1.6 M parameters at the defaults (d_model 256, 2 layers, 4 heads, 16 tokens of 16 symbols).

Torch is imported inside the functions, so the launcher imports this module without it."""
from __future__ import annotations

import argparse

import numpy as np

TRAIN_SEQUENCES, TEST_SEQUENCES = 8192, 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The rank's flags for the optimizer and for the transformer's size."""
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                   help="torch.optim.SGD (momentum) or torch.optim.AdamW on the ranks; the same in the aggregator")
    p.add_argument("--model", choices=["mlp", "transformer"], default=None,
                   help="default: the MLP with sgd, the transformer with adamw")
    p.add_argument("--lr", type=float, default=None, help="default 0.05 (sgd), 1e-3 (adamw)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--betas", type=betas, default=(0.9, 0.999), metavar="B1,B2", help="AdamW's betas")
    p.add_argument("--eps", type=float, default=1e-8, help="AdamW's eps")
    p.add_argument("--weight-decay", type=float, default=None, help="default 0 (sgd), 0.01 (adamw, decoupled)")
    p.add_argument("--d-model", type=int, default=256, help="transformer width")
    p.add_argument("--layers", type=int, default=2, help="transformer encoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divide --d-model)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=16, help="symbols of the sequence task")


def betas(text: str) -> tuple[float, float]:
    try:
        b1, b2 = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"betas are two numbers B1,B2, not {text!r}") from None
    return b1, b2


def resolve(args) -> argparse.Namespace:
    """The defaults that depend on the optimizer, filled in (in place; returned)."""
    adamw = args.optimizer == "adamw"
    if args.model is None:
        args.model = "transformer" if adamw else "mlp"
    if args.lr is None:
        args.lr = 1e-3 if adamw else 0.05
    if args.weight_decay is None:
        args.weight_decay = 0.01 if adamw else 0.0
    args.betas = tuple(args.betas)
    return args


def hyper(args) -> dict:
    """The optimizer's hyperparameters as a rank reports them."""
    if args.optimizer == "adamw":
        return {"optimizer": "adamw", "lr": args.lr, "betas": list(args.betas), "eps": args.eps,
                "weight_decay": args.weight_decay}
    return {"optimizer": "sgd", "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay}


def torch_name(kind: str) -> str:
    return {"sgd": "torch.optim.SGD", "adamw": "torch.optim.AdamW"}[kind]


def torch_optimizer(args, params):
    """The optimizer every rank runs without the offload (and, in float64, the shadow of an offloaded run)."""
    import torch

    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, betas=args.betas, eps=args.eps, weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def optimizer_spec(h: dict):
    """The aggregator's :class:`nicoffload.optim.OptimizerSpec` for hyperparameters ``h`` (:func:`hyper`)."""
    from nicoffload.optim import OptimizerSpec

    if h["optimizer"] == "adamw":
        return OptimizerSpec.adamw(lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"],
                                   weight_decay=h["weight_decay"], amsgrad=False, maximize=False)
    return OptimizerSpec(lr=h["lr"], momentum=h["momentum"], weight_decay=h.get("weight_decay", 0.0))


def shadow_bound(report: dict) -> dict | None:
    """A rank report's shadow (the offloaded optimizer against the float64 torch one on the same
    gradients) with its bound: AdamW's comes from the rank (AdamWBound needs the moments of every
    step); SGD's is nicoffload.optim.error_bound for the run's gradients and parameters."""
    sh = report.get("shadow")
    if not sh:
        return None
    bound = sh.get("bound")
    if bound is None:
        from nicoffload.optim import error_bound

        bound = error_bound(optimizer_spec({"optimizer": "sgd", **report}), report["steps"], grad_max=sh["grad_max"],
                            world=report["world"], w_max=max(report["param_max"]) if report.get("param_max") else 1.0,
                            params_dtype=np.dtype(sh.get("params_dtype", "float32")))
    return {**sh, "bound": bound, "within_bound": sh["max_diff"] <= bound}


# --- the task and the model ------------------------------------------------------------------
def sequences(seed: int, seq: int = 16, vocab: int = 16, train: int = TRAIN_SEQUENCES, test: int = TEST_SEQUENCES):
    """Seeded sorting task: (xtr, ytr, xte, yte), int64 arrays of shape (n, seq), y = sorted x."""
    rng = np.random.default_rng([seed, seq, vocab])
    x = rng.integers(0, vocab, (train + test, seq), dtype=np.int64)
    y = np.sort(x, axis=1)
    return x[:train], y[:train], x[train:], y[train:]


def make_transformer(vocab: int, seq: int, d_model: int, layers: int, heads: int, seed: int):
    """The transformer, seeded (the same parameters on every rank and in the aggregator's job)."""
    import torch
    from torch import nn

    class SortTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model)
            self.pos = nn.Embedding(seq, d_model)  # learned, N(0, 1) like the tokens'
            layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model),
                                                 enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, x):
            h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            return self.head(self.encoder(h)).clone()  # not a view: FSDP2 warns about a view's hooks

    if d_model % heads:
        raise ValueError(f"--heads {heads} must divide --d-model {d_model}")
    torch.manual_seed(seed)
    return SortTransformer()


def shard_units(net) -> list:
    """FSDP2's units of the transformer: each encoder layer (their attention reads its projections'
    weights directly, so a Linear inside cannot be a unit of its own)."""
    from torch import nn

    return [m for m in net.modules() if isinstance(m, nn.TransformerEncoderLayer)]


# --- an offloaded optimizer against float64 --------------------------------------------------
class Shadow:
    """The ranks' torch optimizer in float64 (SGD or AdamW) on their averaged gradients (summed over
    gloo in float64), to measure how far the offloaded optimizer's fixed point drifts from it on
    the same gradients. With AdamW it also feeds :class:`nicoffload.optim.AdamWBound` the float64
    state after each step (the step's largest averaged gradient, the moments, the largest
    parameter before or after the step): the bound of that drift."""

    def __init__(self, model, args):
        import torch

        self.params = [p.detach().to(torch.float64).clone().requires_grad_(True) for p in model.parameters()]
        self.opt = torch_optimizer(args, self.params)
        self.grad_max = 0.0
        self.bound = None
        # the model's parameters take the aggregator's results in their own precision (a bound's last term)
        self.params_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if args.optimizer == "adamw":
            from nicoffload.optim import AdamWBound

            self.bound = AdamWBound(optimizer_spec(hyper(args)), args.world, np.dtype(self.params_dtype))

    def step(self, model) -> None:
        import torch.distributed as dist

        step_max = 0.0
        for sp, p in zip(self.params, model.parameters()):
            g = p.grad.detach().to(sp.dtype)
            dist.all_reduce(g)
            g /= dist.get_world_size()
            step_max = max(step_max, float(g.abs().max()))
            sp.grad = g
        self.grad_max = max(self.grad_max, step_max)
        w_before = self._w_max()
        self.opt.step()
        if self.bound is not None:
            self._bound(step_max, w_before)
        # every rank ends its check before any starts the step: a rank's float64 shadow must not
        # share the machine's cores with another's timed optimizer step (nor the aggregator's)
        dist.barrier()

    def _w_max(self) -> float:
        return max(float(p.detach().abs().max()) for p in self.params)

    def _bound(self, grad_max: float, w_before: float) -> None:
        import torch

        st = [self.opt.state[p] for p in self.params]
        m = torch.cat([s["exp_avg"].reshape(-1) for s in st]).numpy()
        v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in st]).numpy()
        self.bound.update(grad_max=grad_max, m=m, v=v, w_max=max(w_before, self._w_max()))

    def diff(self, model) -> float:
        return max(float((sp.detach() - p.detach().to(sp.dtype)).abs().max())
                   for sp, p in zip(self.params, model.parameters()))

    def report(self, model) -> dict:
        """max_diff, grad_max (over the run) and, with AdamW, the bound."""
        out = {"max_diff": self.diff(model), "grad_max": self.grad_max, "params_dtype": self.params_dtype}
        return out if self.bound is None else {**out, "bound": float(self.bound.value)}
