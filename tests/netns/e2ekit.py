"""Helpers the end-to-end tests of the collectives share (tests/netns/test_worker_e2e.py,
test_ring_e2e.py): the command line's argv, and each rank's input saved as a .npy file."""
from __future__ import annotations

import sys

import numpy as np

CLI = [sys.executable, "-m", "nicoffload.cli"]


def save(tmp_path, arrays, tag=""):
    """Rank r's array saved as in<tag><r>.npy; returns (the inputs' paths, the outputs' paths)."""
    ins = [tmp_path / f"in{tag}{r}.npy" for r in range(len(arrays))]
    outs = [tmp_path / f"out{tag}{r}.npy" for r in range(len(arrays))]
    for a, p in zip(arrays, ins):
        np.save(p, a)
    return ins, outs
