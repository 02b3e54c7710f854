"""The ring offload end to end on the testbed: ``nicoffload worker --mode ring`` processes around
ring programs on every worker (N = 2, 3, 4): int32 exact, floats within the documented bound and
bit for bit what the aggregator mode gives; the user-space UDP ring; bit-identical results under
2% loss and 2% duplication on every link; a node that is gone or never entered the call named by
the others' timeouts; a communicator that loads its own ring program; the CLI; nothing left
behind."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from e2ekit import CLI, save

from nicoffload.ebpf import loader as bpf
from nicoffload.errors import TimeoutError_
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job, run_workers
from nicoffload.lab.links import enable_gro
from nicoffload.lab.rings import RingPrograms, run_ring_job
from nicoffload.ring import node as ring
from nicoffload.wire import proto

E = proto.DEFAULT_ELEMS


def ints(world, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(world)]


def floats(world, n, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(world):
        a = (rng.standard_normal(n) * rng.choice([1e-3, 1, 1e3], n)).astype(dtype)
        a[:E] *= 1e30 if dtype == np.float32 else 1e200
        a[2 * E:3 * E] = 0  # a block zero everywhere
        out.append(a)
    return out


def results(outs):
    return [np.load(p) for p in outs]


def nothing_left(tb) -> None:
    """No ring program, pin or state file of this testbed's workers."""
    for w in tb.workers:
        assert bpf.xdp_prog_id(w.iface, w.netns) is None, w.name
        assert not ring.pin_dir(w.netns, w.iface).exists()
        assert not ring.state_file(w.netns, w.iface).exists()
        assert not ring.state_file(w.netns, w.iface).with_suffix(".lock").exists()
    assert not [ns for ns, _ in ring.loaded() if ns and ns.startswith(f"nco-{tb.name}-")]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_offload_is_exact_for_int32_and_within_the_bound_for_floats(make_testbed, tmp_path, world):
    tb = make_testbed(world)
    xi = ints(world, 7 * E + 5, seed=world)
    ins, outs = save(tmp_path, xi, "i")
    res = run_ring_job(tb, ins, outs, "xdp", timeout=10)
    want = reference.quantized(xi, E)
    for y in results(outs):
        assert want.check(y).within_bound and np.array_equal(y, results(outs)[0])
    # the programs did the hops (every node stored every record; none was malformed on the way)
    st = res.agg_stats
    assert st["final"] + st["gathered"] + sum(r["stats"]["taken_over"] for r in res.ranks) >= world * 8
    assert st["final"] > 0 and not sum(v for k, v in st.items() if k.startswith("bad_"))
    dtype = np.float64 if world == 3 else np.float32
    xf = floats(world, 5 * E + 3, dtype, seed=world)
    ins, outs = save(tmp_path, xf, "f")
    run_ring_job(tb, ins, outs, "xdp", timeout=10)
    want = reference.quantized(xf, E)
    ys = results(outs)
    for y in ys:
        check = want.check(y)
        assert check.within_bound, check.reason
        assert np.array_equal(y.view(np.uint8), ys[0].view(np.uint8))
    if world == 2:  # the same quantization as the aggregator mode: integer sums do not depend on their order
        agg_outs = [tmp_path / f"agg{r}.npy" for r in range(world)]
        run_job(tb, ins, agg_outs, "xdp", timeout=10)
        assert np.array_equal(results(agg_outs)[0].view(np.uint8), ys[0].view(np.uint8))
    nothing_left(tb)


def test_user_space_ring_over_the_same_protocol(make_testbed, tmp_path):
    tb = make_testbed(3)
    xi = ints(3, 9 * E + 1, seed=5)
    ins, outs = save(tmp_path, xi)
    res = run_ring_job(tb, ins, outs, "userspace", timeout=10, reps=2)
    want = reference.quantized(xi, E)
    for y in results(outs):
        assert want.check(y).within_bound
    assert all(r["stats"]["taken_over"] > 0 for r in res.ranks)  # every hop in user space
    # and its own rank program (python -m nicoffload.lab.bench.udpring), next to the TCP ring's
    peers = ",".join(w.ip for w in tb.workers)
    procs = [tb.popen(w, [sys.executable, "-m", "nicoffload.lab.bench.udpring", "--rank", str(w.rank), "--world", "3",
                          "--peers", peers, "--port", str(tb.port), "--input", str(ins[w.rank]), "--output",
                          str(outs[w.rank]), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in tb.workers]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out)["elements"] == xi[0].size
    for y in results(outs):
        assert want.check(y).within_bound
    nothing_left(tb)


def test_bit_identical_under_loss_and_duplication_on_every_link(make_testbed, tmp_path):
    tb = make_testbed(3)
    xf = floats(3, 300 * E + 7, seed=9)
    ins, clean = save(tmp_path, xf, "c")
    run_ring_job(tb, ins, clean, "xdp", timeout=10)
    tb.faults.configure(None, drop=0.02, dup=0.02, seed=11)
    _, lossy = save(tmp_path, xf, "l")
    res = run_ring_job(tb, ins, lossy, "xdp", timeout=20, reps=3)
    fs = tb.faults.stats()
    assert sum(s[d]["dropped"] for s in fs.values() for d in s) > 0
    assert sum(s[d]["duplicated"] for s in fs.values() for d in s) > 0
    for a, b in zip(results(clean), results(lossy)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert res.totals("retransmissions") > 0 or res.agg_stats["dup"] > 0
    xi = ints(3, 100 * E, seed=10)
    ins, outs = save(tmp_path, xi, "i")
    run_ring_job(tb, ins, outs, "xdp", timeout=20, reps=2)
    want = reference.quantized(xi, E)
    for y in results(outs):
        assert want.check(y).within_bound
    tb.faults.remove()
    nothing_left(tb)


def test_a_node_that_stalls_the_ring_is_named(make_testbed, tmp_path):
    tb = make_testbed(3)
    enable_gro(tb)
    ins, outs = save(tmp_path, ints(3, 4 * E))
    spec = ring_spec(tb).replace(timeout=2.0)
    with RingPrograms(tb, spec):
        # rank 2's process never comes (killed before the call): its program answers, in call 0
        with pytest.raises(TimeoutError_) as e:
            run_workers(tb, ins, outs, spec, ranks=[0, 1])
        msg = str(e.value)
        assert "rank 0:" in msg and "rank 1:" in msg and "rank(s) 2 (in call 0) never entered call 1" in msg
        # and with its ring program gone too, nothing answers for it
        w2 = tb.workers[2]
        ring.unload(w2.netns, w2.iface)
        with pytest.raises(TimeoutError_) as e:
            run_workers(tb, ins, outs, spec, ranks=[0, 1])
        assert f"no answer from rank(s) 2 ({w2.ip})" in str(e.value)
    nothing_left(tb)


def ring_spec(tb):
    from nicoffload.jobspec import DEFAULT

    return DEFAULT.replace(port=tb.port, group=tb.mcast_group, mode="ring")


def test_a_worker_loads_its_own_ring_program_and_leaves_nothing(make_testbed, tmp_path):
    tb = make_testbed(2)
    enable_gro(tb)
    xi = ints(2, 3 * E + 2, seed=2)
    ins, outs = save(tmp_path, xi)
    run_workers(tb, ins, outs, ring_spec(tb), capacity=8)  # no ring load: each worker loads its own
    want = reference.quantized(xi, E)
    for y in results(outs):
        assert want.check(y).within_bound
    nothing_left(tb)


def test_ring_cli_load_status_stats_unload_and_testbed_clean(make_testbed, tmp_path):
    tb = make_testbed(2)
    peers = ",".join(w.ip for w in tb.workers)

    def cli(*args, check=True):
        r = subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120)
        assert not check or r.returncode == 0, r.stderr
        return r

    for w in tb.workers:
        cli("ring", "load", "--netns", w.netns, "--iface", w.iface, "--rank", str(w.rank), "--peers", peers,
            "--port", str(tb.port), "--capacity", "64")
    w0 = tb.workers[0]
    again = cli("ring", "load", "--netns", w0.netns, "--iface", w0.iface, "--rank", "0", "--peers", peers, check=False)
    assert again.returncode == 6 and "ring unload" in again.stderr
    st = json.loads(cli("ring", "status", "--netns", w0.netns, "--iface", w0.iface, "--json").stdout)
    assert st["attached"] and st["rank"] == 0 and st["world"] == 2 and st["capacity"] == 64 and st["mode"] == "generic"
    ins, outs = save(tmp_path, ints(2, 5 * E))
    run_workers(tb, ins, outs, ring_spec(tb))
    # a node whose host stages after its peer's records arrive parks them (its host adds them),
    # so on a loaded machine one node's program may have reduced nothing; the node that staged
    # first reduced its peer's records in XDP, and together the two did the call's work
    both = [json.loads(cli("ring", "stats", "--netns", w.netns, "--iface", w.iface, "--json").stdout)
            for w in tb.workers]
    assert sum(s["reduced"] + s["final"] for s in both) > 0 and sum(s["gathered"] for s in both) > 0, both
    assert "call 2" in cli("ring", "status", "--netns", w0.netns, "--iface", w0.iface).stdout
    cli("ring", "unload", "--netns", w0.netns, "--iface", w0.iface)
    gone = cli("ring", "status", "--netns", w0.netns, "--iface", w0.iface, check=False)
    assert gone.returncode == 5
    # testbed clean takes the other node's ring program with the testbed
    out = json.loads(cli("testbed", "clean", "--name-prefix", tb.name, "--json").stdout)
    assert any("ring program" in r for r in out["removed"])
    assert not ring.state_file(tb.workers[1].netns, tb.workers[1].iface).exists()
    assert not [ns for ns, _ in ring.loaded() if ns and ns.startswith(f"nco-{tb.name}-")]


HOLDER = """
import sys, time
from nicoffload.jobspec import JobSpec
from nicoffload.ring.comm import RingCommunicator
c = RingCommunicator.from_spec(0, 2, sys.argv[2].split(","), JobSpec.from_dict(__import__("json").loads(sys.argv[1])))
print("holding", flush=True)
time.sleep(120)
"""


def test_one_communicator_per_node_and_a_rerun_after_a_kill_is_exact(make_testbed, tmp_path):
    """A second process on a ring node would stage into the same mapped records as the first and
    mix their tensors silently: it is refused, naming the first; once that one is killed (-9,
    no cleanup) the next run of the job is exact and the node's lock goes with the program."""
    tb = make_testbed(2)
    enable_gro(tb)
    xi = ints(2, 5 * E + 1, seed=9)
    ins, outs = save(tmp_path, xi)
    spec = ring_spec(tb).replace(timeout=3.0)
    peers = ",".join(w.ip for w in tb.workers)
    with RingPrograms(tb, spec):
        holder = tb.popen(tb.workers[0], [sys.executable, "-c", HOLDER, json.dumps(spec.to_dict()), peers],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
            with pytest.raises(Exception) as e:
                run_workers(tb, ins, outs, spec)
            assert "rank 0:" in str(e.value) and "in use by another communicator (pid" in str(e.value), str(e.value)
        finally:
            holder.kill()
            holder.wait()
        run_workers(tb, ins, outs, spec)
        want = np.sum(np.stack(xi).astype(np.int64), axis=0).astype(np.int32)  # wraps like the ring
        for y in results(outs):
            assert np.array_equal(y, want)
    nothing_left(tb)


def test_ranks_given_different_shapes_fail_naming_the_disagreement(make_testbed, tmp_path):
    """Rank 1 holds 12 elements, the others 10: its record and theirs never add up. The nodes
    that refuse a record as mismatched fail at once with a ProtocolError saying so (not a wait
    for the timeout that would blame losses); no rank returns a sum."""
    tb = make_testbed(3)
    enable_gro(tb)
    xs = [np.arange(12 if r == 1 else 10, dtype=np.int32) for r in range(3)]
    ins, outs = save(tmp_path, xs)
    with RingPrograms(tb, ring_spec(tb)):
        with pytest.raises(Exception) as e:
            run_workers(tb, ins, outs, ring_spec(tb).replace(timeout=3.0))
    msg = str(e.value)
    assert "rank 1: in call" in msg and "disagree with this rank's own" in msg, msg
    assert "not given tensors of the same shape and dtype" in msg
    assert not any(p.exists() for p in outs)
    nothing_left(tb)
