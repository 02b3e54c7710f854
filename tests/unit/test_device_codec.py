"""The fixed point as torch operations (nicoffload.torch.device.codec) against the numba kernels
it must equal bit for bit, on CPU tensors: the block metadata (kernels.block_meta_f32/f64,
refusal codes and subnormals included), the lanes for the group's exponents (fixed.quantize, and
the payloads of the aggregator's own encoders), and the decode of the summed lanes (pump.unfix
through fixed.decode). bfloat16 and float16 go through float32, as the host path takes them."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from nicoffload.datapath import encode, kernels  # noqa: E402
from nicoffload.local import fixed  # noqa: E402
from nicoffload.torch.device import codec  # noqa: E402
from nicoffload.wire import proto, quant  # noqa: E402

TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def host_view(t: torch.Tensor) -> np.ndarray:
    """What the host path hands the kernels: float64 as it is, everything else as float32."""
    return t.double().numpy() if t.dtype == torch.float64 else t.float().numpy()


def meta(x: np.ndarray, E: int) -> np.ndarray:
    e = np.empty(-(-x.size // E), np.int32)
    (kernels.block_meta_f64 if x.dtype == np.float64 else kernels.block_meta_f32)(x, E, e)
    return e


def check(ranks: list[torch.Tensor], elems: int, bits: int, device: str = "cpu") -> None:
    """Every step of a sum of ``ranks`` (one tensor per rank), torch on ``device`` against numba,
    bit for bit."""
    E = quant.block_elems(elems, bits)
    W, n = len(ranks), ranks[0].numel()
    xs = [host_view(t) for t in ranks]
    exps = [meta(x, E) for x in xs]
    for t, e in zip(ranks, exps):
        assert np.array_equal(codec.block_meta(t.to(device), E).cpu().numpy(), e)
    gexp = np.max(exps, axis=0)
    assert gexp.max(initial=0) < quant.REFUSE_EXP
    top, bias = quant.top_bits(bits) - quant.headroom_bits(W), quant.bias(W, bits)
    single = xs[0].dtype == np.float32
    total = np.zeros(len(gexp) * E * bits // 32, np.int64)
    for t, x in zip(ranks, xs):
        want = np.zeros(len(gexp) * E * bits // 32, np.int32)
        fixed.quantize(x, E, gexp, top, bias, single, want if bits == 32 else want.view(np.int16))
        got = codec.quantize(t.to(device), gexp, E, top, bias, bits).cpu().numpy()
        assert got.tobytes() == want.tobytes(), np.flatnonzero(got != want)[:8]
        total += want
    words = total.astype(np.int32)  # the int32 sum wraps as the communicators' does
    want = np.empty(n, xs[0].dtype)
    fixed.decode(words, E, gexp, top, W * bias, bits == 16, 0, len(gexp), n, want)
    sums = torch.from_numpy(words).to(device)
    got = codec.decode(sums, gexp, E, top, W * bias, n, ranks[0].dtype, bits).cpu().numpy()
    assert got.tobytes() == want.tobytes(), np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[:8]


def adversarial(dtype: str, n: int, E: int, seed: int) -> list[torch.Tensor]:
    """Three ranks' tensors: decades mixed within blocks, blocks zero on every rank and on one,
    subnormal-only blocks, subnormals beside normals, values at the edge of the dtype's range."""
    rng = np.random.default_rng(seed)
    fi = torch.finfo(TORCH[dtype])
    lo, hi = np.log10(fi.tiny) + 1, np.log10(fi.max) - 1
    out = []
    for r in range(3):
        x = rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)
        x[: 2 * E] = 0                                          # zero on every rank
        if r == 1:
            x[3 * E:4 * E] = 0                                  # zero on one rank
        x[4 * E:5 * E] = rng.standard_normal(E) * fi.tiny * 0.4  # subnormals only
        x[5 * E:6 * E] *= 1e-30
        x[5 * E] = fi.tiny * 3                                  # a normal among subnormals
        x[6 * E:7 * E] = rng.uniform(-1, 1, E) * float(fi.max)  # near overflow
        x[7 * E:8 * E] = rng.integers(-3, 4, E) * 0.5           # exact halves: round half to even
        out.append(torch.from_numpy(x).to(TORCH[dtype]))
    return out


@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_adversarial_tensors_encode_and_decode_as_the_kernels(dtype, bits):
    elems = 64
    E = quant.block_elems(elems, bits)
    check(adversarial(dtype, 40 * E + 7, E, seed=bits), elems, bits)


def test_lanes_that_sum_to_two_to_the_31_decode_as_the_kernels():
    """float64 just below a power of two rounds to the top lane: two ranks' lanes sum to 2^31,
    an int32 of -2^31, which the decode must take as the kernels do."""
    x = torch.full((3 * 64,), float(np.nextafter(2.0 ** 5, 0)), dtype=torch.float64)
    x[64:128] = -x[64:128]
    x[128:] = float(np.nextafter(2.0 ** -700, 0))
    check([x, x.clone()], 64, 32)


def test_nan_and_inf_blocks_get_the_kernels_refusal_codes():
    x = torch.randn(10 * 64)
    x[64 + 3] = float("inf")                      # Inf alone
    x[128 + 5], x[128 + 9] = float("-inf"), float("nan")  # NaN wins over Inf
    x[192 + 63] = float("nan")
    x[256:320] = 0
    x[320:384] = torch.finfo(torch.float32).tiny / 8    # subnormal only
    for t in (x, x.double(), x.bfloat16(), x.half()):
        want = meta(host_view(t), 64)
        assert np.array_equal(codec.block_meta(t, 64).numpy(), want)
        assert {quant.refusal(int(c))[0] for c in want[1:4]} == {quant.REFUSE_INF, quant.REFUSE_NAN}
    assert codec.first_nonfinite(x) == (67, "Inf")


@pytest.mark.parametrize("bits", [32, 16])
def test_the_lanes_are_the_payloads_of_the_aggregators_encoders(bits):
    """The lanes are what encode_float / encode_half put in the records of the same rounds."""
    elems, W = 64, 2
    x = adversarial("float32", 9 * 128 + 5, 128, seed=3)[0].numpy()
    E = quant.block_elems(elems, bits)
    g = meta(x, E)
    blocks = np.flatnonzero(g != quant.ZERO_EXP).astype(np.int64)
    shifts = quant.shifts_for(g[blocks], W, bits).astype(np.int32)
    rec = proto.record_size(elems)
    buf = np.zeros(len(blocks) * rec, np.uint8)
    tmpl, masks = np.zeros(proto.HDR_LEN, np.uint8), np.ones(len(blocks), np.int64)
    mine = np.arange(len(blocks), dtype=np.int64)
    if bits == 32:
        encode.encode_float(buf, rec, elems, tmpl, x, mine, 0, 64, blocks, masks, shifts, quant.bias(W), True, 0,
                            proto.OP_SUM64)
    else:
        encode.encode_half(buf, rec, elems, tmpl, x, mine, 0, 64, blocks, masks, shifts, quant.bias(W, 16), True, 0)
    payloads = buf.reshape(len(blocks), rec)[:, proto.HDR_LEN:]
    top = quant.top_bits(bits) - quant.headroom_bits(W)
    got = codec.quantize(torch.from_numpy(x), g, E, top, quant.bias(W, bits), bits).view(torch.uint8).numpy()
    assert got.reshape(len(g), -1)[blocks].tobytes() == payloads.tobytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: scripts/gpu-check.sh runs this "
                    "on a machine with one")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_on_the_gpu_the_encoding_is_the_kernels(dtype):
    """The same integers leave the host for the same float input, encoded on the GPU."""
    for bits in (32, 16):
        E = quant.block_elems(64, bits)
        check(adversarial(dtype, 40 * E + 7, E, seed=bits), 64, bits, "cuda")
        rng, dec = np.random.default_rng(bits), 4 if dtype == "float16" else 8  # float16 ends at 65504
        big = [torch.from_numpy(rng.standard_normal(1 << 20) * 10.0 ** rng.integers(-dec, dec, 1 << 20))
               .to(TORCH[dtype]) for _ in range(2)]
        check(big, 256, bits, "cuda")
    x = torch.randn(640)
    x[70], x[130], x[140] = float("inf"), float("-inf"), float("nan")
    t = x.to(TORCH[dtype])
    assert np.array_equal(codec.block_meta(t.cuda(), 64).cpu().numpy(), meta(host_view(t), 64))


floats = st.floats(width=32, allow_nan=False, allow_infinity=False)
decades = st.integers(-45, 38)


@settings(max_examples=60, deadline=None, database=None,  # a loaded CI machine is slow: no health check fails on it
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(data=st.data(), W=st.integers(2, 5), bits=st.sampled_from([32, 16]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_tensors_encode_and_decode_as_the_kernels(data, W, bits, dtype):
    n = data.draw(st.integers(1, 300))
    ranks = []
    for _ in range(W):
        vals = data.draw(st.lists(floats, min_size=n, max_size=n))
        scale = 10.0 ** data.draw(decades)
        x = torch.tensor(vals, dtype=torch.float64) * scale
        x[data.draw(st.integers(0, n)):data.draw(st.integers(0, n))] = 0  # a run of zeros, maybe empty
        x = x.clamp(-3e38, 3e38).float().to(TORCH[dtype])
        ranks.append(torch.nan_to_num(x, posinf=0.0, neginf=0.0))     # float16 overflows to Inf
    check(ranks, 8, bits)
