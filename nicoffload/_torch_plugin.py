"""Registers the torch.distributed backend ``"nicoffload"`` when torch is imported, through torch's
plugin entry points (group ``torch.backends``, loaded by ``import torch`` unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0), so a training script needs no import of its own: only
``dist.init_process_group("nicoffload")``. Light on purpose: the backend itself is imported when
a group is created. ``import nicoffload.torch`` registers it too. Never raises: a failure here
must not break ``import torch`` for anyone."""
from __future__ import annotations


def _create(opts, backend_options=None):
    from nicoffload.torch.backend import create

    return create(opts, backend_options)


def register() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and "NICOFFLOAD" not in dist.Backend._plugins:
            dist.Backend.register_backend("nicoffload", _create, extended_api=True, devices=["cpu"])
    except Exception:  # pragma: no cover - torch without distributed, or a torch that moved things
        pass
