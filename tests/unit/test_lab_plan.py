"""The bench's planning without root or sockets: which points each testbed runs, the shaped
bounds, rates and command-line values, the configuration's checks, what a whole sweep runs and
what each system's ranks are handed."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT
from nicoffload.lab.bench import plan, systems
from nicoffload.lab.bench.plan import BenchConfig, Point
from nicoffload.lab.inputs import format_size, make_gradients, parse_size
from nicoffload.wire import proto

KiB, MiB = 1 << 10, 1 << 20


def pts(cfg: BenchConfig, workers: int) -> list[tuple[int, float]]:
    points = plan.plan_points(cfg, workers)
    assert [p.index for p in points] == list(range(len(points)))  # indexes name inputs and outputs
    return [(p.bytes, p.sparsity) for p in points]


def test_default_points_are_the_axes_the_plots_need():
    cfg = BenchConfig(workers=[2, 4, 8], sizes=[4 * KiB, 64 * KiB, MiB], sparsities=[0.5, 0.0, 0.75])
    sizes_at_base = [(4 * KiB, 0.0), (64 * KiB, 0.0), (MiB, 0.0)]
    assert pts(cfg, 2) == sizes_at_base
    assert pts(cfg, 8) == sizes_at_base
    # the centre worker count also sweeps sparsity, at the reference size
    assert pts(cfg, 4) == sizes_at_base + [(MiB, 0.5), (MiB, 0.75)]


def test_full_is_the_cross_product_without_repeats():
    cfg = BenchConfig(workers=[2], sizes=[4 * KiB, MiB, 4 * KiB], sparsities=[0.0, 0.5], full=True)
    assert pts(cfg, 2) == [(4 * KiB, 0.0), (4 * KiB, 0.5), (MiB, 0.0), (MiB, 0.5)]


def test_a_single_sparsity_adds_no_points():
    cfg = BenchConfig(workers=[4], sizes=[MiB], sparsities=[0.25])
    assert pts(cfg, 4) == [(MiB, 0.25)]


@pytest.mark.parametrize("workers,centre", [([2, 4, 8], 4), ([8, 2, 4], 4), ([2], 2), ([2, 3, 8], 3), ([2, 8], 8)])
def test_centre_workers(workers, centre):
    assert plan.centre_workers(workers) == centre


@pytest.mark.parametrize("sizes,ref", [([4 * KiB, 64 * KiB, MiB], MiB), ([4 * KiB, 64 * MiB], 4 * KiB),
                                       ([16 * MiB, 17 * MiB], 16 * MiB), ([64 * MiB, 32 * MiB], 32 * MiB)])
def test_reference_size_is_the_largest_up_to_16mib(sizes, ref):
    assert plan.reference_size(sizes) == ref


def test_bounds():
    assert plan.bounds(MiB, 4, None) == (None, None)
    agg, ring = plan.bounds(1_000_000, 4, 1_000_000_000)
    assert agg == pytest.approx(0.008)                 # M/R
    assert ring == pytest.approx(2 * 3 / 4 * 0.008)    # 2(N-1)M/(NR)
    assert plan.bounds(1_000_000, 1, 1_000_000_000)[1] == 0.0
    # the ring's bound equals the aggregator's at two workers and exceeds it from three on
    assert plan.bounds(MiB, 2, 10**9)[1] == plan.bounds(MiB, 2, 10**9)[0] < plan.bounds(MiB, 3, 10**9)[1]


def test_rates():
    assert plan.rate_bps("1gbit") == 10**9 and plan.rate_bps("200mbit") == 200 * 10**6
    assert plan.rate_bps("unshaped") is None
    assert plan.rate_label("1000mbit") == "1gbit" and plan.rate_label("unshaped") == "unshaped"
    assert plan.rate("200mbit") == "200mbit"
    for bad in ("fast", "1kbit", "10gbps"):
        with pytest.raises(InputError):
            plan.rate(bad)


def test_command_line_values():
    assert plan.parse_list(plan.size, "4KiB, 1MiB,") == [4 * KiB, MiB]
    assert plan.parse_list(plan.sparsity, "0,0.5,1") == [0.0, 0.5, 1.0]
    assert plan.parse_list(plan.workers, "2,4") == [2, 4]
    assert plan.parse_list(plan.system, "ring,xdp") == ["ring", "xdp"]
    for conv, text in ((plan.size, "2"), (plan.size, "4XB"), (plan.sparsity, "1.5"), (plan.workers, "0"),
                       (plan.workers, "201"), (plan.system, "nccl"), (plan.size, " , ")):
        with pytest.raises((InputError, ValueError)):
            plan.parse_list(conv, text)


@pytest.mark.parametrize("text,n", [("4KiB", 4096), ("16MiB", 16 << 20), ("1.5MB", 1_500_000), ("1000", 1000),
                                    ("2gib", 2 << 30)])
def test_sizes_read_and_shown(text, n):
    assert parse_size(text) == n
    assert parse_size(format_size(n)) == n or n % 1024


def test_config_checks():
    with pytest.raises(InputError, match="--reps"):
        BenchConfig(reps=0).validate()
    with pytest.raises(InputError, match="--max-reps"):
        BenchConfig(max_reps=0).validate()
    with pytest.raises(InputError, match="--max-point-time"):
        BenchConfig(max_point_s=0).validate()
    with pytest.raises(InputError, match="unknown systems"):
        BenchConfig(systems=["xdp", "nccl"]).validate()
    with pytest.raises(InputError, match="--zero-run"):
        BenchConfig(zero_run=0).validate()
    cfg = BenchConfig(reps=50, max_reps=10, systems=["mpi", "xdp"]).validate()
    assert cfg.max_reps == 50 and cfg.systems == ["xdp", "mpi"]  # SYSTEMS order


def test_zero_runs_cluster_the_zero_blocks():
    """--zero-run k: each rank's zero blocks come in aligned runs of k blocks, at the same rate;
    1 keeps the scattered inputs (and the numbers measured with them) as they were."""
    n, E = 4096 * 256 + 100, 256  # a partial last block
    one = make_gradients(3, n, 0.75, 5, E)
    assert all(np.array_equal(a, b) for a, b in zip(one, make_gradients(3, n, 0.75, 5, E, zero_run=1)))
    for g in make_gradients(3, n, 0.75, 5, E, zero_run=64):
        zero = np.pad(g, (0, (-n) % E)).reshape(-1, E).any(axis=1) == 0
        runs = zero[:4096].reshape(-1, 64)
        assert (runs.all(axis=1) | ~runs.any(axis=1)).all()  # whole runs, never parts of one
        assert 0.6 < zero.mean() < 0.9
    with pytest.raises(InputError, match="--zero-run"):
        make_gradients(2, n, 0.5, 0, E, zero_run=0)


def test_quick_configs_do_not_share_lists():
    a = BenchConfig.quick()
    a.workers.append(8)
    assert BenchConfig.quick().workers == [2]
    assert BenchConfig.quick(reps=7).reps == 7


def test_what_a_sweep_runs():
    quick = plan.sweep_plan(BenchConfig.quick())
    assert [(rate, n) for rate, n, _ in quick] == [("unshaped", 2), ("200mbit", 2)]
    for _, _, points in quick:  # 2 workers is the centre: both sizes, and the sparsity at the larger
        assert [(p.bytes, p.sparsity) for p in points] == [(4 * KiB, 0.0), (256 * KiB, 0.0), (256 * KiB, 0.5)]
    full = plan.sweep_plan(BenchConfig())
    assert [(rate, n) for rate, n, _ in full] == [(r, n) for r in ("unshaped", "1gbit") for n in (2, 4, 8)]
    assert [len(p) for _, _, p in full] == [3, 5, 3] * 2


def _tb():
    ws = [SimpleNamespace(rank=r, ip=f"10.9.0.{r + 10}", iface="eth0", netns=f"ns{r}") for r in range(3)]
    agg = SimpleNamespace(ip="10.9.0.100")
    return SimpleNamespace(workers=ws, agg=agg, aggs=[agg], port=40000, mcast_group="239.9.0.1")


def test_what_each_systems_ranks_are_handed(tmp_path):
    tb, cfg = _tb(), BenchConfig(timeout=33.0, spec=DEFAULT.replace(slots=512))
    p = systems.rank_params(tb, "xdp", cfg)
    spec = systems.job_spec(p)
    assert p["aggregator"] == "10.9.0.100"
    assert (spec.port, spec.group, spec.slots, spec.timeout) == (40000, "239.9.0.1", 512, 33.0)
    ports = {s: systems.rank_params(tb, s, cfg)["port"] for s in ("ring", "gloo")}
    assert len({40000, *ports.values()}) == 3  # nobody shares the nicoffload port
    ranks = systems.rank_specs(tb, "gloo", Path("/p.json"), systems.rank_params(tb, "gloo", cfg), tmp_path, cfg)
    assert [r.label for r in ranks] == ["rank 0", "rank 1", "rank 2"]
    assert all(r.env["MASTER_ADDR"] == "10.9.0.10" and r.env["MASTER_PORT"] == str(ports["gloo"]) for r in ranks)
    assert ranks[2].argv[-2:] == ["--rank", "2"] and "nicoffload.lab.bench.ranks" in ranks[2].argv


def test_packet_shapes_follow_the_record_size():
    spec = DEFAULT.replace(elems=512)
    shape = systems.packet_shape("xdp", "native", spec)
    assert shape["mode"] == "native" and f"{proto.HDR_LEN + 512 * 4} B datagrams" in shape["shape"]
    assert systems.packet_shape("userspace", None, spec)["mode"] == "userspace"
    assert systems.packet_shape("ring", None, spec) == {"mode": "-", "shape": "TCP streams"}


def test_point_is_a_value():
    assert Point(0, 4, 0.5) == Point(0, 4, 0.5) and len({Point(0, 4, 0.5), Point(0, 4, 0.5)}) == 1


def test_a_point_stops_by_its_rules():
    from nicoffload.lab.bench.ranks import _go_on
    p = {"reps": 3, "min_time": 0.5, "max_reps": 20, "max_point_s": 5.0}
    assert _go_on(p, 0, 99.0)                     # one rep always, however long the warm-up took
    assert _go_on(p, 2, 4.0) and _go_on(p, 3, 0.1)  # fewer than reps, or under min_time
    assert not _go_on(p, 3, 0.6)                  # reps done and min_time spent
    assert not _go_on(p, 1, 5.0)                  # a slow point stops after max_point_s with what it has
    assert not _go_on(p, 20, 0.1)                 # max_reps


# --- interleaved systems (lab.bench.drive) ----------------------------------------------------
def test_groups_interleave_what_can_share_a_testbed():
    from nicoffload.lab.bench import drive

    cfg = BenchConfig(systems=["xdp", "gloo", "xdpring", "xdp16", "xdptorch", "userspace"]).validate()
    assert drive.groups(cfg, 4) == [["xdp", "userspace", "gloo", "xdp16"], ["xdpring"], ["xdptorch"]]
    cfg.compute = True
    assert drive.groups(cfg, 4) == [[s] for s in cfg.systems]
    cfg.compute = False
    assert drive.groups(cfg, 40) == [[s] for s in cfg.systems]  # two-level jobs hold the aggregator
    # the AF_XDP engine shares the testbed too: beside the XDP systems their aggregator hands its
    # job off to it (the XDP program steers the job's frames), alone it steers them itself
    cfg = BenchConfig(systems=["userspace", "afxdp", "xdp", "gloo"]).validate()
    assert drive.groups(cfg, 4) == [["xdp", "afxdp", "userspace", "gloo"]]


def test_side_specs_never_collide():
    from nicoffload.jobspec import DEFAULT
    from nicoffload.lab.bench import drive

    base = DEFAULT.replace(port=40000, group="239.77.9.1")
    specs = {s: drive.side_spec(s, base) for s in drive.SIDE}
    assert specs["xdp"] == base
    for key in ("job", "group"):
        assert len({getattr(sp, key) for sp in specs.values()}) == len(specs), key
    rank_ports = [sp.local_port or sp.port for sp in specs.values()]
    assert len(set(rank_ports)) == len(rank_ports)
    # the XDP systems talk to the XDP program's port, and so does afxdp (beside the XDP aggregator
    # that program steers its job's frames to the engine); the others have servers of their own
    assert {specs[s].port for s in ("xdp", "xdpuni", "xdp16", "afxdp")} == {40000}
    assert specs["userspace"].port != 40000 and specs["udpring"].port != 40000


def test_schedule_and_order():
    from nicoffload.lab.bench import drive

    cfg = BenchConfig(reps=3, max_reps=10, min_time=0.5, max_point_s=2.0).validate()
    assert not drive.schedule_done(cfg, 2, {"a": 9.0}, 1.0, 2)           # fewer than reps
    assert not drive.schedule_done(cfg, 3, {"a": 9.0, "b": 0.1}, 1.0, 2)  # b below min_time
    assert drive.schedule_done(cfg, 3, {"a": 0.6, "b": 0.6}, 1.0, 2)
    assert drive.schedule_done(cfg, 1, {"a": 0.0, "b": 0.0}, 4.1, 2)     # past max_point_s per system
    assert drive.schedule_done(cfg, 10, {"a": 0.0}, 0.0, 1)              # max_reps
    assert drive.order(["a", "b", "c"], 0) == ["a", "b", "c"] and drive.order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_paired_ratios_are_rep_by_rep():
    from nicoffload.lab.bench import drive

    xdp = {"system": "xdp", "status": "ok", "times": [1.0, 2.0, 4.0, 1.0]}
    gloo = {"system": "gloo", "status": "ok", "times": [1.5, 3.0, 6.0, 1.5, 9.0]}  # one rep more: 4 pairs
    bad = {"system": "mpi", "status": "error", "times": [1.0]}
    drive.paired([xdp, gloo, bad])
    assert gloo["paired"]["xdp"] == {"median": 1.5, "q1": 1.5, "q3": 1.5, "pairs": 4}
    assert gloo["paired_vs"] == "xdp" and gloo["paired_ratio"] == 1.5
    assert xdp["paired"]["gloo"]["median"] == pytest.approx(1 / 1.5) and xdp["paired_vs"] == "gloo"
    assert "paired" not in bad
