"""The ``nicoffload`` command: :func:`main` (in :mod:`.app`) assembles the subcommands, each in
its own module exposing ``register(subparsers)``; they parse arguments and call the layers below.

    app       the root parser, one-line errors with a distinct exit code per error class
    agg       ``agg load|status|stats|slots|unload|bench``: the XDP aggregator
    aggjob    ``agg job add|remove|list``: its jobs, here or through a service (``--service``)
    aggopt    ``agg opt ...``: an optimizer job's parameters, state, learning rate, checkpoints
    aggserve  ``agg serve``: the aggregator as a service (HTTP API, leases, metrics)
    ring      ``ring load|status|stats|unload``: the ring offload's program on a node
    xdp       what ``agg`` and ``ring`` share: attach modes, --netns/--iface, the counter printer
    testbed   ``testbed up|down|list|exec|clean``
    worker    ``worker``, ``allreduce``, ``demo``, ``aggregator-userspace``
    train     ``train-demo``: DDP with gloo against nicoffload, the optimizer offload
    bench     ``bench``: systems side by side, soak, tenants
    doctor    ``doctor``: the read-only preflight of a host (kernel, BPF, NIC, limits)
"""
from __future__ import annotations

from nicoffload.cli.app import main

__all__ = ["main"]
