"""SIGINT and SIGTERM during a testbed's ``with`` block: turned into exceptions, so the block
unwinds and tears the testbed down, instead of killing the process with namespaces left behind.

The signal surfaces as KeyboardInterrupt (SIGINT) or SystemExit(128 + signum) (SIGTERM). The
handler does not tear down itself: the signal may land in the middle of a netlink call of this
very thread, so teardown runs from the unwinding (``__exit__``, or ``up``'s except clause).
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Any, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalGuard:
    """Handlers for SIGINT and SIGTERM between :meth:`install` and :meth:`restore` (main thread
    only; elsewhere both do nothing). ``on_signal`` runs first (the testbed forgets ``keep()``);
    a handler that was installed before (an enclosing testbed's) runs next."""

    def __init__(self, on_signal: Callable[[], None]):
        self._on_signal = on_signal
        self._pid = os.getpid()
        self._prev: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN or prev is None:
                continue
            self._prev[sig] = prev
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        while self._prev:
            sig, prev = self._prev.popitem()
            signal.signal(sig, prev)

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # a forked child (pyroute2 forks to open sockets in namespaces and stops them with
            # SIGTERM): die the default way; unwinding here would tear the parent's testbed down
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)
        self._on_signal()
        prev = self._prev.get(signum)
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)  # an outer handler (e.g. an enclosing testbed) may raise itself
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def terminated_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when its parent (the thread that forked it) dies.
    ``ip netns exec`` execs the command, which keeps the setting."""
    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
            os._exit(1)
    return preexec
