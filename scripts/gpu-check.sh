#!/usr/bin/env bash
# The CUDA checks and numbers of the backend's device path (issue 34; nicoffload/torch/device/),
# for any machine with an NVIDIA GPU. Needs a CUDA build of torch 2.13 in the venv (scripts/setup.sh
# installs the CPU wheel; for example: .venv/bin/pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu126, the index that matches the machine's driver).
#
#   scripts/gpu-check.sh            # the checks, then the numbers, into gpu-check-DATE/
#   PYTHON=/path/to/python OUT=dir scripts/gpu-check.sh
#
# 1. bit identity: the device encoding against the host's numba kernels, on the GPU
# 2. two ranks of CUDA tensors on this machine (127.0.0.1, shared memory): the host path's bits for
#    every dtype, dense and sparse; DDP of a small model against the host path and against gloo;
#    gloo's calls (broadcast, all_gather, send/recv) on CUDA tensors
# 3. as root with bcc: the same through the XDP aggregator on a namespace testbed (else skipped:
#    step 2 stands for it, through the ranks of one host)
# 4. numbers: the codec on the GPU against the kernels on the CPU, a 16 MiB all-reduce on each path
#    and through gloo (two ranks, interleaved; rank 0's profile of each), DDP's step on each path
#    and through gloo, and the host bytes copied per element
# Exit status: 0 all passed, 1 a check failed, 2 no GPU.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PY="${PYTHON:-$here/.venv/bin/python}"
out="${OUT:-$here/gpu-check-$(date +%Y%m%d-%H%M%S)}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$PY" -c 'import torch; print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")' \
        2>/dev/null || echo "gpu-check: torch is not importable with $PY"
    echo "gpu-check: run it on a machine with an NVIDIA GPU and a CUDA build of torch 2.13 (see the top of this script)"
    exit 2
fi
mkdir -p "$out"
"$PY" - <<'EOF' | tee "$out/machine.txt"
import os, platform, torch
p = torch.cuda.get_device_properties(0)
print(f"GPU: {torch.cuda.get_device_name(0)} ({p.total_memory >> 20} MiB), {torch.cuda.device_count()} device(s)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {platform.platform()}, {os.cpu_count()} CPUs, "
      f"load {os.getloadavg()}")
EOF
fail=0
step() { echo; echo "== $*"; }

step "1. bit identity of the device encoding against the host kernels, on the GPU"
"$PY" -m pytest -q -rs tests/unit/test_device_codec.py -p no:cacheprovider || fail=1

step "2. two ranks of CUDA tensors on this machine: bits, DDP against the host path and gloo, gloo's calls"
"$PY" -m pytest -q -rs tests/unit/test_device_path.py -p no:cacheprovider || fail=1

step "3. through the XDP aggregator on a namespace testbed"
if [ "$(id -u)" = 0 ] && "$PY" -c 'import bcc' 2>/dev/null; then
    "$PY" -m pytest -q -rs -s tests/netns/test_device_netns.py -p no:cacheprovider | tee "$out/aggregator.txt" \
        || fail=1
else
    echo "skipped: needs root and bcc (scripts/setup.sh); step 2 ran the ranks of one host instead"
fi

step "4. numbers"
"$PY" scripts/device_bench.py codec --device cuda --reps 20 | tee "$out/codec_cuda.json"
"$PY" scripts/device_bench.py codec --device cpu --reps 7 | tee "$out/codec_cpu.json"
"$PY" scripts/device_bench.py allreduce --device cuda --reps 20 --profile "$out/profile" \
    | tee "$out/allreduce_cuda.json"
"$PY" scripts/device_bench.py ddp --device cuda --reps 20 | tee "$out/ddp_cuda.json"
"$PY" scripts/device_bench.py copies > "$out/copies.json"
"$PY" - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "machine.txt").read_text().strip())
ar = json.loads((out / "allreduce_cuda.json").read_text())["bench"]
for path, d in ar.items():
    print(f"16 MiB float32 all-reduce, two ranks, {path:>4} path: {d['median_ms']:.2f} ms median "
          f"({d['min_ms']:.2f} min); device-path copies per element: {d['copies_per_element']}")
    if d.get("phases_ms"):
        print(f"    rank 0's phases, ms per call (profiled reps included): {d['phases_ms']}")
if "auto" in ar and "host" in ar:
    print(f"host/device: {ar['host']['median_ms'] / ar['auto']['median_ms']:.2f} (the target: at least 1.5)")
if "auto" in ar and "gloo" in ar:
    print(f"gloo/device: {ar['gloo']['median_ms'] / ar['auto']['median_ms']:.2f}")
ddp = json.loads((out / "ddp_cuda.json").read_text())["ddp_step_ms"]
print("DDP step, 8.4 M parameters, two ranks, median ms:", {k: round(v, 2) for k, v in ddp.items()},
      f"gloo/device {ddp['gloo'] / ddp['auto']:.2f} (the target: at least 1)")
c = json.loads((out / "codec_cuda.json").read_text())
tk = next(v for k, v in c.items() if k.startswith("torch_ms"))
print("codec, 16 MiB, min ms (torch on the GPU | numba on the CPU):",
      {k: (round(tk[k][0], 3), round(c["numba_ms"][k][0], 3)) for k in tk})
for name, r in json.loads((out / "copies.json").read_text()).items():
    if isinstance(r, dict):
        print(f"host bytes per element, {name}: host path {r['host_bytes']}, device path {r['device_bytes']} "
              f"(ratio {r['ratio']}; send side {r['send_ratio']})")
EOF
echo
echo "results in $out; exit status $fail"
exit $fail
