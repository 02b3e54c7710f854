"""Several ranks per host, as the commands plan them (no root, no testbed): the bench's
``--ranks-per-host K`` (which systems, where each rank runs, the lanes' jobs, how rows name the
shape), train-demo's ``--nproc-per-node K`` and ``testbed up --ranks-per-host K``'s torchrun
command per host."""
from __future__ import annotations

import ipaddress
from pathlib import Path
from types import SimpleNamespace

import pytest

from nicoffload.cli import app as cli
from nicoffload.errors import InputError
from nicoffload.jobspec import JobSpec
from nicoffload.lab.bench import drive, plan, report, systems
from nicoffload.lab.bench.plan import BenchConfig, Point
from nicoffload.lab.train.torchrun import host_commands
from nicoffload.wire import proto


def _tb(hosts: int = 3):
    ws = [SimpleNamespace(rank=r, name=f"w{r}", ip=f"10.9.0.{r + 10}", iface="eth0", netns=f"nco-x-w{r}")
          for r in range(hosts)]
    agg = SimpleNamespace(name="agg", ip="10.9.0.1", iface="eth0", netns="nco-x-agg")
    return SimpleNamespace(name="x", workers=ws, agg=agg, aggs=[agg], port=40000, mcast_group="239.9.0.1")


def test_the_sweep_takes_the_systems_that_have_a_host_path():
    cfg = BenchConfig(workers=[2], ranks_per_host=2, systems=["gloo", "xdp", "xdp16"]).validate()
    assert cfg.systems == ["xdp", "gloo", "xdp16"]
    assert BenchConfig(ranks_per_host=2, systems=["xdpring", "udpring"]).validate().systems == ["xdpring", "udpring"]
    for bad, match in ((dict(systems=["xdp", "ring"]), "not ring"), (dict(systems=["userspace"]), "not userspace"),
                       (dict(compute=True), "--compute"), (dict(aggregators=2), "--aggregators"),
                       (dict(ranks_per_host=0), "1..8"), (dict(ranks_per_host=9), "1..8"),
                       (dict(ranks_per_host=8, systems=["xdp", "xdp16", "xdpuni"]), "not xdpuni")):
        with pytest.raises(InputError, match=match):
            BenchConfig(**{"ranks_per_host": 2, "systems": ["xdp", "gloo"], **bad}).validate()
    # 8 lanes of xdp and of xdp16: the 16 jobs one aggregator holds
    assert plan.MAX_RANKS_PER_HOST * sum(s in plan.XDP_AGG_SYSTEMS for s in plan.HOST_SYSTEMS) <= proto.MAX_JOBS
    BenchConfig(ranks_per_host=8, systems=["xdp", "xdp16", "gloo"]).validate()


def test_k_consecutive_ranks_run_in_each_host_and_each_lane_has_a_job_of_its_own(tmp_path):
    tb, cfg = _tb(3), BenchConfig(ranks_per_host=2, timeout=33.0)
    gloo = systems.rank_specs(tb, "gloo", Path("/p.json"), systems.rank_params(tb, "gloo", cfg), tmp_path, cfg)
    assert [r.label for r in gloo] == [f"rank {r}" for r in range(6)]
    assert [r.host.name for r in gloo] == ["w0", "w0", "w1", "w1", "w2", "w2"]
    assert [r.argv[-1] for r in gloo] == [str(r) for r in range(6)]
    assert all(r.env["MASTER_ADDR"] == "10.9.0.10" and r.env["GLOO_SOCKET_IFNAME"] == "eth0" for r in gloo)
    lanes = {}
    for s in ("xdp", "xdp16"):
        p = systems.rank_params(tb, s, cfg, side=True)
        lanes[s] = [JobSpec.from_dict(d) for d in p["lane_specs"]]
        base = systems.job_spec(p)
        assert len(lanes[s]) == 2 and lanes[s][0].job == base.job and lanes[s][0].group == base.group
        assert all(ln.lanes == 32 and not ln.sparse and ln.port == base.port for ln in lanes[s])
        assert lanes[s] == [drive.lane_spec(base, j) for j in range(2)]  # what SharedXdp loads
    every = [ln for ls in lanes.values() for ln in ls]
    for key in ("job", "group", "local_port"):  # no two jobs of one aggregator meet
        assert len({getattr(ln, key) for ln in every}) == len(every), key
    assert all(ipaddress.IPv4Address(ln.group).is_multicast for ln in every)
    # one host: no lanes, no aggregator; the ring modes' one lane is the ring of the hosts
    assert "lane_specs" not in systems.rank_params(_tb(1), "xdp", cfg)
    assert systems.rank_params(tb, "xdpring", cfg)["peers"] == ["10.9.0.10", "10.9.0.11", "10.9.0.12"]


def test_rows_name_the_shape_and_hold_a_hosts_bound():
    pt = Point(0, 16 << 20, 0.0)
    r = report.row("xdp", 2, pt, "1gbit", 10**9, 2)
    assert r["ranks_per_host"] == 2 and r["workers"] == 2
    assert r["bound_s"] == pytest.approx((16 << 20) * 8 / 1e9)  # a host's link carries the tensor once
    r.update(status="ok", median_s=0.2, min_s=0.2, max_s=0.2, goodput_bps=1.0, cpu_s=0.1, bound_fraction=0.7, reps=3)
    assert "N=2x2" in report.fmt_row(r) and " 2x2 " in report.table([r])
    assert "N=4 " in report.fmt_row({**r, "workers": 4, "ranks_per_host": 1})


@pytest.mark.parametrize("argv, match", [
    (["bench", "--soak", "5", "--ranks-per-host", "2"], "--ranks-per-host"),
    (["bench", "--paired", "sparsity", "--ranks-per-host", "2"], "goes with the sweep"),
    (["bench", "--torch-overhead", "--ranks-per-host", "2"], "goes with the sweep"),
    (["train-demo", "--nproc-per-node", "2"], "goes with --backend"),
    (["train-demo", "--backend", "--nproc-per-node", "0"], "at least 1"),
])
def test_commands_refuse_what_they_cannot_run(argv, match, capsys):
    pytest.importorskip("torch") if argv[0] == "train-demo" else None
    assert cli.main(argv) == InputError.exit_code
    assert match in capsys.readouterr().err


def test_the_torchrun_command_of_every_host():
    two = host_commands(_tb(2), 2, script="train.py")
    assert two["world"] == 4 and two["service"]["argv"][:3] == ["nicoffload", "agg", "serve"]
    assert "--netns nco-x-agg --iface eth0 --listen 10.9.0.1:7470" in two["service"]["command"]
    for i, h in enumerate(two["hosts"]):
        a = h["argv"]
        assert a[:6] == ["nicoffload", "testbed", "exec", "x", f"w{i}", "--"] and a[-1] == "train.py"
        t = a.index("torchrun")
        assert a[t:t + 11] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),
                               "--master-addr", "10.9.0.10", "--master-port", "29500"]
        assert "GLOO_SOCKET_IFNAME=eth0" in a and "NICOFFLOAD_SERVICE=http://10.9.0.1:7470" in a
    one = host_commands(_tb(1), 4)
    assert one["service"] is None and len(one["hosts"]) == 1
    assert not any(x.startswith("NICOFFLOAD_") for x in one["hosts"][0]["argv"])  # one host: no service
    assert "--nnodes 1 --nproc-per-node 4 --node-rank 0" in one["hosts"][0]["command"]
