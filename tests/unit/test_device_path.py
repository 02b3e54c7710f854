"""The backend's device path (nicoffload.torch.device.path) in a group of two ranks on this
machine (shared memory, no root, no service): on CPU tensors with NICOFFLOAD_DEVICE_PATH=device
it must return the host path's bits for every dtype, dense and sparse, SUM and AVG, strided
tensors and reduce-scatter, and refuse a NaN with the host path's words; DDP through it must
train to the host path's parameters, bit for bit. The same job on CUDA tensors (and DDP against
gloo, and gloo's calls on device tensors) runs where a GPU is (scripts/gpu-check.sh); here it
skips."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from nicoffload.errors import InputError  # noqa: E402
from nicoffload.torch.device import gloo as devicegloo  # noqa: E402
from nicoffload.torch.device import path as devicepath  # noqa: E402

JOB = Path(__file__).with_name("device_ranks.py")
CUDA = torch.cuda.is_available()
NO_GPU = "no CUDA device here: scripts/gpu-check.sh runs this on a machine with one"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: Path, device: str, phases: str, world: int = 2, timeout: float = 240) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets it: two ranks' thread pools on 2 cores crawl
    procs = [subprocess.Popen([sys.executable, str(JOB), "--out", str(out), "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--device", device, "--phases", phases],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    reports = {}
    for r in range(world):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no report:\n" + "\n".join(x[-3000:] for x in logs)
        reports[r] = json.loads(f.read_text())
        assert "error" not in reports[r], reports[r]["error"]
    return reports


def check_bits(out: Path, reports: dict, fast: str) -> None:
    for r, rep in reports.items():
        with np.load(out / f"bits{r}.npz") as z:
            got = {k: z[k].tobytes() for k in z.files}
        cases = {k.rsplit("/", 1)[0] for k in got}
        assert len(cases) == 17, sorted(cases)  # 16 all-reduces and a reduce-scatter
        for case in cases:
            assert got[f"{case}/{fast}"] == got[f"{case}/host"], (r, case)
        errs = rep["errors"]
        assert set(errs) == {"float32-nan-sum/host", f"float32-nan-sum/{fast}"}, errs
        assert errs["float32-nan-sum/host"] == errs[f"float32-nan-sum/{fast}"]
        assert "RefusedError" in errs["float32-nan-sum/host"] and "rank 1" in errs["float32-nan-sum/host"]


def test_the_device_path_returns_the_host_paths_bits_on_cpu_tensors(tmp_path):
    reports = run(tmp_path, "cpu", "bits,ddp")
    assert "shared memory" in reports[0]["group"]
    check_bits(tmp_path, reports, "device")
    for r, rep in reports.items():
        assert rep["ddp"]["ddp_device_equals_host"], (r, rep["ddp"])
        assert rep["ddp"]["ddp_vs_gloo"] < 1e-4, (r, rep["ddp"])
        assert rep["stats"]["calls"] > 0 and rep["stats"]["blocks_skipped"] > 0, rep["stats"]


@pytest.mark.skipif(not CUDA, reason=NO_GPU)
def test_cuda_tensors_through_the_backend(tmp_path):
    reports = run(tmp_path, "cuda", "bits,ddp,gloo")
    check_bits(tmp_path, reports, "auto")
    for r, rep in reports.items():
        assert rep["ddp"]["ddp_device_equals_host"], (r, rep["ddp"])
        assert rep["ddp"]["ddp_vs_gloo"] < 1e-4, (r, rep["ddp"])
        assert rep["gloo"] == {"broadcast": True, "all_gather": [0.0, 1.0], "send_recv": 0.0}, rep["gloo"]
        assert rep["stats"]["host_calls"] > 0 and rep["stats"]["d2h_bytes"] > 0, rep["stats"]


def test_the_setting_and_which_gloo_calls_are_staged(monkeypatch):
    monkeypatch.setenv("NICOFFLOAD_DEVICE_PATH", "gpu")
    with pytest.raises(InputError, match="auto, host or device"):
        devicepath.setting()
    monkeypatch.delenv("NICOFFLOAD_DEVICE_PATH")
    assert devicepath.setting() == "auto"
    cpu = torch.zeros(2)
    assert not devicepath.takes(cpu, "sum", None)
    meta = torch.zeros(2, device="meta")  # any tensor not on the CPU is the device path's
    assert devicepath.takes(meta, "max", None)
    assert devicegloo.needs_staging("send", ([meta],)) and devicegloo.needs_staging("allreduce_coalesced", ([meta],))
    assert not devicegloo.needs_staging("allreduce", ([meta],)) and not devicegloo.needs_staging("send", ([cpu],))


def test_a_segment_is_registered_with_the_gpu_once_and_unregistered_before_it_goes(monkeypatch, caplog):
    from types import SimpleNamespace

    from nicoffload.torch.device import pinning

    calls = []

    class Runtime:
        def __init__(self, err):
            self.err = err

        def cudaHostRegister(self, addr, size, flags):
            calls.append(("register", addr, size))
            return self.err

        def cudaHostUnregister(self, addr):
            calls.append(("unregister", addr))
            return 0

    def segment(addr):
        return SimpleNamespace(addr=addr, size=1 << 20, name=f"seg{addr}", on_close=[])

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime(0))
    seg = segment(4096)
    assert pinning.pin_segment(seg) and pinning.pin_segment(seg)
    assert calls == [("register", 4096, 1 << 20)]  # once
    seg.on_close.pop()()
    assert calls[-1] == ("unregister", 4096)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime(1))  # refused: the copies stay correct
    refused = segment(8192)
    assert not pinning.pin_segment(refused) and not refused.on_close
    assert "could not be registered with the GPU" in caplog.text
