"""``nicoffload bench --scaling`` without root or sockets: the preset, the aggregator's link in
the bounds (N x R, or the workers' rate), the CPU-bound verdict of a row, and the figure of time
against N drawn from synthetic rows."""
from __future__ import annotations

import pytest

from nicoffload.errors import InputError
from nicoffload.lab.bench import plan, plot, report
from nicoffload.lab.bench.plan import BenchConfig, Point

MiB, R = 1 << 20, 200_000_000


def test_the_scaling_preset_sweeps_n_at_fixed_rates_and_takes_overrides():
    cfg = BenchConfig.scaling().validate()
    assert cfg.workers == [2, 4, 8, 16] and cfg.sizes == [16 * MiB, 64 * MiB] and cfg.sparsities == [0.0]
    assert cfg.rates == ["200mbit", "1gbit"] and cfg.systems == ["xdp", "ring", "gloo", "xdp16"]
    assert [(r, n) for r, n, _ in plan.sweep_plan(cfg)] == [(r, n) for r in cfg.rates for n in cfg.workers]
    assert all(len(p) == 2 for _, _, p in plan.sweep_plan(cfg))  # both sizes, dense only
    assert BenchConfig.scaling(workers=[2, 4], rates=["200mbit"]).workers == [2, 4]
    assert BenchConfig.scaling().workers == [2, 4, 8, 16]  # the preset's lists are not shared


def test_the_aggregators_link_is_n_times_the_workers_or_what_agg_rate_says():
    assert plan.agg_rate_bps(None, 4, R) == 4 * R
    assert plan.agg_rate_bps("1x", 4, R) == R and plan.agg_rate_bps("2.5x", 8, R) == int(2.5 * R)
    assert plan.agg_rate_bps("1gbit", 4, R) == 10**9
    assert plan.agg_rate_bps(None, 4, None) is None and plan.agg_rate_bps("1x", 4, None) is None
    for bad in ("fast", "0x", "x"):
        with pytest.raises(InputError):
            plan.agg_rate_bps(bad, 4, R)
        with pytest.raises(InputError):
            BenchConfig(agg_rate=bad).validate()


def test_an_aggregator_no_faster_than_a_worker_bounds_the_call_at_n_times_m_over_r():
    m = 16 * MiB
    agg, ring = plan.bounds(m, 4, R, agg_bps=4 * R)
    assert agg == pytest.approx(m * 8 / R) and ring == pytest.approx(1.5 * m * 8 / R)
    assert plan.bounds(m, 4, R, agg_bps=R)[0] == pytest.approx(4 * m * 8 / R)
    assert plan.bounds(m, 4, R, agg_bps=2 * R)[0] == pytest.approx(2 * m * 8 / R)  # two aggregators at R
    assert plan.bounds(m, 4, R, agg_bps=R)[1] == ring  # the ring never crosses it


def _recs(n: int, t: float, cpu: float) -> list[dict]:
    """Every rank's record of a point of 3 reps of ``t`` seconds, each rank ``cpu`` CPU-s a rep."""
    return [{"rank": k, "times": [t] * 3, "cpu_busy_s": 1.0, "cpu_all_s": 2.0, "proc_cpu_s": 3 * cpu,
             "counters": {"packets": 10, "retransmissions": 0}} for k in range(n)]


def test_a_shaped_point_whose_ranks_keep_the_cores_busy_says_it_is_cpu_bound(monkeypatch):
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    pt = Point(0, 16 * MiB, 0.0)
    link = report.measured_row("xdp", 4, pt, "200mbit", R, _recs(4, 0.75, 0.05), agg_bps=4 * R)
    assert link["host_cpu_s"] == pytest.approx(0.2) and link["cpu_share"] == pytest.approx(0.2 / 1.5)
    assert link["limit"] == "link" and link["agg_rate_bps"] == 4 * R
    cpu = report.measured_row("gloo", 16, pt, "200mbit", R, _recs(16, 1.0, 0.1))
    assert cpu["cpu_share"] == pytest.approx(0.8) and cpu["limit"] == "cpu"
    assert "CPU-BOUND" in report.fmt_row(cpu) and " cpu " in report.table([cpu, link])
    unshaped = report.measured_row("xdp", 4, pt, "unshaped", None, _recs(4, 0.05, 0.04))
    assert unshaped["cpu_share"] == pytest.approx(1.6) and unshaped["limit"] is None


def test_the_scaling_figure_is_drawn_from_the_rows(tmp_path):
    cfg = BenchConfig.scaling(out=tmp_path, agg_rate="1x").validate()
    rows = []
    for rate, rbps in (("200mbit", R), ("1gbit", 10**9)):
        for n in cfg.workers:
            for i, size in enumerate(cfg.sizes):
                for system in cfg.systems:
                    agg = plan.agg_rate_bps(cfg.agg_rate, n, rbps)
                    t = (n if system.startswith("xdp") else 2) * size * 8 / rbps
                    rows.append(report.measured_row(system, n, Point(i, size, 0.0), rate, rbps,
                                                    _recs(n, t, 0.01 * n), agg_bps=agg))
    paths = plot.plot(rows, cfg)
    assert tmp_path / plot.SCALING in paths
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p


def test_a_one_column_figure_wraps_its_title_inside_the_figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = ("AllReduce time against the number of workers (sparsity 0; median, min..max; "
             "aggregator's link N x the worker rate)")
    fig, _ = plot._panels(plt, 1, title, fontsize=11)
    try:
        fig.tight_layout()
        fig.canvas.draw()
        text = fig._suptitle
        assert "\n" in text.get_text() and text.get_text().replace("\n", " ") == title
        box, width = text.get_window_extent(), fig.bbox.width
        assert box.x0 >= 0 and box.x1 <= width, (box, width)  # not cropped on either side
    finally:
        plt.close(fig)
