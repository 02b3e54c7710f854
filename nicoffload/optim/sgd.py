"""SGD in the aggregator's fixed point: torch.optim.SGD's update (momentum, dampening, Nesterov,
weight decay) as the XDP program computes it (``sgd_apply`` in xdp/optim.h), bit for bit;
a whole optimizer job in numpy (:class:`JobModel`, which hands AdamW's blocks to :mod:`.adamw`);
and a bound on SGD's distance from float64 (derivation: docs/optimizer.md). The user-space
aggregator runs this model and the tests hold the XDP program to it.

Formats (constants from xdp/nicoffload_proto.h):
- master weights w and momentum m: int64 with F = AR_OPT_FRAC (32) fractional bits;
- hyperparameters lr, momentum, dampening, weight_decay: integers c = round(v * 2^F), 0 <= v <= 1;
- a product x * v is mulfrac(x, c) = floor(x * c / 2^F), exact (no 128-bit product needed);
- the gradient of a round: the SUM64 lanes of the ranks' pre-averaged, quantized gradients
  (each rank's lane offset by ``bias``, scaled by 2^-exp, exp the round's exponent), converted
  to F fractional bits with rounding;
- the result: the updated w as int32 lanes with one exponent for the block (value = lane * 2^e,
  e = max(0, bits(max |w|) - 31) - F, lanes floor(w / 2^(e + F))).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nicoffload.wire import proto, quant

from ..errors import InputError
from . import adamw
from .fixed import FRAC, ONE, mulfrac, returned_error
from .spec import OptimizerSpec, blocks

#: |gradient| and |parameter| stay below 2^RANGE (checked where they enter)
RANGE = proto.C["AR_OPT_RANGE"]


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
        exps = [quant.block_exponents(padded_blocks(g, nb, E)) for g in grads]
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


def padded_blocks(g: np.ndarray, nb: int, elems: int) -> np.ndarray:
    """A gradient as ``nb`` blocks of ``elems``, zero-padded (float32 unless it is float64)."""
    out = np.zeros(nb * elems, dtype=np.float64 if g.dtype == np.float64 else np.float32)
    out[:g.size] = g.reshape(-1)
    return out.reshape(nb, elems)


# --- error against float64 ------------------------------------------------------------------
def error_bound(spec: OptimizerSpec, steps: int, grad_max: float, world: int, w_max: float = 1.0,
                params_dtype=np.float64) -> float:
    """A bound on |w - w_float64| after ``steps`` updates, per parameter, for summed (averaged)
    gradients with |g| <= grad_max and parameters with |w| <= w_max throughout (the derivation
    is in docs/optimizer.md). It follows the worst case of every rounding through the recurrence:
    the workers' quantization of the gradient (N * 2^(L-30) * grad_max, L = ceil(log2 N)), its
    conversion to fixed point (half an ulp, u = 2^-F), each floor of mulfrac (one ulp), and each
    hyperparameter's representation (half an ulp relative to the value it multiplies); then the
    parameters' way back into the rank's ``params_dtype`` (float32 for a float32 model)."""
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
    return e_w + returned_error(w_max, params_dtype)
