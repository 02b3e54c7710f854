"""The PyTorch integration (needs the ``torch`` extra). Importing it registers the
torch.distributed backend ``"nicoffload"``:

    import nicoffload.torch
    dist.init_process_group("nicoffload")      # under torchrun; configured from NICOFFLOAD_* (config)

    backend     :class:`~nicoffload.torch.backend.ProcessGroupNicoffload`, the ProcessGroup itself:
                all-reduces (and reduce-scatters, barriers) through the offload, every other
                collective through the internal gloo group
    routing     which call takes which path (the communicator's capabilities)
    work        the work queue: one thread per group runs its calls in order; Work objects
    gloo        the internal gloo group on the same store, and the calls it takes
    jobs        the group's jobs at the aggregator services: asking, leases, removal
    rendezvous  how a group's ranks meet in torchrun's store: addresses, the job rank 0 gets from
                the service, heartbeats, leaving
    liveness    the heartbeat watcher that fails the offload naming a rank that is gone
    placement   which ranks share a host; paths: the path a group takes (the offload, shared
                memory and lanes, or gloo) and why
    failover    the group going on without its aggregator (fixedgloo: gloo summing the
                aggregator's fixed point, the same bits); hookfailover: the DDP hook's
    config      the ``NICOFFLOAD_*`` environment
    metrics     every rank's Prometheus metrics (``NICOFFLOAD_METRICS_PORT``): the server and
                the hooks of the backend and the gloo path
    device      CUDA tensors: the fixed point encoded on the device, integers to the host
                (NICOFFLOAD_DEVICE_PATH), and gloo's calls on device tensors
    ddp         the DDP communication hook (:func:`~nicoffload.torch.ddp.register`) and
                :class:`~nicoffload.torch.ddp.OffloadedOptimizer`, the optimizer in the
                aggregator (also set up through the backend's service)

``nicoffload.ddp`` is the ``ddp`` module under its documented name.
"""
from __future__ import annotations

from nicoffload.errors import SetupError

try:
    import torch  # noqa: F401
except ImportError as _e:  # an optional extra: say what to install, in one line
    raise SetupError("nicoffload.torch needs PyTorch: pip install 'nicoffload[torch]' "
                     f"(torch==2.13.0, the CPU wheel) ({_e})") from None

from nicoffload.torch import backend  # noqa: E402
from nicoffload.torch.backend import ProcessGroupNicoffload  # noqa: E402

backend.register()

__all__ = ["ProcessGroupNicoffload"]
