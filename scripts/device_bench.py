#!/usr/bin/env python3
"""Measurements of the backend's device path (issue 34; nicoffload/torch/device/).

    device_bench.py codec [--device cpu|cuda] [--mib 16]   # encode and decode: torch ops vs numba
    device_bench.py copies                                 # host bytes copied per element, each path
    device_bench.py allreduce [--device cpu|cuda]          # two ranks on this machine, 16 MiB, each path
    device_bench.py ddp [--device cpu|cuda]                # DDP's step, each path and gloo

codec      the three steps of a float32 sum (block metadata, lanes, decode of the sums) for a
           tensor of --mib MiB: the torch operations on --device against the numba kernels on
           the host (one thread each: the kernels are single-threaded; torch's default threads
           too, on the CPU)
copies     the copies each path makes per gradient element, from the code (which function makes
           each), and the bytes they write into host memory
allreduce  two ranks of tests/unit/device_ranks.py at 127.0.0.1 (shared memory between them):
           the time of a 16 MiB float32 all-reduce on the device path, on the host path and
           through gloo, interleaved rep by rep, and the copy counters of each path per element;
           --profile DIR: rank 0's cProfile of each path
ddp        the same two ranks: DDP's step time on an 8.4 M-parameter model through each path and
           through gloo, three interleaved runs of --reps steps each
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _best(fn, reps: int, sync=lambda: None) -> tuple[float, float]:
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return 1e3 * min(ts), 1e3 * float(np.median(ts))


def codec_bench(device: str, mib: int, reps: int) -> dict:
    import torch

    from nicoffload.datapath import kernels
    from nicoffload.local import fixed
    from nicoffload.torch.device import codec
    from nicoffload.wire import quant

    n, E, W = mib << 18, 256, 2
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    top, bias = quant.top_bits(32) - quant.headroom_bits(W), quant.bias(W)
    e = np.empty(n // E, np.int32)
    w = np.zeros(n, np.int32)
    out = np.empty(n, np.float32)
    kernels.block_meta_f32(x, E, e)
    fixed.quantize(x, E, e, top, bias, True, w)
    numba = {"meta": _best(lambda: kernels.block_meta_f32(x, E, e), reps),
             "quantize": _best(lambda: fixed.quantize(x, E, e, top, bias, True, w), reps),
             "decode": _best(lambda: fixed.decode(w, E, e, top, W * bias, False, 0, len(e), n, out), reps)}
    xt, wt = torch.from_numpy(x).to(device), torch.from_numpy(w).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res = {"elements": n, "device": device, "numba_ms": numba}
    for threads in ([1, torch.get_num_threads()] if device == "cpu" else [torch.get_num_threads()]):
        torch.set_num_threads(threads)
        res[f"torch_ms_{threads}_threads"] = {
            "meta": _best(lambda: codec.block_meta(xt, E), reps, sync),
            "quantize": _best(lambda: codec.quantize(xt, e, E, top, bias), reps, sync),
            "decode": _best(lambda: codec.decode(wt, e, E, top, W * bias, n, torch.float32), reps, sync)}
    return res


#: the copies of one all-reduce, per element: (step, who makes it, bytes written into host memory,
#: as a function of the tensor's element size s, the lane's bytes l and whether the dtype is a half one)
HOST_PATH = [
    ("tensor to pinned host memory", "device/path.py _via_host (DMA)", lambda s, l, h: s),
    ("to float32 (bfloat16/float16)", "backend._reduce_tensor .to(work_dtype)", lambda s, l, h: 4 if h else 0),
    ("encode into the send ring", "datapath/encode.py encode_float/encode_half", lambda s, l, h: l),
    ("send: into the kernel's buffers", "sendmsg (kernel)", lambda s, l, h: l),
    ("receive: out of the kernel's buffers", "recvmmsg (kernel)", lambda s, l, h: l),
    ("decode into float32", "datapath/pump.py unfix", lambda s, l, h: 4),
    ("back to bfloat16/float16", "backend._reduce_tensor t.copy_(work)", lambda s, l, h: s if h else 0),
    ("to the device", "device/path.py _via_host (DMA)", lambda s, l, h: 0),
]
DEVICE_PATH = [
    ("lanes to pinned host memory", "device/path.py _Staging.to_host (DMA)", lambda s, l, h: l),
    ("copied into the send ring", "datapath/encode.py encode_int", lambda s, l, h: l),
    ("send: into the kernel's buffers", "sendmsg (kernel)", lambda s, l, h: l),
    ("receive: out of the kernel's buffers", "recvmmsg (kernel)", lambda s, l, h: l),
    ("sums into pinned host memory", "datapath/pump.py decode_results (KIND_INT32)", lambda s, l, h: l),
    ("sums to the device", "device/path.py _Staging.to_device (DMA)", lambda s, l, h: 0),
]
#: the send half, as the issue counts it (to host, encode, send / lanes to pinned, send)
SEND = 4


def copies() -> dict:
    rows = {}
    for name, s, lanes, half in (("float32, 32-bit lanes", 4, 4, False), ("float32, 16-bit lanes", 4, 2, False),
                                 ("bfloat16, 16-bit lanes", 2, 2, True)):
        hp = [(step, who, f(s, lanes, half)) for step, who, f in HOST_PATH]
        dp = [(step, who, f(s, lanes, half)) for step, who, f in DEVICE_PATH]
        h_all, d_all = sum(b for *_, b in hp), sum(b for *_, b in dp)
        h_send, d_send = sum(b for *_, b in hp[:SEND]), sum(b for *_, b in dp[:3])
        rows[name] = {"host_path": hp, "device_path": dp, "host_bytes": h_all, "device_bytes": d_all,
                      "ratio": round(d_all / h_all, 3), "send_host": h_send, "send_device": d_send,
                      "send_ratio": round(d_send / h_send, 3),
                      # the pageable copy the DDP hook makes today: the driver stages it through
                      # a pinned buffer of its own, one more memcpy each way
                      "ratio_vs_pageable": round(d_all / (h_all + 2 * s), 3),
                      # if the send path read the pinned lanes in place (not built here)
                      "ratio_if_sent_from_pinned": round((d_all - 2 * lanes) / h_all, 3)}
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(device: str, phases: str, reps: int, profile: str | None = None) -> dict:
    """Two ranks of device_ranks.py at 127.0.0.1 running ``phases``; rank 0's report."""
    job = ROOT / "tests" / "unit" / "device_ranks.py"
    with tempfile.TemporaryDirectory(prefix="nicoffload-bench") as out:
        port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
        extra = ["--profile", profile] if profile else []
        procs = [subprocess.Popen([sys.executable, str(job), "--out", out, "--rank", str(r), "--world", "2", "--port",
                                   str(port), "--device", device, "--phases", phases, "--reps", str(reps), *extra],
                                  env=env) for r in range(2)]
        for p in procs:
            p.wait(timeout=600)
        rep = json.loads(Path(out, "rank0.json").read_text())
    if "error" in rep:
        raise SystemExit(rep["error"])
    return rep


def allreduce(device: str, reps: int, profile: str | None = None) -> dict:
    if profile:
        Path(profile).mkdir(parents=True, exist_ok=True)
    rep = _ranks(device, "bench", reps, profile)
    n = 4 << 20
    for path, d in rep["bench"].items():
        got = d.pop("copies")
        d["copies_per_element"] = {k: round(v / n, 4) for k, v in got.items() if k.endswith("bytes")}
        # rank 0's wall time in each phase of the device path, ms per call (path.DeviceStats)
        d["phases_ms"] = {k[:-2]: round(1e3 * v, 3) for k, v in got.items() if k.endswith("_s") and v}
    return {"gpu": rep.get("gpu"), "group": rep["group"], "bench": rep["bench"]}


def ddp(device: str, steps: int) -> dict:
    rep = _ranks(device, "ddpbench", steps)
    return {"gpu": rep.get("gpu"), "group": rep["group"], "ddp_step_ms": rep["ddp_bench"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["codec", "copies", "allreduce", "ddp"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7, help="reps (ddp: steps per run, three runs per path)")
    ap.add_argument("--profile", metavar="DIR", help="allreduce: rank 0's cProfile of each path, into DIR")
    a = ap.parse_args()
    if a.what == "codec":
        res = codec_bench(a.device, a.mib, a.reps)
    elif a.what == "copies":
        res = copies()
    elif a.what == "ddp":
        res = ddp(a.device, a.reps)
    else:
        res = allreduce(a.device, a.reps, a.profile)
    res = {"what": a.what, "load": os.getloadavg(), **res}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
