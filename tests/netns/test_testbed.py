"""The namespace testbed end to end: lifecycle and cleanup, signals, names and errors, and the
CLI. Traffic on its links (reachability, XDP_TX, shaping, faults) is in test_testbed_links.py;
the pure parts (topology, rates, fault decisions, --help) are tested in tests/unit.

Every test names its testbeds after the uid fixture and tears them down in a finalizer."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nicoffload.ebpf import loader as nbpf
from nicoffload.errors import AlreadyExistsError, InputError, NotFoundError
from nicoffload.testbed import Testbed, Topology
from nicoffload.testbed import state as st
from nicoffload.testbed.netlink import ipr, list_netns, qdisc_kinds

REPO = Path(__file__).resolve().parents[2]
SO_RCVBUFFORCE = 33


# --- helpers ----------------------------------------------------------------------------------
def ns_of(name):
    return [ns for ns in list_netns() if ns.startswith(f"nco-{name}-")]


def prog_alive(prog_id: int) -> bool:
    return subprocess.run(["bpftool", "prog", "show", "id", str(prog_id)], capture_output=True).returncode == 0


def wait_gone(prog_ids, timeout=3.0):
    deadline = time.monotonic() + timeout
    while any(prog_alive(p) for p in prog_ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in prog_ids if prog_alive(p)]


def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "nicoffload.cli", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"nicoffload {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


# --- lifecycle ----------------------------------------------------------------------------------
def test_up_down_leaves_nothing_behind(uid):
    root_links = sorted(os.listdir("/sys/class/net"))
    name = f"t{uid}"
    tb = Testbed(Topology.star(name, 2, rate="1gbit", agg_napi=True))
    try:
        tb.up()
        tb.faults.configure(drop=0.1, dup=0.1, seed=1)
        assert sorted(ns_of(name)) == sorted(tb.topology.netns_names())
        assert st.state_path(name).exists() and tb.faults.pin_dir.exists()
        prog_ids = [nbpf.xdp_prog_id(tb.agg.peer, tb.bridge_netns)]
        with ipr(tb.bridge_netns) as br:
            idx = br.link_lookup(ifname="p-w0")[0]
            assert set(qdisc_kinds(br, idx)) >= {"tbf", "clsact"}
        for prog in ("fault_ingress", "fault_egress"):
            r = subprocess.run(["bpftool", "-j", "prog", "show", "pinned", str(tb.faults.pin_dir / prog)],
                               capture_output=True, text=True, check=True)
            prog_ids.append(json.loads(r.stdout)["id"])
        r = subprocess.run(["tc", "-n", tb.bridge_netns, "filter", "show", "dev", "p-w0", "ingress"],
                           capture_output=True, text=True, check=True)
        assert f"id {prog_ids[1]} " in r.stdout
        assert None not in prog_ids and len(prog_ids) == 3
        assert all(prog_alive(p) for p in prog_ids)
        assert sorted(os.listdir("/sys/class/net")) == root_links  # nothing in the root namespace
    finally:
        removed = tb.down()
    assert removed and ns_of(name) == []
    assert not st.state_path(name).exists()
    assert not (nbpf.PIN_ROOT / tb.topology.bridge_netns).exists()
    assert wait_gone(prog_ids) == [], "programs outlived their testbed"
    assert sorted(os.listdir("/sys/class/net")) == root_links
    assert tb.down() == []  # idempotent


def test_teardown_tolerates_objects_already_gone(make_testbed):
    from nicoffload.testbed.netlink import remove_netns

    tb = make_testbed(2)
    with ipr(tb.host("w1").netns) as s:  # a link deleted behind the testbed's back
        s.link("del", index=s.link_lookup(ifname="eth0")[0])
    remove_netns(tb.host("w0").netns)  # and a whole namespace
    tb.down()
    assert ns_of(tb.name) == [] and not st.state_path(tb.name).exists()


def test_with_block_tears_down_when_body_raises(uid):
    name = f"t{uid}"
    with pytest.raises(RuntimeError):
        with Testbed(Topology.star(name, 1, agg_napi=False)):
            assert ns_of(name)
            raise RuntimeError("boom")
    assert ns_of(name) == [] and not st.state_path(name).exists()


def test_failed_up_removes_what_it_made(uid, monkeypatch):
    import nicoffload.testbed.realise as tbmod
    def broken(*a, **k):
        raise OSError(5, "injected failure")

    monkeypatch.setattr(tbmod, "limit", broken)  # the qdisc of the first link
    name = f"t{uid}"
    with pytest.raises(OSError):
        Testbed(Topology.star(name, 2, rate="10mbit")).up()
    assert ns_of(name) == [] and not st.state_path(name).exists()


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_signal_tears_down(uid, sig, rc):
    """SIGTERM surfaces as SystemExit(143), SIGINT as KeyboardInterrupt: both after teardown."""
    name = f"t{uid}"
    script = ("import sys, time, faulthandler\n"
              "faulthandler.dump_traceback_later(12, exit=True)  # a hang shows where\n"
              "from nicoffload.testbed import Testbed, Topology\n"
              "with Testbed(Topology.star(sys.argv[1], 1, agg_napi=False)):\n"
              "    print('ready', flush=True)\n    time.sleep(30)\n")
    # a suite run from a background job inherits SIGINT ignored, and Python then keeps it ignored:
    # the child starts with the default disposition, as from a terminal
    p = subprocess.Popen([sys.executable, "-c", script, name], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
        assert ns_of(name)
        p.send_signal(sig)
        code = p.wait(20)
        err = p.stderr.read()
        left = ns_of(name) + [str(st.state_path(name))] * st.state_path(name).exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        from nicoffload.testbed import clean
        clean(name)
    assert code == rc, err[-3000:]
    assert left == []


def test_load_names_and_errors(make_testbed):
    tb = make_testbed(2, rate="1gbit", queues=2)
    other = Testbed.load(tb.name)
    assert other.hosts == tb.hosts and other.mcast_group == tb.mcast_group and other.port == tb.port
    with other:  # a re-attached testbed is not owned: leaving the block keeps it up
        pass
    assert sorted(ns_of(tb.name)) == sorted(tb.topology.netns_names())
    with pytest.raises(AlreadyExistsError):
        Testbed(Topology.star(tb.name, 1)).up()
    with pytest.raises(AlreadyExistsError):  # subnets are never shared
        Testbed(Topology.star(tb.name + "x", 1, subnet=tb.topology.subnet)).up()
    second = make_testbed(1, suffix="b")
    assert second.subnet != tb.subnet and second.mcast_group != tb.mcast_group
    with pytest.raises(NotFoundError):
        Testbed.load(tb.name + "zz")
    with pytest.raises(InputError):
        tb.host("w7")
    assert tb.host(1) == tb.host("w1") == tb.workers[1]
    r = tb.run("w1", ["cat", "/sys/class/net/eth0/address"], capture_output=True, text=True)
    assert r.stdout.strip() == tb.host("w1").mac
    assert tb.call("w0", lambda: sorted(n for _, n in socket.if_nameindex())) == ["eth0", "lo"]
    # veth queue count
    with ipr(tb.agg.netns) as s:
        link = s.get_links(s.link_lookup(ifname="eth0")[0])[0]
        assert link.get_attr("IFLA_NUM_TX_QUEUES") == 2 and link.get_attr("IFLA_NUM_RX_QUEUES") == 2


# --- CLI --------------------------------------------------------------------------------------------
@pytest.fixture
def cli_names(uid):
    from nicoffload.testbed import clean

    yield f"t{uid}c", f"t{uid}d"
    clean(f"t{uid}")


def test_cli_up_exec_list_down(cli_names):
    name, _ = cli_names
    out = json.loads(cli("testbed", "up", "--workers", "2", "--name", name, "--drop", "0.1", "--seed", "4",
                         "--rate", "1gbit", "--ranks-per-host", "2", "--json").stdout)
    assert set(out) >= {"name", "aggregator", "workers"} and out["name"] == name
    # the shape is recorded, and every host's torchrun command printed (tests/unit/test_ranks_per_host_plans.py)
    assert out["ranks_per_host"] == 2 and [h["host"] for h in out["torchrun"]["hosts"]] == ["w0", "w1"]
    assert "--nproc-per-node 2 --node-rank 1" in out["torchrun"]["hosts"][1]["command"]
    assert set(out["aggregator"]) == {"netns", "iface", "ip", "mac"}
    assert [w["rank"] for w in out["workers"]] == [0, 1]
    assert set(out["workers"][0]) == {"rank", "netns", "iface", "ip", "mac"}
    assert sorted(ns_of(name)) == sorted([out["bridge_netns"], out["aggregator"]["netns"]]
                                         + [w["netns"] for w in out["workers"]])
    # the testbed outlived the process that made it, faults included
    tb = Testbed.load(name)
    assert tb.faults.configured()["w1"].drop == 0.1
    r = cli("testbed", "exec", name, "w1", "--", "cat", "/sys/class/net/eth0/address")
    assert r.stdout.strip() == out["workers"][1]["mac"]
    assert cli("testbed", "exec", name, "agg", "--", "sh", "-c", "exit 3", check=False).returncode == 3
    bad = cli("testbed", "exec", name, "w9", "--", "true", check=False)
    assert bad.returncode == InputError.exit_code and "w9" in bad.stderr and "Traceback" not in bad.stderr
    dup = cli("testbed", "up", "--workers", "1", "--name", name, check=False)
    assert dup.returncode == AlreadyExistsError.exit_code and len(dup.stderr.strip().splitlines()) == 1
    assert [b.get("ranks_per_host") for b in json.loads(cli("testbed", "list", "--json").stdout)
            if b["name"] == name] == [2]
    assert "w0" in json.loads(cli("testbed", "faults", name, "--json").stdout)["stats"]
    cli("testbed", "down", name)
    assert ns_of(name) == [] and not st.state_path(name).exists()
    gone = cli("testbed", "down", name, check=False)
    assert gone.returncode == NotFoundError.exit_code and "Traceback" not in gone.stderr


def test_cli_clean_removes_only_prefixed_objects(cli_names, uid):
    from nicoffload.agg.control import pin_dir, state_file
    from nicoffload.testbed.netlink import create_netns

    a, b = cli_names
    cli("testbed", "up", "--workers", "1", "--name", a, "--drop", "0.5")
    cli("testbed", "up", "--workers", "1", "--name", b)
    agg = Topology.star(a, 1).hosts[0]
    cli("agg", "load", "--netns", agg.netns, "--iface", agg.iface, "--workers", "1")
    # a crash leftover: a namespace with the prefix and no state file, and a stray state file
    create_netns(f"nco-{a}-zz")
    st.state_path(a).unlink()
    pins = nbpf.PIN_ROOT / f"nco-{a}-br"
    assert pins.exists() and pin_dir(agg.netns, agg.iface).exists() and state_file(agg.netns, agg.iface).exists()
    r = json.loads(cli("testbed", "clean", "--name-prefix", a, "--json").stdout)
    assert f"nco-{a}-zz" in r["removed"] and f"{agg.netns}/{agg.iface} aggregator" in r["removed"]
    assert ns_of(a) == [] and not pins.exists()
    assert not pin_dir(agg.netns, agg.iface).exists(), "clean left the aggregator's pins"
    assert not state_file(agg.netns, agg.iface).exists(), "clean left the aggregator's state file"
    assert sorted(ns_of(b)) == sorted(Topology.star(b, 1).netns_names())  # another testbed: untouched
    cli("testbed", "down", b)

