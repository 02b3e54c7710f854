"""``train-demo --pairs N``: the two systems' step times as paired, interleaved ratios. The
demo's comparison runs gloo, then nicoffload; one such pair gives a ratio that swings with
whatever else the machine did meanwhile. N pairs alternate the order (gloo first, then
nicoffload first, ...) on the same testbed, and the ratio of each pair's medians (nicoffload /
gloo) is reported with its median and quartiles: drift that lasts longer than a pair cancels.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np


def interleaved(compare: Callable[..., tuple], workdir: Path, pairs: int, progress=None,
                **kw) -> tuple[tuple, list[dict]]:
    """``compare(tb..., workdir, reverse=...)`` ``pairs`` times, alternating the order: the first
    pair's runs (the curves), and one row per pair (each run's median step time and the ratio)."""
    first = None
    rows = []
    for i in range(pairs):
        if progress and pairs > 1:
            progress(f"pair {i + 1} of {pairs} ({'nicoffload' if i % 2 else 'gloo'} first)")
        d = workdir / f"pair{i}"
        d.mkdir(parents=True, exist_ok=True)
        runs = compare(workdir=d, reverse=bool(i % 2), progress=progress if i == 0 else None, **kw)
        first = first or runs
        rows.append(row(i, runs))
    assert first is not None
    return first, rows


def row(i: int, runs: tuple) -> dict:
    """Pair ``i``: the median step time of each run (after the warm-up) and the ratio."""
    from nicoffload.lab.train.ddp_train import WARMUP

    def median_ms(run) -> float:
        t = run.step_seconds()
        tail = t[WARMUP:] if len(t) > 2 * WARMUP else t
        return float(np.median(tail) * 1e3)

    ref, other = runs[0], runs[-1]
    a, b = median_ms(ref), median_ms(other)
    return {"pair": i, "first": ref.label if i % 2 == 0 else other.label, "reference": ref.label,
            "system": other.label, "reference_ms": a, "system_ms": b, "ratio": b / a}


def summary(rows: list[dict]) -> dict:
    """The ratios' median, quartiles and range."""
    r = np.array([x["ratio"] for x in rows])
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    return {"pairs": len(r), "median": float(med), "q1": float(q1), "q3": float(q3), "min": float(r.min()),
            "max": float(r.max()), "each": [float(v) for v in r]}


def line(rows: list[dict]) -> str:
    """The summary's line: every pair's ratio and their median and quartiles."""
    s = summary(rows)
    ref, system = rows[0]["reference"], rows[0]["system"]
    return (f"step time {system} / {ref}, {s['pairs']} interleaved pair(s) (the order alternating): "
            + " ".join(f"{v:.2f}" for v in s["each"])
            + f"; median {s['median']:.2f}, quartiles {s['q1']:.2f}-{s['q3']:.2f}")
