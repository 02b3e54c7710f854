"""The XDP aggregator end to end on the namespace testbed: real traffic from 4 worker
namespaces on both CPUs, results checked byte-exact against numpy, counters that add up, and
load/unload semantics (nothing left attached or pinned)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nicoffload.agg.control import Aggregator, AggSpec, pin_dir, state_file, unload
from nicoffload.ebpf import loader as bpf
from nicoffload.lab.aggregators import AggregatorProcess
from nicoffload.lab.jobs import run_workers
from nicoffload.lab.links import enable_gro
from nicoffload.ring.node import unload as ring_unload
from nicoffload.wire import keys, proto

CLI = [sys.executable, "-m", "nicoffload.cli"]


@pytest.mark.parametrize("mode", ["generic", "native"])
def test_more_than_10000_completions_exact_on_both_cpus(make_testbed, tmp_path, mode):
    n, E = 4, proto.DEFAULT_ELEMS
    blocks = 10_240
    rng = np.random.default_rng(42)
    arrays = [rng.integers(-(2**31), 2**31 - 1, size=blocks * E - 7, dtype=np.int32) for _ in range(n)]
    ins, outs = [], []
    for r, a in enumerate(arrays):
        ins.append(tmp_path / f"in{r}.npy")
        outs.append(tmp_path / f"out{r}.npy")
        np.save(ins[-1], a)
    tb = make_testbed(n)
    enable_gro(tb)
    with AggregatorProcess(tb, "xdp", mode=mode) as ap:
        assert ap.agg.spec.mode == mode
        reports = run_workers(tb, ins, outs, sparse=False, timeout=20, pin_cpus=True)
        st = ap.stats()
    with np.errstate(over="ignore"):
        want = np.sum(np.stack(arrays), axis=0, dtype=np.int32)  # wraps like the aggregator
    for r in range(n):
        assert np.array_equal(np.load(outs[r]), want), f"rank {r}'s sum differs from numpy"
    # each worker ran a barrier (1 round) and the tensor (10240 rounds) and got every result
    rounds = blocks + 1
    for rep in reports:
        assert rep["stats"]["results"] == blocks
    assert st["completed"] == rounds
    if mode == "native":  # one result frame per round, + the JOINED
        assert st["result_sent"] == rounds + 1 and st["rx"] == st["records"]
    else:  # a frame carries up to 61 results: a batch from the last contributor completes them all
        assert st["result_sent"] < rounds // 8 and st["rx"] < st["records"] // 8, st
    assert st["epoch_formed"] == 1 and st["join"] >= n
    assert st["aggregated"] == n * rounds, "every rank's contribution added exactly once"
    outcomes = ["aggregated", "retx_answered", "pull_answered", "status_sent", "dup_dropped", "join", "ack",
                "stale_epoch", "stale_round", "stale_join", "early", "mismatch"]
    handled = sum(st[k] for k in outcomes) + sum(v for k, v in st.items() if k.startswith("bad_"))
    assert st["records"] == handled, f"counters do not add up: {st}"
    # every rank: its JOINs, the barrier's round, the tensor's rounds (+ their retransmissions)
    sent = sum(rep["stats"]["packets_sent"] for rep in reports) + n
    assert n * rounds <= st["records"] - st["join"] <= sent


def test_load_status_unload_leave_nothing(make_testbed):
    tb = make_testbed(2)
    a = tb.agg
    spec = AggSpec(a.netns, a.iface, 2, slots=64, group=tb.mcast_group, worker_ips=[w.ip for w in tb.workers])
    with Aggregator.load(spec) as agg:
        assert bpf.xdp_prog_id(a.iface, a.netns) == agg.spec.prog_id
        assert (pin_dir(a.netns, a.iface) / "ar_slots").exists()
        other = Aggregator.open(a.netns, a.iface)  # what a later process sees
        assert other.status()["attached"] and other.config()["workers"] == 2
        other.b.cleanup()
    assert bpf.xdp_prog_id(a.iface, a.netns) is None
    assert not pin_dir(a.netns, a.iface).exists() and not state_file(a.netns, a.iface).exists()
    assert unload(a.netns, a.iface, missing_ok=True) is False  # unloading twice is harmless


def cli(*args, **kw):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=120, **kw)


def test_cli_load_outlives_the_process_and_errors_are_one_line(make_testbed):
    tb = make_testbed(2)
    ns, ifc = tb.agg.netns, tb.agg.iface
    try:
        r = cli("agg", "load", "--netns", ns, "--iface", ifc, "--workers", "2", "--slots", "16", "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        # the CLI process is gone; the program stays attached and its maps pinned
        assert bpf.xdp_prog_id(ifc, ns) == st["prog_id"]
        assert keys.parse(st["key"])  # the job's key, drawn for it and printed once
        r = cli("agg", "status", "--netns", ns, "--iface", ifc, "--json")
        status = json.loads(r.stdout)
        assert r.returncode == 0 and status["attached"] is True
        assert status["jobs"][0]["keyed"] and st["key"] not in r.stdout  # listings never show a key
        r = cli("agg", "slots", "--netns", ns, "--iface", ifc, "--slot", "3", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)[0]["slot"] == 3
        r = cli("agg", "stats", "--netns", ns, "--iface", ifc, "--json")
        assert r.returncode == 0 and set(json.loads(r.stdout)) == set(proto.STATS)
        # a second load on a loaded interface
        r = cli("agg", "load", "--netns", ns, "--iface", ifc, "--workers", "2")
        assert r.returncode == 6 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        r = cli("agg", "unload", "--netns", ns, "--iface", ifc)
        assert r.returncode == 0
        assert bpf.xdp_prog_id(ifc, ns) is None and not pin_dir(ns, ifc).exists()
        # unloading what is not loaded, unknown interface, unknown namespace
        for args, code in ((("--netns", ns, "--iface", ifc), 5), (("--netns", ns, "--iface", "nope0"), 5),
                           (("--netns", "nco-no-such-ns", "--iface", ifc), 5)):
            r = cli("agg", "unload", *args)
            assert r.returncode == code, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
        r = cli("agg", "load", "--netns", "nco-no-such-ns", "--iface", "eth0", "--workers", "2")
        assert r.returncode == 5 and "does not exist" in r.stderr
        # another program on the interface (a ring node) is not the aggregator's to remove
        r = cli("ring", "load", "--netns", ns, "--iface", ifc, "--rank", "0", "--peers",
                f"{tb.agg.ip},{tb.workers[0].ip}")
        assert r.returncode == 0, r.stderr
        ring_prog = bpf.xdp_prog_id(ifc, ns)
        r = cli("agg", "unload", "--netns", ns, "--iface", ifc)
        assert r.returncode == 5 and "left attached" in r.stderr, r.stderr
        assert bpf.xdp_prog_id(ifc, ns) == ring_prog
        assert cli("ring", "unload", "--netns", ns, "--iface", ifc).returncode == 0
        assert bpf.xdp_prog_id(ifc, ns) is None
    finally:
        unload(ns, ifc, missing_ok=True)
        ring_unload(ns, ifc, missing_ok=True)


def test_killed_cli_leaves_state_that_testbed_down_removes(make_testbed, uid):
    tb = make_testbed(2, suffix="k")
    ns, ifc = tb.agg.netns, tb.agg.iface
    p = subprocess.Popen(CLI + ["agg", "load", "--netns", ns, "--iface", ifc, "--workers", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.communicate(timeout=120)
    p = subprocess.Popen(CLI + ["agg", "stats", "--netns", ns, "--iface", ifc, "--watch", "0.2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    import time
    time.sleep(3)
    p.kill()  # killed mid-watch
    p.communicate()
    assert pin_dir(ns, ifc).exists()
    # `testbed clean` does the same for every testbed; `down` keeps this test from touching others
    r = subprocess.run(CLI + ["testbed", "down", tb.name], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not Path(f"/run/netns/{ns}").exists()
    assert not pin_dir(ns, ifc).exists(), "testbed down left the aggregator's pins"
    assert not state_file(ns, ifc).exists(), "testbed down left the aggregator's state file"
