"""Training on a testbed: PyTorch ranks, the aggregator as a service, torchrun.

    ddp_rank     one DDP (or FSDP2) training rank (``python -m nicoffload.lab.train.ddp_rank``): gloo,
                 the nicoffload DDP hook, the optimizer in the aggregator, or the backend "nicoffload"
    ddp_train    N ranks on a testbed, gloo against nicoffload, summarized (``train-demo``)
    ddp_report   the summary as text and as a PNG
    pairs        ``train-demo --pairs N``: the two systems interleaved, paired step-time ratios
    data         the MLP's data (seeded synthetic, or scikit-learn's digits) and each rank's batch
    kill         ``train-demo --kill-aggregator-at STEP``: the aggregator's program detached mid-run
    transformer  the transformer and its sorting task; the ranks' optimizer (SGD or AdamW) and its
                 float64 shadow (``train-demo --optimizer adamw``)
    torchrun     ``nicoffload agg serve`` on a testbed's aggregator host, and one torchrun per worker host
    torchcost    the backend's cost over its communicator, interleaved in one job (``bench --torch-overhead``)
"""
