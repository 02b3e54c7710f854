"""``nicoffload testbed ACTION --help``: every action documents itself with examples, without
root and without a testbed (the commands themselves are tested in tests/netns/test_testbed.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sub", ["up", "exec", "down", "list", "clean", "faults"])
def test_cli_help_has_examples(sub):
    r = subprocess.run([sys.executable, "-m", "nicoffload.cli", "testbed", sub, "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "examples:" in r.stdout and f"nicoffload testbed {sub}" in r.stdout
