"""The device path through the XDP aggregator: two testbed hosts (network namespaces of one
machine), ``nicoffload agg serve`` on the aggregator host, and under torchrun the device path's
checks (tests/unit/device_ranks.py). On CPU tensors (NICOFFLOAD_DEVICE_PATH=device) the
aggregator's int32 sums of the lanes must give the bits of its own float sums, every case; on
CUDA tensors (where a GPU is: scripts/gpu-check.sh) the same, and DDP against the host path (bit
for bit) and gloo, and 16 MiB all-reduces timed on both paths."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from nicoffload.lab.launcher import Launch  # noqa: E402
from nicoffload.lab.train.torchrun import ServiceProcess, torchrun_specs, write_token  # noqa: E402
from tests.unit.test_device_path import JOB, NO_GPU, check_bits  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_GPU))])
def test_the_device_path_through_the_xdp_aggregator(device, make_testbed, tmp_path):
    tb = make_testbed(2)
    out = tmp_path / "out"
    out.mkdir()
    phases = "bits" if device == "cpu" else "bits,ddp,gloo,bench"
    with ServiceProcess(tb, write_token(tmp_path / "tok")) as svc:
        specs = torchrun_specs(tb, JOB, ["--out", str(out), "--device", device, "--phases", phases],
                               env={**svc.env(), "NICOFFLOAD_REQUIRE_OFFLOAD": "1"})
        with Launch(tb, specs) as launch:
            outcomes = launch.wait(time.monotonic() + 400)
    reports = {}
    for f in sorted(Path(out).glob("rank*.json")):
        d = json.loads(f.read_text())
        reports[d["rank"]] = d
    assert sorted(reports) == [0, 1], [o.describe() for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert "aggregator" in reports[0]["group"]
    check_bits(out, reports, "device" if device == "cpu" else "auto")
    if device == "cuda":
        for r, rep in reports.items():
            assert rep["ddp"]["ddp_device_equals_host"], (r, rep["ddp"])
            assert rep["ddp"]["ddp_vs_gloo"] < 1e-4, (r, rep["ddp"])
        print(json.dumps({"gpu": reports[0]["gpu"], "bench": reports[0]["bench"], "ddp_s": reports[0]["ddp"]["ddp_s"]}))
