"""Build the AF_XDP engine (engine.c) into a shared library with gcc, once per source, and load
it with ctypes. The library is cached by the hash of its sources (engine.c, its headers beside it,
and the headers of xdp/, whose record.h it includes) and the compiler's version in
``$NICOFFLOAD_CACHE/afxdp`` (default ``~/.cache/nicoffload/afxdp``); a rebuild takes about a
second. It links libxdp (the xsk API: UMEM, the four rings, socket creation) and libbpf (the
XSKMAP and the XDP link): Debian's ``libxdp-dev`` and ``libbpf-dev``, which scripts/setup.sh
installs."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from nicoffload.errors import SetupError
from nicoffload.wire.proto import xdp_dir

#: engine counters (enum AFX_E_* in engine.c), in the library's order: checked when it loads
ENGINE_STATS = ["rx_frames", "rx_descs", "tx_frames", "tx_kicks", "tx_wait", "polls", "batches", "not_ours",
                "too_big", "spins", "tx_sends"]

SOURCE = Path(__file__).with_name("engine.c")
#: the engine's limits and state (AFX_FRAME, AFX_FRAMES: nicoffload doctor reads the UMEM's size here)
LIMITS = SOURCE.with_name("engine.h")
CFLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers"]
LIBS = ["-lxdp", "-lbpf", "-lpthread"]
HEADERS = ("/usr/include/xdp/xsk.h", "/usr/include/bpf/bpf.h")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def cache_dir() -> Path:
    base = os.environ.get("NICOFFLOAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nicoffload")
    return Path(base) / "afxdp"


def _compiler() -> str:
    cc = os.environ.get("CC", "gcc")
    if not shutil.which(cc):
        raise SetupError(f"the AF_XDP engine is compiled with {cc}, which is not installed: run scripts/setup.sh "
                         f"(apt-get install gcc libxdp-dev libbpf-dev)")
    return cc


def library_path() -> Path:
    """The engine's shared library, built now if this source has not been built before."""
    cc = _compiler()
    for h in HEADERS:
        if not Path(h).exists():
            raise SetupError(f"{h} is missing: the AF_XDP engine needs libxdp-dev and libbpf-dev "
                             f"(run scripts/setup.sh, or apt-get install libxdp-dev libbpf-dev)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    h = hashlib.sha256()
    # the engine's own headers, and xdp/record.h (nicoffload_proto.h through it): every header of xdp/ counts
    headers = [p.read_bytes() for p in (*sorted(SOURCE.parent.glob("*.h")), *sorted(xdp_dir().glob("*.h")))]
    for part in (SOURCE.read_bytes(), *headers, " ".join(CFLAGS + LIBS).encode(), "".join(version).encode()):
        h.update(part)
    out = cache_dir() / f"engine-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *CFLAGS, f"-I{xdp_dir()}", str(SOURCE), "-o", str(tmp), *LIBS]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        tmp.unlink(missing_ok=True)
        raise SetupError(f"building the AF_XDP engine failed ({' '.join(cmd)}):\n{r.stderr.strip()[-3000:]}")
    os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same bytes
    return out


def load() -> ctypes.CDLL:
    """The engine library with its functions' signatures declared."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        lib = ctypes.CDLL(str(library_path()))
        P, U8P = ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint8)
        u16, u32, u64, i = ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
        sigs = {
            "afx_open": ([ctypes.c_char_p, i, i, i, u32, u16, u32, u32, u32, U8P, u16, i, i, ctypes.POINTER(i)], P),
            "afx_error": ([P], ctypes.c_char_p),
            "afx_close": ([P], None),
            "afx_add_job": ([P, u32, u32, u32, u32, ctypes.POINTER(u32), U8P, u32, u32, u64], i),
            "afx_remove_job": ([P, u32], i),
            "afx_job_stats": ([P, u32, ctypes.POINTER(u64)], i),
            "afx_job_state": ([P, u32, ctypes.POINTER(u32)], i),
            "afx_engine_stats": ([P, ctypes.POINTER(u64)], None),
            "afx_engine_stat_count": ([], i),
            "afx_stat_count": ([], i),
            "afx_stop": ([P], None),
            "afx_run": ([P, u64], i),
        }
        for name, (args, res) in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
        # the counters' names live in Python, their slots in C: they must agree
        from nicoffload.wire.proto import STATS

        if lib.afx_stat_count() != len(STATS) or lib.afx_engine_stat_count() != len(ENGINE_STATS):
            raise SetupError(f"the AF_XDP engine counts {lib.afx_stat_count()} protocol and "
                             f"{lib.afx_engine_stat_count()} engine counters, nicoffload names {len(STATS)} and "
                             f"{len(ENGINE_STATS)}: engine.c and nicoffload/afxdp/build.py disagree")
        _lib = lib
        return lib
