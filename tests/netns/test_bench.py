"""``nicoffload bench`` end to end (root, namespaces): the quick sweep writes sane results and the
plots; the TCP ring baseline sums exactly (int32) or within float32's bound; systems that cannot
run are skipped with a reason, never a crash."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from nicoffload.lab import reference
from nicoffload.lab.bench import drive, plan, report, systems

REPO = Path(__file__).resolve().parents[2]
PNGS = ["latency_vs_size.png", "time_vs_workers.png", "time_vs_sparsity.png", "shaped_bound_fraction.png"]
STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def run_bench(out: Path, *extra: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nicoffload.cli", "bench", "--quick", "--out", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_quick_bench_writes_sane_results_and_plots(tmp_path):
    stats_before = STATS.read_text()
    out = tmp_path / "b"
    r = run_bench(out)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert STATS.read_text() == stats_before, "kernel.bpf_stats_enabled was not restored"
    assert "median" in r.stdout and "[" in r.stderr  # the table, and progress while it ran

    rows = json.loads((out / "results.json").read_text())
    with open(out / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and set(report.FIELDS) <= set(csv_rows[0])
    for p in PNGS:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p
    meta = json.loads((out / "meta.json").read_text())

    cfg = plan.BenchConfig.quick()
    points = {(p.bytes, p.sparsity) for p in plan.plan_points(cfg, 2)}
    assert {r["system"] for r in rows} == set(plan.SYSTEMS)
    for sys_ in plan.SYSTEMS:
        for rate in ("unshaped", "200mbit"):
            got = {(r["bytes"], r["sparsity"]) for r in rows if r["system"] == sys_ and r["rate"] == rate}
            assert got == points, (sys_, rate)
    assert not [r for r in rows if r["status"] == "error"]
    for sys_ in ("xdp", "userspace", "ring"):  # always available where these tests run
        assert all(r["status"] == "ok" for r in rows if r["system"] == sys_), sys_
    for r in rows:
        if r["status"] == "skipped":
            assert r["reason"] and r["median_s"] is None
            assert meta["systems"][r["system"]]["reason"]
            continue
        M, N = r["bytes"], r["workers"]
        assert len(r["times"]) == r["reps"] >= 1, r
        if r["reps"] < cfg.reps:  # only a point that ran past max_point_s stops early (test_lab_plan)
            warnings.warn(f"{r['system']} {r['rate']} {M} B s={r['sparsity']}: {r['reps']} reps {r['times']}")
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"] < 10, r
        assert r["goodput_bps"] == pytest.approx(8 * M / r["median_s"])
        assert r["cpu_s"] is not None and r["cpu_s"] >= 0
        half = r["system"] in ("xdp16", "gloobf16", "gloofp16")  # two bytes per element on the wire
        assert r["within_bound"] is True and r["max_abs_err"] < (2e-2 if half else 1e-3)
        # the data really crossed worker 0's link (no shared-memory shortcut)
        share = (1 - r["sparsity"]) * M if r["system"] in plan.STAR_SYSTEMS else 2 * (N - 1) / N * M
        assert r["w0_tx_bytes"] >= 0.8 * share / (2 if half else 1), r
        if r["system"] in ("xdp", "xdpring", "xdpuni", "xdp16"):
            assert r["bpf_ns"] > 0 and r["bpf_cnt"] > 0
        else:
            assert r["bpf_ns"] is None
        if r["rate"] == "unshaped":
            assert r["bound_s"] is None and r["bound_fraction"] is None
        else:
            ba, br = plan.bounds(M // 2 if half else M, N, 200_000_000)
            assert (r["bound_agg_s"], r["bound_ring_s"]) == (pytest.approx(ba), pytest.approx(br))
            assert r["bound_fraction"] == pytest.approx(r["bound_s"] / r["median_s"])
    # the systems that shared the testbed ran interleaved: every ok row of theirs has paired ratios
    # against the others of its point, rep for rep
    together = {s for g in drive.groups(cfg, 2) if len(g) > 1 for s in g}
    for r in rows:
        if r["status"] == "ok" and r["system"] in together:
            others = {o["system"] for o in rows if o["status"] == "ok" and o["system"] in together and
                      o["system"] != r["system"] and (o["rate"], o["bytes"], o["sparsity"]) ==
                      (r["rate"], r["bytes"], r["sparsity"])}
            assert set(r["paired"]) == others, r["system"]
            for o, p in r["paired"].items():
                assert p["q1"] <= p["median"] <= p["q3"] and p["pairs"] == min(r["reps"], len(
                    next(x for x in rows if x["system"] == o and (x["rate"], x["bytes"], x["sparsity"]) ==
                         (r["rate"], r["bytes"], r["sparsity"]))["times"]))
    # shaping held: the largest quick size cannot beat its bound by much (tbf's bucket is ~4 ms)
    for r in rows:
        if r["status"] == "ok" and r["rate"] == "200mbit" and r["sparsity"] == 0 and r["bytes"] == max(cfg.sizes):
            assert r["median_s"] >= 0.5 * r["bound_s"], r


def test_unavailable_systems_are_skipped_with_a_reason(tmp_path):
    out = tmp_path / "s"
    r = run_bench(out, "--systems", "mpi", "--mpirun", "/nonexistent/mpirun", timeout=60)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    rows = json.loads((out / "results.json").read_text())
    assert rows and all(x["status"] == "skipped" and x["system"] == "mpi" for x in rows)
    assert all("mpirun not found" in x["reason"] for x in rows)
    assert "skipped mpi: mpirun not found" in r.stdout
    assert all((out / p).exists() for p in PNGS)


def test_probe_reasons():
    assert "mpirun not found" in systems.probe("mpi", mpirun="/nonexistent/mpirun")[0]
    assert systems.probe("ring")[0] is None and systems.probe("userspace")[0] is None
    assert "unknown system" in systems.probe("nccl")[0]


# --- the ring baseline ------------------------------------------------------------------------------
def _ring(tb, ranks, x, tmp: Path, tag: str, port: int):
    peers = ",".join(tb.workers[r].ip for r in ranks)
    procs = []
    for i, r in enumerate(ranks):
        np.save(tmp / f"{tag}-in{i}.npy", x[i])
        argv = [sys.executable, "-m", "nicoffload.lab.bench.tcpring", "--rank", str(i), "--world", str(len(ranks)),
                "--peers", peers, "--port", str(port), "--input", str(tmp / f"{tag}-in{i}.npy"),
                "--output", str(tmp / f"{tag}-out{i}.npy"), "--reps", "2", "--timeout", "10", "--json"]
        procs.append(tb.popen(tb.workers[r], argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        o, e = p.communicate(timeout=30)
        assert p.returncode == 0, e
        assert len(json.loads(o.strip().splitlines()[-1])["times"]) == 2
    return [np.load(tmp / f"{tag}-out{i}.npy") for i in range(len(ranks))]


@pytest.mark.parametrize("n", [2, 3])
def test_ring_sums_exactly_or_within_the_float32_bound(make_testbed, tmp_path, n):
    tb = make_testbed(3)
    rng = np.random.default_rng(n)
    for k, size in enumerate((1, 1001, 300_007)):  # fewer elements than ranks, uneven chunks, ~1 MiB
        ints = rng.integers(-2**30, 2**30, size=(n, size), dtype=np.int64).astype(np.int32)
        outs = _ring(tb, list(range(n)), ints, tmp_path, f"i{k}", 47000 + k)
        want = reference.host_sum(list(ints))  # the int64 sum; the ring's int32 wraps modulo 2^32
        for o in outs:
            assert o.dtype == np.int32 and want.check(o).within_bound, want.check(o).reason
        fl = (rng.standard_normal((n, size)) * 10.0 ** rng.integers(-3, 3, size=(n, size))).astype(np.float32)
        outs = _ring(tb, list(range(n)), fl, tmp_path, f"f{k}", 47100 + k)
        want = reference.host_sum(list(fl))
        for o in outs:
            assert o.dtype == np.float32 and np.array_equal(o, outs[0])  # every rank bit-identical
            assert want.check(o).within_bound, want.check(o).reason


def test_paired_sparsity_interleaves_dense_and_sparse_inputs(tmp_path):
    """--paired sparsity: the sparse variant's calls really carry the sparse input (fewer results
    than blocks), both variants are timed, and the ratio comes with its quartiles."""
    r = subprocess.run([sys.executable, "-m", "nicoffload.cli", "bench", "--paired", "sparsity", "--sparsity", "0.75",
                        "--zero-run", "4", "--workers", "2", "--sizes", "256KiB", "--reps", "4", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    got = json.loads((tmp_path / "paired_sparsity.json").read_text())
    dense, sparse = got["results"]
    assert dense == 256 and 0 < sparse < 200  # 1 - 0.75^2 of the blocks are non-zero somewhere
    assert got["b"] == "sparse 0.75, zero runs of 4" and all(m > 0 for m in got["median_ms"])
    q = got["ratio_b_over_a"]
    assert q["q1"] <= q["median"] <= q["q3"] and "per pair of reps" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "nicoffload.cli", "bench", "--paired", "sparsity", "--sparsity", "0",
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "one sparsity above 0" in bad.stderr


def test_ranks_per_host_reduce_inside_each_host_and_send_its_tensor_once(tmp_path):
    """--ranks-per-host 2 on one host and on two: xdp's ranks go through shared memory (one host:
    nothing on the wire, no aggregator) and local rank j's share through lane j's job (two jobs
    formed, a host's link carries the tensor once, not once per rank); udpring's one lane is the
    ring of the hosts; gloo runs the same placement; every result within its bound, the systems
    interleaved (paired ratios)."""
    M = 1 << 20
    r = run_bench(tmp_path, "--ranks-per-host", "2", "--workers", "1,2", "--systems", "xdp,udpring,gloo", "--sizes",
                  "1MiB", "--sparsity", "0", "--rate", "unshaped", "--reps", "2", timeout=300)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "N=2x2" in r.stdout and "N=1x2" in r.stdout
    rows = {(x["system"], x["workers"]): x for x in json.loads((tmp_path / "results.json").read_text())}
    assert sorted(rows) == [(s, n) for s in ("gloo", "udpring", "xdp") for n in (1, 2)]
    for (s, n), x in rows.items():
        assert x["status"] == "ok" and x["ranks_per_host"] == 2 and x["reps"] >= 2, x
        assert x["within_bound"] is True and x["max_abs_err"] < 1e-3, x
        assert set(x["paired"]) == {"gloo", "udpring", "xdp"} - {s}
    one, two = rows["xdp", 1], rows["xdp", 2]
    assert one["w0_tx_bytes"] == 0 and one["bpf_ns"] is None  # shared memory alone
    assert 0.8 * M <= two["w0_tx_bytes"] <= 1.5 * M and two["bpf_cnt"] > 0, two  # once, not once per rank
    assert rows["udpring", 1]["w0_tx_bytes"] == 0 and rows["udpring", 2]["w0_tx_bytes"] >= 0.8 * M
    meta = json.loads((tmp_path / "meta.json").read_text())
    stats = next(t for t in meta["testbeds"] if t["workers"] == 2)["aggregator_stats"]["xdp"][0]["stats"]
    assert stats["epoch_formed"] == 2 and stats["completed"] > 0  # two lanes, a job each
