"""Expected results of an AllReduce, and how far from them a system may land: the one home of
both, used by ``demo``, ``allreduce``, the bench and the tests.

* Integers: the exact sum, computed in int64. A system summing int32 lanes (nicoffload, or a
  host in int32) must match it modulo 2^32, bit for bit.
* nicoffload on floats (:func:`quantized`): the exact sum within :func:`nicoffload.wire.quant.error_bound`
  for each block of ``elems`` elements (block exponents are the largest over the ranks, as the
  workers agree on them), plus half an ulp of the result's dtype for the final cast.
* A host summing floats in their own dtype (TCP ring, gloo, MPI; :func:`host_sum`): within
  N * u * sum_i |x_i| plus half an ulp of the result, u the dtype's unit roundoff (2^-24 for
  float32). N - 1 additions in any order stay within gamma_(N-1) * sum_i |x_i|, and gamma_(N-1)
  < N * u while N * u < 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from nicoffload.wire.quant import block_elems, block_exponents, error_bound

from ..jobspec import DEFAULT


@dataclass
class Check:
    """A result held against its reference."""

    max_abs_err: float
    within_bound: bool
    reason: str = ""                 # why not, when it is not


@dataclass
class Expected:
    exact: np.ndarray                # int64 for integer inputs, float64 for floats
    bound: np.ndarray | None         # per element; None: exact (integers, modulo the result's width)

    def check(self, result: np.ndarray) -> Check:
        result = np.asarray(result).reshape(-1)
        if result.shape != self.exact.shape:
            return Check(float("inf"), False, f"result has {result.size} elements, expected {self.exact.size}")
        if self.bound is None:
            want = self.exact.astype(result.dtype)  # wraps like the sum's int32 lanes
            bad = np.flatnonzero(result != want)
            err = float(np.abs(result.astype(np.float64) - want).max()) if result.size else 0.0
            reason = f"{result.dtype} sum not exact at {len(bad)} elements (first {int(bad[0])})" if len(bad) else ""
            return Check(err, not len(bad), reason)
        err = np.abs(result.astype(np.float64) - self.exact)
        ok = bool((err <= self.bound).all())
        reason = ""
        if not ok:
            i = int(np.argmax(err - self.bound))
            reason = f"result outside the error bound at element {i}: |err| {err[i]:.3g} > {self.bound[i]:.3g}"
        return Check(float(err.max()) if err.size else 0.0, ok, reason)


def _flat(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a).reshape(-1) for a in arrays]


def exact_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """int64 sum of integer inputs, float64 sum of float inputs (one rank at a time, so inputs
    may be memory maps)."""
    xs = _flat(arrays)
    acc = np.zeros(xs[0].size, dtype=np.int64 if xs[0].dtype.kind in "iu" else np.float64)
    for x in xs:
        acc += x
    return acc


def _half_ulp(exact: np.ndarray, dtype) -> np.ndarray:
    return np.spacing(np.abs(exact).astype(dtype)).astype(np.float64) / 2


def _integer(arrays) -> Expected | None:
    if np.asarray(arrays[0]).dtype.kind in "iu":
        return Expected(exact_sum(arrays), None)
    return None


def quantization_bound(arrays: Sequence[np.ndarray], elems: int = DEFAULT.elems, lanes: int = 32) -> np.ndarray:
    """Per element, nicoffload's bound on |sum_hat - sum| before the final cast (``lanes``: 32 or
    16 bits per fixed-point lane; 16-bit blocks hold 2 * elems elements)."""
    xs = _flat(arrays)
    lanes = lanes if lanes in (16, 32) else 32
    elems = block_elems(elems, lanes)
    n = xs[0].size
    nb = -(-n // elems)
    exps = None
    for x in xs:
        pad = np.zeros(nb * elems, dtype=x.dtype)
        pad[:n] = x
        e = block_exponents(pad.reshape(nb, elems))
        exps = e if exps is None else np.maximum(exps, e)
    return np.repeat(error_bound(exps, len(xs), lanes), elems)[:n]


def quantized(arrays: Sequence[np.ndarray], elems: int = DEFAULT.elems, lanes: int = 32) -> Expected:
    """What nicoffload must return for these inputs (records of ``elems`` 32-bit words, floats in
    ``lanes``-bit fixed point)."""
    exp = _integer(arrays)
    if exp is not None:
        return exp
    exact = exact_sum(arrays)
    dtype = np.asarray(arrays[0]).dtype
    return Expected(exact, quantization_bound(arrays, elems, lanes) + _half_ulp(exact, dtype))


def _sums(xs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sum of the inputs and the sum of their magnitudes."""
    exact = np.zeros(xs[0].size, dtype=np.float64)
    abs_sum = np.zeros(xs[0].size, dtype=np.float64)
    for x in xs:
        x64 = np.asarray(x, dtype=np.float64)
        exact += x64
        abs_sum += np.abs(x64)
    return exact, abs_sum


def host_sum(arrays: Sequence[np.ndarray]) -> Expected:
    """What a host summing in the inputs' own dtype must return."""
    exp = _integer(arrays)
    if exp is not None:
        return exp
    xs = _flat(arrays)
    exact, abs_sum = _sums(xs)
    u = np.finfo(xs[0].dtype).eps / 2
    return Expected(exact, len(xs) * u * abs_sum + _half_ulp(exact, xs[0].dtype))


#: unit roundoff of the half types a host may sum in (torch's bfloat16 and float16)
HALF_UNIT = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
#: half the spacing of their subnormals: the absolute error of a rounding near zero
HALF_TINY = {"bfloat16": 2.0 ** -134, "float16": 2.0 ** -25}


def half_sum(arrays: Sequence[np.ndarray], half: str) -> Expected:
    """What a host returns that casts every input to ``half`` (bfloat16 or float16), sums in that
    type and casts the sum back (DDP's bf16/fp16 compress hooks over gloo): within (N + 2) u
    sum_i |x_i| (each input's cast, N - 1 additions, the result's cast), u the type's unit
    roundoff, plus (2N + 1) times half the type's subnormal spacing (roundings near zero are
    absolute: N casts, N - 1 additions, one cast back... counted generously) and half an ulp of
    the inputs' dtype."""
    xs = _flat(arrays)
    exact, abs_sum = _sums(xs)
    n = len(xs)
    return Expected(exact, (n + 2) * HALF_UNIT[half] * abs_sum + (2 * n + 1) * HALF_TINY[half] +
                    _half_ulp(exact, xs[0].dtype))


def expected(arrays: Sequence[np.ndarray], quantizes: bool, elems: int = DEFAULT.elems,
             lanes: int = 32) -> Expected:
    """:func:`quantized` for a system that sums through nicoffload's fixed point, else :func:`host_sum`."""
    return quantized(arrays, elems, lanes) if quantizes else host_sum(arrays)


def two_level(arrays: Sequence[np.ndarray], elems: int = DEFAULT.elems, width: int | None = None) -> Expected:
    """What a job of more than 32 ranks (nicoffload.worker.hier: leaf groups, then their
    leaders) must return for float inputs: every leaf's bound on its group's sum, the half ulp of
    each group sum's cast, the root's bound on the sum of those sums (twice it: a group sum off by
    its leaf's error can cross a power of two and raise its block's exponent by one), and the
    final cast. Integers: exact, as everywhere. ``width``: ranks per leaf group at most (default
    the aggregator's 32)."""
    from nicoffload.worker.hier import groups_of

    exp = _integer(arrays)
    if exp is not None:
        return exp
    xs = _flat(arrays)
    dtype = xs[0].dtype
    exact = exact_sum(xs)
    bound = np.zeros(exact.size, np.float64)
    parts = []
    for g in (groups_of(len(xs)) if width is None else groups_of(len(xs), width)):
        group = [xs[r] for r in g]
        s = exact_sum(group)
        bound += quantization_bound(group, elems) + _half_ulp(s, dtype)
        parts.append(s.astype(dtype))
    bound += 2 * quantization_bound(parts, elems) + _half_ulp(exact, dtype)
    return Expected(exact, bound)
