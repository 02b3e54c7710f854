"""`nicoffload agg bench`: the in-kernel costs it prints come from runs that really completed
their rounds, the slot lock's and the key check's costs paired frame by frame against the
test-only builds without them."""
from __future__ import annotations

import json
import subprocess
import sys

from nicoffload.lab import xdpbench


def test_agg_bench_reports_costs_and_the_slot_lock():
    r = subprocess.run([sys.executable, "-m", "nicoffload.cli", "agg", "bench", "--workers", "2", "--rounds", "200",
                        "--lock-cost", "--key-cost", "--no-live", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    t, lk = out["test_run_ns"], out["lock"]
    assert out["workers"] == 2 and t["sum64_first"] > 0 and t["pass"] > 0
    assert lk["frames"] == 200 and lk["locked"] > 0 and lk["unlocked"] > 0
    assert abs(lk["lock_ns"]) < lk["locked"]  # a difference of two costs of the same frames, not a sum
    locked, unlocked = lk["insns"]
    assert unlocked < locked, lk["insns"]  # the second build really lacks the lock's helper calls

    assert "slot lock (200 one-record frames" in xdpbench.describe(out)  # what the command prints without --json
    batch = xdpbench.key_batch(256)
    assert batch == 3  # 1072-byte records in a test run's 3,520 linear bytes
    for name, frames in (("single", 200), ("batch", 200 // batch)):
        k = out["key"][name]
        assert k["frames"] == frames and k["with"] > 0 and k["without"] > 0 and len(k["spread"]) == 5, k
        assert abs(k["diff"]) < k["with"] and k["share"] == k["diff"] / k["with"]
        checked, unchecked = k["insns"]
        assert unchecked < checked, k["insns"]  # the test-only build really lacks the compare
    assert "key check (200 one-record frames" in xdpbench.describe(out)
