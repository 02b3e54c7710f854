"""``nicoffload doctor``: the read-only preflight of a host (:mod:`nicoffload.doctor`): one line
per check, OK / WARN / FAIL with the reason and the fix, and an exit code that says the worst."""
from __future__ import annotations

from nicoffload.cli.app import add_examples
from nicoffload.jobspec import DEFAULT

EXIT_CODES = """exit codes:
  0  every check OK
  1  at least one WARN (it runs, slower or after a setting is changed), no FAIL
  2  at least one FAIL (a job cannot run here as things are)
  5  the interface or the namespace does not exist"""


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check a host before a job: kernel, BPF, privileges, NIC, MTU, multicast "
                                      "(read-only)",
                       description="Check this host for nicoffload, read-only: the kernel's BPF features (probed "
                                   "with a tiny program that is never attached), privileges, the interface's driver "
                                   "and native XDP, its MTU against the records, offloads, multicast and IGMP, "
                                   "rp_filter, RLIMIT_MEMLOCK, IRQ spread, the CPU governor, huge pages and the "
                                   "clock source. One line per check: OK, WARN or FAIL with the reason and the fix. "
                                   "It never changes a setting (docs/doctor.md).")
    add_examples(p, "sudo nicoffload doctor --iface eth1 --role aggregator",
                 "nicoffload doctor --iface eth1 --role worker --json",
                 "sudo nicoffload doctor --netns nco-tb-agg --iface eth0 --elems 856")
    p.epilog += "\n\n" + EXIT_CODES
    p.add_argument("--iface", metavar="IF", help="the interface the job's traffic crosses (default: the one of the "
                                                 "default route)")
    p.add_argument("--netns", metavar="NS", help="the network namespace the interface is in (/run/netns/NS)")
    p.add_argument("--role", choices=["aggregator", "worker"],
                   help="check for this role only (default: both, with the aggregator's needs)")
    p.add_argument("--elems", type=int, default=DEFAULT.elems,
                   help=f"int32 elements per record the job will use (default {DEFAULT.elems}; 856: jumbo frames)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    p.set_defaults(func=_doctor)


def _doctor(args) -> int:
    from nicoffload.doctor import diagnose

    report = diagnose(args.iface, args.netns, args.role, args.elems)
    print(report.to_json() if args.json else report.text())
    return report.exit_code
