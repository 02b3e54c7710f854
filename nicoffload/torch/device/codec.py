"""The aggregator's fixed point as torch operations, on whatever device the tensor is: the same
integers as the numba kernels for the same floats, bit for bit (tests/unit/test_device_codec.py).

    block_meta      the exponent of each block's largest magnitude (kernels.block_meta_f32/f64):
                    the bits of the largest magnitude on the device (block_max_bits), the exponent
                    from them on the host (exps_from_bits):
                    ZERO_EXP for an all-zero block, a refusal code for a block holding a NaN or
                    an Inf (REFUSE_EXP + (reason << 16); the caller adds its rank), subnormals
                    included
    quantize        given the group's exponents, rint(x * 2^s) + bias per element, s = top -
                    gexp[b], as int32 words: 32-bit lanes one per word, 16-bit lanes two per word
                    (the int16 view of the words, as encode_half and fixed.quantize lay them out);
                    blocks zero on every rank and the tail beyond the tensor are 0
    decode          the summed words back into floats: (lane - nb32) * 2^-s, pump.unfix's
                    arithmetic, one rounding; blocks zero on every rank are +0.0
    first_nonfinite where a refused tensor holds its first NaN or Inf (for the error's message)

The kernels' arithmetic, step for step: float32 input (and bfloat16/float16, through float32,
exactly) is scaled in float32 where 2^s is a normal float32 (-100 < s < 100), else in float64
(2^s split in two factors where it leaves float64's range, kernels.pow2_split); float64 input is
always scaled in float64; rint is round half to even (torch.round). Powers of two are built from
their bits (no exp2, which a device may approximate). The per-block scales are computed on the
host from the group's exponents (a numpy array: they arrive there from the metadata round), so no
step waits for the device.
"""
from __future__ import annotations

import numpy as np
import torch

from nicoffload.wire import quant

ZERO_EXP = quant.ZERO_EXP
F32_SHIFT_LIMIT = 100  # kernels.F32_SHIFT_LIMIT: 2^s and 2^-s are normal float32 numbers
HALF = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: float layout: (int dtype of its bits, magnitude mask, mantissa bits, Inf/NaN field, frexp bias,
#: log2 of the smallest subnormal)
_LAYOUT = {torch.float32: (torch.int32, 0x7FFFFFFF, 23, 0xFF, 126, 149),
           torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 52, 0x7FF, 1022, 1074)}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float dtype a tensor is encoded from and decoded into (float32 for the half types)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(v: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``v`` (flat) as its whole blocks [full, E] (a view) and its last partial block, padded
    with zeros to E elements ([1, E]; None if there is none)."""
    n = v.numel()
    full = n // E
    rows = v[:full * E].view(full, E)
    if full * E == n:
        return rows, None
    tail = v.new_zeros(1, E)
    tail[0, :n - full * E] = v[full * E:]
    return rows, tail


# --- metadata ----------------------------------------------------------------------------------
def block_meta(x: torch.Tensor, E: int) -> torch.Tensor:
    """int32 exponent per block of ``E`` elements of the flat float tensor ``x``, on its device:
    math.frexp's exponent of the block's largest magnitude (kernels.block_meta_*, with the same
    ZERO_EXP and refusal codes). :func:`block_max_bits` on the device, :func:`exps_from_bits` on
    the host (the device path copies the per-block bits and derives the exponents there)."""
    mm = block_max_bits(x, E).cpu().numpy()
    return torch.from_numpy(exps_from_bits(mm, x.dtype == torch.float64)).to(x.device)


def block_max_bits(x: torch.Tensor, E: int) -> torch.Tensor:
    """Per block of ``E`` elements of the flat float tensor ``x``, on its device, the bits of its
    largest magnitude (int32; int64 for float64): two operations on the device, whatever the
    values (the exponents, zero blocks, subnormals and refusals follow from these bits alone)."""
    xf = x.reshape(-1)
    if xf.dtype in HALF:
        xf = xf.float()  # exact: every bfloat16/float16 value is a float32 value
    idt, amask = _LAYOUT[xf.dtype][:2]
    mag = xf.view(idt) & amask                     # |x|'s bits: a larger magnitude has larger bits
    rows, tail = _rows(mag, E)
    mm = rows.amax(dim=1) if rows.shape[0] else mag.new_zeros(0)
    if tail is not None:
        mm = torch.cat([mm, tail.amax(dim=1)])
    return mm


def exps_from_bits(mm: np.ndarray, double: bool) -> np.ndarray:
    """The blocks' int32 exponents (numpy) from :func:`block_max_bits` (copied to the host)."""
    _, _, mbits, inf_field, fbias, tiny = _LAYOUT[torch.float64 if double else torch.float32]
    mm = np.asarray(mm).astype(np.int64)
    field = mm >> mbits
    exps = field - fbias
    # zero or subnormal only: the largest mantissa m decides (frexp(m * 2^-tiny) = bit length - tiny)
    sub = np.frexp(mm.astype(np.float64))[1].astype(np.int64) - tiny
    exps = np.where(field == 0, sub, exps)
    exps = np.where(mm == 0, ZERO_EXP, exps)
    refuse = quant.REFUSE_EXP + (np.where(mm > inf_field << mbits, quant.REFUSE_NAN, quant.REFUSE_INF) << 16)
    return np.where(field == inf_field, refuse, exps).astype(np.int32)


def first_nonfinite(x: torch.Tensor) -> tuple[int, str] | None:
    """(flat index, "NaN" or "Inf") of the first non-finite value of ``x``, or None."""
    xf = x.reshape(-1)
    bad = torch.nonzero(~torch.isfinite(xf))
    if not bad.numel():
        return None
    i = int(bad[0, 0])
    return i, "NaN" if bool(torch.isnan(xf[i])) else "Inf"


# --- scales (on the host, from the group's exponents) ---------------------------------------------
def _pow2_bits(e: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """2^e as float32/float64 numbers built from their exponent field (e within the normal range)."""
    if dtype == torch.float32:
        return ((e.astype(np.int64) + 127) << 23).astype(np.int32).view(np.float32)
    return ((e.astype(np.int64) + 1023) << 52).view(np.float64)


def _split(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kernels.pow2_split for every s: (2^s, 1) where 2^s is a normal float64, else two halves."""
    s = np.clip(s, -2000, 2000)
    inside = (s > -1000) & (s < 1000)
    h = np.where(inside, s, s // 2)
    return _pow2_bits(h, torch.float64), np.where(inside, 1.0, _pow2_bits(s - h, torch.float64))


def scales(gexp: np.ndarray, top: int, single: bool) -> dict:
    """Per block: which rows are zero everywhere (``zero``), which are scaled in float32
    (``f32``, with their factor) and which in float64 (two factors), for shifts s = top - gexp."""
    g = np.asarray(gexp, np.int64)
    zero = g == ZERO_EXP
    s = np.where(zero, 0, top - g)
    f32 = ~zero & (-F32_SHIFT_LIMIT < s) & (s < F32_SHIFT_LIMIT) if single else np.zeros(len(g), bool)
    return {"s": s, "zero": zero, "f32": f32, "f64": ~zero & ~f32}


#: bytes of per-block scales copied to a device that is not the CPU (the device path counts them)
SCALE_BYTES = [0]


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for it: through pinned memory, copied
    asynchronously on the current stream (a copy from pageable memory waits until the stream has
    run everything queued before it, which stalled the pipeline at every chunk). The caching
    host allocator keeps the pinned block until the copy is done."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _put(rows: torch.Tensor, vals: np.ndarray, idx: np.ndarray, dtype) -> torch.Tensor:
    """The per-row values ``vals[idx]`` as a [k, 1] tensor on ``rows``' device."""
    v = torch.from_numpy(np.ascontiguousarray(vals[idx])).to(dtype)
    if rows.device.type != "cpu":
        SCALE_BYTES[0] += v.numel() * v.element_size()
    return to_device(v, rows.device).view(-1, 1)


# --- encoding ------------------------------------------------------------------------------------
def _encode_rows(xr: torch.Tensor, sc: dict, lo: int, bias: int, single: bool) -> torch.Tensor:
    """int32 rint(x * 2^s) + bias of the rows ``xr`` (blocks lo.. of the scales ``sc``)."""
    k = xr.shape[0]
    s = sc["s"][lo:lo + k]
    f32, f64 = sc["f32"][lo:lo + k], sc["f64"][lo:lo + k]
    if f32.all() and k:
        f = _put(xr, _pow2_bits(s, torch.float32), np.arange(k), torch.float32)
        q = torch.round(xr * f).to(torch.int32)
    else:
        q = torch.zeros(xr.shape, dtype=torch.int32, device=xr.device)
        for rows, scale in ((np.flatnonzero(f32), "f32"), (np.flatnonzero(f64), "f64")):
            if not len(rows):
                continue
            it = to_device(rows, xr.device)
            if scale == "f32":
                f = _put(xr, _pow2_bits(s, torch.float32), rows, torch.float32)
                q[it] = torch.round(xr[it] * f).to(torch.int32)
            else:
                d1, d2 = _split(s)
                xd = xr[it].to(torch.float64)
                q[it] = torch.round(xd * _put(xr, d1, rows, torch.float64) * _put(xr, d2, rows, torch.float64)
                                    ).to(torch.int32)
    q += bias
    zero = sc["zero"][lo:lo + k]
    if zero.any():
        q[to_device(np.flatnonzero(zero), xr.device)] = 0
    return q


def quantize(x: torch.Tensor, gexp: np.ndarray, E: int, top: int, bias: int, bits: int = 32,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The lanes of the flat float tensor ``x`` for the group's block exponents ``gexp`` (numpy,
    one per block of ``E`` elements), on ``x``'s device, as int32 words (``out``, or new):
    per element rint(x * 2^(top - gexp[b])) + bias, as fixed.quantize writes them (32-bit lanes
    one per word; 16-bit lanes two per word, the element of even index in the low half)."""
    xf = x.reshape(-1)
    single = xf.dtype != torch.float64
    if xf.dtype in HALF:
        xf = xf.float()
    nb = len(gexp)
    words = nb * E * bits // 32
    if out is None:
        out = torch.empty(words, dtype=torch.int32, device=x.device)
    sc = scales(gexp, top, single)
    rows, tail = _rows(xf, E)
    parts = [(rows, 0, False)] + ([(tail, rows.shape[0], True)] if tail is not None else [])
    lanes = out.view(torch.int16) if bits == 16 else out
    for xr, lo, is_tail in parts:
        q = _encode_rows(xr, sc, lo, bias, single)
        if is_tail:
            q[0, xf.numel() - lo * E:] = 0  # the tail beyond x is 0, as the kernels write it
        if bits == 16:  # offset-binary 16-bit lanes: the int16 that has the same low 16 bits
            q = (q - ((q & 0x8000) << 1)).to(torch.int16)
        lanes[lo * E:(lo + xr.shape[0]) * E] = q.reshape(-1)
    return out


# --- decoding -----------------------------------------------------------------------------------
def decode(words: torch.Tensor, gexp: np.ndarray, E: int, top: int, nb32: int, n: int, dtype: torch.dtype,
           bits: int = 32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``n`` elements of the summed ``words`` (int32, the layout of :func:`quantize`)
    as ``dtype`` (float32 or float64; the half types decode into float32): per block
    (lane - nb32) * 2^-(top - gexp[b]) with one rounding (pump.unfix); zero blocks are +0.0."""
    dt = work_dtype(dtype)
    nb = len(gexp)
    if bits == 16:  # the unsigned 16-bit lane sums (below 2^15 + 1), less the bias: no overflow
        v = words.view(torch.int16).to(torch.int32) & 0xFFFF
        v -= nb32
    else:  # sum S in [0, 2^31] (2^31 stored as -2^31): S ^ 2^31 is S - 2^31 exactly, and
        # S - 2^31 + (2^31 - nb32) = S - nb32 stays inside int32: no step overflows
        v = torch.bitwise_xor(words, -(1 << 31))
        v += (1 << 31) - nb32
    v = v.view(nb, E)
    sc = scales(gexp, top, True)  # the decode scales float32 output in float32 wherever it can
    s = sc["s"]
    res = None if sc["f32"].all() or sc["f64"].all() else torch.zeros((nb, E), dtype=dt, device=words.device)
    for scale, rows in (("f32", np.flatnonzero(sc["f32"])), ("f64", np.flatnonzero(sc["f64"]))):
        if not len(rows):
            continue
        it = to_device(rows, words.device) if len(rows) < nb else None
        vr = v[it] if it is not None else v
        if dt == torch.float32 and scale == "f32":
            r = vr.to(torch.float32) * _put(v, _pow2_bits(-s, torch.float32), rows, torch.float32)
        elif dt == torch.float32:
            g = _put(v, np.ldexp(1.0, np.clip(-s, -1100, 1100)), rows, torch.float64)
            r = (vr.to(torch.float64) * g).to(torch.float32)
        else:
            d1, d2 = _split(-s)
            r = vr.to(torch.float64) * _put(v, d1, rows, torch.float64) * _put(v, d2, rows, torch.float64)
        if it is None:
            res = r
        else:
            assert res is not None  # made above wherever blocks take different scalings
            res[it] = r
    if res is None:  # every block zero on every rank
        res = torch.zeros((nb, E), dtype=dt, device=words.device)
    flat = res.reshape(-1)[:n]
    if out is None:
        return flat
    out.copy_(flat)
    return out
