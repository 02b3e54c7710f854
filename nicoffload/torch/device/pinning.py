"""Host memory the GPU's copy engine reads and writes directly: a shared segment of the ranks of
one host (:class:`~nicoffload.local.segment.Segment`) registered with the CUDA driver
(``cudaHostRegister``), so the device path's copies into and out of it are DMA with no staging
buffer, and the CPU copies nothing (torch/device/path.py, a group of one host).

A segment is registered once, by the first call that uses it, and unregistered before it is
unmapped (``Segment.on_close``). Where the driver refuses (a sandbox's kernel, say), the copies
stay correct: the driver stages pageable memory itself, more slowly; a warning says so once.
"""
from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)
_warned = [False]


def pin_segment(seg) -> bool:
    """Register ``seg`` (``addr``, ``size``, ``on_close``) with the GPU once; whether it is."""
    done = getattr(seg, "cuda_pinned", None)
    if done is not None:
        return done
    rt = torch.cuda.cudart()
    err = int(rt.cudaHostRegister(seg.addr, seg.size, 0))
    seg.cuda_pinned = err == 0
    if seg.cuda_pinned:
        seg.on_close.append(lambda: rt.cudaHostUnregister(seg.addr))
    else:
        _clear_last_error()
        if not _warned[0]:
            _warned[0] = True
            log.warning("the shared segment %s (%d bytes) could not be registered with the GPU (cudaError %d): "
                        "the device path's copies go through the driver's staging, more slowly", seg.name,
                        seg.size, err)
    return seg.cuda_pinned


def _clear_last_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration: torch checks it after
    each kernel launch and would raise this one there. Through the runtime library the process
    has loaded (no binding of torch's resets it)."""
    try:
        with open("/proc/self/maps") as f:
            lib = next((line.split()[-1] for line in f if "libcudart" in line), None)
        if lib:
            ctypes.CDLL(lib).cudaGetLastError()
    except OSError:
        pass
