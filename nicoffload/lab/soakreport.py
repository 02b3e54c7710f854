"""The soak's summary (pure; :mod:`nicoffload.lab.soak` runs the soak and fills it in): one
record per call, the call times' nearest-rank distribution per size and dtype, the worst call,
the recovery totals, and the table people read with what the fault injector and the aggregator
counted."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InputError
from .inputs import format_size

#: the dtypes a soak cycles through, in the order its tables show them
DTYPES = ("int32", "float32", "float64")
#: the aggregator's counters the table shows (when non-zero); JSON has them all
AGG_SHOWN = ("completed", "retx_answered", "pull_answered", "status_sent", "dup_dropped", "stale_round", "early",
             "mismatch", "tx_failed")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p% of ``values`` at or below it
    (p = 0: the minimum); NaN for no values."""
    if not 0 <= p <= 100:
        raise InputError(f"percentile {p} is not in 0..100")
    v = sorted(values)
    if not v:
        return float("nan")
    return float(v[max(1, math.ceil(p / 100 * len(v))) - 1])


def distribution(values: Sequence[float]) -> dict:
    """count, min, median, p90, p99, max and mean of ``values``."""
    d = {"count": len(values)}
    for name, p in (("min", 0), ("median", 50), ("p90", 90), ("p99", 99), ("max", 100)):
        d[name] = percentile(values, p)
    d["mean"] = float(np.mean(values)) if len(values) else float("nan")
    return d


@dataclass
class CallRecord:
    call: int
    bytes: int
    dtype: str
    seconds: float              # the slowest rank's own time of the call
    retransmissions: int = 0    # summed over the ranks
    pulls: int = 0
    timeouts: int = 0
    max_abs_err: float = 0.0
    ok: bool = True
    bad_rank: int = -1
    reason: str = ""


def time_table(records: Sequence[CallRecord]) -> list[dict]:
    """The call-time distribution of every (size, dtype) and of every size over its dtypes
    (dtype "all"), sizes ascending."""
    groups: dict[tuple[int, str], list[float]] = {}
    for r in records:
        groups.setdefault((r.bytes, r.dtype), []).append(r.seconds)
        groups.setdefault((r.bytes, "all"), []).append(r.seconds)
    order = {d: k for k, d in enumerate(DTYPES + ("all",))}
    return [{"bytes": b, "dtype": d, **distribution(v)}
            for (b, d), v in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))]


def worst_call(records: Sequence[CallRecord]) -> CallRecord | None:
    """The slowest call (the first of equals)."""
    return max(records, key=lambda r: r.seconds, default=None)


@dataclass
class SoakSummary:
    config: dict
    workers: int
    records: list[CallRecord] = field(default_factory=list)
    wall_s: float = 0.0                                  # the whole loop: inputs, calls, checks
    faults: dict = field(default_factory=dict)           # host -> fault injector counters of its link
    aggregator: dict = field(default_factory=dict)       # the aggregator's counters
    mode: str | None = None
    error: str = ""                                      # why the soak stopped early

    @property
    def count(self) -> int:
        return len(self.records)

    @property
    def failures(self) -> list[CallRecord]:
        return [r for r in self.records if not r.ok]

    @property
    def exact(self) -> bool:
        """Every call ran and every result was exact (or within its bound)."""
        return not self.error and self.count == self.config["calls"] and not self.failures

    def totals(self) -> dict:
        return {k: sum(getattr(r, k) for r in self.records) for k in ("retransmissions", "pulls", "timeouts")}

    def to_dict(self, records: bool = True) -> dict:
        worst, fails = worst_call(self.records), self.failures
        d = {"config": self.config, "workers": self.workers, "mode": self.mode, "count": self.count,
             "exact": self.exact, "failures": len(fails), "first_failure": asdict(fails[0]) if fails else None,
             "error": self.error, "wall_s": self.wall_s, "times": time_table(self.records),
             "worst": asdict(worst) if worst else None, "totals": self.totals(), "faults": self.faults,
             "aggregator": self.aggregator}
        if records:
            d["calls"] = [asdict(r) for r in self.records]
        return d


def format_summary(s: SoakSummary) -> str:
    """The summary as a table people read."""
    c = s.config
    verdict = ("all exact" if s.exact else
               f"STOPPED after {s.count} calls: {s.error}" if s.error else
               f"{len(s.failures)} WRONG RESULT(S)")
    lines = [f"soak: {s.count} of {c['calls']} AllReduces, {s.workers} ranks, drop {c['drop']:.2%} and "
             f"dup {c['dup']:.2%} of frames both ways on every link (seed {c['seed']}), "
             f"XDP {s.mode or '?'}: {verdict}"]
    if s.failures:
        f = s.failures[0]
        lines.append(f"first wrong result: call {f.call} ({format_size(f.bytes)} {f.dtype}), rank {f.bad_rank}: "
                     f"{f.reason}")
    lines.append(f"{'call time (ms), slowest rank':<30}{'calls':>6}{'min':>9}{'median':>9}{'p90':>9}{'p99':>9}"
                 f"{'max':>9}")
    for row in time_table(s.records):
        label = f"  {format_size(row['bytes'])} {row['dtype']}"
        lines.append(f"{label:<30}{row['count']:>6}" + "".join(f"{row[k] * 1e3:>9.1f}" for k in
                                                              ("min", "median", "p90", "p99", "max")))
    w = worst_call(s.records)
    if w is not None:
        lines.append(f"worst: call {w.call}, {format_size(w.bytes)} {w.dtype}: {w.seconds * 1e3:.1f} ms with "
                     f"{w.retransmissions} retransmissions, {w.pulls} pulls, {w.timeouts} timeouts")
    t = s.totals()
    lines.append(f"recovery over every call and rank: {t['retransmissions']} retransmissions, {t['pulls']} pulls, "
                 f"{t['timeouts']} timeouts; the loop took {s.wall_s:.1f} s")
    if s.faults:
        lines.append(f"{'fault injector (frames)':<26}{'from host: seen':>15}{'dropped':>9}{'dup':>7}"
                     f"{'to host: seen':>15}{'dropped':>9}{'dup':>7}")
        for host, st in s.faults.items():
            i, e = st["ingress"], st["egress"]
            lines.append(f"  {host:<24}{i['seen']:>15}{i['dropped']:>9}{i['duplicated']:>7}"
                         f"{e['seen']:>15}{e['dropped']:>9}{e['duplicated']:>7}")
    shown = [f"{k} {s.aggregator[k]}" for k in AGG_SHOWN if s.aggregator.get(k)]
    bad = sum(v for k, v in s.aggregator.items() if k.startswith("bad_"))
    if s.aggregator:
        lines.append("aggregator: " + ", ".join(shown + [f"malformed {bad}"]))
    return "\n".join(lines)
