"""Several jobs on one XDP aggregator, end to end: jobs on their own hosts run at once and are
exact, a job's results reach only its own hosts (the testbed bridge snoops IGMP), and two jobs
whose ranks share hosts stay apart through their own groups and local ports."""
from __future__ import annotations

import json
import threading

import numpy as np

from nicoffload.agg.control import Aggregator, AggSpec
from nicoffload.wire import keys
from nicoffload.worker.comm import Communicator


def rx_packets(tb, host) -> int:
    out = tb.run(host, ["ip", "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]["stats64"]["rx"]["packets"]


def run_jobs(tb, jobs: list[dict], inputs: dict) -> dict:
    """Run every job's ranks at once (a thread per rank, its socket in its host's namespace);
    returns {(job, rank): output}. ``jobs``: dicts of job, group, hosts, local_port."""
    comms, outs, errors = {}, {}, []
    for j in jobs:
        for r, h in enumerate(j["hosts"]):
            with tb.in_host(h):
                comms[j["job"], r] = Communicator(r, len(j["hosts"]), tb.agg.ip, group=j["group"],
                                                  local_ip=tb.host(h).ip, job=j["job"], slots=j["slots"],
                                                  local_port=j.get("local_port"), timeout=20, key=j.get("key", 0))

    def go(key):
        try:
            outs[key] = comms[key].allreduce(inputs[key])
        except BaseException as e:  # reported below, naming the rank
            errors.append((key, e))

    threads = [threading.Thread(target=go, args=(k,)) for k in comms]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for c in comms.values():
            c.close()
    assert not errors, errors
    return outs


def inputs_for(jobs, n, seed):
    rng = np.random.default_rng(seed)
    return {(j["job"], r): rng.standard_normal(n).astype(np.float32) for j in jobs for r in range(len(j["hosts"]))}


def check(jobs, inputs, outs):
    for j in jobs:
        ranks = range(len(j["hosts"]))
        want = np.sum([inputs[j["job"], r].astype(np.float64) for r in ranks], axis=0)
        for r in ranks:
            assert np.allclose(outs[j["job"], r], want, atol=1e-4), (j["job"], r)


def test_jobs_on_their_own_hosts_run_at_once_exact_and_apart(make_testbed):
    tb = make_testbed(4)
    w = [h.name for h in tb.workers]
    jobs = [dict(job=1, group=tb.topology.group_of(1), hosts=w[:2], slots=256),
            dict(job=2, group=tb.topology.group_of(2), hosts=w[2:], slots=256)]
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=512)) as agg:
        for j in jobs:
            agg.add_job(j["job"], 2, j["group"], [tb.host(h).ip for h in j["hosts"]], slots=j["slots"])
        ins = inputs_for(jobs, 300_000, seed=1)
        check(jobs, ins, run_jobs(tb, jobs, ins))
        for j in jobs:
            st = agg.stats(j["job"])
            assert st["completed"] > 0 and st["aggregated"] == 2 * st["completed"], st
            assert st["bad_src"] == 0 and st["bad_slot"] == 0
        # job 1 alone: its results reach w0 and w1 only
        before = [rx_packets(tb, h) for h in w]
        ins1 = inputs_for(jobs[:1], 300_000, seed=2)
        check(jobs[:1], ins1, run_jobs(tb, jobs[:1], ins1))
        got = [rx_packets(tb, h) - b for h, b in zip(w, before)]
        assert min(got[:2]) > 20 and max(got[2:]) <= 2, f"packets received per worker: {got}"


def test_two_jobs_sharing_hosts_stay_apart(make_testbed):
    tb = make_testbed(2)
    w = [h.name for h in tb.workers]
    jobs = [dict(job=7, group=tb.topology.group_of(7), hosts=w, slots=128, local_port=5007, key=keys.new_key()),
            dict(job=8, group=tb.topology.group_of(8), hosts=w, slots=128, local_port=5008, key=keys.new_key())]
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=256)) as agg:
        for j in jobs:  # each with its own key
            agg.add_job(j["job"], 2, j["group"], [tb.host(h).ip for h in j["hosts"]], slots=j["slots"], key=j["key"])
        for seed in (3, 4):  # twice: a second run of both jobs is exact too
            ins = inputs_for(jobs, 200_000, seed=seed)
            check(jobs, ins, run_jobs(tb, jobs, ins))
        assert agg.stats(7)["epoch_formed"] == agg.stats(8)["epoch_formed"] == 2
        assert agg.stats(7)["bad_key"] == agg.stats(8)["bad_key"] == 0


def test_the_job_commands(make_testbed):
    import subprocess
    import sys

    from nicoffload.agg.control import state_file, unload

    cli = [sys.executable, "-m", "nicoffload.cli"]
    tb = make_testbed(3)
    a, w = tb.agg, tb.workers
    where = ["--netns", a.netns, "--iface", a.iface]

    def run(*argv):
        return subprocess.run(cli + ["agg", *argv, *where], capture_output=True, text=True, timeout=120)

    try:
        r = run("load", "--slots", "256")
        assert r.returncode == 0 and "no job yet" in r.stdout, r.stderr
        r = run("job", "add", "--job", "3", "--workers", "2", "--slots", "200", "--group", tb.topology.group_of(3),
                "--worker-ip", w[0].ip, "--worker-ip", w[1].ip)
        assert r.returncode == 0 and "slots 0..199" in r.stdout, r.stderr
        r = run("job", "add", "--job", "4", "--workers", "1", "--slots", "100", "--group", tb.topology.group_of(4))
        assert r.returncode == 10 and "largest free range of the pool holds 56" in r.stderr, (r.returncode, r.stderr)
        r = run("job", "add", "--job", "4", "--workers", "1", "--group", tb.topology.group_of(4),
                "--worker-ip", w[2].ip, "--json")
        added = json.loads(r.stdout)
        assert r.returncode == 0 and added["slot_count"] == 56, r.stderr
        # a job runs through the registered entry (another process, as users run them), with the key
        # `job add` drew for it and printed
        key = keys.parse(added["key"])
        ins = {(4, 0): np.arange(1000, dtype=np.float32)}
        check([dict(job=4, hosts=[w[2].name])], ins,
              run_jobs(tb, [dict(job=4, group=tb.topology.group_of(4), hosts=[w[2].name], slots=56, key=key)], ins))
        r = run("job", "list", "--json")
        jobs = {j["job"]: j for j in json.loads(r.stdout)["jobs"]}
        assert set(jobs) == {3, 4} and jobs[4]["stats"]["completed"] > 0 and jobs[3]["stats"]["rx"] == 0
        r = run("job", "remove", "--job", "3")
        assert r.returncode == 0 and "slots 0..199 are free" in r.stdout
        r = run("stats", "--job", "3")
        assert r.returncode == 5 and "not registered" in r.stderr
        r = run("job", "list")
        assert r.returncode == 0 and "free slots: 200 of 256" in r.stdout, r.stdout
    finally:
        unload(a.netns, a.iface, missing_ok=True)
    assert not state_file(a.netns, a.iface).exists()


def test_the_tenants_benchmark_runs_jobs_at_once_and_checks_them():
    from nicoffload.lab import tenants

    lines = []
    rows = tenants.run([1, 2], workers=2, nbytes=256 << 10, reps=3, progress=lines.append)
    assert [r.jobs for r in rows] == [1, 2] and all(r.exact for r in rows)
    assert len(rows[1].seconds) == 2 and rows[1].aggregate_gbps > 0
    assert "x one job alone" in lines[1]
