"""What an optimizer job asks of the aggregator (OptimusNIC): its optimizer, torch.optim.SGD's
hyperparameters (momentum, dampening, Nesterov, weight decay) or torch.optim.AdamW's, validated
for the fixed point the XDP program computes in; and its share of the slot pool.

Layout of a job's share of the slot pool: slot s < meta holds the rounds of the block exponents
(op MAX), slot meta + b the rounds of parameter block b (op SGD), so a step of P = meta + blocks
rounds maps round i to slot i mod P and the aggregator finds a round's parameters from its slot.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from nicoffload.wire import proto

from ..errors import InputError
from . import adamw
from .fixed import FRAC, fixed

KINDS = {"sgd": proto.C["AR_OPT_SGD"], "adamw": proto.C["AR_OPT_ADAMW"]}
NESTEROV = proto.C["AR_OPT_NESTEROV"]
#: records of an aggregator with optimizer state hold at most this many elements (beyond, the
#: program's two copies of the slot algorithm exceed the verifier's budget of 1M instructions)
MAX_ELEMS = 256


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer of a job: torch.optim.SGD's hyperparameters (kind "sgd": lr, momentum,
    dampening, weight_decay, nesterov, each in [0, 1]) or torch.optim.AdamW's (kind "adamw": lr,
    betas, eps, weight_decay, amsgrad, maximize; :meth:`adamw` has torch's defaults)."""

    kind: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a list from JSON

    @classmethod
    def adamw(cls, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
              amsgrad: bool = False, maximize: bool = False) -> "OptimizerSpec":
        return cls("adamw", lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, amsgrad=amsgrad,
                   maximize=maximize).validate()


    @classmethod
    def from_dict(cls, d: dict | None) -> "OptimizerSpec":
        """From a request's or a user's dict, validated; an adamw without lr or weight_decay gets
        torch.optim.AdamW's defaults (1e-3, 1e-2), an sgd torch.optim.SGD-like ones (see fields)."""
        d = dict(d or {})
        if d.get("kind") == "adamw":
            d.setdefault("lr", 1e-3)
            d.setdefault("weight_decay", 1e-2)
        try:
            return cls(**d).validate()
        except TypeError as e:
            raise InputError(f"optimizer: {e}") from None

    def validate(self) -> "OptimizerSpec":
        if self.kind not in KINDS:
            raise InputError(f"optimizer {self.kind!r} is not one the aggregator has: {', '.join(KINDS)}")
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0 and math.isfinite(v)):
                raise InputError(f"--{name.replace('_', '-')} must be in [0, 1] (fixed point with {FRAC} fractional "
                                 f"bits), not {v}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InputError("Nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)")
        if self.kind == "adamw":
            self._validate_adamw()
        elif self.amsgrad or self.maximize:
            raise InputError("amsgrad and maximize are AdamW's (the aggregator's SGD has neither)")
        return self

    def _validate_adamw(self) -> None:
        if self.momentum or self.dampening or self.nesterov:
            raise InputError("momentum, dampening and nesterov are SGD's: AdamW takes betas")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b <= 1 - 2 ** -20
                                           for b in self.betas):
            raise InputError(f"betas must be two numbers in [0, 1 - 2^-20], not {self.betas}")
        if not (isinstance(self.eps, (int, float)) and 1e-10 <= self.eps < 1):
            raise InputError(f"eps must be in [1e-10, 1) (fixed point with {adamw.FA} fractional bits), not {self.eps}")
        if self.lr > 1 - self.betas[0]:
            raise InputError(f"lr must be at most 1 - beta1 = {1 - self.betas[0]:g} (the step factor "
                             f"lr * sqrt(1 - beta2^t) / (1 - beta1^t) stays below 1), not {self.lr}")

    def fixed(self) -> dict[str, int]:
        """The hyperparameters in fixed point (dampening only matters with momentum, as in torch)."""
        if self.kind == "adamw":
            return adamw.hyper(self)
        out = {k: fixed(getattr(self, k)) for k in ("lr", "momentum", "dampening", "weight_decay")}
        if not self.momentum:
            out["dampening"] = 0
        return out

    @property
    def flags(self) -> int:
        return (NESTEROV if self.nesterov else 0) | (adamw.AMSGRAD if self.amsgrad else 0) \
            | (adamw.MAXIMIZE if self.maximize else 0)

    def describe(self) -> str:
        if self.kind == "adamw":
            return (f"adamw lr {self.lr:g} betas {self.betas[0]:g},{self.betas[1]:g} eps {self.eps:g} weight decay "
                    f"{self.weight_decay:g}{' amsgrad' if self.amsgrad else ''}{' maximize' if self.maximize else ''}")
        return (f"sgd lr {self.lr:g} momentum {self.momentum:g} dampening {self.dampening:g} weight decay "
                f"{self.weight_decay:g}{' nesterov' if self.nesterov else ''}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


# --- layout of a job's share ----------------------------------------------------------------
def blocks(params: int, elems: int) -> int:
    return -(-params // elems)


def meta_slots(params: int, elems: int) -> int:
    """Rounds (= slots) of one step's block exponents: one int32 per block, ``elems`` per record."""
    return -(-blocks(params, elems) // elems)


def share(params: int, elems: int) -> int:
    """Slots of an optimizer job: its exponent rounds, then one per parameter block."""
    return meta_slots(params, elems) + blocks(params, elems)


def shards(params: int, elems: int, k: int) -> list[tuple[int, int]]:
    """An optimizer job over ``k`` aggregators (its state sharded like ZeRO's, over NICs): the
    parameter range [start, stop) each holds, whole blocks, contiguous. The update is per block,
    so the shards together compute exactly what one aggregator would."""
    nb = blocks(params, elems)
    cuts = [min(params, (i * nb // k) * elems) for i in range(k + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(k)]
