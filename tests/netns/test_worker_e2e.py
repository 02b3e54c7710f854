"""The worker library end to end on the testbed: exact int32 sums, float sums within the
documented bound on adversarial inputs, bit-identical results under 2% loss and 2% duplication,
a lost record resent by its rank alone, a missing rank named by every other rank
within the timeout, block sparsity."""
from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
from e2ekit import CLI, save

from nicoffload.errors import ProtocolError, TimeoutError_
from nicoffload.lab import reference
from nicoffload.lab.aggregators import AggregatorProcess
from nicoffload.lab.jobs import run_job, run_workers
from nicoffload.lab.links import enable_gro
from nicoffload.wire import proto

E = proto.DEFAULT_ELEMS


def wait_for_epoch(ap, procs, timeout=60.0) -> None:
    """Until every rank has joined (the aggregator formed the job's epoch): process start-up takes
    seconds on a loaded machine, so a fixed sleep cannot say the ranks are in the middle of a job."""
    deadline = time.monotonic() + timeout
    while not ap.stats().get("epoch_formed"):
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, [p.stderr.read() for p in dead]
        assert time.monotonic() < deadline, "the ranks never formed an epoch"
        time.sleep(0.05)


def adversarial(world, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    fmax = np.finfo(np.float32).max / 64
    for r in range(world):
        a = (rng.standard_normal(E * 9 + 37) * rng.choice([1e-3, 1, 1e3], E * 9 + 37)).astype(np.float32)
        a[:E] *= np.float32(1e30)
        a[E:2 * E] *= np.float32(1e-30)
        a[2 * E:2 * E + 4] = [1e-45, -1e-45, 2e-40, -0.0]
        a[3 * E:4 * E] = fmax  # every rank at the maximum
        a[4 * E:5 * E] = 0 if r % 2 else a[4 * E:5 * E]  # zero on some ranks
        a[5 * E:6 * E] = 0  # zero on every rank
        a[6 * E] = np.float32(1e25) * (-1) ** r
        out.append(a)
    return out


@pytest.mark.parametrize("kind,mode", [("xdp", "generic"), ("xdp", "native"), ("userspace", None)])
def test_float32_within_the_documented_bound_on_adversarial_inputs(make_testbed, tmp_path, kind, mode):
    arrays = adversarial(4)
    tb = make_testbed(4)
    ins, outs = save(tmp_path, arrays)
    res = run_job(tb, ins, outs, kind, timeout=15, **({"mode": mode} if mode else {}))
    want = reference.quantized(arrays, E)
    for r in range(4):
        check = want.check(np.load(outs[r]))
        assert check.within_bound, f"rank {r}: {check.reason}"
    assert np.array_equal(np.load(outs[0]), np.load(outs[3]))
    assert res.ranks[0]["stats"]["blocks_skipped"] == 1  # the block that is zero everywhere


def test_int32_exact_and_float64(make_testbed, tmp_path):
    rng = np.random.default_rng(3)
    ints = [rng.integers(-(2**31), 2**31 - 1, 5 * E + 3, dtype=np.int32) for _ in range(3)]
    f64 = [rng.standard_normal(4 * E + 1) * 1e100 for _ in range(3)]
    tb = make_testbed(3)
    ins, outs = save(tmp_path, ints, "i")
    run_job(tb, ins, outs, "xdp", timeout=15)
    check = reference.quantized(ints, E).check(np.load(outs[1]))  # the int64 sum, wrapped to int32
    assert check.within_bound and check.max_abs_err == 0, check.reason
    ins, outs = save(tmp_path, f64, "d")
    run_job(tb, ins, outs, "xdp", timeout=15)
    check = reference.quantized(f64, E).check(np.load(outs[2]))
    assert check.within_bound, check.reason


@pytest.mark.parametrize("mode", ["generic", "native"])
def test_loss_and_duplication_give_bit_identical_results(make_testbed, tmp_path, mode):
    """2% drop and 2% duplication on every link, both directions: the same bits as a clean run.
    Half of each rank's blocks are zero, so results also come back to ranks that did not
    contribute (pulls) and acknowledgements gate the reuse of sets."""
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(3000 * E).astype(np.float32) for _ in range(4)]
    for a in arrays:
        a.reshape(-1, E)[rng.random(3000) < 0.5] = 0
    tb = make_testbed(4)
    ins, clean_outs = save(tmp_path, arrays, "c")
    run_job(tb, ins, clean_outs, "xdp", timeout=20, mode=mode)
    tb.faults.configure(drop=0.02, dup=0.02, seed=7)
    lossy_outs = [tmp_path / f"lossy{r}.npy" for r in range(4)]
    res = run_job(tb, ins, lossy_outs, "xdp", timeout=20, mode=mode, reps=3)
    fs = tb.faults.stats()
    dropped = sum(v[d]["dropped"] for v in fs.values() for d in ("ingress", "egress"))
    dupped = sum(v[d]["duplicated"] for v in fs.values() for d in ("ingress", "egress"))
    assert dropped > 10 and dupped > 10, fs
    assert res.totals("retransmissions") + res.totals("pulls") > 0
    for r in range(4):
        assert np.array_equal(np.load(lossy_outs[r]), np.load(clean_outs[r])), f"rank {r} differs under loss"


def test_a_record_lost_on_the_way_in_is_resent_once_not_by_every_rank(make_testbed, tmp_path):
    """2% of the frames towards the aggregator dropped: every rank sees the rounds stall and probes
    them, and only the rank whose record is missing resends it, so the job resends about as many
    records as were lost (every rank resending its own would be 4 times as many); the sums stay
    exact."""
    rng = np.random.default_rng(11)
    arrays = [rng.integers(-1 << 20, 1 << 20, 3000 * E).astype(np.int32) for _ in range(4)]
    tb = make_testbed(4)
    tb.faults.configure("agg", drop=0.02, seed=5, directions=["egress"])
    ins, outs = save(tmp_path, arrays, "p")
    res = run_job(tb, ins, outs, "xdp", timeout=20, mode="generic", reps=2)
    want = np.sum(arrays, axis=0, dtype=np.int32)
    for r in range(4):
        assert np.array_equal(np.load(outs[r]), want), f"rank {r} differs"
    a = res.agg_stats
    st = [r["stats"] for r in res.ranks]
    # a resend of a record the aggregator holds is answered as such: a STATUS, or the stored result
    wasted = a["status_sent"] - a["probed"] + a["retx_answered"]
    resent = sum(s["retransmissions"] for s in st)
    assert a["probed"] > 0 and resent > 10 and wasted * 5 < resent, (wasted, resent, a)


def test_a_rank_that_never_joins_is_named_by_every_other_rank(make_testbed, tmp_path):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(50 * E).astype(np.float32) for _ in range(3)]
    tb = make_testbed(3)
    ins, outs = save(tmp_path, arrays)
    enable_gro(tb)
    t0 = time.monotonic()
    with AggregatorProcess(tb, "xdp"):
        with pytest.raises(TimeoutError_) as ei:  # classified by the ranks' exit codes
            run_workers(tb, ins, outs, timeout=2, ranks=[0, 1])
    took = time.monotonic() - t0
    msg = str(ei.value)
    assert "rank 0" in msg and "rank 1" in msg, msg
    # rank 2 never started, so the run never formed: both others name it at the join
    assert msg.count("no JOIN from rank(s) 2") == 2, msg
    assert took < 30


@pytest.mark.parametrize("mode", ["generic", "native"])
def test_a_rank_that_dies_mid_call_is_named_by_every_other_rank_within_the_timeout(make_testbed, tmp_path, mode):
    """Rank 2 joins and contributes, then is killed in the middle of a long job: the others'
    rounds stop completing; each names rank 2 (from the aggregator's STATUS answers) within its
    timeout instead of hanging."""
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(4 << 20).astype(np.float32) for _ in range(3)]
    tb = make_testbed(3)
    ins, outs = save(tmp_path, arrays)
    enable_gro(tb)
    with AggregatorProcess(tb, "xdp", mode=mode) as ap:
        procs = [tb.popen(w, CLI + ["worker", "--rank", str(w.rank), "--world", "3", "--aggregator", tb.agg.ip,
                                    "--group", tb.mcast_group, "--local-ip", w.ip, "--input", str(ins[w.rank]),
                                    "--timeout", "2", "--reps", "200"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in tb.workers]
        wait_for_epoch(ap, procs)
        time.sleep(1.0)  # in the middle of the repetitions
        assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs if p.poll() is not None]
        procs[2].kill()
        t0 = time.monotonic()
        errs = [p.communicate(timeout=30)[1] for p in procs[:2]]
        took = time.monotonic() - t0
    assert [p.returncode for p in procs[:2]] == [TimeoutError_.exit_code] * 2, errs
    for r, err in enumerate(errs):
        assert f"rank {r}: allreduce timed out" in err and "no contribution from rank(s) 2" in err, err
    assert took < 15


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_sparsity_each_rank_sends_only_its_own_nonzero_blocks(make_testbed, tmp_path, dtype):
    """OmniReduce's sparsity: a rank sends nothing for its own zero blocks; blocks zero on every
    rank cost nobody anything; the sum stays exact (int32) or within the bound (float32)."""
    rng = np.random.default_rng(6)
    nb = 400
    n = nb * E
    zero_all = rng.random(nb) < 0.3
    arrays = []
    for r in range(4):
        a = rng.integers(-1000, 1000, n).astype(dtype) if dtype == np.int32 else rng.standard_normal(n).astype(dtype)
        a[np.repeat(zero_all | (rng.random(nb) < 0.6), E)] = 0
        arrays.append(a)
    tb = make_testbed(4)
    ins, outs = save(tmp_path, arrays)
    res = run_job(tb, ins, outs, "xdp", timeout=15)
    check = reference.quantized(arrays, E).check(np.load(outs[0]))  # exact for int32
    assert check.within_bound, check.reason
    nonzero = np.stack([np.any(a.reshape(nb, E) != 0, axis=1) for a in arrays])
    meta = (1 if dtype == np.int32 else 2) * -(-nb // E)  # OR bitmaps (+ MAX exponents for floats)
    for rep, own in zip(res.ranks, nonzero):
        st = rep["stats"]
        assert st["blocks_skipped"] == int((~nonzero.any(axis=0)).sum())
        assert st["own_blocks"] == int(own.sum())
        sent = st["packets_sent"] - st["retransmissions"] - st["pulls"]
        assert sent == int(own.sum()) + meta, st  # nothing at all for its zero blocks


def test_allreduce_cli_and_its_input_errors(tmp_path):
    rng = np.random.default_rng(8)
    a, b = (rng.standard_normal((30, 50)).astype(np.float32) for _ in range(2))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    r = subprocess.run(CLI + ["allreduce", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "-o",
                              str(tmp_path / "s.npy"), "--json"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert {"workers", "elements", "dtype", "seconds", "aggregator", "packets_sent", "retransmissions"} <= set(rep)
    s = np.load(tmp_path / "s.npy")
    assert s.shape == a.shape and s.dtype == a.dtype
    assert np.abs(s.astype(np.float64) - (a.astype(np.float64) + b)).max() < 1e-5
    bad = a.copy()
    bad[3, 4] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    np.save(tmp_path / "short.npy", a[:10])
    np.save(tmp_path / "f64.npy", a.astype(np.float64))
    (tmp_path / "junk.npy").write_text("not numpy")
    for other, words in (("nan.npy", "NaN"), ("short.npy", "shape"), ("f64.npy", "dtype"),
                         ("junk.npy", "not a readable"), ("missing.npy", "no such file")):
        r = subprocess.run(CLI + ["allreduce", str(tmp_path / "a.npy"), str(tmp_path / other), "-o",
                                  str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (other, r.stderr)
        assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_same_job_run_twice_against_a_loaded_aggregator_gives_two_correct_sums(make_testbed, tmp_path):
    """The aggregator stays loaded between the runs and still holds the first run's completed
    rounds; the second run's processes start their rounds at 0 again."""
    tb = make_testbed(3)
    enable_gro(tb)
    rng = np.random.default_rng(9)
    with AggregatorProcess(tb, "xdp") as ap:
        for run in range(2):
            arrays = [rng.integers(-1000, 1000, 70_001, dtype=np.int32) for _ in range(3)]
            ins, outs = save(tmp_path, arrays, f"run{run}")
            run_workers(tb, ins, outs, timeout=10)
            want = np.sum(np.stack(arrays), axis=0, dtype=np.int32)
            for r in range(3):
                assert np.array_equal(np.load(outs[r]), want), f"run {run}, rank {r}: wrong sum"
        st = ap.stats()
    assert st["epoch_formed"] == 2 and st["retx_answered"] == 0


def test_a_worker_restarted_mid_job_fails_the_job_clearly(make_testbed, tmp_path):
    """Rank 2 is killed in the middle of a job and started again: its new process joins anew,
    which ends the running epoch; the old ranks fail naming the cause, and nothing writes a
    stale or mixed result."""
    tb = make_testbed(3)
    enable_gro(tb)
    rng = np.random.default_rng(10)
    arrays = [rng.standard_normal(4 << 20).astype(np.float32) for _ in range(3)]
    ins, outs = save(tmp_path, arrays)

    def start(w, reps):
        argv = CLI + ["worker", "--rank", str(w.rank), "--world", "3", "--aggregator", tb.agg.ip, "--group",
                      tb.mcast_group, "--local-ip", w.ip, "--input", str(ins[w.rank]), "--output",
                      str(outs[w.rank]), "--timeout", "3", "--reps", str(reps)]
        return tb.popen(w, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    with AggregatorProcess(tb, "xdp") as ap:
        procs = [start(w, 200) for w in tb.workers]
        wait_for_epoch(ap, procs)
        time.sleep(1.0)  # in the middle of its repetitions
        assert procs[2].poll() is None
        procs[2].kill()
        procs[2].wait()
        again = start(tb.workers[2], 1)
        results = [p.communicate(timeout=60) for p in (procs[0], procs[1], again)]
    codes = [procs[0].returncode, procs[1].returncode, again.returncode]
    assert codes == [ProtocolError.exit_code] * 2 + [TimeoutError_.exit_code], (codes, [e for _, e in results])
    for _, err in results[:2]:
        assert "another run of the job has started" in err, err
    assert "no JOIN from rank(s) 0, 1" in results[2][1], results[2][1]
    for r in range(3):
        assert not outs[r].exists(), f"rank {r} wrote a result"


@pytest.mark.parametrize("kind", ["xdp", "afxdp", "userspace"])
def test_ranks_given_different_shapes_fail_at_once_saying_so(make_testbed, tmp_path, kind):
    """Rank 1 holds 9,000 floats, the others 5,000: the round of their last block disagrees (its
    count). The aggregator answers STATUS MISMATCH to that record and to every later one of the
    round, so every rank fails within the call with a ProtocolError saying the tensors differ,
    long before the 30 s progress timeout that used to blame a silent rank."""
    tb = make_testbed(3)
    enable_gro(tb)
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal(9000 if r == 1 else 5000).astype(np.float32) for r in range(3)]
    ins, outs = save(tmp_path, xs)
    with AggregatorProcess(tb, kind) as ap:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            run_workers(tb, ins, outs, timeout=30.0)
        took = time.monotonic() - t0
        st = ap.stats()
    msg = str(e.value)
    for r in range(3):
        assert f"rank {r}: the ranks disagree on the round of block 19" in msg, msg
    assert msg.count("not given tensors of the same shape and dtype") == 3, msg
    assert took < 25, took  # process start-up included; the progress timeout alone is 30 s
    assert not any(p.exists() for p in outs)
    if kind == "xdp":
        assert st["mismatch"] >= 1, st
