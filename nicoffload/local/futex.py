"""Futex wait and wake on a 32-bit word of shared memory (Linux), through libc's ``syscall``: the
sleeping half of the host's barrier. A rank waits on the sequence counter of the rank it waits
for, which only that rank writes, and that rank wakes the waiters after each increment; the
kernel compares the word before it sleeps, so no wake-up is lost.

Shared (not PRIVATE) futexes: the word sits in a segment that several processes map."""
from __future__ import annotations

import ctypes
import platform

#: syscall numbers of futex(2)
_NR_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}
FUTEX_WAIT, FUTEX_WAKE = 0, 1
INT_MAX = 2 ** 31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NR = _NR_FUTEX.get(platform.machine())


def available() -> bool:
    """Whether this machine's futex syscall number is known (else waiters poll)."""
    return _NR is not None


def wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` holds ``expected``, at most ``timeout`` seconds.
    Returns on a wake-up, a changed word, a timeout or a signal alike: the caller looks again."""
    if _NR is None:
        import time

        time.sleep(min(timeout, 0.001))
        return
    ts = _Timespec(int(timeout), int((timeout - int(timeout)) * 1e9))
    _syscall(ctypes.c_long(_NR), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAIT),
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), ctypes.c_void_p(0), ctypes.c_int(0))


def wake(addr: int, n: int = INT_MAX) -> None:
    """Wake up to ``n`` processes sleeping on the word at ``addr``."""
    if _NR is None:
        return
    _syscall(ctypes.c_long(_NR), ctypes.c_void_p(addr), ctypes.c_int(FUTEX_WAKE), ctypes.c_int(n),
             ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int(0))
