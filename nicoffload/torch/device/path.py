"""The backend's path for tensors on a device (CUDA): the float sum is encoded where the tensor
lives and only integers cross to the host.

One all-reduce SUM/AVG of a float tensor on the device (:func:`device_sum`):
    1. the block metadata (:mod:`~nicoffload.torch.device.codec`): each block's largest magnitude
       on the device, its bits to the host (one word per block), the exponents from them there,
       the group's MAX of them through the communicator (an exact int32 MAX), a NaN or an Inf
       refused on every rank together (as the host path refuses it)
    2. per chunk of CHUNK elements, pipelined on a CUDA stream: the lanes of the blocks not zero
       everywhere, encoded on the device, copied once into pinned host memory, summed in place
       through the communicator's int32 SUM (exact: the offset-binary lanes of world contributions
       never overflow, :mod:`~nicoffload.local.fixed`), copied back once and decoded on the
       device with the contributors' bias (world x bias); while the CPU sends chunk k, the device
       encodes and copies chunk k + 1. A group of one host (a communicator with ``sum_staged``:
       local/host.py) copies the lanes of STAGED_CHUNK elements from the device straight into its
       row of the shared segment, registered with the GPU, and the sums straight back out of it:
       no copy through a buffer of this module's, none by the CPU
The integers are the aggregator's (the same exponents, shifts and rint), so the result is the
bits of the host path's for the same input (tests/unit/test_device_path.py on CPU tensors).

Everything else on a device tensor (int32 sums, MAX/MIN, a communicator without int32 MAX, or
NICOFFLOAD_DEVICE_PATH=host) takes the host path: one copy to pinned host memory, the backend's
CPU path, one copy back. NICOFFLOAD_DEVICE_PATH:
    auto    device tensors take this path; CPU tensors the host path (the numba kernels: faster
            on a CPU than these torch operations, see docs/torchrun.md)
    host    every tensor the host path (device tensors copied to the host and back)
    device  every float sum this path, CPU tensors too (checks, and the CPU tests of this module)

Streams: the path waits for the work queued so far on the calling thread's current stream (the
backend's work thread: the device's default stream, where DDP's buckets are written), and the
call completes only once its results are on the device (the side stream is synchronized), so any
stream may read them afterwards.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, fields

import numpy as np
import torch

from nicoffload.datapath.tensors import refusal
from nicoffload.errors import InputError, RefusedError
from nicoffload.torch.device import codec as dc
from nicoffload.torch.device import pinning
from nicoffload.wire import quant

SETTINGS = ("auto", "host", "device")
#: elements per chunk of the pipeline (whole blocks of both lane widths for records up to 2048)
CHUNK = 1 << 20
#: elements per chunk where the lanes go straight into a shared segment (a group of one host):
#: one call of the host's communicator (local/host.py CHUNK); nothing on a wire to overlap with,
#: and every chunk costs its torch operations' launches, its barriers and its waits again
STAGED_CHUNK = 4 << 20


def setting(env=None) -> str:
    """NICOFFLOAD_DEVICE_PATH (auto, host or device), read at each call."""
    env = os.environ if env is None else env
    v = (env.get("NICOFFLOAD_DEVICE_PATH") or "auto").strip() or "auto"
    if v not in SETTINGS:
        raise InputError(f"NICOFFLOAD_DEVICE_PATH must be auto, host or device, not {v!r}")
    return v


def usable(comm) -> bool:
    """Whether ``comm`` sums int32 and takes its MAX: what this path sends through."""
    caps = getattr(comm, "capabilities", None)
    return caps is not None and caps.supports("sum", np.int32) and caps.supports("max", np.int32)


def takes(t: torch.Tensor, how: str, comm) -> bool:
    """Whether the backend hands ``t`` to :func:`reduce`: every tensor not on the CPU, and with
    NICOFFLOAD_DEVICE_PATH=device every float sum the communicator can take as integers."""
    if t.device.type != "cpu":
        return True
    return setting() == "device" and how == "sum" and t.dtype in dc.FLOATS and usable(comm)


@dataclass
class DeviceStats:
    """What this process's device path did: calls, and the bytes of each copy it made (host
    memory written: device to pinned host; device memory written: host to device)."""

    calls: int = 0
    host_calls: int = 0          # device tensors that took the host path (staged)
    elements: int = 0
    d2h_bytes: int = 0           # device -> host copies (metadata, lanes; staged tensors)
    h2d_bytes: int = 0           # host -> device copies (scales, sums; staged tensors)
    comm_bytes: int = 0          # int32 words handed to the communicator (metadata and lanes)
    blocks_skipped: int = 0      # blocks zero on every rank: not sent
    # where a call's wall time went (seconds, summed over calls): the metadata on the device and
    # its copy to the host, the MAX round, queueing the chunks' encodes and copies, waiting for
    # them on the host, the chunks' int32 sums, queueing the decodes, and the final wait
    meta_s: float = 0.0
    max_s: float = 0.0
    encode_s: float = 0.0
    copy_wait_s: float = 0.0
    sum_s: float = 0.0
    decode_s: float = 0.0
    settle_s: float = 0.0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


STATS = DeviceStats()


# --- the backend's entry point -------------------------------------------------------------------
def reduce(pg, t: torch.Tensor, how: str, avg: bool, dtype: torch.dtype | None = None) -> None:
    """``pg._reduce_tensor(t, ...)`` for a tensor :func:`takes` (``pg``: the process group)."""
    if t.numel() == 0:
        return
    device_ok = how == "sum" and t.dtype in dc.FLOATS and usable(pg.comm)
    if t.device.type != "cpu" and (setting() == "host" or not device_ok):
        return _via_host(pg, t, how, avg, dtype)
    bits = pg.router.lanes(dtype or t.dtype).get("lanes", 32)
    wd = dc.work_dtype(t.dtype)
    direct = t.dtype == wd and t.is_contiguous()
    work = t.detach().reshape(-1) if direct else t.detach().to(wd).reshape(-1).contiguous()
    try:
        pg._offload(lambda: device_sum(pg.comm, work, rank=pg._rank, world=pg._size, bits=bits))
    except RefusedError as e:
        if pg.config.nonfinite != "nan" or e.kind not in ("NaN", "Inf"):
            raise
        work.fill_(float("nan"))  # every rank refused it together: every rank gets NaN
    if avg:
        divide(work, pg._size)
    if not direct:
        t.detach().copy_(work.view(t.shape))
    settle(t)


def settle(t: torch.Tensor) -> None:
    """Wait until the work queued on the current stream (the average, the copy back) is done:
    the call completes with its results in place, whatever stream reads them next."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def divide(work: torch.Tensor, k: int) -> None:
    """``work /= k`` as the CPU divides (IEEE division): on CUDA a divisor that is a CPU scalar
    becomes a multiplication by its reciprocal, one ulp away at times; a device tensor does not."""
    if work.device.type == "cpu":
        work.div_(k)
    else:
        work.div_(torch.full((), k, dtype=work.dtype, device=work.device))


def hook_takes(buf: torch.Tensor, comm) -> bool:
    """Whether the DDP hook (nicoffload.ddp) sends ``buf`` through :func:`hook_mean`."""
    return buf.device.type != "cpu" and buf.dtype in dc.FLOATS and setting() != "host" and usable(comm)


def hook_mean(state, buf: torch.Tensor) -> torch.Tensor:
    """The DDP hook's average of a device bucket (``state``: its NicoffloadHookState), in place:
    pre-divided by the world size as DDP does, then summed through :func:`device_sum` (16-bit
    lanes for bfloat16/float16 buckets unless the state says otherwise; 32 on the ring)."""
    wd = dc.work_dtype(buf.dtype)
    direct = buf.dtype == wd and buf.is_contiguous()
    work = buf.detach().reshape(-1) if direct else buf.detach().to(wd).reshape(-1).contiguous()
    st = state.stats
    if work.numel():
        st.input_absmax = max(st.input_absmax, float(work.abs().max()))
    divide(work, state.world)
    lanes = state.lanes or (16 if buf.dtype in dc.HALF else None)
    t0 = time.perf_counter()
    device_sum(state.comm, work, rank=state.rank, world=state.world, bits=32 if state._ring else lanes or 32)
    st.seconds += time.perf_counter() - t0
    st.calls += 1
    st.elements += work.numel()
    if not direct:
        buf.detach().copy_(work.view(buf.shape))
    settle(buf)
    return buf


def _via_host(pg, t: torch.Tensor, how: str, avg: bool, dtype) -> None:
    """The host path for a device tensor: one copy into pinned memory, the CPU path, one back."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t.detach())
    STATS.host_calls += 1
    STATS.d2h_bytes += host.numel() * host.element_size()
    pg._reduce_tensor(host, how, avg, dtype)
    t.detach().copy_(host, non_blocking=False)
    STATS.h2d_bytes += host.numel() * host.element_size()


# --- the sum itself ------------------------------------------------------------------------------
_LOCAL = threading.local()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """This thread's side stream on ``device``, made once: a new stream per call would make
    every call's device memory new to the caching allocator (it keeps blocks per stream), a
    cudaMalloc of each temporary, about 0.4 ms a 16 MiB call on an H200 (torch.profiler)."""
    streams = getattr(_LOCAL, "streams", None)
    if streams is None:
        streams = _LOCAL.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


class _Staging:
    """Where a call's chunks wait for the host: pinned slots and a side stream on CUDA; on the
    CPU the device's tensors are the host's (no copies, nothing to wait for)."""

    def __init__(self, device: torch.device, words: int):
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = _side_stream(device) if self.cuda else None
        self.slots = [torch.empty(words, dtype=torch.int32, pin_memory=True) for _ in range(2)] \
            if self.cuda and words else []

    def __enter__(self):
        if self.cuda:  # wait for the work queued so far on the caller's stream (the gradients)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._ctx.__exit__(*exc)
            t = time.perf_counter()
            self.stream.synchronize()  # the results are on the device before the call completes
            STATS.settle_s += time.perf_counter() - t

    def to_host(self, v: torch.Tensor, slot: int | None = None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``v`` (int32 for a ``slot``) on the host, and an event to wait for before reading it."""
        if not self.cuda:
            return v.contiguous(), None
        h = self.slots[slot][:v.numel()] if slot is not None else torch.empty(v.numel(), dtype=v.dtype,
                                                                               pin_memory=True)
        h.copy_(v, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        STATS.d2h_bytes += v.numel() * v.element_size()
        return h, ev

    def pin(self, seg) -> None:
        """The shared segment ``seg`` registered with the GPU (:mod:`.pinning`), on CUDA."""
        if self.cuda and seg is not None:
            pinning.pin_segment(seg)

    def copy_now(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` between the host and the device, done when it returns."""
        dst.copy_(src, non_blocking=self.cuda)
        if self.stream is not None:
            self.stream.synchronize()

    def to_device(self, h: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return h
        STATS.h2d_bytes += h.numel() * 4
        return h.to(self.device, non_blocking=True)


def _index(act: np.ndarray, device: torch.device) -> torch.Tensor:
    """The active blocks' indices on the device (counted with the copies)."""
    if device.type != "cpu":
        STATS.h2d_bytes += act.nbytes
    return dc.to_device(act, device)


def device_sum(comm, x: torch.Tensor, *, rank: int, world: int, bits: int = 32, elems: int | None = None) -> None:
    """The sum over the group of the flat float32/float64 tensor ``x`` (in place, on its device),
    in the aggregator's fixed point with ``bits``-bit lanes, through ``comm``'s int32 MAX and SUM."""
    n = x.numel()
    if not n:
        return  # every rank's tensor is empty alike: nothing to sum
    elems = elems or getattr(comm, "elems", None) or 256
    E = quant.block_elems(elems, bits)
    top, bias = quant.top_bits(bits) - quant.headroom_bits(world), quant.bias(world, bits)
    # a group of one host sums in its shared segment: the lanes go straight into it and back
    staged = getattr(comm, "sum_staged", None)
    per = max(1, (STAGED_CHUNK if staged else CHUNK) // (2 * elems)) * (2 * elems) // E  # blocks per chunk
    wpb = E * bits // 32                                      # int32 words per block
    STATS.calls += 1
    STATS.elements += n
    with _Staging(x.device, 0 if staged else min(per, -(-n // E)) * wpb) as st:
        gexp = _group_exponents(comm, st, x, E, rank)
        chunks = [(b0, min(len(gexp), b0 + per)) for b0 in range(0, len(gexp), per)]
        pending: deque = deque()

        def launch(c: int) -> None:  # encode chunk c on the device (and start its copy to the host)
            b0, b1 = chunks[c]
            act = np.flatnonzero(gexp[b0:b1] != quant.ZERO_EXP)
            STATS.blocks_skipped += (b1 - b0) - len(act)
            if not len(act):
                pending.append((act, None, None))
                return
            t = time.perf_counter()
            words = dc.quantize(x[b0 * E:min(n, b1 * E)], gexp[b0:b1], E, top, bias, bits).view(b1 - b0, wpb)
            if len(act) < b1 - b0:
                words = words[_index(act, x.device)]
            pending.append((act, words.reshape(-1), None) if staged else (act, *st.to_host(words.reshape(-1), c % 2)))
            STATS.encode_s += time.perf_counter() - t

        for c in range(min(2, len(chunks))):
            launch(c)
        for c in range(len(chunks)):
            act, h, ev = pending.popleft()
            b0, b1 = chunks[c]
            sums = None
            if h is not None:
                t = time.perf_counter()
                if staged:
                    sums = _sum_staged(comm, st, h)
                else:
                    if ev is not None:
                        ev.synchronize()
                    a = h.numpy()
                    STATS.copy_wait_s += time.perf_counter() - t
                    t = time.perf_counter()
                    comm.allreduce(a, out=a)  # the int32 SUM of the group's lanes, in place
                    sums = st.to_device(h)
                STATS.sum_s += time.perf_counter() - t
                STATS.comm_bytes += h.numel() * 4
            t = time.perf_counter()
            _decode(x, sums, act, gexp, b0, b1, E, wpb, top, world * bias, bits)
            STATS.decode_s += time.perf_counter() - t
            if c + 2 < len(chunks):
                launch(c + 2)  # queued behind this chunk's copy back: its slot is free by then


def _sum_staged(comm, st: "_Staging", words: torch.Tensor) -> torch.Tensor:
    """The group's int32 sum of ``words`` (on the device) through ``comm.sum_staged``: copied
    from the device straight into this rank's row of the shared segment, registered with the
    GPU once (page-locked), and the sums straight back out of it. Returns the sums on the device."""
    sums = torch.empty_like(words)

    def fill(row: np.ndarray, lo: int, hi: int) -> None:
        st.pin(comm.data_segment())
        st.copy_now(torch.from_numpy(row), words[lo:hi])
        STATS.d2h_bytes += (hi - lo) * 4

    def take(src: np.ndarray, lo: int, hi: int) -> None:
        st.copy_now(sums[lo:hi], torch.from_numpy(src))
        STATS.h2d_bytes += (hi - lo) * 4

    comm.sum_staged(words.numel(), fill, take)
    return sums


def _group_exponents(comm, st: _Staging, x: torch.Tensor, E: int, rank: int) -> np.ndarray:
    """Step 1: the group's exponent of every block (numpy), or RefusedError on every rank."""
    t = time.perf_counter()
    h, ev = st.to_host(dc.block_max_bits(x, E))  # two operations on the device, one copy
    if ev is not None:
        ev.synchronize()
    mine = dc.exps_from_bits(h.numpy(), x.dtype == torch.float64)
    mine = np.where(mine >= quant.REFUSE_EXP, mine + rank, mine).astype(np.int32)
    gexp = mine.copy()
    t1 = time.perf_counter()
    comm.allreduce(gexp, out=gexp, op="max")
    STATS.meta_s += t1 - t
    STATS.max_s += time.perf_counter() - t1
    STATS.comm_bytes += gexp.nbytes
    if len(gexp) and int(gexp.max()) >= quant.REFUSE_EXP:
        _refuse(gexp, rank, x, int(mine.max()) >= quant.REFUSE_EXP, E)
    return gexp


def _refuse(gexp: np.ndarray, rank: int, x: torch.Tensor, mine: bool, E: int) -> None:
    """tensors.refuse_together's error: the rank that holds the value names its index."""
    bad = dc.first_nonfinite(x) if mine else None
    if bad is not None:
        raise refusal(rank, bad[1], index=bad[0])
    hit = np.flatnonzero(gexp >= quant.REFUSE_EXP)
    b = int(hit[0])
    reason, who = quant.refusal(int(gexp[b])) or (0, None)
    kind = {quant.REFUSE_RANGE: "range", quant.REFUSE_ABORT: "abort"}.get(reason) or quant.REFUSE_WHAT.get(reason, "?")
    raise refusal(who, kind, span=(b * E, min((b + 1) * E, x.numel())), more=len(hit) - 1)


def _decode(x: torch.Tensor, sums: torch.Tensor | None, act: np.ndarray, gexp: np.ndarray, b0: int, b1: int,
            E: int, wpb: int, top: int, nb32: int, bits: int) -> None:
    """Chunk [b0, b1) of ``x`` from its summed lanes ``sums`` (the active blocks ``act``'s, on the
    device; None: zero on every rank)."""
    n = x.numel()
    lo, hi = b0 * E, min(n, b1 * E)
    if sums is None:
        x[lo:hi] = 0
        return
    sums = sums.view(-1, wpb)
    if len(act) < b1 - b0:
        full = torch.zeros((b1 - b0, wpb), dtype=torch.int32, device=x.device)
        full[_index(act, x.device)] = sums
        sums = full
    dc.decode(sums.reshape(-1), gexp[b0:b1], E, top, nb32, hi - lo, x.dtype, bits, out=x[lo:hi])
