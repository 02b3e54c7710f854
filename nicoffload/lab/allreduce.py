"""``nicoffload allreduce`` and ``nicoffload demo`` as library calls: sum arrays through a
fresh namespace testbed, and the demo's gradients through the XDP, the AF_XDP and the user-space
aggregator, each result held against :mod:`nicoffload.lab.reference`."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from nicoffload.ebpf import loader as bpf

from ..errors import InputError, ProtocolError
from ..jobspec import DEFAULT, JobSpec
from . import reference
from .inputs import make_gradients
from .jobs import run_job, tempdir, testbed

#: seconds without progress before a demo worker fails (the demo's jobs are large)
DEMO_TIMEOUT = 20.0
#: what the demo compares, in order: the aggregators (mode aggregator), the rings (mode ring: the
#: ring offload and the user-space UDP ring; the AF_XDP engine is no ring)
DEMO_KINDS = {"aggregator": ("xdp", "afxdp", "userspace"), "ring": ("xdp", "userspace")}


def _save(d: Path, arrays: list[np.ndarray], tag: str) -> list[Path]:
    paths = [d / f"{tag}{r}.npy" for r in range(len(arrays))]
    for a, p in zip(arrays, paths):
        np.save(p, a.reshape(-1))
    return paths


# --- allreduce --------------------------------------------------------------------------------
def allreduce_arrays(arrays: list[np.ndarray], aggregator: str = "xdp", spec: JobSpec = DEFAULT,
                     drop: float = 0.0, dup: float = 0.0, seed: int = 1,
                     multicast: bool = True, aggregators: int = 1) -> tuple[np.ndarray, dict]:
    """The sum of ``arrays`` (one per worker, checked by inputs.check_inputs), through a testbed
    with ``drop``/``dup`` probabilities on every link (``multicast`` False: a fabric that drops
    multicast frames): (sum in the inputs' shape, report)."""
    for p in (drop, dup):
        if not 0 <= p < 1:
            raise InputError("--drop and --dup are probabilities in [0, 1)")
    if spec.mode == "ring" and aggregator == "afxdp":
        raise InputError("--mode ring runs its hops in XDP (xdp) or in user space (userspace): the AF_XDP engine "
                         "is an aggregator (--mode aggregator)")
    bpf.require_root("nicoffload allreduce (it builds a namespace testbed)")
    n = len(arrays)
    with testbed(n, spec.elems, multicast=multicast, aggregators=aggregators) as tb, tempdir() as d:
        if drop or dup:
            tb.faults.configure(drop=drop, dup=dup, seed=seed)
        outs = [Path(d) / f"out{r}.npy" for r in range(n)]
        res = _run(tb, _save(Path(d), arrays, "in"), outs, aggregator, spec)
        results = [np.load(p) for p in outs]
    for r, y in enumerate(results[1:], 1):
        if not np.array_equal(y, results[0]):
            raise ProtocolError(f"rank {r}'s result differs from rank 0's (a bug: please report)")
    out = results[0].reshape(arrays[0].shape).astype(arrays[0].dtype)
    return out, {"workers": n, "elements": int(out.size), "dtype": str(out.dtype), "seconds": res.seconds,
                 "aggregator": aggregator, "mode": spec.mode, "delivery": spec.delivery, "multicast": multicast,
                 "lanes": spec.lanes,
                 "aggregators": aggregators,
                 "packets_sent": res.totals("packets_sent"),
                 "retransmissions": res.totals("retransmissions")}


def _run(tb, inputs, outputs, kind: str, spec: JobSpec, **kw):
    """One job of ``spec.mode``: through a ``kind`` aggregator, or around a ring of the workers
    whose hops run in ``kind`` (XDP: the ring offload; userspace: the user-space UDP ring)."""
    if spec.mode == "ring":
        from .rings import run_ring_job

        return run_ring_job(tb, inputs, outputs, kind, spec, **kw)
    return run_job(tb, inputs, outputs, kind, spec, **kw)


def describe_allreduce(report: dict) -> str:
    via = f"{report['aggregator']} ring" if report.get("mode") == "ring" else f"{report['aggregator']} aggregator"
    return (f"summed {report['workers']} x {report['elements']} {report['dtype']} through the "
            f"{via} in {report['seconds'] * 1e3:.1f} ms ({report['packets_sent']} "
            f"packets, {report['retransmissions']} retransmitted) -> {report['output']}")


# --- demo -------------------------------------------------------------------------------------
def demo(workers: int, nbytes: int, sparsity: float = 0.5, reps: int = 3, seed: int = 0,
         progress: Callable[[str], None] | None = None, mode: str = "aggregator", delivery: str = "multicast",
         multicast: bool = True, aggregators: int = 1, lanes: int = 32) -> dict:
    """Float32 gradients of ``nbytes`` per worker (``sparsity``: fraction of zero blocks)
    through the XDP aggregator, the AF_XDP engine and the user-space aggregator (``mode`` ring:
    the ring offload and the user-space UDP ring); per system its times, goodput, error and
    whether the error is within the documented bound (the AF_XDP engine's rows: also what it
    said at start, ``engine``). ``progress(kind)`` before each."""
    bpf.require_root("nicoffload demo (it builds a namespace testbed and loads XDP)")
    if not 0 <= sparsity <= 1:
        raise InputError("--sparsity is a fraction in [0, 1]")
    n = nbytes // 4
    grads = make_gradients(workers, n, sparsity, seed)
    want = reference.quantized(grads, DEFAULT.elems, lanes)
    rows = []
    with testbed(workers, multicast=multicast, aggregators=aggregators) as tb, tempdir() as d:
        ins = _save(Path(d), grads, "g")
        for kind in DEMO_KINDS.get(mode, DEMO_KINDS["aggregator"]):
            outs = [Path(d) / f"{kind}{r}.npy" if r == 0 else None for r in range(workers)]
            if progress:
                progress(kind)
            res = _run(tb, ins, outs, kind, DEFAULT.replace(mode=mode, delivery=delivery, lanes=lanes), reps=reps,
                       timeout=DEMO_TIMEOUT)
            check = want.check(np.load(outs[0]))
            rows.append({
                "aggregator": kind, "seconds": res.seconds, "min_s": min(res.rep_seconds),
                "goodput_gbps": n * 4 * 8 / res.seconds / 1e9, "max_abs_err": check.max_abs_err,
                "within_bound": check.within_bound,
                "packets_sent": res.totals("packets_sent"),
                "retransmissions": res.totals("retransmissions"),
                "blocks_skipped": res.ranks[0]["stats"].get("blocks_skipped", 0),
            })
            if kind == "afxdp" and getattr(res, "engine", None):
                rows[-1]["engine"] = res.engine
    return {"workers": workers, "bytes": n * 4, "sparsity": sparsity, "mode": mode, "delivery": delivery,
            "multicast": multicast, "aggregators": aggregators, "lanes": lanes, "runs": rows}


def demo_ok(summary: dict) -> bool:
    return all(r["within_bound"] for r in summary["runs"])


def describe_demo(summary: dict, reps: int) -> str:
    rows = summary["runs"]
    what = "ring" if summary.get("mode") == "ring" else "aggregator"
    lanes = " in 16-bit lanes" if summary.get("lanes") == 16 else ""
    lines = [f"\n{summary['workers']} workers, {summary['bytes'] / 2**20:.1f} MiB float32 each{lanes}, "
             f"{summary['sparsity']:.0%} zero blocks (median of {reps})",
             f"{what:<11} {'time':>10} {'goodput':>12} {'max |err|':>11} {'in bound':>9} {'packets':>9} "
             f"{'retx':>6}"]
    for r in rows:
        lines.append(f"{r['aggregator']:<11} {r['seconds'] * 1e3:>8.1f}ms {r['goodput_gbps']:>8.2f}Gb/s "
                     f"{r['max_abs_err']:>11.3g} {'yes' if r['within_bound'] else 'NO':>9} {r['packets_sent']:>9} "
                     f"{r['retransmissions']:>6}")
    lines += _comparison(rows, what)
    return "\n".join(lines)


def _speed(a: dict, b: dict) -> str:
    """'2.0x faster than', '1.5x slower than' or 'about as fast as': row a's time against row b's
    (within 5%: about as fast)."""
    ratio = b["seconds"] / a["seconds"]
    if 1 / 1.05 < ratio < 1.05:
        return "about as fast as"
    return f"{ratio:.1f}x faster than" if ratio >= 1 else f"{1 / ratio:.1f}x slower than"


def _comparison(rows: list[dict], what: str) -> list[str]:
    """The closing line: XDP against the user-space {what}, and the AF_XDP engine against both
    when it ran."""
    by = {r["aggregator"]: r for r in rows if r.get("seconds")}
    if "xdp" in by and "userspace" in by:
        line = f"XDP is {_speed(by['xdp'], by['userspace'])} the user-space {what}"
        if "afxdp" in by:
            line += (f"; the AF_XDP engine is {_speed(by['afxdp'], by['userspace'])} the user-space {what} "
                     f"and {_speed(by['afxdp'], by['xdp'])} XDP")
        return [line]
    if "afxdp" in by:
        other = "xdp" if "xdp" in by else "userspace" if "userspace" in by else None
        if other:
            return [(f"the AF_XDP engine is {_speed(by['afxdp'], by[other])} "
                     f"{'XDP' if other == 'xdp' else f'the user-space {what}'}")]
    return []
