"""AdamW in the aggregator's fixed point: torch.optim.AdamW's update (decoupled weight decay,
bias correction from the step count, amsgrad and maximize) as the XDP program computes it
(``adamw_constants``/``adamw_chunk`` in xdp/optim.h), bit for bit, and a bound on its distance
from float64 AdamW on the same gradients (derivation: docs/optimizer.md, "AdamW").

State per parameter: the master weight w (int64, F = 32 fractional bits, as SGD's), the first
moment m and s = sqrt(v), the square root of the second moment (int64/uint64 with FA = 42
fractional bits), and with amsgrad the running maximum of s. Keeping sqrt(v) instead of v is
what makes the region v ~ eps^2 exact enough: s has an absolute resolution of 2^-42 (2.3e-13),
far below eps, where a fixed-point v of 64 bits would resolve sqrt(v) only to ~1e-8.

Per block and step t (the block's update count + 1), once:
    bc1 = 1 - b1^t, bc2 = 1 - b2^t (powers by squaring, floored, 32 fractional bits)
    sq = sqrt(bc2)  (isqrt(bc2 << 30) << 1);  alpha = lr * sq / bc1;  eps' = eps * sq
Per element (g the summed pre-averaged gradient, negated with maximize):
    w -= w * lr * wd
    m = b1 * m + (1 - b1) * g
    s = sqrt(b2 * s^2 + (1 - b2) * g^2)   (operands normalised to 31 bits, exact integer sqrt)
    w -= alpha * m / (max(smax, s) if amsgrad else s + eps')
which is torch's update rearranged: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
= (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2)).
"""
from __future__ import annotations

import numpy as np

from nicoffload.wire import proto, quant

from .fixed import FRAC, ONE, fixed, mulfrac, mulfrac_int, returned_error

FA = proto.C["AR_ADAM_FRAC"]
EPS_FRAC = proto.C["AR_ADAM_EPS_FRAC"]
LR_FRAC = EPS_FRAC
AMSGRAD = proto.C["AR_OPT_AMSGRAD"]
MAXIMIZE = proto.C["AR_OPT_MAXIMIZE"]
#: |m / (s + eps')| is clamped below 2^20 (unreachable for beta1^2 < beta2: |m| <= ~8 s)
QMAX = 1 << 52


def hyper(spec) -> dict[str, int]:
    """The hyperparameters in the integers the aggregator keeps (the ar_hyper entry): lr and eps
    with 62 fractional bits (lr * sqrt(bc2) / bc1 keeps 32 significant bits), the rest 32."""
    b1, b2 = spec.betas
    return {"lr": fixed(spec.lr, LR_FRAC), "weight_decay": fixed(spec.weight_decay), "beta1": fixed(b1),
            "beta2": fixed(b2), "omb1": fixed(1 - b1), "omb2": fixed(1 - b2), "eps": fixed(spec.eps, EPS_FRAC)}


def pow_fixed(b: int, t: int) -> int:
    """b^t, 32 fractional bits, by squaring with a floor after each product (as the program)."""
    r = ONE
    for _ in range(32):
        if t & 1:
            r = (r * b) >> 32
        b = (b * b) >> 32
        t >>= 1
    return r


def step_constants(h: dict[str, int], t: int) -> dict[str, int]:
    """What the program computes once per block for update number t (1-based): the step factor
    alpha = lr * sqrt(bc2) / bc1 as a 32-bit mantissa ``alpha`` and a right shift ``ashift``
    (alpha = mantissa * 2^-(32 + ashift)), eps' = eps * sqrt(bc2) (FA fractional bits) and
    lr * weight_decay (32 fractional bits)."""
    from math import isqrt

    bc1 = ONE - pow_fixed(h["beta1"], t)
    bc2 = ONE - pow_fixed(h["beta2"], t)
    sq = isqrt(bc2 << 30) << 1
    x = mulfrac_int(h["lr"], sq)                                   # lr * sqrt(bc2), 62 bits
    a62 = min(((x // bc1) << 32) + (((x % bc1) << 32) // bc1), (1 << 62) - 1)
    r = max(0, a62.bit_length() - 32)
    epsd = mulfrac_int(h["eps"], sq) >> (EPS_FRAC - FA)
    return {"alpha": a62 >> r, "ashift": 30 - r, "epsd": max(1, epsd),
            "lrwd": mulfrac_int(h["lr"], h["weight_decay"]) >> (LR_FRAC - FRAC)}


def _bitlen(x: np.ndarray) -> np.ndarray:
    """Bits of non-negative int64 values (0 for 0), exactly."""
    x = np.asarray(x, dtype=np.int64)
    out = np.zeros(x.shape, np.int64)
    v = x.copy()
    for k in (32, 16, 8, 4, 2, 1):
        big = (v >> np.int64(k)) != 0
        out += np.where(big, k, 0)
        v = np.where(big, v >> np.int64(k), v)
    return out + v


def isqrt(t: np.ndarray) -> np.ndarray:
    """floor(sqrt(t)) for 0 <= t < 2^62, exactly."""
    t = np.asarray(t, dtype=np.int64)
    r = np.floor(np.sqrt(t.astype(np.float64))).astype(np.int64)
    for _ in range(2):
        r = np.where(r * r > t, r - 1, r)
        r = np.where((r + 1) * (r + 1) <= t, r + 1, r)
    return r


def update(state, lanes: np.ndarray, offset: int, gexp: int, h: dict[str, int], flags: int,
           count: int) -> None:
    """One AdamW update of a block's state (w, m, s, smax, steps) from the SUM64 lanes of its
    completed round (uint32 per element; gradient = (lane - offset) * 2^-gexp), on its first
    ``count`` elements (the padding's gradient is 0: its w, m, s stay 0). Mirrors ar_adamw."""
    k = np.arange(len(lanes))
    q = np.where(k < count, lanes.astype(np.int64) - np.int64(offset), 0)
    sh = FA - gexp
    g = q << np.int64(sh) if sh >= 0 else (q + np.int64(1 << (-sh - 1))) >> np.int64(-sh)
    if flags & MAXIMIZE:
        g = -g
    c = step_constants(h, state.steps + 1)
    w = state.w - mulfrac(state.w, c["lrwd"])
    m = mulfrac(state.m, h["beta1"]) + mulfrac(g, h["omb1"])
    ag = np.abs(g)
    a = np.maximum(state.s, ag)
    nsh = np.maximum(0, _bitlen(a) - 31)
    s1, g1 = state.s >> nsh, ag >> nsh
    t = mulfrac(s1 * s1, h["beta2"]) + mulfrac(g1 * g1, h["omb2"])
    s = isqrt(t) << nsh
    su = s
    if flags & AMSGRAD:
        state.smax = np.maximum(state.smax, s)
        su = state.smax
    d = su + np.int64(c["epsd"])
    am = np.abs(m)
    L = 62 - _bitlen(am)
    sd = np.maximum(0, _bitlen(d) - 31)
    Q = (am << L) // (d >> sd)
    kk = L + sd - 32
    kpos, kneg = np.maximum(kk, 0), np.maximum(-kk, 0)
    qa = np.minimum(Q >> kpos, np.int64(QMAX) >> kneg) << kneg
    qs = np.where(m < 0, -qa, qa)
    state.w = w - (mulfrac(qs, c["alpha"]) >> np.int64(c["ashift"]))
    state.m, state.s, state.steps = m, s, state.steps + 1


# --- the bound against float64 AdamW ------------------------------------------------------------
class AdamWBound:
    """A bound on |w - w_float64| per parameter, carried step by step alongside a float64 AdamW
    shadow on the same averaged gradients (docs/optimizer.md derives each term): feed it after
    each shadow step the step's largest |g| and the shadow's exp_avg and exp_avg_sq (flat); its
    ``value`` is the largest bound over the parameters so far, as the rank's ``params_dtype``
    holds them (float32 for a float32 model)."""

    def __init__(self, spec, world: int, params_dtype=np.float64):
        self.spec, self.world, self.params_dtype = spec, world, params_dtype
        self.h = hyper(spec)
        self.t = 0
        self.m_prev = self.e_w = self.e_m = self.e_s = self.e_smax = self.s_max = None
        self.value = 0.0

    def update(self, grad_max: float, m: np.ndarray, v: np.ndarray, w_max: float) -> float:
        b1, b2 = self.spec.betas
        m = np.asarray(m, np.float64).reshape(-1)
        s = np.sqrt(np.asarray(v, np.float64).reshape(-1))
        u, uw = 2.0 ** -FA, 2.0 ** -FRAC
        if self.e_w is None:
            z = np.zeros_like(m)
            self.m_prev, self.e_w, self.e_m, self.e_s, self.e_smax, self.s_max = z, z + uw / 2, z, z, z, z.copy()
            self.s_prev = z.copy()
        self.t += 1
        g = np.abs(m - b1 * self.m_prev) / (1 - b1) if b1 < 1 else np.full_like(m, grad_max)
        e_g = self.world * 2.0 ** (quant.headroom_bits(self.world) - 30) * grad_max + u / 2
        rep = 2.0 ** -(FRAC + 1)  # a hyperparameter's representation: half a 2^-32
        self.e_m = b1 * self.e_m + (1 - b1) * e_g + 2 * u + (np.abs(self.m_prev) + g + e_g) * rep
        a = np.maximum(self.s_prev + self.e_s, g + e_g)
        self.e_s = np.sqrt(b2) * self.e_s + np.sqrt(1 - b2) * e_g + a * 2.0 ** -28 + u
        if self.spec.amsgrad:
            self.s_max = np.maximum(self.s_max, s)
            self.e_smax = np.maximum(self.e_smax, self.e_s)
            su, e_su = self.s_max, self.e_smax
        else:
            su, e_su = s, self.e_s
        c = step_constants(self.h, self.t)
        lr, wd, eps = self.spec.lr, self.spec.weight_decay, self.spec.eps
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        alpha, epsd = lr * np.sqrt(bc2) / bc1, eps * np.sqrt(bc2)
        e_alpha = abs(c["alpha"] * 2.0 ** -(FRAC + c["ashift"]) - alpha) + alpha * 2.0 ** -50
        e_eps = abs(c["epsd"] * u - epsd) + epsd * 2.0 ** -50
        den = su + epsd - e_su - e_eps
        q = np.abs(m) / (su + epsd)
        e_q = np.where(den > 0, (self.e_m + q * (e_su + e_eps)) / np.maximum(den, 1e-300), np.inf)
        e_q = e_q + (q + e_q) * 2.0 ** -28 + uw
        self.e_w = (self.e_w * (1 - lr * wd) + w_max * abs(c["lrwd"] * uw - lr * wd) + uw
                    + e_alpha * (q + e_q) + alpha * e_q + 2 * uw)
        self.m_prev, self.s_prev = m, s
        self.value = float(self.e_w.max()) + returned_error(w_max, self.params_dtype) if m.size else 0.0
        return self.value
