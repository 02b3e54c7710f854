"""Lazy exports for the subpackages' ``__init__`` (PEP 562): the few names users write
(``from nicoffload.worker import Communicator``) come from the module that defines them, imported
on first use, so importing a light module of a subpackage (a command's ``--help``, the pure ring
layout) never drags in numba kernels or bcc."""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package`` that import ``names`` (public name ->
    submodule that defines it) when first asked for, and keep them."""

    def __getattr__(name: str):
        sub = names.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
