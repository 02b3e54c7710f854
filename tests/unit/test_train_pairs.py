"""``train-demo --pairs N``: the order alternates, each pair gives the ratio of its medians, the
summary their median and quartiles; and the flag refuses what it cannot compare."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nicoffload.lab.train import pairs


class FakeRun:
    def __init__(self, label, ms):
        self.label, self._t = label, np.array(ms) / 1e3

    def step_seconds(self):
        return self._t


def test_pairs_alternate_and_report_each_ratio(tmp_path):
    calls = []
    times = {0: (10.0, 5.0), 1: (10.0, 8.0), 2: (20.0, 5.0)}

    def compare(workdir, reverse, progress=None, **kw):
        i = len(calls)
        calls.append((workdir.name, reverse, kw))
        g, x = times[i]
        # warm-up steps (slow) are left out of the medians
        return FakeRun("gloo", [900.0] * 5 + [g] * 20), FakeRun("nicoffload-backend", [900.0] * 5 + [x] * 20)

    first, rows = pairs.interleaved(compare, tmp_path, 3, steps=7)
    assert [(d, r) for d, r, _ in calls] == [("pair0", False), ("pair1", True), ("pair2", False)]
    assert all(kw == {"steps": 7} for _, _, kw in calls)
    assert first[0].label == "gloo"
    assert [r["ratio"] for r in rows] == pytest.approx([0.5, 0.8, 0.25])
    assert [r["first"] for r in rows] == ["gloo", "nicoffload-backend", "gloo"]
    s = pairs.summary(rows)
    assert s["median"] == pytest.approx(0.5) and s["q1"] == pytest.approx(0.375) and s["q3"] == pytest.approx(0.65)
    assert "0.50 0.80 0.25; median 0.50, quartiles 0.38-0.65" in pairs.line(rows)


@pytest.mark.parametrize("argv, says", [
    (["--pairs", "0"], "--pairs must be at least 1"),
    (["--pairs", "2", "--backend", "--kill-aggregator-at", "3"], "not with --kill-aggregator-at"),
])
def test_pairs_refuses_what_it_cannot_compare(argv, says):
    p = subprocess.run([sys.executable, "-m", "nicoffload.cli", "train-demo", "--steps", "10", *argv],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and says in p.stderr, p.stderr
