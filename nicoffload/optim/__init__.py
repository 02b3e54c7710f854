"""The optimizer an aggregator applies for a job (OptimusNIC): SGD with momentum, dampening,
Nesterov and weight decay, as torch.optim.SGD defines them, and AdamW as torch.optim.AdamW does
(:mod:`.adamw`), in the fixed point the XDP program computes in. This module is the one Python home of that arithmetic: the user-space aggregator
runs it, the tests hold the XDP program to it bit for bit, and docs/optimizer.md derives its
error against float64.

Formats (constants from xdp/nicoffload_proto.h):
- master weights w and momentum m: int64 with F = AR_OPT_FRAC (32) fractional bits;
- hyperparameters lr, momentum, dampening, weight_decay: integers c = round(v * 2^F), 0 <= v <= 1;
- a product x * v is mulfrac(x, c) = floor(x * c / 2^F), exact (no 128-bit product needed);
- the gradient of a round: the SUM64 lanes of the ranks' pre-averaged, quantized gradients
  (each rank's lane offset by ``bias``, scaled by 2^-exp, exp the round's exponent), converted
  to F fractional bits with rounding;
- the result: the updated w as int32 lanes with one exponent for the block (value = lane * 2^e,
  e = max(0, bits(max |w|) - 31) - F, lanes floor(w / 2^(e + F))).

Layout of a job's share of the slot pool: slot s < meta holds the rounds of the block exponents
(op MAX), slot meta + b the rounds of parameter block b (op SGD), so a step of P = meta + blocks
rounds maps round i to slot i mod P and the aggregator finds a round's parameters from its slot.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from nicoffload.wire import proto, quant

from ..errors import InputError
from . import adamw
from .adamw import AdamWBound  # noqa: F401  (re-exported)

from .fixed import FRAC, ONE, fixed, mulfrac  # noqa: F401  (mulfrac: the models' product, re-exported)
#: |gradient| and |parameter| stay below 2^RANGE (checked where they enter)
RANGE = proto.C["AR_OPT_RANGE"]
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


# --- fixed point ----------------------------------------------------------------------------
def to_fixed(values: np.ndarray) -> np.ndarray:
    """Parameters to int64 with FRAC fractional bits (rounded); |value| < 2^RANGE."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(v).all():
        raise InputError("parameters must be finite")
    if v.size and np.abs(v).max() >= 2.0 ** RANGE:
        raise InputError(f"parameters must be below 2^{RANGE} in magnitude (largest {np.abs(v).max():.3g})")
    return np.rint(v * ONE).astype(np.int64)


def from_fixed(w: np.ndarray) -> np.ndarray:
    return np.asarray(w, dtype=np.int64).astype(np.float64) / ONE


def bit_length(v: int) -> int:
    return int(v).bit_length()


@dataclass
class BlockState:
    """One block's master weights, momentum (AdamW: first moment) and count of updates; AdamW's
    s = sqrt(second moment) and its running maximum (amsgrad), AR_ADAM_FRAC fractional bits."""

    w: np.ndarray
    m: np.ndarray
    steps: int = 0
    s: np.ndarray | None = None
    smax: np.ndarray | None = None

    def __post_init__(self):
        if self.s is None:
            self.s = np.zeros_like(self.m)
        if self.smax is None:
            self.smax = np.zeros_like(self.m)


def sgd_update(state: BlockState, lanes: np.ndarray, offset: int, gexp: int, hyper: dict[str, int],
               nesterov: bool, count: int | None = None) -> tuple[np.ndarray, int]:
    """Apply one update to ``state`` from the SUM64 lanes of a completed round (uint32, one per
    element; ``offset`` = ranks * bias; the gradient is (lane - offset) * 2^-gexp) to its first
    ``count`` elements (the padding of a partial block stays as it is, 0); returns the result:
    (int32 lanes, exponent). Mirrors sgd_apply in xdp/optim.h exactly."""
    if count is not None and count < len(lanes):
        head = BlockState(state.w[:count].copy(), state.m[:count].copy(), state.steps)
        res, e = sgd_update(head, lanes[:count], offset, gexp, hyper, nesterov)
        state.w[:count], state.m[:count], state.steps = head.w, head.m, head.steps
        out = np.zeros(len(lanes), np.int32)
        out[:count] = res
        return out, e
    q = lanes.astype(np.int64) - np.int64(offset)
    sh = FRAC - gexp
    if sh >= 0:
        g = q << np.int64(sh)
    else:
        g = (q + np.int64(1 << (-sh - 1))) >> np.int64(-sh)
    first = state.steps == 0
    mu = 0 if first else hyper["momentum"]
    damp = 0 if first else hyper["dampening"]
    g = g + mulfrac(state.w, hyper["weight_decay"])
    m = mulfrac(state.m, mu) + g - mulfrac(g, damp)
    d = g + mulfrac(m, hyper["momentum"]) if nesterov else m
    w = state.w - mulfrac(d, hyper["lr"])
    state.w, state.m, state.steps = w, m, state.steps + 1
    return result_lanes(w)


def result_lanes(w: np.ndarray) -> tuple[np.ndarray, int]:
    """The updated parameters as the aggregator sends them: int32 lanes and one exponent."""
    bits = bit_length(int(np.bitwise_or.reduce(np.abs(w).astype(np.uint64)))) if w.size else 0
    out = max(0, bits - 31)
    return (w >> np.int64(out)).astype(np.int32), out - FRAC


def apply_update(spec: OptimizerSpec, state: BlockState, lanes: np.ndarray, offset: int, gexp: int,
                 hyper: dict[str, int], count: int) -> tuple[np.ndarray, int]:
    """The job's optimizer on one completed round of a block: its result (lanes, exponent)."""
    if spec.kind == "adamw":
        adamw.update(state, lanes, offset, gexp, hyper, spec.flags, count)
        return result_lanes(state.w)
    return sgd_update(state, lanes, offset, gexp, hyper, spec.nesterov, count)


# --- a whole job, in numpy (the user-space aggregator's and the tests' model) ---------------
def step_shifts(gexp: np.ndarray, world: int) -> np.ndarray:
    """The quantization shift of each block of a step (0 for blocks zero on every rank)."""
    return np.where(gexp == quant.ZERO_EXP, 0, 30 - quant.headroom_bits(world) - gexp.astype(np.int64))


def rank_lanes(grad: np.ndarray, shifts: np.ndarray, elems: int, world: int) -> np.ndarray:
    """What one rank sends for a step's data rounds: (blocks, elems) int32 lanes, offset binary."""
    nb = len(shifts)
    padded = np.zeros(nb * elems, dtype=grad.dtype)
    padded[:grad.size] = grad.reshape(-1)
    q = quant.quantize(padded.reshape(nb, elems), shifts)
    bias = 1 << (30 - quant.headroom_bits(world))
    return (q.astype(np.int64) + bias).astype(np.uint32).view(np.int32)


class JobModel:
    """An optimizer job as the aggregator holds it: per block its state; :meth:`step` takes every
    rank's pre-averaged gradients and returns what the aggregator sends back (the updated
    parameters as lanes and exponents) and their values."""

    def __init__(self, spec: OptimizerSpec, params: np.ndarray, world: int, elems: int):
        self.spec, self.world, self.elems = spec.validate(), world, elems
        self.n = params.size
        nb = blocks(self.n, elems)
        w = np.zeros(nb * elems, np.int64)
        w[:self.n] = to_fixed(params)
        self.states = [BlockState(w[b * elems:(b + 1) * elems].copy(), np.zeros(elems, np.int64)) for b in range(nb)]
        self.bias = 1 << (30 - quant.headroom_bits(world))

    def step(self, grads: list[np.ndarray]) -> tuple[list[tuple[np.ndarray, int]], np.ndarray]:
        E, nb = self.elems, len(self.states)
        exps = [quant.block_exponents(_padded(g, nb, E)) for g in grads]
        gexp = np.max(np.stack(exps), axis=0)
        sh = step_shifts(gexp, self.world)
        lanes = sum(rank_lanes(g, sh, E, self.world).view(np.uint32).astype(np.uint64) for g in grads)
        lanes = (lanes & 0xFFFFFFFF).astype(np.uint32)
        out, values = [], np.empty(nb * E)
        hyper = self.spec.fixed()
        for b, st in enumerate(self.states):
            count = min(E, self.n - b * E)
            res, e = apply_update(self.spec, st, lanes[b], self.world * self.bias, int(sh[b]), hyper, count)
            out.append((res, e))
            values[b * E:(b + 1) * E] = np.ldexp(res.astype(np.float64), e)
        return out, values[:self.n]

    @property
    def w(self) -> np.ndarray:
        return np.concatenate([s.w for s in self.states])[:self.n]


def _padded(g: np.ndarray, nb: int, elems: int) -> np.ndarray:
    out = np.zeros(nb * elems, dtype=np.float64 if g.dtype == np.float64 else np.float32)
    out[:g.size] = g.reshape(-1)
    return out.reshape(nb, elems)


# --- error against float64 ------------------------------------------------------------------
def error_bound(spec: OptimizerSpec, steps: int, grad_max: float, world: int, w_max: float = 1.0) -> float:
    """A bound on |w - w_float64| after ``steps`` updates, per parameter, for summed (averaged)
    gradients with |g| <= grad_max and parameters with |w| <= w_max throughout (the derivation
    is in docs/optimizer.md). It follows the worst case of every rounding through the recurrence:
    the workers' quantization of the gradient (N * 2^(L-30) * grad_max, L = ceil(log2 N)), its
    conversion to fixed point (half an ulp, u = 2^-F), each floor of mulfrac (one ulp), and each
    hyperparameter's representation (half an ulp relative to the value it multiplies)."""
    u = 2.0 ** -FRAC
    mu, damp, wd, lr = spec.momentum, spec.dampening if spec.momentum else 0.0, spec.weight_decay, spec.lr
    e_quant = world * 2.0 ** (quant.headroom_bits(world) - 30) * grad_max
    m_max = (grad_max + wd * w_max) / (1 - mu) if mu < 1 else steps * (grad_max + wd * w_max)
    d_max = grad_max + wd * w_max + mu * m_max
    e_w, e_m = u / 2, 0.0
    for k in range(steps):
        e_g = e_quant + u / 2 + wd * e_w + w_max * u / 2 + u
        if k == 0 or not mu:
            e_m = e_g * (1 + damp) + u
        else:
            e_m = mu * e_m + m_max * u / 2 + u + e_g * (1 + damp) + (grad_max + wd * w_max) * u / 2 + u
        e_d = e_g + mu * e_m + m_max * u / 2 + u if spec.nesterov else e_m
        e_w = e_w + lr * e_d + d_max * u / 2 + u
    return e_w + w_max * 2.0 ** -31  # the result's block floating point (31-bit lanes) on the way back
