"""What the doctor says: one :class:`Check` per line (OK, WARN or FAIL, the reason, the fix),
gathered in a :class:`Report` that prints as text or JSON and maps to the documented exit code.

    0   every check OK
    1   at least one WARN, no FAIL: it runs, slower or with a setting to change
    2   at least one FAIL: a job cannot run here as things are
    5   the interface (or the namespace) does not exist: nothing of it could be checked
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

OK, WARN, FAIL = "OK", "WARN", "FAIL"
#: exit codes (docs/doctor.md)
EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_MISSING = 0, 1, 2, 5
ROLES = ("aggregator", "worker")


@dataclass
class Check:
    """One line: ``name`` (e.g. ``mtu``), its ``group`` (kernel, interface, host), the
    ``status``, what was found (``detail``) and, unless OK, what to do (``fix``)."""

    name: str
    status: str
    detail: str
    fix: str = ""
    group: str = ""

    def line(self, width: int = 14) -> str:
        text = f"{self.status:<5} {self.name:<{width}} {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix and self.status != OK else text


def ok(name: str, detail: str, fix: str = "") -> Check:
    return Check(name, OK, detail, fix)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, WARN, detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, FAIL, detail, fix)


def worst(a: str, b: str) -> str:
    order = (OK, WARN, FAIL)
    return max(a, b, key=order.index)


@dataclass
class Report:
    """Every check of one run; ``missing``: the interface or namespace does not exist."""

    iface: str | None
    netns: str | None
    role: str | None
    checks: list[Check] = field(default_factory=list)
    missing: bool = False

    def add(self, group: str, checks) -> None:
        for c in checks:
            c.group = c.group or group
            self.checks.append(c)

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def exit_code(self) -> int:
        if self.missing:
            return EXIT_MISSING
        if self.count(FAIL):
            return EXIT_FAIL
        return EXIT_WARN if self.count(WARN) else EXIT_OK

    def summary(self) -> str:
        return f"{self.count(OK)} OK, {self.count(WARN)} WARN, {self.count(FAIL)} FAIL (exit {self.exit_code})"

    def text(self) -> str:
        where = f"{self.iface or 'no interface'} in {self.netns or 'the root namespace'}"
        head = f"nicoffload doctor: {where}, role {self.role or 'aggregator and worker'} (read-only)"
        width = max([len(c.name) for c in self.checks] + [8])
        return "\n".join([head, *(c.line(width) for c in self.checks), self.summary()])

    def to_json(self) -> str:
        return json.dumps({"iface": self.iface, "netns": self.netns, "role": self.role, "missing": self.missing,
                           "exit_code": self.exit_code,
                           "summary": {"ok": self.count(OK), "warn": self.count(WARN), "fail": self.count(FAIL)},
                           "checks": [asdict(c) for c in self.checks]}, indent=2)
