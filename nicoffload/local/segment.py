"""The ranks of one host in one group, and the POSIX shared memory they share (``/dev/shm``).

A control segment holds one cache line per local rank (its sequence counter and its pid); the
barrier is those counters: a rank bumps its own (no other process writes it, so no atomic
operation is needed on x86-64's ordered stores) and wakes whoever sleeps on it (:mod:`futex`),
and waits for every other rank's counter to reach the same value, first spinning briefly where
the host has a core to spare, then sleeping in the kernel. A data segment holds the call's
buffers; it is replaced by a larger one (a new generation) when a larger tensor comes.

Names: ``nicoffload-<token>-h<host>-p<creator pid>-<part>``: the token is the group's (random,
from its rendezvous), so two jobs or two groups on one host never meet. Every segment is
unlinked as soon as every local rank has it mapped: nothing is left in /dev/shm when the ranks
die, however they die (a crash in the instant between creation and unlinking leaves a segment
whose creator pid is dead: :func:`sweep` removes those).

A local rank that dies is noticed by the ranks waiting for it (its pid is gone, checked a few
times a second while waiting), and they fail naming it instead of spinning; the group's abort
(the torch backend's liveness, for ranks on other hosts) ends every wait within 50 ms.
"""
from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np

from nicoffload.errors import (AggregatorLost, AggregatorReset, InputError, NicoffloadError, SetupError,
                               SilentAggregator, TimeoutError_)
from nicoffload.local import futex

SHM = Path("/dev/shm")
PREFIX = "nicoffload-"
MAGIC = 0x4E49434F4C4F4341  # "NICOLOCA"
#: int64 words per rank in the control segment (one cache line), and of the header before them
LINE = 8
#: how often a waiting rank looks at whether the rank it waits for is still alive (seconds)
PID_CHECK_S = 0.2
#: bytes of a failed rank's message in the control segment
MSG = 512
#: the counter of a rank that failed: past every barrier, so that every waiter wakes and reads why
FAILED = 1 << 62
#: the errors that mean the aggregator is lost, by the class name a failed rank writes
_LOST = {c.__name__ for c in (AggregatorLost, AggregatorReset, SilentAggregator)}


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def sweep() -> list[str]:
    """Unlink the segments of this toolkit whose creator is dead; returns their names."""
    gone = []
    for p in SHM.glob(PREFIX + "*"):
        pid = next((part[1:] for part in p.name.split("-") if part[:1] == "p" and part[1:].isdigit()), None)
        if pid is not None and not alive(int(pid)):
            try:
                p.unlink()
                gone.append(p.name)
            except OSError:
                pass
    return gone


class Segment:
    """One POSIX shared memory segment of ``size`` bytes mapped into this process."""

    def __init__(self, name: str, size: int, create: bool, timeout: float = 30.0):
        self.name, self.size = name, size
        self.path = SHM / name
        if not SHM.is_dir():
            raise SetupError(f"{SHM} is missing: the ranks of one host share memory through POSIX shared memory")
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            except OSError as e:
                os.close(fd)
                self.unlink()
                raise SetupError(f"shared memory segment {self.path} of {size} bytes: {e.strerror} (is {SHM} "
                                 f"large enough? df -h {SHM})") from None
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    if os.fstat(fd).st_size >= size:
                        break
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError_(f"the shared memory segment {self.path} did not appear within {timeout:g}s "
                                        f"(its creator, local rank 0 of this host, is gone or stalls)")
                time.sleep(0.002)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, np.uint8)
        self.addr = self.buf.ctypes.data
        #: called before the mapping goes (a device path unregisters it from the GPU here)
        self.on_close: list = []

    def array(self, offset: int, dtype, count: int) -> np.ndarray:
        return self.buf[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)

    def unlink(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap (the memory goes when every process has unmapped it; the name is long gone)."""
        while self.on_close:
            self.on_close.pop()()
        self.buf = None
        try:
            self.mm.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: the mapping goes with the last one


class HostGroup:
    """The ``len(ranks)`` ranks of one host in one group (``ranks``: their group ranks, local
    rank 0 first); this process is local rank ``me``. Local rank 0 creates the segments."""

    def __init__(self, name: str, me: int, ranks: list[int], timeout: float):
        self.name, self.me, self.ranks, self.K = name, me, list(ranks), len(ranks)
        self.timeout = timeout
        self.error: BaseException | None = None
        self._root = ""  # the message of the local rank whose failure this one's follows
        self._spins = 200 if (os.cpu_count() or 1) > self.K else 0  # spinning with no core to spare only delays
        if me == 0:
            sweep()
        lines = LINE * 8 * (1 + self.K)
        ctl_size = lines + MSG * self.K
        self.ctl = Segment(self._part("c"), ctl_size, create=me == 0, timeout=timeout)
        words = self.ctl.array(0, np.int64, lines // 8)
        self._seq = words[LINE::LINE]                 # one counter per rank, a cache line apart
        self._pid = words[LINE + 1::LINE]
        self._err = words[LINE + 2::LINE]             # 1: the rank failed (its message below)
        self._sig = words[LINE:].reshape(self.K, LINE)[:, 3:7]  # what the rank's call is (checked together)
        self._lost = words[LINE + 7::LINE]            # 1: the rank's lane lost the aggregator in this call
        self._msg = self.ctl.array(lines, np.uint8, MSG * self.K).reshape(self.K, MSG)
        if me == 0:
            words[1] = self.K
            words[0] = MAGIC
        else:
            deadline = time.monotonic() + timeout
            while int(words[0]) != MAGIC:
                if time.monotonic() > deadline:
                    raise TimeoutError_(f"local rank 0 of this host never set up {self.ctl.path}")
                time.sleep(0.001)
        self._pid[me] = os.getpid()
        self.seq = 0
        self.data: Segment | None = None
        self.gen = 0
        self.barrier()  # every local rank has the control segment mapped: its name can go
        self.ctl.unlink()

    def _part(self, part: str) -> str:
        creator = os.getpid() if self.me == 0 else None
        if creator is None:  # the others learn local rank 0's pid from its name in /dev/shm
            return self._find(part)
        return f"{self.name}-p{creator}-{part}"

    def _find(self, part: str) -> str:
        deadline = time.monotonic() + self.timeout
        while True:
            for p in SHM.glob(f"{self.name}-p*-{part}"):
                return p.name
            if time.monotonic() > deadline:
                raise TimeoutError_(f"rank {self.ranks[self.me]}: local rank 0 of this host (rank {self.ranks[0]}) "
                                    f"did not create {SHM}/{self.name}-p*-{part} within {self.timeout:g}s")
            time.sleep(0.002)

    # --- the barrier ----------------------------------------------------------------------------
    def barrier(self, sig: tuple[int, ...] | None = None) -> None:
        """Returns once every local rank has called it as often as this one. ``sig`` (up to four
        integers: what this call is) must be every rank's: ranks given different calls fail
        together (InputError naming both), instead of each waiting at a step the other skips."""
        if self.error is not None:
            raise self.error
        if sig is not None:
            self._sig[self.me, :] = 0
            self._sig[self.me, :len(sig)] = sig
        self.seq += 1
        self._seq[self.me] = self.seq
        futex.wake(self.ctl.addr + 8 * LINE * (1 + self.me))
        for j in range(self.K):
            if j != self.me:
                self._wait_for(j, self.seq)
        if sig is not None:
            for j in range(self.K):
                if tuple(int(v) for v in self._sig[j, :len(sig)]) != tuple(sig):
                    theirs = tuple(int(v) for v in self._sig[j, :len(sig)])
                    self.error = InputError(
                        f"rank {self.ranks[self.me]}: the ranks of this host were not given tensors of the same "
                        f"shape and dtype, nor the same call: {self.describe(sig)} here, {self.describe(theirs)} on "
                        f"rank {self.ranks[j]}; this group's calls are out of step")
                    raise self.error

    #: how a call's ``sig`` reads in an error (the communicator sets its own)
    describe = staticmethod(lambda sig: "call " + "/".join(map(str, sig)))

    def fail(self, error: BaseException) -> None:
        """This rank could not finish its part of a call: tell the others (who wake at once and
        raise naming it), and fail every later call here with ``error``."""
        if self.error is None:
            self.error = error
        # a rank that fails because a peer did passes the peer's message on, not a nest of them
        self._write_msg(self._root or f"{type(error).__name__}: {error}")
        self._err[self.me] = 1
        self._seq[self.me] = FAILED
        futex.wake(self.ctl.addr + 8 * LINE * (1 + self.me))

    def lost(self, error: BaseException | None) -> None:
        """This rank's lane lost the aggregator in the call under way (``error``; None: a new
        call, nothing lost yet). The call goes on to its end on every local rank, so that each
        returns what the host's lanes got of it, and then every rank raises (:meth:`who_lost`)."""
        if error is not None:
            self._write_msg(f"{type(error).__name__}: {error}")
        self._lost[self.me] = 0 if error is None else 1

    def who_lost(self) -> AggregatorLost | None:
        """After a barrier: the first local rank whose lane lost the aggregator in this call, as
        this rank's error naming it and why (None: none)."""
        for j in range(self.K):
            if self._lost[j]:
                why = bytes(self._msg[j]).rstrip(b"\0").decode(errors="replace")
                return AggregatorLost(f"rank {self.ranks[self.me]}: local rank {j} of this host (rank "
                                      f"{self.ranks[j]}) lost the aggregator in this call: {why}")
        return None

    def _write_msg(self, text: str) -> None:
        raw = text.encode()[:MSG - 1]
        self._msg[self.me, :] = 0
        self._msg[self.me, :len(raw)] = np.frombuffer(raw, np.uint8)

    def _failed(self, j: int) -> None:
        if self._err[j]:
            why = self._root = bytes(self._msg[j]).rstrip(b"\0").decode(errors="replace")
            # the aggregator lost by a local rank's lane is lost for this rank too (failover)
            cls = AggregatorLost if why.split(":")[0] in _LOST else NicoffloadError
            self.error = cls(f"rank {self.ranks[self.me]}: local rank {j} of this host (rank "
                             f"{self.ranks[j]}) failed this call: {why}")
            raise self.error

    def _wait_for(self, j: int, target: int) -> None:
        seq = self._seq
        for _ in range(self._spins):
            if seq[j] >= target:
                return self._failed(j)
        addr = self.ctl.addr + 8 * LINE * (1 + j)
        start = time.monotonic()
        check = start + PID_CHECK_S
        while True:
            v = int(seq[j])
            if v >= target:
                return self._failed(j)
            if self.error is not None:
                raise self.error
            futex.wait(addr, v, 0.05)
            now = time.monotonic()
            if now >= check:
                check = now + PID_CHECK_S
                pid = int(self._pid[j])
                if pid and not alive(pid) and seq[j] < target:
                    raise TimeoutError_(f"rank {self.ranks[self.me]}: local rank {j} of this host (rank "
                                        f"{self.ranks[j]}, pid {pid}) is gone: its process died")
            if now - start > self.timeout:
                raise TimeoutError_(f"rank {self.ranks[self.me]}: local rank {j} of this host (rank {self.ranks[j]}) "
                                    f"did not reach this call's step within {self.timeout:g}s")

    def abort(self, error: BaseException) -> None:
        """Every wait of this process ends with ``error`` (within 50 ms)."""
        self.error = error

    # --- the data segment -----------------------------------------------------------------------
    def ensure(self, size: int) -> Segment:
        """The data segment, at least ``size`` bytes (every local rank calls it with the same size
        at the same point: a larger one replaces it, its name gone once every rank mapped it)."""
        if self.data is not None and self.data.size >= size:
            return self.data
        new = 1 << max(20, (size - 1).bit_length())
        self.gen += 1
        part = f"d{self.gen}"
        seg = Segment(self._part(part), new, create=True) if self.me == 0 else None
        self.barrier()  # it exists
        if seg is None:
            seg = Segment(self._find(part), new, create=False, timeout=self.timeout)
        self.barrier()  # every rank has it mapped
        seg.unlink()
        if self.data is not None:
            self.data.close()
        self.data = seg
        return seg

    def close(self) -> None:
        for seg in (self.data, self.ctl):
            if seg is not None:
                seg.unlink()
                seg.close()
        self.data = None
