"""One run of the doctor: the kernel's and the process's checks, the interface's (inside its
namespace), and the host's, in that order, as a :class:`~nicoffload.doctor.report.Report`.
Everything is read; nothing is set, mounted or attached."""
from __future__ import annotations

import socket

from nicoffload.doctor.host import host_checks
from nicoffload.doctor.kernel import kernel_checks
from nicoffload.doctor.link import gather
from nicoffload.doctor.nic import nic_checks
from nicoffload.doctor.report import ROLES, Report, warn
from nicoffload.ebpf.loader import netns as enter_netns
from nicoffload.errors import InputError, NotFoundError, PrivilegeError
from nicoffload.jobspec import DEFAULT


def default_iface(netns: str | None) -> str | None:
    """The interface of the default IPv4 route in ``netns``, or None."""
    from pyroute2 import IPRoute

    try:
        with enter_netns(netns), IPRoute() as ipr:
            for r in ipr.get_default_routes(family=socket.AF_INET):
                oif = r.get_attr("RTA_OIF")
                if oif:
                    return ipr.get_links(oif)[0].get_attr("IFLA_IFNAME")
    except (NotFoundError, PrivilegeError):
        return None
    return None


def diagnose(iface: str | None = None, netns: str | None = None, role: str | None = None,
             elems: int = DEFAULT.elems) -> Report:
    """Run every check for ``role`` (aggregator, worker, or None: both, with the aggregator's
    needs) on ``iface`` in ``netns`` (default: the interface of the default route)."""
    if role is not None and role not in ROLES:
        raise InputError(f"--role must be aggregator or worker, not {role!r}")
    name = iface or default_iface(netns)
    facts = gather(name, netns) if name else None
    report = Report(name, netns, role)
    report.add("kernel", kernel_checks(role, facts.rx_queues if facts and facts.exists else 1))
    if facts is None:
        report.add("interface", [warn("interface", f"no --iface given and no default route in "
                                                   f"{netns or 'the root namespace'}: the interface was not checked",
                                      "name the interface the job's traffic crosses: --iface IF")])
    else:
        report.missing = bool(facts.missing)
        report.add("interface", nic_checks(facts, role, elems))
    report.add("host", host_checks(facts))
    return report
