"""The compiled kernels release the GIL (datapath/__init__.py says why): a kernel compiled
without ``nogil`` would hold every other thread of the rank for the length of its loop or its
system call."""
from __future__ import annotations

import importlib

import pytest

pytest.importorskip("numba")
from numba.core.registry import CPUDispatcher  # noqa: E402

MODULES = ["nicoffload.datapath.encode", "nicoffload.datapath.kernels", "nicoffload.datapath.pump",
           "nicoffload.local.fixed", "nicoffload.ring.hop", "nicoffload.ring.kernels"]


def kernels():
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, fn in vars(mod).items():
            if isinstance(fn, CPUDispatcher) and fn.__module__ == name:
                yield f"{name}.{attr}", fn


def test_every_kernel_that_is_not_inlined_releases_the_gil():
    compiled = [(k, fn) for k, fn in kernels() if fn.targetoptions.get("inline", "never") != "always"]
    held = [k for k, fn in compiled if not fn.targetoptions.get("nogil")]
    assert len(compiled) >= 20, [k for k, _ in compiled]
    assert held == [], held
