"""``nicoffload.ddp``, the documented name of the DDP hook and the optimizer offload
(``nicoffload.ddp.register(model, ...)``, ``nicoffload.ddp.OffloadedOptimizer``): the very module
:mod:`nicoffload.torch.ddp`, under a second name (one module object, so patches apply to both)."""
import sys

from nicoffload.torch import ddp as _ddp

sys.modules[__name__] = _ddp
