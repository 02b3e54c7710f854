"""PyTorch's own distributed tests against the backend (tests/netns/torchsuite.py), gloo beside
it as the reference: a trimmed selection here (the whole one: ``python tests/netns/torchsuite.py
--select core ...``, docs/torchrun.md). Every test gloo passes (one rank per testbed host), the
backend must pass with two ranks on each of two hosts (shared memory + lanes). One rank per host
goes through the same calls in test_torch_backend (torchrun_checks: coalesced, barriers,
broadcast, DDP), so the suite is not run a third time for it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nicoffload.lab.train.torchrun import ServiceProcess, write_token

pytest.importorskip("torch")
pytest.importorskip("expecttest", reason="torch's distributed tests need the expecttest package")

SUITE = Path(__file__).with_name("torchsuite.py")


def suite(backend: str, spaces: list[str], env: dict, select: str = "ci", timeout: float = 900) -> dict[str, str]:
    p = subprocess.run([sys.executable, str(SUITE), "--backend", backend, "--netns", ",".join(spaces),
                        "--select", select], capture_output=True, text=True, timeout=timeout,
                       env={**__import__("os").environ, **env, "TORCH_CPP_LOG_LEVEL": "ERROR"})
    results = {}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            _, name, outcome, *why = line.split(" ", 3)
            results[name] = outcome + (f" {why[0]}" if why else "")
    assert results, p.stdout[-2000:] + p.stderr[-3000:]
    return results


def test_the_suite_passes_what_gloo_passes(make_testbed, tmp_path):
    tb = make_testbed(3)
    spaces = [w.netns for w in tb.workers]
    with ServiceProcess(tb, write_token(tmp_path / "tok")) as svc:
        gloo = suite("gloo", spaces, {})
        two = suite("nicoffload", [spaces[0], spaces[0], spaces[1], spaces[1]], svc.env())
    passed = sorted(n for n, r in gloo.items() if r == "passed")
    assert len(passed) >= 6, gloo
    for name in passed:
        assert two[name] == "passed", (name, "2 ranks per host", two[name])
