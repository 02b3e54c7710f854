"""The training data of the DDP demo's MLP: seeded synthetic classification data, or
scikit-learn's digits where sklearn is importable, and each rank's slice of a global batch."""
from __future__ import annotations

import importlib

import numpy as np

FEATURES, CLASSES = 64, 10


def synthetic(seed: int, train: int = 4096, test: int = 1024, d: int = FEATURES, c: int = CLASSES):
    """Seeded Gaussian clusters, two per class, overlapping enough that the task is not trivial;
    features standardised. Same arrays on every rank and in every run with the same seed."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((2 * c, d)).astype(np.float32) * 0.6
    n = train + test
    y = rng.integers(0, c, n)
    which = y * 2 + rng.integers(0, 2, n)
    x = centers[which] + rng.standard_normal((n, d)).astype(np.float32)
    x = (x - x.mean(0)) / x.std(0)
    return (x[:train].astype(np.float32), y[:train].astype(np.int64),
            x[train:].astype(np.float32), y[train:].astype(np.int64))


def digits(seed: int):
    """scikit-learn's 8x8 digits (shipped with sklearn, 1797 samples), seeded 1397/400 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    p = np.random.default_rng(seed).permutation(len(y))
    tr, te = p[:-400], p[-400:]
    return x[tr], y[tr], x[te], y[te]


def have_sklearn() -> bool:
    try:
        importlib.import_module("sklearn")
    except ImportError:
        return False
    return True


def resolve_data(kind: str) -> str:
    """``auto``: digits if sklearn is importable, else synthetic."""
    if kind == "auto":
        return "digits" if have_sklearn() else "synthetic"
    if kind == "digits" and not have_sklearn():
        raise NicoffloadError("--data digits needs scikit-learn, which is not installed; use --data synthetic")
    return kind


def load_data(kind: str, seed: int):
    return digits(seed) if resolve_data(kind) == "digits" else synthetic(seed)


def batch_indices(step: int, rank: int, world: int, batch: int, n: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s slice of global batch ``step``: a seeded permutation per epoch, cut in
    global batches of world * batch samples (the incomplete tail of an epoch is skipped)."""
    per_epoch = n // (world * batch)
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    start = k * world * batch + rank * batch
    return perm[start:start + batch]
