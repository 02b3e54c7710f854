"""The torch backend and the service hold to their interfaces: a type checker run over them
finds no call to a method an interface (Collective, Engine, ...) lacks, nor any other error; and
the same checker does catch such a call (so the first check means something)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["nicoffload/torch", "nicoffload/service", "nicoffload/collective.py", "nicoffload/communicators.py",
           "nicoffload/fallback.py", "nicoffload/local/fixedsum.py"]

pytest.importorskip("mypy", reason="the test extra installs mypy")
pytest.importorskip("torch", reason="nicoffload/torch needs the torch extra")


def mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_the_backend_and_the_service_type_check():
    p = mypy(*TARGETS)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]


def test_a_call_the_interface_lacks_is_caught(tmp_path):
    bad = tmp_path / "uses_a_collective.py"
    bad.write_text("from nicoffload.collective import Collective\n\n"
                   "def f(c: Collective) -> None:\n    c.allreduce_all()\n")
    p = mypy(str(bad))
    assert p.returncode != 0 and '"Collective" has no attribute "allreduce_all"' in p.stdout, p.stdout
