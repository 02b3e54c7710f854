"""Device (CUDA) tensors on the internal gloo group: the calls gloo moves through host copies
itself, and host copies of our own for the others.

What torch 2.13's ProcessGroupGloo does with CUDA tensors (its source, and the work classes in
the 2.13 wheel's libtorch_cpu.so: AsyncBroadcastCUDAWork, AsyncAllgatherCUDAWork,
AsyncGatherCUDAWork, AsyncScatterCUDAWork, AsyncReduceCUDAWork, AsyncAlltoallCUDAWork,
AsyncAlltoallListCUDAWork; all_reduce's CUDA work is registered by libtorch_cuda): at the call,
it records an event on the calling thread's current stream, copies each CUDA tensor into pinned
host memory on a side stream (``pinnedLike(t).copy_(t, non_blocking=True)``), runs the CPU
algorithm on the host copies, copies the results back on that stream, and makes the caller's
stream wait for them. Those calls (:data:`GLOO_CUDA`) are handed to gloo as they are.

gloo refuses CUDA tensors in ``allreduce_coalesced`` ("unsupported device type"), and its
send/recv hand a tensor's data pointer to the TCP transport as if it were host memory (torch's
documentation: send/recv are CPU-only on gloo); the coalesced and single-tensor forms of the
gathers and reduce-scatters are not in that list of CUDA works either. For every call outside
:data:`GLOO_CUDA` with a device tensor, :func:`staged` copies each device tensor to pinned host
memory, runs the call on the copies, and copies the outputs back when it completes.
"""
from __future__ import annotations

import torch

from nicoffload.torch.work import Work

#: gloo calls that take CUDA tensors themselves (through pinned host copies of their own)
GLOO_CUDA = frozenset({"broadcast", "allreduce", "allgather", "gather", "scatter", "reduce", "alltoall",
                       "alltoall_base", "barrier", "monitored_barrier"})


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def needs_staging(name: str, args: tuple) -> bool:
    """Whether gloo's ``name`` cannot take ``args`` as they are: a device tensor in a call that
    is not one of :data:`GLOO_CUDA`."""
    return name not in GLOO_CUDA and any(t.device.type != "cpu" for t in _tensors(args))


def _to_host(x, pairs: list):
    """``x`` with every device tensor replaced by a pinned host copy; (device, host) pairs kept."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            return x
        h = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.device.type == "cuda")
        h.copy_(x.detach())
        pairs.append((x, h))
        return h
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(y, pairs) for y in x)
    return x


def staged(path, name: str, args: tuple, kwargs: dict) -> Work:
    """``path.call(name, ...)`` on host copies of ``args``' device tensors; the outputs (every
    tensor but a send's) are copied back before the work completes, and its future holds the
    caller's tensors."""
    pairs: list = []
    host_args = _to_host(args, pairs)
    w = path.call(name, *host_args, **kwargs)
    back = [] if name == "send" else pairs
    originals = {id(h): d for d, h in pairs}

    def mapped(v):
        if isinstance(v, (list, tuple)):
            return [mapped(y) for y in v]
        return originals.get(id(v), v)

    def then(f):
        value = f.value()
        with torch.no_grad():
            for d, h in back:
                d.copy_(h)
        return mapped(value)

    return Work(w.fut.then(then), name, path.queue)
