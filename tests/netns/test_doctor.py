"""``nicoffload doctor`` as a user runs it (the CLI, --json): on the testbed's veth interfaces, on
a dummy interface in a namespace this test makes, and on interfaces and namespaces that do not
exist. It must read only: every setting it looks at is the same afterwards, nothing is attached,
and no probe program stays loaded."""
from __future__ import annotations

import errno
import json
import subprocess
import time

import pytest
from pyroute2 import IPRoute, NetlinkError
from pyroute2 import netns as pyr_netns

from nicoffload.doctor import probe
from nicoffload.doctor.link import gather
from nicoffload.lab.launcher import CLI


def doctor(*args: str) -> tuple[int, dict]:
    p = subprocess.run([*CLI, "doctor", "--json", *args], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip(), p.stderr[-2000:]
    return p.returncode, json.loads(p.stdout)


def by_name(report: dict) -> dict:
    return {c["name"]: c for c in report["checks"]}


def snapshot(name: str, ns: str) -> tuple:
    f = gather(name, ns)
    assert f.exists, f.error
    return f.mtu, f.flags, f.features, f.rp_filter, f.force_igmp, f.xdp_attached, f.xdp_prog


def probes_loaded() -> list:
    out = subprocess.run(["bpftool", "prog", "show", "--json"], capture_output=True, text=True).stdout
    return [p["id"] for p in json.loads(out or "[]") if p.get("name", "").startswith("nco_doctor")]


@pytest.fixture
def dummy_ns(uid):
    """A namespace holding a dummy interface (MTU 1500, up, an address); removed even on failure.
    A kernel built without the dummy driver (CONFIG_DUMMY; this project's VMs) gets an ifb device
    instead, which shares the two traits the test needs: no native XDP, no MULTICAST flag."""
    ns, dev = f"ncodoc-{uid}", f"ncod{uid}"
    pyr_netns.create(ns)
    try:
        with IPRoute(netns=ns) as ipr:
            try:
                ipr.link("add", ifname=dev, kind="dummy")
            except NetlinkError as e:
                if e.code != errno.EOPNOTSUPP:
                    raise
                ipr.link("add", ifname=dev, kind="ifb")
            idx = ipr.link_lookup(ifname=dev)[0]
            ipr.link("set", index=idx, mtu=1500, state="up")
            ipr.addr("add", index=idx, address="10.254.77.1", prefixlen=24)
        yield ns, dev
    finally:
        pyr_netns.remove(ns)


def test_doctor_on_veth_dummy_and_missing_interfaces_reads_only(make_testbed, dummy_ns):
    tb = make_testbed(2)
    ns, dev = dummy_ns
    hosts = [(tb.agg.iface, tb.agg.netns, "aggregator"), (tb.workers[0].iface, tb.workers[0].netns, "worker")]
    before = {(i, n): snapshot(i, n) for i, n, _ in hosts + [(dev, ns, None)]}

    # the testbed's veth interfaces: nothing fails for either role
    for iface, netns, role in hosts:
        rc, rep = doctor("--netns", netns, "--iface", iface, "--role", role)
        checks = by_name(rep)
        assert rc in (0, 1) and rep["summary"]["fail"] == 0, [c for c in rep["checks"] if c["status"] != "OK"]
        assert rc == (1 if rep["summary"]["warn"] else 0)
        assert "veth" in checks["interface"]["detail"] and checks["native-xdp"]["status"] == "OK"
        assert checks["multicast"]["status"] == "OK" and checks["irq-spread"]["status"] == "OK"
        assert {"kernel", "privileges", "bpf_loop", "mtu", "offloads", "rp_filter", "clocksource"} <= set(checks)
        assert checks["bpf_loop"]["status"] == "OK" and "probed" in checks["bpf_loop"]["detail"]

    # a dummy interface: no native XDP, no MULTICAST flag, and an MTU too small for jumbo records
    rc, rep = doctor("--netns", ns, "--iface", dev, "--role", "aggregator", "--elems", "856")
    checks = by_name(rep)
    assert rc == 2, rep
    assert checks["interface"]["status"] == "OK" and ("dummy" in checks["interface"]["detail"] or
                                                      "ifb" in checks["interface"]["detail"])
    assert checks["mtu"]["status"] == "FAIL" and "3500" in checks["mtu"]["detail"]
    assert checks["native-xdp"]["status"] == "WARN" and "generic" in checks["native-xdp"]["fix"]
    assert checks["multicast"]["status"] == "WARN" and "--delivery unicast" in checks["multicast"]["fix"]
    rc, rep = doctor("--netns", ns, "--iface", dev, "--role", "worker")
    assert rc == 1 and by_name(rep)["mtu"]["status"] == "OK", rep

    # an interface, and a namespace, that do not exist: a FAIL that names them, exit code 5
    rc, rep = doctor("--netns", ns, "--iface", "nosuch0")
    iface = by_name(rep)["interface"]
    assert rc == 5 and rep["missing"] and iface["status"] == "FAIL" and "nosuch0" in iface["detail"], rep
    assert f"ip -n {ns} link" in iface["fix"]
    rc, rep = doctor("--netns", f"{ns}-gone", "--iface", dev)
    assert rc == 5 and f"{ns}-gone" in by_name(rep)["interface"]["detail"]
    p = subprocess.run([*CLI, "doctor", "--netns", ns, "--iface", "nosuch0"], capture_output=True, text=True)
    assert p.returncode == 5 and "FAIL  interface" in p.stdout and "nosuch0" in p.stdout

    # read-only: every setting as it was, nothing attached, no probe program left loaded
    assert {k: snapshot(*k) for k in before} == before
    deadline = time.monotonic() + 5
    while probes_loaded() and time.monotonic() < deadline:
        time.sleep(0.1)  # a closed program goes after an RCU grace period
    assert probes_loaded() == []
    # and the probes can fail: a helper the kernel does not have is refused
    code, funcs = probe.loop_program(helper=10_000)
    assert probe._load(code, funcs=funcs) is False and probe.bpf_loop() is True
