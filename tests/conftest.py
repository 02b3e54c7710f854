"""Shared pytest fixtures and capability probes: tests that need root, bcc or namespaces skip
with a reason instead of failing obscurely."""
from __future__ import annotations

import os
import uuid

import pytest


def _have_bcc() -> bool:
    try:
        import bcc  # noqa: F401
    except Exception:
        return False
    return True


IS_ROOT = os.geteuid() == 0
HAVE_BCC = _have_bcc()


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        needs = "bpf" if "/tests/bpf/" in path else "netns" if "/tests/netns/" in path else None
        if needs:
            item.add_marker(getattr(pytest.mark, needs))
            if not IS_ROOT:
                item.add_marker(pytest.mark.skip(reason=f"{needs} tests need root"))
            elif not HAVE_BCC:
                item.add_marker(pytest.mark.skip(reason="bcc is not importable (run scripts/setup.sh)"))


@pytest.fixture
def uid() -> str:
    """A short unique suffix for names (interface names are at most 15 characters)."""
    return uuid.uuid4().hex[:5]
