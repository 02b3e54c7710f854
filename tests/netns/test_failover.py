"""Training survives its aggregator (issue 32): a torchrun DDP job of three ranks whose
aggregator's program is detached, whose aggregator's link is cut, or whose job the service
removes, at a step the test picks, finishes on the fallback path, and its parameters are the
bits of a run without the failure; after a removal the group goes back to a job granted again."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time

import pytest

from nicoffload.lab.launcher import CLI, Launch
from nicoffload.lab.train.torchrun import torchrun_specs, wait_for
from tests.netns.test_torch_backend import JOB, client, service, with_service  # noqa: F401  (fixture)

pytest.importorskip("torch")
STEPS = 150


def train(tb, svc, out, env: dict | None = None, act=None, at: int = 0, timeout: float = 240.0):
    """The job's ``train`` phase; ``act()`` once rank 0 has reached step ``at``. Returns the
    reports and every rank's parameters (bytes)."""
    out.mkdir(parents=True, exist_ok=True)
    specs = torchrun_specs(tb, JOB, ["--out", str(out), "--phases", "train", "--steps", str(STEPS)],
                           env={**svc.env(), "TORCHRUN_JOB_PROGRESS": "1", "NICOFFLOAD_FAILOVER": "2",
                                **(env or {})})
    with Launch(tb, specs) as launch:
        if act is not None:
            wait_for(lambda: (out / "progress").exists() and int((out / "progress").read_text() or 0) >= at, 120,
                     f"rank 0 at step {at}")
            act()
        outcomes = launch.wait(time.monotonic() + timeout)
    reports = {json.loads(f.read_text())["rank"]: json.loads(f.read_text()) for f in out.glob("rank*.json")}
    assert sorted(reports) == [0, 1, 2], [o.describe() + o.stderr[-3000:] for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    return reports, {r: (out / f"params{r}.bin").read_bytes() for r in range(3)}


def agg_cmd(tb, *args: str) -> None:
    subprocess.run(["ip", "-n", tb.agg.netns, *args], check=True, capture_output=True)


def test_training_fails_over_bit_for_bit_and_rejoins(service, tmp_path):
    tb, svc = service(3)
    rng = random.Random(32)
    ref, want = train(tb, svc, tmp_path / "ref")
    assert all(d["stats"]["failovers"] == 0 for d in ref.values()), ref
    assert len({want[r] for r in range(3)}) == 1  # every rank holds the same parameters

    # the service removes the job: the group fails over, then takes the job it is granted again
    c = client(svc)

    def remove():
        jobs = with_service(c, tb, lambda c: c.jobs())["jobs"]
        with_service(c, tb, lambda c: c.remove_job(jobs[0]["job"]))

    got, params = train(tb, svc, tmp_path / "removed", {"NICOFFLOAD_REJOIN": "1"}, remove, rng.randint(10, 40))
    assert params == want, "the parameters differ from the run without a failover"
    for d in got.values():
        st = d["stats"]
        assert st["failovers"] >= 1 and st["rejoins"] >= 1 and not st["on_fallback"], st
    # the group's request after its failover told the service: nicoffload_failovers_reported
    m = with_service(c, tb, lambda c: c.metrics())
    assert any(ln.startswith("nicoffload_failovers_reported_total") and float(ln.split()[-1]) >= 1
               for ln in m.splitlines()), [ln for ln in m.splitlines() if "failover" in ln]

    # the aggregator's link cut, then its program detached: every later call on the fallback,
    # the cut call done within NICOFFLOAD_FAILOVER (2 s) and a few seconds of agreeing
    for name, cut, mend in (("link", ("link", "set", "dev", tb.agg.iface, "down"),
                             ("link", "set", "dev", tb.agg.iface, "up")),
                            ("program", ("link", "set", "dev", tb.agg.iface, "xdpgeneric", "off"), None)):
        acted = []
        got, params = train(tb, svc, tmp_path / name, None,
                            lambda: (agg_cmd(tb, *cut), acted.append(time.time())), rng.randint(10, 60))
        if mend:
            agg_cmd(tb, *mend)
        assert params == want, f"{name}: the parameters differ from the run without a failover"
        for d in got.values():
            st = d["stats"]
            assert st["failovers"] == 1 and st["on_fallback"] and "Silent" in st["cause"], (name, st)
            assert st["recovered_at"] - acted[0] < 2 + 3, (name, st["recovered_at"] - acted[0])


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_demo_kills_its_aggregator_and_the_loss_curve_goes_on(tmp_path, nproc):
    """``train-demo --backend --kill-aggregator-at STEP`` as a user runs it: the aggregator's
    program detached after STEP steps, every rank fails over once, the run ends with every
    step's loss, and the summary holds the step times on the aggregator and on the fallback.
    ``nproc`` 2: torchrun's two ranks on each of the two hosts, which sum inside each host
    through shared memory and send across hosts through a lane each; those lanes fail over."""
    steps, at = 40, 15
    p = subprocess.run([*CLI, "train-demo", "--backend", "--workers", "2", "--nproc-per-node", str(nproc),
                        "--steps", str(steps), "--kill-aggregator-at", str(at), "--json", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=400, env={**os.environ, "NICOFFLOAD_FAILOVER": "2"})
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    run = s["runs"]["nicoffload-backend"]
    f = run["failover"]
    assert f["killed"] and not f["error"] and f["at_step"] == at, f
    assert f["failovers"] == [1] * (2 * nproc) and "Silent" in f["cause"] and f["on_fallback"], f
    assert 0 < f["recovery_s"] < 2 + 3, f
    assert f["step_ms_before"] and f["step_ms_after"] and f["cut_step"] >= at, f
    assert f["cut_step_ms"] > 1000 * 2 * 0.9 > 10 * f["step_ms_after"], f
    assert len(run["losses"]) == steps and s["runs"]["gloo"].get("failover") is None
    # the fallback sums the same integers: the curve is the aggregator's, as close to gloo's as before
    assert abs(run["final_loss_rel"]) < 0.01, run["final_loss_rel"]


def test_the_ddp_hook_fails_over_bit_for_bit(tmp_path):
    """The DDP hook (``NicoffloadHookState(..., failover=3)``) of three ranks whose XDP
    aggregator's program is detached mid-run: every rank fails over once, and the parameters
    at the end are the bits of the same run without the failure."""
    import numpy as np

    from nicoffload.lab.jobs import testbed
    from nicoffload.lab.train.ddp_train import TRAIN_SPEC, launch

    steps, at = 30, 10
    with testbed(3, TRAIN_SPEC.elems) as tb:
        ref = launch(tb, "nicoffload", tmp_path / "ref", steps=steps, extra=["--failover", "3"]).check()
        cut = launch(tb, "nicoffload", tmp_path / "cut", steps=steps, kill_at=at).check()
    f = cut.failover
    assert f["killed"] and not f["error"] and f["failovers"] == [1, 1, 1] and f["on_fallback"], f
    assert "Silent" in f["cause"] and 0 < f["recovery_s"] < 3 + 3, f
    for r in range(3):
        assert ref.ranks[r].params is not None and ref.ranks[r].report["pg_stats"]["failovers"] == 0
        assert np.asarray(cut.ranks[r].params).tobytes() == np.asarray(ref.ranks[r].params).tobytes(), \
            f"rank {r}: the parameters differ from the run without a failover"
