"""``nicoffload doctor``: a read-only preflight of a host before a job. One line per check (OK,
WARN or FAIL, the reason, the fix); it never changes a setting and never attaches a program
(the BPF feature probes load a tiny program and close it). Exit codes: :mod:`.report`.

    report   Check and Report: the lines, the text and JSON forms, the exit code
    kernel   the kernel's version and BPF features, bcc and headers, privileges, RLIMIT_MEMLOCK
    probe    the tiny programs those feature probes load (bpf_loop, multi-buffer XDP)
    link     what is read about the interface inside its namespace (netlink, ethtool, sysctls)
    nic      the interface's checks: driver and native XDP, MTU, offloads, multicast, rp_filter
    host     the interface's IRQ spread, the CPU governor, huge pages, the clock source
    run      :func:`diagnose`, the whole run
"""
from __future__ import annotations

from nicoffload.doctor.report import EXIT_FAIL, EXIT_MISSING, EXIT_OK, EXIT_WARN, FAIL, OK, WARN, Check, Report
from nicoffload.doctor.run import diagnose

__all__ = ["diagnose", "Check", "Report", "OK", "WARN", "FAIL", "EXIT_OK", "EXIT_WARN", "EXIT_FAIL", "EXIT_MISSING"]
