"""``nicoffload.ddp``, the documented name of the DDP hook and the optimizer offload
(``nicoffload.ddp.register(model, ...)``, ``nicoffload.ddp.OffloadedOptimizer``): the very module
:mod:`nicoffload.torch.ddp`, under a second name (one module object, so patches apply to both)."""
import sys

from nicoffload.errors import SetupError

try:
    import torch  # noqa: F401
except ImportError as _e:  # an optional extra: say what to install, in one line
    raise SetupError("nicoffload.ddp needs PyTorch: pip install 'nicoffload[torch]' "
                     f"(torch==2.13.0, the CPU wheel) ({_e})") from None

from nicoffload.torch import ddp as _ddp  # noqa: E402

sys.modules[__name__] = _ddp
