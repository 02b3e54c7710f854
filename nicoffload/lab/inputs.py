"""What goes into an AllReduce: sizes as people write them, .npy inputs read and checked, and
seeded gradients (float32 with zero blocks, or int32 on the same pattern)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


from ..errors import InputError
from ..jobspec import DEFAULT

#: ranks of a testbed job at most (the testbed's worker hosts)
MAX_HOSTS = 200

#: dtypes a worker sums (int32 exactly, floats through fixed point)
DTYPES = (np.int32, np.float32, np.float64)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def parse_size(s: str) -> int:
    """Bytes in ``s``: ``4KiB``, ``16MiB``, ``1.5MB``, ``1000000``."""
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise InputError(f"cannot read size {s!r}: use e.g. 4KiB, 16MiB, 1000000")
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise InputError(f"cannot read size {s!r}: use e.g. 4KiB, 16MiB, 1000000") from None


def load_input(path: Path, finite: bool = True) -> np.ndarray:
    """One .npy input, refused with a reason if a worker cannot sum it. ``finite=False`` lets a
    NaN or an Inf through: a rank of a running job refuses it together with the others (the
    communicator's metadata round), so that they fail at once instead of waiting for it."""
    try:
        a = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file")
    except Exception as e:
        raise InputError(f"{path}: not a readable .npy file ({e.__class__.__name__}: {e})")
    if a.dtype.byteorder not in ("=", "|") and a.dtype.newbyteorder("=") in DTYPES:
        a = a.astype(a.dtype.newbyteorder("="))  # big-endian values, in this machine's order
    if a.dtype not in DTYPES:
        raise InputError(f"{path}: dtype {a.dtype} is not supported (int32, float32, float64)")
    a = np.ascontiguousarray(a)  # a Fortran-order array sums in C order, as its output is written
    if finite and a.dtype.kind == "f" and not np.isfinite(a).all():
        raise InputError(f"{path}: holds NaN or Inf; refusing to sum it")
    return a


def check_output(path: Path) -> None:
    """Refuse an output path that cannot be written, before a job runs for it."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not a file for the output")
    if not parent.is_dir():
        raise InputError(f"{path}: no directory {parent} to write the output in")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{path}: cannot be written (permissions)")


def save_output(path: Path, a: np.ndarray) -> None:
    """np.save, or a one-line InputError saying why not."""
    try:
        np.save(path, a)
    except OSError as e:
        raise InputError(f"{path}: the output could not be written ({e.strerror or e})") from None


def check_inputs(paths: list[Path]) -> list[np.ndarray]:
    """The inputs of one job, one per worker: same shape, same dtype, 1..MAX_HOSTS of them (more
    than AR_MAX_WORKERS: two levels of aggregator jobs)."""
    arrays = [load_input(p) for p in paths]
    shapes = {a.shape for a in arrays}
    dtypes = {str(a.dtype) for a in arrays}
    if len(shapes) > 1:
        raise InputError(f"inputs differ in shape: {', '.join(f'{p}: {a.shape}' for p, a in zip(paths, arrays))}")
    if len(dtypes) > 1:
        raise InputError(f"inputs differ in dtype: {', '.join(f'{p}: {a.dtype}' for p, a in zip(paths, arrays))}")
    if not 1 <= len(arrays) <= MAX_HOSTS:
        raise InputError(f"need 1..{MAX_HOSTS} inputs, got {len(arrays)}")
    return arrays


def make_gradients(workers: int, n: int, sparsity: float, seed: int, elems: int = DEFAULT.elems,
                   zero_run: int = 1) -> list[np.ndarray]:
    """Random float32 gradients; a fraction ``sparsity`` of each rank's blocks of ``elems``
    elements is all zero, in runs of ``zero_run`` neighbouring blocks (1: each block on its own;
    larger: clustered, as the untouched rows of an embedding table or a pruned layer are)."""
    if zero_run < 1:
        raise InputError(f"--zero-run is a number of blocks, at least 1 (not {zero_run})")
    rng = np.random.default_rng(seed)
    nb = -(-n // elems)
    out = []
    for _ in range(workers):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        zero = rng.random(-(-nb // zero_run)) < sparsity
        if zero_run > 1:
            zero = np.repeat(zero, zero_run)[:nb]
        g[np.repeat(zero, elems)[:n]] = 0
        out.append(g)
    return out


def as_int32(grads: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """int32 inputs with the zero pattern of ``grads`` (values in +-2^20: sums never wrap for up
    to 2^11 ranks)."""
    rng = np.random.default_rng(seed)
    return [np.where(g != 0, rng.integers(-(1 << 20), 1 << 20, g.size, dtype=np.int32), 0).astype(np.int32)
            for g in grads]


def format_size(b: int) -> str:
    """``4KiB``, ``1MiB``, ``1.5MiB``, ``100B``: the inverse of :func:`parse_size` for the sizes people pick."""
    units = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
    for unit, m in units:
        if b >= m and b % m == 0:
            return f"{b // m}{unit}"
    for unit, m in units:
        if b >= m:
            return f"{b / m:.3g}{unit}"
    return f"{b}B"
