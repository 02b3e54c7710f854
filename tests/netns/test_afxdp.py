"""The AF_XDP aggregator engine end to end (issue 21): exact int32 and float32 within the bound,
bit-identical results under 2% drop and 2% duplication, hostile traffic counted frame by frame,
a job the XDP pool refuses served by the engine beside it (agg job add --fallback afxdp), and
nothing left behind: no XDP program, no AF_XDP socket, no engine process, even after SIGKILL."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import subprocess
import time
from collections import Counter

import numpy as np
import pytest
from e2ekit import CLI, run_ranks, save
from test_worker_e2e import adversarial

from nicoffload.afxdp.engine import AfxdpEngine
from nicoffload.agg.control import Aggregator, AggSpec
from nicoffload.ebpf import loader as bpf
from nicoffload.errors import InputError
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job
from nicoffload.packets import attacks
from nicoffload.wire import keys, proto
from nicoffload.worker.comm import Communicator

E = proto.DEFAULT_ELEMS


_libc = ctypes.CDLL(None, use_errno=True)
AF_XDP, SOL_SOCKET, SO_DOMAIN = 44, 1, 39


def xsk_fds() -> int:
    """AF_XDP sockets among this process's open files."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                dom, size = ctypes.c_int(0), ctypes.c_uint32(4)
                if _libc.getsockopt(int(fd), SOL_SOCKET, SO_DOMAIN, ctypes.byref(dom), ctypes.byref(size)) == 0:
                    n += dom.value == AF_XDP
    return n


def engine_procs() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "nicoffload.cli aggregator-afxdp"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize("tx", ["socket", "xsk"])
def test_exact_within_bound_and_bit_identical_under_loss(make_testbed, tmp_path, tx):
    """Results leaving through a UDP socket (a batch per UDP_SEGMENT send, the default in copy
    mode) or built by the engine on the AF_XDP tx ring."""
    tb = make_testbed(4)
    rng = np.random.default_rng(21)
    ints = [rng.integers(-(2**31), 2**31 - 1, 40 * E + 3, dtype=np.int32) for _ in range(4)]
    ins, outs = save(tmp_path, ints, "i")
    eng = {"tx": tx}
    res = run_job(tb, ins, outs, "afxdp", timeout=20, engine=eng)
    assert res.mode == "afxdp" and res.engine["tx"] == tx and res.engine["copy_mode"]
    c = res.engine["counters"]
    assert (c["tx_sends"] if tx == "socket" else c["tx_frames"]) > 0 and c["tx_sends" if tx == "xsk" else "tx_frames"] == 0
    check = reference.quantized(ints, E).check(np.load(outs[2]))  # the int64 sum, wrapped to int32
    assert check.within_bound and check.max_abs_err == 0, check.reason
    st = res.agg_stats
    assert st["completed"] > 0 and st["aggregated"] == 4 * st["completed"] and not any(
        v for k, v in st.items() if k.startswith("bad_")), st

    floats = adversarial(4)
    ins, outs = save(tmp_path, floats, "f")
    run_job(tb, ins, outs, "afxdp", timeout=20, engine=eng)
    want = reference.quantized(floats, E)
    for r in range(4):
        check = want.check(np.load(outs[r]))
        assert check.within_bound, f"rank {r}: {check.reason}"

    # half the blocks zero: results also reach ranks that did not contribute (pulls)
    sparse = [rng.standard_normal(2000 * E).astype(np.float32) for _ in range(4)]
    for a in sparse:
        a.reshape(-1, E)[rng.random(2000) < 0.5] = 0
    ins, clean = save(tmp_path, sparse, "c")
    once = run_job(tb, ins, clean, "afxdp", timeout=20, engine=eng).agg_stats["aggregated"]
    tb.faults.configure(drop=0.02, dup=0.02, seed=11)
    lossy = [tmp_path / f"lossy{r}.npy" for r in range(4)]
    res = run_job(tb, ins, lossy, "afxdp", timeout=20, reps=2, engine=eng)
    fs = tb.faults.stats()
    assert sum(v[d]["dropped"] for v in fs.values() for d in ("ingress", "egress")) > 10, fs
    assert sum(v[d]["duplicated"] for v in fs.values() for d in ("ingress", "egress")) > 10, fs
    st = res.agg_stats
    # recovery ran (the drops are certain) and each record was aggregated once. How many
    # duplicates reach the engine as plain contributions (dup_dropped) varies from run to run: a
    # duplicated RETX, PULL or ACK is answered or taken again instead
    assert st["retx_answered"] + st["pull_answered"] + st["status_sent"] > 0, st
    assert st["aggregated"] == 2 * once, (st, once)  # each contribution taken exactly once per rep
    for r in range(4):
        assert np.array_equal(np.load(lossy[r]), np.load(clean[r])), f"rank {r} differs under loss"
    # the engine process is gone, and with it its program and sockets
    assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is None
    assert not engine_procs()


def test_unicast_delivery_on_a_fabric_without_multicast_and_two_queues(make_testbed, tmp_path):
    """No multicast on the fabric: a copy of each result to every rank (through the registered next
    hops); two rx queues: a socket and a UMEM on each, the steering program picking by queue."""
    tb = make_testbed(3, multicast=False, queues=2)
    rng = np.random.default_rng(23)
    ints = [rng.integers(-(2**31), 2**31 - 1, 60 * E + 1, dtype=np.int32) for _ in range(3)]
    ins, outs = save(tmp_path, ints)
    res = run_job(tb, ins, outs, "afxdp", timeout=20, delivery="unicast")
    assert res.engine["queues"] == 2
    want = reference.quantized(ints, E)
    for r in range(3):
        check = want.check(np.load(outs[r]))
        assert check.within_bound and check.max_abs_err == 0, check.reason
    st = res.agg_stats
    assert st["copies"] > 0 and st["copies"] % 3 == 0, st  # every batch of results: a copy to each rank


W, JOB, SLOTS = 2, 3, 64
MTU = 20 + 8 + 2 * proto.record_size(E)  # the largest hostile frame: a batch of two records


def test_hostile_frames_are_counted_one_by_one_and_the_job_stays_exact(make_testbed):
    """Every distinct frame of the hostile-traffic attack (packets/attacks.py), sent one at a time
    from a host in no job during a live job: each is counted once, by the reason the XDP
    aggregator gives it, in its row (the job's or no job's); foreign frames never reach the
    engine; the job's epoch and results are untouched."""
    tb = make_testbed(W + 1, mtu=MTU)
    ranks, attacker = tb.workers[:W], tb.workers[W]
    group = tb.topology.group_of(JOB)
    rng = np.random.default_rng(5)
    xs = [rng.integers(-(2**20), 2**20, 50 * E).astype(np.int32) for _ in range(W)]
    sockets = xsk_fds()
    with contextlib.ExitStack() as stack:
        eng = stack.enter_context(AfxdpEngine(port=tb.port, netns=tb.agg.netns, local_ip=tb.agg.ip))
        assert xsk_fds() == sockets + 1  # one queue, one socket
        key = keys.new_key()
        eng.add_job(JOB, W, SLOTS, group, [h.ip for h in ranks], key=key)
        comms = []
        for r, h in enumerate(ranks):
            with tb.in_host(h):
                comms.append(stack.enter_context(Communicator(r, W, tb.agg.ip, group=group, local_ip=h.ip, job=JOB,
                                                              port=tb.port, slots=SLOTS, timeout=20, key=key)))
        outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), W)
        assert not errs, errs
        epoch = eng.job_state(JOB)["live_epoch"]
        assert epoch and all(np.array_equal(o, xs[0].astype(np.int64) + xs[1]) for o in outs)

        frames = attacks.attack(job=JOB, epoch=epoch, worker_ips=[h.ip for h in ranks], slots=SLOTS,
                                attacker_ip=attacker.ip, attacker_mac=attacker.mac, dst_ip=tb.agg.ip,
                                dst_mac=tb.agg.mac, other_jobs=(JOB + 1, 0, 0xFFFFFFFF), key=key)
        with tb.in_host(attacker):
            raw = stack.enter_context(socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
            raw.bind((attacker.iface, 0))
        wrong = []
        for f in frames:
            before = {"job": eng.stats(JOB), "row0": eng.unattributed()}
            rx0 = eng.engine_stats()["rx_frames"]
            raw.send(f.frame)
            deadline = time.monotonic() + 2
            while f.kind != "foreign" and eng.engine_stats()["rx_frames"] == rx0 and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.01)  # foreign frames: give one a chance to arrive (it must not)
            after = {"job": eng.stats(JOB), "row0": eng.unattributed()}
            delta = {row: {k: after[row][k] - before[row][k] for k in proto.STATS
                           if after[row][k] != before[row][k] and k not in ("rx", "records")} for row in after}
            if f.kind == "foreign":
                want = {"job": {}, "row0": {}}
            else:
                mine = "job" if f.job_row else "row0"
                want = {mine: {f.reason: 1, **{a: 1 for a in f.also}}, ("row0" if mine == "job" else "job"): {}}
            if delta != want:
                wrong.append((f.kind, f.what, delta, want))
        assert not wrong, wrong
        assert eng.job_state(JOB)["live_epoch"] == epoch
        # the job goes on, exact
        outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), W)
        assert not errs, errs
        assert all(np.array_equal(o, xs[0].astype(np.int64) + xs[1]) for o in outs)
        kinds = Counter(f.kind for f in frames)
        assert kinds["malformed"] > 10 and kinds["spoofed_rank"] and kinds["wrong_job"] and kinds["spoofed_key"], kinds
    assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is None
    assert xsk_fds() == sockets


def run_int32_job(tb, job: int, slots: int, seed: int, local_port: int | None = None, key: int = 0) -> None:
    """Job ``job``'s two ranks (the testbed's two workers) sum int32 arrays: exact."""
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-(2**30), 2**30, 30 * E + 5).astype(np.int32) for _ in range(2)]
    comms = []
    try:
        for r, w in enumerate(tb.workers):
            with tb.in_host(w):
                comms.append(Communicator(r, 2, tb.agg.ip, group=tb.topology.group_of(job), local_ip=w.ip,
                                          port=tb.port, job=job, slots=slots, timeout=20, local_port=local_port,
                                          key=key))
        outs, errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), 2)
    finally:
        for c in comms:
            c.close()
    assert not errs, errs
    want = (xs[0].astype(np.int64) + xs[1]).astype(np.int32)
    assert all(np.array_equal(o.astype(np.int32), want) for o in outs), job


def test_jobs_the_xdp_pool_refuses_are_served_by_the_fallback_engine(make_testbed):
    """Two refused jobs handed off: one engine process serves both (its sockets own the XSKMAP),
    beside the XDP aggregator's own job; removing one leaves the other served; unload ends it."""
    tb = make_testbed(2)
    ips = [w.ip for w in tb.workers]
    where = ["--netns", tb.agg.netns, "--iface", tb.agg.iface]
    ip_args = [a for ip in ips for a in ("--worker-ip", ip)]

    def add(job: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, "agg", "job", "add", *where, "--job", str(job), "--workers", "2", "--slots", "64",
                               "--group", tb.topology.group_of(job), *extra, *ip_args],
                              capture_output=True, text=True, timeout=120)

    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=128, port=tb.port)) as agg:
        agg.add_job(1, 2, tb.topology.group_of(1), ips, slots=128)  # the whole pool
        r = add(2)
        assert r.returncode == 10, r.stderr  # without --fallback the refusal stands (CapacityError)
        r = add(2, "--fallback", "afxdp", "--json")
        assert r.returncode == 0, r.stderr
        two = json.loads(r.stdout)
        assert two["engine"] == "afxdp" and "free range" in two["refused_by_xdp"] and two["copy_mode"]
        key3 = keys.new_key()
        r = add(3, "--fallback", "afxdp", "--key", keys.show(key3))
        assert r.returncode == 0 and "AF_XDP engine took it" in r.stdout and keys.show(key3) in r.stdout, r.stderr
        assert engine_procs() == [two["pid"]]  # one engine for both
        # each with the key `job add` drew (and printed) or was given
        run_int32_job(tb, 2, 64, seed=8, local_port=tb.port + 2, key=keys.parse(two["key"]))
        run_int32_job(tb, 3, 64, seed=9, local_port=tb.port + 3, key=key3)
        run_int32_job(tb, 1, 128, seed=10)  # the XDP aggregator's own job, beside them
        time.sleep(0.3)  # the engine writes its counters every tenth of a second
        listed = json.loads(subprocess.run([*CLI, "agg", "job", "list", *where, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        assert [h["job"] for h in listed["afxdp"]] == [2, 3]
        assert all(h["alive"] and h["stats"]["completed"] > 0 and h["stats"]["bad_job"] == 0 for h in listed["afxdp"])
        assert all(h["keyed"] and "key" not in h for h in listed["afxdp"])  # listings never show a key
        assert listed["unattributed"]["bad_job"] == 0  # their frames went to the engine, not to row 0
        st = json.loads(subprocess.run([*CLI, "agg", "stats", *where, "--job", "3", "--json"], capture_output=True,
                                       text=True, check=True).stdout)
        assert st["completed"] > 0 and st["aggregated"] == 2 * st["completed"], st
        status = subprocess.run([*CLI, "agg", "status", *where], capture_output=True, text=True, check=True).stdout
        assert "job 3: 2 workers, 64 slots of the AF_XDP engine" in status, status
        r = subprocess.run([*CLI, "agg", "job", "remove", *where, "--job", "2"], capture_output=True, text=True)
        assert r.returncode == 0 and "AF_XDP engine" in r.stdout, r.stderr
        assert engine_procs() == [two["pid"]]
        run_int32_job(tb, 3, 64, seed=11, local_port=tb.port + 3, key=key3)
        assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is not None  # the XDP aggregator stays
        # a job of the pool never takes the group of a job the engine serves
        agg.remove_job(1)
        with pytest.raises(InputError, match="AF_XDP engine serves"):
            agg.add_job(4, 2, tb.topology.group_of(3), ips, slots=16)
    assert engine_procs() == []  # unloaded: the engine went with the aggregator


def test_a_killed_engine_leaves_no_program_behind(make_testbed):
    """The steering program hangs on the engine's XDP link: SIGKILL, and the kernel detaches it."""
    tb = make_testbed(1)
    p = tb.popen(tb.agg, [*CLI, "aggregator-afxdp", "--workers", "1", "--port", str(tb.port),
                          "--local-ip", tb.agg.ip], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("ready"), line
        assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is not None
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 5
    while bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is None


def test_bad_requests_get_clear_errors(make_testbed):
    tb = make_testbed(1)
    sockets = xsk_fds()
    with pytest.raises(Exception, match="MTU"):
        AfxdpEngine(port=tb.port, elems=1024, netns=tb.agg.netns, local_ip=tb.agg.ip)
    with AfxdpEngine(port=tb.port, netns=tb.agg.netns, local_ip=tb.agg.ip) as eng:
        eng.add_job(1, 1, 8, tb.mcast_group)
        with pytest.raises(Exception, match="already served"):
            eng.add_job(1, 1, 8, tb.mcast_group)
        with pytest.raises(Exception, match="not an IPv4 multicast"):
            eng.add_job(2, 1, 8, "10.0.0.1")
        # a second engine on the same interface: its program cannot attach over the first one's
        with pytest.raises(Exception, match="already has an XDP program|busy|Busy"):
            AfxdpEngine(port=tb.port, netns=tb.agg.netns, local_ip=tb.agg.ip)
    assert bpf.xdp_prog_id(tb.agg.iface, tb.agg.netns) is None
    assert xsk_fds() == sockets  # the refused second engine closed its socket too
