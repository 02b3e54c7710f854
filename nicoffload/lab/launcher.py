"""Rank processes on a testbed: each started inside its host's network namespace, its output
gathered, a deadline that names whoever missed it, and failures told apart by exit code.

Every program the lab starts (``nicoffload worker``, ``aggregator-userspace``, the bench's ranks,
the DDP ranks, the TCP ring) ends with the exit code of its error class in
:mod:`nicoffload.errors` (9 a timeout, 8 a protocol failure, 2 bad input, ...). The parent learns
*what* failed from that code alone; the child's last line of stderr is only the message shown
to a person. A process killed at the deadline counts as a timeout.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import NicoffloadError, TimeoutError_

#: how the lab starts the ``nicoffload`` command, and its own programs (``python -m MODULE``)
CLI = [sys.executable, "-m", "nicoffload.cli"]


def program(module: str) -> list[str]:
    return [sys.executable, "-m", module]


#: stderr lines that are noise, not a message (PyTorch's C++ warnings)
_NOISE = ("[W",)
_CLI_PREFIX = "nicoffload: error: "


def _error_classes(base: type[NicoffloadError] = NicoffloadError):
    yield base
    for sub in base.__subclasses__():
        yield from _error_classes(sub)


def error_class(returncode: int | None) -> type[NicoffloadError]:
    """The error class a child's exit status stands for (None: killed at the deadline, a timeout;
    a signal or an unknown status: the base class)."""
    if returncode is None:
        return TimeoutError_
    for cls in _error_classes():
        if cls.exit_code == returncode and returncode > 0:
            return cls
    return NicoffloadError


@dataclass
class RankSpec:
    """One process to start: ``label`` names it in every message ("rank 2", "mpirun")."""

    label: str
    host: Any                      # the testbed host (Host, name or worker index)
    argv: list[str]
    env: dict[str, str] | None = None


@dataclass
class Outcome:
    """How one process ended."""

    label: str
    returncode: int | None         # None: still running at the deadline, killed
    stdout: list[str] = field(default_factory=list)
    stderr: str = ""
    waited: float = 0.0            # seconds the parent waited for it at most

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def error_class(self) -> type[NicoffloadError]:
        return error_class(self.returncode)

    @property
    def message(self) -> str:
        """The process's own last word on stderr (without the CLI's prefix)."""
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip() and not ln.startswith(_NOISE)]
        return lines[-1].removeprefix(_CLI_PREFIX) if lines else "(no message)"

    @property
    def reason(self) -> str | None:
        """Why it failed, in words (None when it did not)."""
        if self.returncode is None:
            return f"did not finish within {self.waited:.0f}s (killed)"
        if self.returncode < 0:
            return f"killed by signal {-self.returncode}: {self.message}"
        if self.returncode != 0:
            return self.message
        return None

    def describe(self) -> str:
        """``label: reason`` (the label once, even when the process named itself)."""
        r = self.reason or "ok"
        return r if r.startswith(f"{self.label}:") else f"{self.label}: {r}"

    def json_lines(self) -> list[str]:
        return [ln for ln in self.stdout if ln.startswith("{")]


def failure(outcomes: list, what: str = "") -> NicoffloadError | None:
    """One error naming every process that failed and why; its class is theirs when they all
    failed the same way (by exit code), else the base class. None when all succeeded.
    ``outcomes``: :class:`Outcome` or anything with its ``ok``, ``error_class`` and ``describe()``."""
    bad = [o for o in outcomes if not o.ok]
    if not bad:
        return None
    classes = {o.error_class for o in bad}
    cls = classes.pop() if len(classes) == 1 else NicoffloadError
    text = "; ".join(o.describe() for o in bad)
    return cls(f"{what}{text}")


def _descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (from /proc)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _kill(pid: int, group: bool = False) -> None:
    """SIGKILL to ``pid`` (``group``: to its process group), if it is still there."""
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Launch:
    """Processes started together. Their stdout lines arrive in one queue as they are printed
    (:meth:`next_line`) and are kept per process; stderr goes to a file per process."""

    def __init__(self, tb, specs: list[RankSpec]):
        self.specs = list(specs)
        self.q: queue.Queue = queue.Queue()
        self.procs: list[subprocess.Popen] = []
        self._out: list[list[str]] = []
        self._err: list = []
        self._threads: list[threading.Thread] = []
        self._final: list[Outcome] | None = None
        self._t0 = time.monotonic()
        try:
            for spec in self.specs:
                self._start(tb, spec)
        except BaseException:
            self.stop()
            raise

    def _start(self, tb, spec: RankSpec) -> None:
        err = tempfile.TemporaryFile("w+", errors="replace", prefix="nicoffload-stderr-")
        self._err.append(err)
        # a session of its own: what it starts goes with it (wait)
        p = tb.popen(spec.host, spec.argv, stdout=subprocess.PIPE, stderr=err, text=True, env=spec.env,
                     start_new_session=True)
        lines: list[str] = []
        self.procs.append(p)
        self._out.append(lines)
        t = threading.Thread(target=self._read, args=(spec.label, p, lines), daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self, label: str, p: subprocess.Popen, lines: list[str]) -> None:
        try:
            for line in p.stdout:
                lines.append(line.rstrip("\n"))
                self.q.put((label, line))
        except (OSError, ValueError):  # closed under us: a grandchild kept the pipe open
            pass
        finally:
            self.q.put((label, None))

    def next_line(self, timeout: float) -> tuple[str, str | None]:
        """(label, line) of the next line any process printed; line None: that process closed its
        stdout (it ended). Raises queue.Empty after ``timeout`` seconds without one."""
        return self.q.get(timeout=max(0.01, timeout))

    def _outcome(self, i: int, killed: bool = False) -> Outcome:
        p, err = self.procs[i], self._err[i]
        self._threads[i].join(timeout=2)
        err.seek(0)
        return Outcome(self.specs[i].label, None if killed else p.returncode, list(self._out[i]), err.read(),
                       time.monotonic() - self._t0)

    def ended(self) -> list[Outcome]:
        """Outcomes of the processes that have ended so far."""
        return [self._outcome(i) for i, p in enumerate(self.procs) if p.poll() is not None]

    def wait(self, deadline: float) -> list[Outcome]:
        """Wait for every process until ``deadline`` (time.monotonic()); kill the ones still
        running then. Outcomes in the order the specs were given."""
        if self._final is not None:
            return self._final
        killed = set()
        for i, p in enumerate(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kids = _descendants(p.pid)  # torchrun's ranks sit in sessions of their own
                p.kill()
                p.wait()
                for k in kids:
                    _kill(k)
                killed.add(i)
            # what it left running in its session: a rank that torchrun started and that outlived
            # it would keep the stdout pipe open for ever
            _kill(p.pid, group=True)
        self._final = [self._outcome(i, i in killed) for i in range(len(self.procs))]
        self._close()
        return self._final

    def stop(self, grace: float = 10.0) -> list[Outcome]:
        """SIGTERM to every process still running, SIGKILL after ``grace`` seconds (once)."""
        if self._final is not None:
            return self._final
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        return self.wait(time.monotonic() + grace)

    def _close(self) -> None:
        for p, t in zip(self.procs, self._threads):
            # a reader still blocked on the pipe (held open by something that outlived the
            # process) holds the file's lock: closing it would wait for ever; the thread is a daemon
            if p.stdout and not t.is_alive():
                p.stdout.close()
        for f in self._err:
            f.close()

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
