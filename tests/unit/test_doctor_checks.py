"""nicoffload doctor's checks on synthetic input (no root, nothing read from this host): the
parsers of /proc/interrupts, /proc/net/igmp, CapEff and sysfs settings, each check's verdict and
fix, and the report's exit codes."""
from __future__ import annotations

import json
import resource

import pytest

from nicoffload.doctor import host, kernel, nic
from nicoffload.doctor.link import IFF_MULTICAST, IFF_UP, XDP_ACT, LinkFacts, parse_igmp
from nicoffload.doctor.report import FAIL, OK, WARN, Report, fail, ok, warn
from nicoffload.wire import proto

ROOT_CAPS = "CapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\n"
USER_CAPS = "CapEff:\t0000000000000000\n"

INTERRUPTS = """\
           CPU0       CPU1       CPU2       CPU3
 24:          1          0          0          0  IO-APIC   5-edge      ACPI:Ged
 38:          0      12163          0          0  PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0
 39:       9953          0          0          0  PCI-MSIX-0000:00:03.0   2-edge      virtio2-output.0
 60:       5000          0          0          0  IR-PCI-MSI 1048576-edge      eth7-TxRx-0
 61:       4000          0          0          0  IR-PCI-MSI 1048577-edge      eth7-TxRx-1
 62:          9          0          0          0  IR-PCI-MSI 1048578-edge      eth77
NMI:          0          0          0          0   Non-maskable interrupts
"""

IGMP = """\
Idx\tDevice    :Count Querier\tGroup    Users Timer\tReporter
1\tlo        :     1      V3
\t\t\t\t010000E0     1 0:00000000\t\t0
4\teth0      :     3      V2
\t\t\t\t010000E0     1 0:00000000\t\t0
"""


def nicfacts(**kw) -> LinkFacts:
    base = dict(name="eth1", exists=True, index=3, driver="ixgbe", bus="0000:3b:00.0", mtu=1500,
                flags=IFF_UP | IFF_MULTICAST, operstate="UP", ipv4=["10.0.0.1"], rx_queues=8,
                xdp_features=XDP_ACT["basic"] | XDP_ACT["redirect"],
                features={"rx-gro": True, "tx-generic-segmentation": True, "rx-lro": False,
                          "rx-udp-gro-forwarding": False, "tx-udp-segmentation": True},
                rp_filter=(0, 0), igmp={"groups": 1, "querier": "V3"})
    base.update(kw)
    return LinkFacts(**base)


# --- parsers -------------------------------------------------------------------------------------
def test_interrupts_are_parsed_and_a_device_found_by_name_or_bus():
    ncpu, rows = host.parse_interrupts(INTERRUPTS)
    assert ncpu == 4 and [r[0] for r in rows] == ["24", "38", "39", "60", "61", "62", "NMI"]
    assert [r[0] for r in host.device_irqs(rows, "eth0", "0000:00:03.0")] == ["38", "39"]
    # eth7's queues, not eth77 (a word of its own)
    assert [r[0] for r in host.device_irqs(rows, "eth7", "")] == ["60", "61"]


def test_igmp_rows_by_interface():
    assert parse_igmp(IGMP, "eth0") == {"groups": 3, "querier": "V2"}
    assert parse_igmp(IGMP, "lo") == {"groups": 1, "querier": "V3"}
    assert parse_igmp(IGMP, "eth9") is None


def test_capabilities_versions_and_settings():
    assert kernel.has(kernel.cap_eff(ROOT_CAPS), kernel.CAP_BPF) and kernel.cap_eff(USER_CAPS) == 0
    assert kernel.version("6.18.44-fc-v657") == (6, 18) and kernel.version("5.4.0-150-generic") == (5, 4)
    assert kernel.version("garbage") == (0, 0)
    assert host.selected("always [madvise] never") == "madvise"
    assert host.meminfo("HugePages_Total:       4\nHugepagesize:       2048 kB\n") == \
        {"HugePages_Total": 4, "Hugepagesize": 2048}
    assert kernel.bpffs_mounted("sysfs /sys sysfs rw 0 0\nbpf /sys/fs/bpf bpf rw,relatime 0 0\n")
    assert not kernel.bpffs_mounted("sysfs /sys sysfs rw 0 0\nnone /sys/fs/bpf tmpfs rw 0 0\n")


def test_umem_size_comes_from_the_engines_source():
    from nicoffload.afxdp import build

    assert kernel.umem_bytes(build.LIMITS.read_text()) == 4096 * 4096
    assert kernel.umem_bytes("#define AFX_FRAMES 1024u\n#define AFX_FRAME 2048u\n") == 1024 * 2048


# --- the kernel's and the process's checks ------------------------------------------------------
def test_kernel_versions_by_role():
    assert kernel.check_kernel("5.15.0-91-generic", "aggregator").status == FAIL  # no bpf_loop
    assert kernel.check_kernel("5.15.0-91-generic", "worker").status == OK
    assert kernel.check_kernel("4.19.0", "worker").status == FAIL
    assert kernel.check_kernel("6.1.0-18-amd64", None).status == OK


def test_probes_decide_and_the_version_stands_in_when_they_cannot_run():
    assert kernel.check_probe("bpf_loop", True, "6.1.0", (5, 17), "x", required=True).status == OK
    assert kernel.check_probe("bpf_loop", False, "6.1.0", (5, 17), "x", required=True).status == FAIL
    assert kernel.check_probe("xdp-frags", False, "6.1.0", (5, 18), "x", required=False).status == WARN
    assert kernel.check_probe("bpf_loop", None, "6.1.0", (5, 17), "x", required=True).status == OK
    c = kernel.check_probe("bpf_loop", None, "5.10.0", (5, 17), "x", required=True)
    assert c.status == FAIL and "not probed" in c.detail and "5.17" in c.fix


def test_privileges_by_role():
    root = kernel.cap_eff(ROOT_CAPS)
    assert kernel.check_privileges(root, 0, "aggregator").status == OK
    c = kernel.check_privileges(0, 1000, "aggregator")
    assert c.status == FAIL and "CAP_BPF" in c.detail and "root" in c.fix
    assert kernel.check_privileges(0, 1000, "worker").status == OK


def test_memlock_against_the_umem():
    inf, umem = resource.RLIM_INFINITY, 16 << 20
    assert kernel.check_memlock(inf, 0, "6.1.0", umem, 4, "aggregator").status == OK
    c = kernel.check_memlock(8 << 20, 0, "6.1.0", umem, 4, "aggregator")
    assert c.status == WARN and "64 MiB" in c.detail and "LimitMEMLOCK" in c.fix
    assert kernel.check_memlock(8 << 20, 1 << kernel.CAP_IPC_LOCK, "6.1.0", umem, 4, "aggregator").status == OK
    assert kernel.check_memlock(8 << 20, 0, "6.1.0", umem, 4, "worker").status == OK


def test_bcc_headers_jit_btf_bpffs():
    assert kernel.check_bcc(None).status == FAIL
    assert kernel.check_headers("6.1.0", False).status == FAIL
    assert kernel.check_jit("0").status == WARN and kernel.check_jit("1\n").status == OK
    assert kernel.check_btf(False).status == WARN
    assert kernel.check_bpffs("", root=True).status == OK and kernel.check_bpffs("", root=False).status == WARN


# --- the interface's checks --------------------------------------------------------------------
def test_a_missing_interface_is_one_fail():
    f = LinkFacts("eth9", "ns1", error="no interface 'eth9' in namespace ns1 (ip -n ns1 link)",
                  missing="interface")
    checks = nic.nic_checks(f, None, 256)
    assert [c.status for c in checks] == [FAIL] and "eth9" in checks[0].detail and "ip -n ns1 link" in checks[0].fix
    denied = nic.nic_checks(LinkFacts("eth0", "ns1", error="entering network namespace 'ns1' needs root"), None, 256)
    assert [c.status for c in denied] == [FAIL] and "root" in denied[0].fix
    gone = nic.nic_checks(LinkFacts("eth0", "ns2", error="network namespace 'ns2' does not exist",
                                    missing="namespace"), None, 256)
    assert [c.status for c in gone] == [FAIL] and "ip netns list" in gone[0].fix


def test_native_xdp_from_the_netdev_bits_or_the_driver_table():
    assert nic.check_native_xdp(nicfacts(), "aggregator").status == OK
    c = nic.check_native_xdp(nicfacts(driver="", kind="dummy", xdp_features=0), "aggregator")
    assert c.status == WARN and "generic" in c.fix
    assert nic.check_native_xdp(nicfacts(xdp_features=0), "worker").status == OK
    assert nic.check_native_xdp(nicfacts(xdp_features=None, driver="mlx5_core"), "aggregator").status == OK
    assert nic.check_native_xdp(nicfacts(xdp_features=None, driver="r8169"), "aggregator").status == WARN
    held = nic.check_native_xdp(nicfacts(xdp_attached="native", xdp_prog=42), "aggregator")
    assert held.status == WARN and "id 42" in held.detail


def test_mtu_against_the_records():
    assert nic.check_mtu(nicfacts(mtu=1500), None, 256).status == OK
    need = proto.mtu_for_elems(nic.JUMBO_ELEMS)
    assert need <= 3500 < proto.mtu_for_elems(nic.JUMBO_ELEMS + 1)
    c = nic.check_mtu(nicfacts(mtu=1500), None, nic.JUMBO_ELEMS)
    assert c.status == FAIL and str(need) in c.detail and f"mtu {need}" in c.fix
    assert nic.check_mtu(nicfacts(mtu=1000), None, 256).status == FAIL
    assert nic.check_mtu(nicfacts(mtu=9000), "aggregator", nic.JUMBO_ELEMS).status == WARN  # native XDP without rx-sg
    sg = XDP_ACT["basic"] | XDP_ACT["rx-sg"]
    assert nic.check_mtu(nicfacts(mtu=9000, xdp_features=sg), "aggregator", nic.JUMBO_ELEMS).status == OK


def test_offloads_that_change_what_generic_xdp_sees():
    assert nic.check_offloads(nicfacts(), "aggregator").status == OK
    lro = nicfacts(features={"rx-gro": True, "rx-lro": True, "tx-generic-segmentation": True})
    assert nic.check_offloads(lro, "aggregator").status == WARN and "lro off" in nic.check_offloads(lro, None).fix
    nogro = nicfacts(features={"rx-gro": False, "rx-lro": False, "tx-generic-segmentation": True})
    assert "gro on" in nic.check_offloads(nogro, "worker").fix
    nogso = nicfacts(features={"rx-gro": True, "rx-lro": False, "tx-generic-segmentation": False})
    assert nic.check_offloads(nogso, "worker").status == WARN and nic.check_offloads(nogso, "aggregator").status == OK
    assert nic.check_offloads(nicfacts(features={}), None).status == WARN


def test_multicast_and_igmp():
    assert nic.check_multicast(nicfacts(), "worker").status == OK
    c = nic.check_multicast(nicfacts(flags=IFF_UP), "worker")
    assert c.status == WARN and "MULTICAST" in c.detail and "--delivery unicast" in c.fix
    assert "IGMPv2 querier answers" in nic.check_multicast(nicfacts(igmp={"groups": 2, "querier": "V2"}), None).detail


def test_rp_filter_strict_matters_to_a_worker_off_the_default_route():
    assert nic.check_rp_filter(nicfacts(rp_filter=(0, 2)), "worker").status == OK
    c = nic.check_rp_filter(nicfacts(rp_filter=(1, 0)), "worker")
    assert c.status == WARN and "rp_filter=2" in c.fix
    assert nic.check_rp_filter(nicfacts(rp_filter=(1, 0), default_route=True), "worker").status == OK
    assert nic.check_rp_filter(nicfacts(rp_filter=(1, 0)), "aggregator").status == OK


# --- the host's checks -------------------------------------------------------------------------
def test_irq_spread():
    virtio = nicfacts(name="eth0", bus="0000:00:03.0", rx_queues=1)
    c = host.check_irqs(virtio, INTERRUPTS)
    assert c.status == WARN and "one receive queue" in c.detail and "rps_cpus" in c.fix
    one_cpu = host.check_irqs(nicfacts(name="eth7", bus="", rx_queues=2), INTERRUPTS)
    assert one_cpu.status == WARN and "CPU 0" in one_cpu.detail
    assert host.check_irqs(nicfacts(name="veth1", kind="veth", bus=""), INTERRUPTS).status == OK


def test_governor_hugepages_clock():
    assert host.check_governor([]).status == OK
    assert host.check_governor(["performance"] * 4).status == OK
    assert host.check_governor(["powersave", "performance"]).status == WARN
    assert host.check_hugepages("always madvise [never]", {}).status == WARN
    assert host.check_hugepages("[always] madvise never", {"HugePages_Total": 0}).status == OK
    assert host.check_clocksource("tsc\n").status == OK
    c = host.check_clocksource("hpet\n", "tsc hpet acpi_pm\n")
    assert c.status == WARN and "clocksource=tsc" in c.fix


# --- the report ----------------------------------------------------------------------------------
@pytest.mark.parametrize("checks,missing,code", [
    ([ok("a", "x")], False, 0),
    ([ok("a", "x"), warn("b", "y", "z")], False, 1),
    ([warn("b", "y", "z"), fail("c", "y", "z")], False, 2),
    ([fail("interface", "no interface", "z")], True, 5),
])
def test_exit_codes(checks, missing, code):
    r = Report("eth0", None, None, missing=missing)
    r.add("g", checks)
    assert r.exit_code == code
    d = json.loads(r.to_json())
    assert d["exit_code"] == code and len(d["checks"]) == len(checks) and d["checks"][0]["group"] == "g"
    lines = r.text().splitlines()
    assert len(lines) == len(checks) + 2 and lines[-1].endswith(f"(exit {code})")
    assert all(line.split()[0] in (OK, WARN, FAIL) for line in lines[1:-1])
    assert all("fix:" in line for line in lines[1:-1] if not line.startswith(OK))
