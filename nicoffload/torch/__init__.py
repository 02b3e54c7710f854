"""The PyTorch integration (needs the ``torch`` extra).

    ddp   a DistributedDataParallel communication hook that sums every gradient bucket through
          nicoffload (:func:`~nicoffload.torch.ddp.register`), and
          :class:`~nicoffload.torch.ddp.OffloadedOptimizer`, the optimizer in the aggregator

``nicoffload.ddp`` is the same module under its documented name.
"""
