"""The bench's plots (PNG, matplotlib): AllReduce time against size, workers and sparsity, one
panel per link rate, with the shaped bounds; on shaped links the goodput as a fraction of the
bound; and with several worker counts on shaped links (``--scaling``), time against N per size
and rate with each system's own bound, CPU-bound points marked, and the share of the cores the
ranks kept busy."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from nicoffload.lab.bench.plan import (
    BenchConfig,
    agg_rate_bps,
    bounds,
    centre_workers,
    rate_bps,
    rate_label,
    reference_size,
    tbf_burst_bytes,
)
from nicoffload.lab.bench.report import CPU_BOUND
from nicoffload.lab.inputs import format_size

COLORS = {"xdp": "tab:red", "afxdp": "goldenrod", "userspace": "tab:orange", "ring": "tab:blue",
          "gloo": "tab:green", "mpi": "tab:purple", "xdpring": "tab:brown", "udpring": "tab:pink",
          "xdptorch": "tab:olive", "xdpuni": "tab:cyan", "xdp16": "tab:gray", "gloobf16": "lime",
          "gloofp16": "darkgreen"}
#: the ring offload's figure: latency gain over the TCP ring against the chunk size M/N
RING_GAIN = "ring_gain_vs_chunk.png"
#: gains below this (a system several times slower than the TCP ring) are drawn on it
GAIN_FLOOR = -1.0
#: DirectReduce's reported gain over a ring AllReduce for M/N > 1 KB (15% .. 36%)
PAPER_GAIN = (0.15, 0.36)
PANEL = (6.2, 4.6)  # inches per panel
DPI = 110
FILES = ["latency_vs_size.png", "time_vs_workers.png", "time_vs_sparsity.png", "shaped_bound_fraction.png"]
#: time against N at each size and shaped rate (drawn when the sweep has both)
SCALING = "scaling_vs_workers.png"


@dataclass
class _Sweep:
    """The axes of the sweep, as the plots need them."""

    rows: list[dict]           # rows with a measurement
    rates: list[str]           # rate labels, in sweep order
    systems: list[str]
    nc: int                    # the centre worker count
    ref: int                   # the reference size
    base: float                # the lowest sparsity
    out: Path
    agg_rate: str | None = None  # BenchConfig.agg_rate
    aggregators: int = 1

    def agg_bps(self, n: int, rbps: int) -> int | None:
        """The aggregators' links together on the testbed of ``n`` workers at ``rbps``."""
        each = agg_rate_bps(self.agg_rate, n, rbps)
        return each * self.aggregators if each else None


@dataclass(frozen=True)
class _TimePlot:
    """One figure of time against ``xkey``: which rows, which bound at each x, how to label."""

    name: str
    title: str
    xkey: str
    xlabel: str
    select: Callable[[dict], bool]
    bound: Callable[[float, int], tuple]     # (x, rate_bps) -> (aggregator bound, ring bound)
    xlog: bool = False
    agg_in_title: bool = False


def _time_plots(s: _Sweep) -> list[_TimePlot]:
    return [
        _TimePlot("latency_vs_size.png",
                  f"AllReduce time vs size ({s.nc} workers, sparsity {s.base:g}; median, min..max)",
                  "bytes", "bytes per worker", lambda r: r["workers"] == s.nc and r["sparsity"] == s.base,
                  lambda m, rb: bounds(m, s.nc, rb, s.agg_bps(s.nc, rb)), xlog=True, agg_in_title=True),
        _TimePlot("time_vs_workers.png", f"AllReduce time vs workers ({format_size(s.ref)}, sparsity {s.base:g})",
                  "workers", "workers", lambda r: r["bytes"] == s.ref and r["sparsity"] == s.base,
                  lambda n, rb: bounds(s.ref, int(n), rb, s.agg_bps(int(n), rb))),
        _TimePlot("time_vs_sparsity.png",
                  f"AllReduce time vs sparsity ({s.nc} workers, {format_size(s.ref)}; fraction of zero 1 KiB blocks)",
                  "sparsity", "sparsity", lambda r: r["bytes"] == s.ref and r["workers"] == s.nc,
                  lambda _x, rb: bounds(s.ref, s.nc, rb, s.agg_bps(s.nc, rb))),
    ]


def _series(ax, rows: list[dict], xkey: str, system: str) -> None:
    rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r[xkey])
    if not rs:
        return
    x = np.array([r[xkey] for r in rs], dtype=float)
    y = np.array([r["median_s"] for r in rs])
    lo = y - np.array([r["min_s"] for r in rs])
    hi = np.array([r["max_s"] for r in rs]) - y
    ax.errorbar(x, y * 1e3, yerr=[lo * 1e3, hi * 1e3], marker="o", ms=4, capsize=3, label=system,
                color=COLORS.get(system))


def _bound_lines(ax, xs: list, bound: Callable[[float], tuple]) -> None:
    xs = sorted(set(xs))
    if not xs:
        return
    ax.plot(xs, [bound(x)[0] * 1e3 for x in xs], "k--", lw=1, label="bound M/R or NM/R_agg (aggregator)")
    ax.plot(xs, [bound(x)[1] * 1e3 for x in xs], "k:", lw=1.2, label="bound 2(N-1)M/(NR) (ring)")


def _suptitle(fig, title: str, columns: int, **kw) -> None:
    """The figure's title, wrapped to the width of its ``columns`` panels (about 10 characters
    per inch at 11 points), so that a one-column figure does not crop it."""
    fig.suptitle("\n".join(textwrap.wrap(title, int(PANEL[0] * max(1, columns) * 10))), **kw)


def _panels(plt, n: int, title: str, **kw):
    fig, axes = plt.subplots(1, max(1, n), figsize=(PANEL[0] * max(1, n), PANEL[1]), squeeze=False)
    _suptitle(fig, title, n, **kw)
    return fig, axes[0]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _finish(plt, fig, axes, path: Path, **legend) -> Path:
    """Legends (or 'no measurements'), grids, saved; ``legend``: matplotlib's legend options."""
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**{"fontsize": 7, **legend})
        else:
            ax.text(0.5, 0.5, "no measurements", ha="center", va="center", transform=ax.transAxes)
        ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, path)


def _draw_time(plt, s: _Sweep, p: _TimePlot) -> Path:
    fig, axes = _panels(plt, len(s.rates), p.title)
    for ax, rate in zip(axes, s.rates):
        sel = [r for r in s.rows if r["rate"] == rate and p.select(r)]
        for system in s.systems:
            _series(ax, sel, p.xkey, system)
        rb = rate_bps(rate)
        if rb:
            _bound_lines(ax, [r[p.xkey] for r in sel], lambda x: p.bound(x, rb))
        if p.xlog:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel=p.xlabel, ylabel="time (ms)",
               title=f"links {rate}" + (f", aggregator {s.nc}x" if rb and p.agg_in_title else ""))
    return _finish(plt, fig, axes, s.out / p.name)


def _draw_bound_fraction(plt, s: _Sweep) -> Path:
    shaped = [r for r in s.rates if rate_bps(r)]
    fig, axes = _panels(plt, len(shaped), f"Shaped links: goodput as a fraction of the bound ({s.nc} workers, "
                        f"sparsity {s.base:g})\nxdp/afxdp/userspace vs M/R, ring/gloo/mpi vs 2(N-1)M/(NR)",
                        fontsize=10)
    path = s.out / "shaped_bound_fraction.png"
    if not shaped:
        axes[0].text(0.5, 0.5, "no shaped rate in this sweep (--rate 1gbit)", ha="center", va="center",
                     transform=axes[0].transAxes)
        axes[0].set_axis_off()
        return _save(plt, fig, path)
    for ax, rate in zip(axes, shaped):
        sel = [r for r in s.rows if r["rate"] == rate and r["workers"] == s.nc and r["sparsity"] == s.base
               and r.get("bound_fraction") is not None]
        for system in s.systems:
            rs = sorted((r for r in sel if r["system"] == system), key=lambda r: r["bytes"])
            if rs:
                ax.plot([r["bytes"] for r in rs], [r["bound_fraction"] for r in rs], marker="o", label=system,
                        color=COLORS.get(system))
        ax.axhline(1.0, color="k", ls="--", lw=1, label="bound")
        burst = tbf_burst_bytes(rate_bps(rate))
        ax.axvline(burst, color="gray", ls=":", lw=1, label=f"tbf bucket ({format_size(burst)}): smaller can beat the bound")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, max([1.15] + [r["bound_fraction"] * 1.05 for r in sel]))
        ax.set(xlabel="bytes per worker", ylabel="fraction of the bound", title=f"links {rate}, aggregator {s.nc}x")
    return _finish(plt, fig, axes, path)


def _draw_ring_gain(plt, s: _Sweep) -> Path:
    """Per link rate: 1 - t(system) / t(TCP ring) at each (workers, size), against M/N."""
    fig, axes = _panels(plt, len(s.rates), "Latency gain over the TCP ring against the chunk size M/N "
                        "(1 - t / t_ring; median times)")
    markers = ["o", "s", "^", "D", "v", "P"]
    for ax, rate in zip(axes, s.rates):
        ring = {(r["workers"], r["bytes"]): r["median_s"] for r in s.rows if r["rate"] == rate
                and r["system"] == "ring" and r["sparsity"] == s.base}
        for system in [x for x in s.systems if x not in ("ring", "xdp", "afxdp", "userspace")]:
            for i, n in enumerate(sorted({w for w, _ in ring})):
                rs = sorted((r for r in s.rows if r["rate"] == rate and r["system"] == system and r["workers"] == n
                             and r["sparsity"] == s.base and (n, r["bytes"]) in ring), key=lambda r: r["bytes"])
                if rs:  # gains below GAIN_FLOOR (gloo's small messages) sit on the floor, or nothing else reads
                    gains = [max(GAIN_FLOOR, 1 - r["median_s"] / ring[(n, r["bytes"])]) for r in rs]
                    ax.plot([r["bytes"] / n for r in rs], [100 * g for g in gains], marker=markers[i % len(markers)],
                            color=COLORS.get(system), label=f"{system} N={n}")
        for g in PAPER_GAIN:
            ax.axhline(100 * g, color="gray", ls=":", lw=1)
        ax.axhline(0, color="k", lw=0.8)
        ax.axvline(1024, color="gray", ls="--", lw=1, label="M/N = 1 KiB (dotted: the paper's 15%, 36%)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(100 * GAIN_FLOOR - 5, 100)
        ax.set(xlabel="M/N (bytes of each node's chunk)",
               ylabel=f"% lower latency than the TCP ring (floor {100 * GAIN_FLOOR:.0f}%)", title=f"links {rate}")
    return _finish(plt, fig, axes, s.out / RING_GAIN, loc="lower right", ncol=3, fontsize=6, framealpha=0.6)


def _agg_label(s: _Sweep) -> str:
    a = s.agg_rate or "N x"
    k = f"{s.aggregators} aggregators' links" if s.aggregators > 1 else "aggregator's link"
    return f"{k} {a}{' the worker rate' if a.endswith('x') else ''}"


def _scaling_panel(ax, sel: list[dict], systems: list[str]) -> None:
    from matplotlib.ticker import ScalarFormatter

    """Time against N of every system in ``sel``, its own bound dashed, CPU-bound points crossed."""
    for system in systems:
        rs = sorted((r for r in sel if r["system"] == system), key=lambda r: r["workers"])
        if not rs:
            continue
        n = [r["workers"] for r in rs]
        y = np.array([r["median_s"] for r in rs])
        err = [y - [r["min_s"] for r in rs], np.array([r["max_s"] for r in rs]) - y]
        ax.errorbar(n, y, yerr=err, marker="o", ms=4, capsize=3, label=system, color=COLORS.get(system))
        ax.plot(n, [r["bound_s"] for r in rs], "--", lw=1, color=COLORS.get(system), alpha=0.8)
        cpu = [r for r in rs if r.get("limit") == "cpu"]
        if cpu:
            ax.plot([r["workers"] for r in cpu], [r["median_s"] for r in cpu], "kx", ms=9, mew=1.5)
    ax.plot([], [], "k--", lw=1, label="each system's bound (its colour)")
    ax.plot([], [], "kx", ms=9, mew=1.5, label=f"CPU-bound: ranks kept >= {CPU_BOUND:.0%} of the cores busy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["workers"] for r in sel}) or [2])
    ax.get_xaxis().set_major_formatter(ScalarFormatter())
    ax.set_ylim(bottom=0)


def _draw_scaling(plt, s: _Sweep) -> Path:
    """Rows: one per size (time against N), then the share of the cores the ranks kept busy;
    columns: the shaped rates."""
    from matplotlib.ticker import ScalarFormatter

    shaped = [r for r in s.rates if rate_bps(r)]
    sizes = sorted({r["bytes"] for r in s.rows if r["sparsity"] == s.base}) or [s.ref]
    fig, axes = plt.subplots(len(sizes) + 1, len(shaped), figsize=(PANEL[0] * len(shaped), PANEL[1] * (len(sizes) + 1)),
                             squeeze=False)
    _suptitle(fig, f"AllReduce time against the number of workers (sparsity {s.base:g}; median, min..max; "
                   f"{_agg_label(s)})", len(shaped), fontsize=11)
    for c, rate in enumerate(shaped):
        here = [r for r in s.rows if r["rate"] == rate and r["sparsity"] == s.base]
        for i, size in enumerate(sizes):
            ax = axes[i][c]
            _scaling_panel(ax, [r for r in here if r["bytes"] == size], s.systems)
            ax.set(xlabel="workers N", ylabel="time (s)", title=f"{format_size(size)} per worker, links {rate}")
        ax = axes[len(sizes)][c]
        styles = ["-", ":", "-.", "--"]
        for system in s.systems:
            for i, size in enumerate(sizes):
                rs = sorted((r for r in here if r["system"] == system and r["bytes"] == size
                             and r.get("cpu_share") is not None), key=lambda r: r["workers"])
                if rs:
                    ax.plot([r["workers"] for r in rs], [r["cpu_share"] for r in rs], styles[i % len(styles)],
                            marker="o", ms=3, color=COLORS.get(system), label=f"{system} {format_size(size)}")
        ax.axhline(CPU_BOUND, color="k", ls="--", lw=1, label=f"CPU-bound from {CPU_BOUND:.0%}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["workers"] for r in here}) or [2])
        ax.get_xaxis().set_major_formatter(ScalarFormatter())
        top = max([1.1] + [1.05 * r["cpu_share"] for r in here if r.get("cpu_share") is not None])
        ax.set(xlabel="workers N", ylabel="ranks' CPU / (cores x wall time)", ylim=(0, top),
               title=f"share of the machine's cores the ranks kept busy, links {rate}")
    return _finish(plt, fig, [a for row in axes for a in row], s.out / SCALING, ncol=2)


def plot(rows: list[dict], cfg: BenchConfig) -> list[Path]:
    """Every plot of the sweep into cfg.out; their paths (in FILES order, then the ring offload's
    gain over the TCP ring when the sweep has both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = _Sweep([r for r in rows if r.get("median_s") is not None], list(dict.fromkeys(rate_label(r) for r in cfg.rates)),
               list(cfg.systems), centre_workers(cfg.workers), reference_size(cfg.sizes), min(cfg.sparsities), cfg.out,
               cfg.agg_rate, cfg.aggregators)
    out = [_draw_time(plt, s, p) for p in _time_plots(s)] + [_draw_bound_fraction(plt, s)]
    if len(set(cfg.workers)) > 1 and any(rate_bps(r) for r in s.rates):
        out.append(_draw_scaling(plt, s))
    if "ring" in cfg.systems and set(cfg.systems) & {"xdpring", "udpring", "gloo", "mpi"}:
        out.append(_draw_ring_gain(plt, s))
    return out
