"""A ring node's maps by fd (:class:`nicoffload.ring.RingNode` holds them; a
:class:`~nicoffload.ring.RingCommunicator` maps them into its address space): the state
words, the staged records (``ring_local``) and stored finals (``ring_result``) as numpy arrays
over the mmap-ed maps, the program's event ring buffer, and its per-CPU counters. Opened from a
bcc module, or by id in a process that cannot see the pins."""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from nicoffload.ebpf import libbpf
from nicoffload.errors import MapError, NotFoundError
from nicoffload.ring.layout import ST_WORDS, STATS
from nicoffload.wire import proto

MAPS = ("ring_cfg", "ring_state", "ring_local", "ring_result", "ring_stats", "ring_events")
PAGE = mmap.PAGESIZE


class RingEvents:
    """Consumer side of the program's BPF ring buffer: ``fileno()`` for select/poll, ``drain()``
    the events (call, what) it holds. Mapped directly (no libbpf ring buffer API needed)."""

    BUSY, DISCARD = 1 << 31, 1 << 30

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.mask = fd, size, size - 1
        self._cons = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._prod = mmap.mmap(fd, PAGE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE)
        self._cpos = np.frombuffer(self._cons, dtype=np.uint64, count=1)
        self._ppos = np.frombuffer(self._prod, dtype=np.uint64, count=1)
        self._words = np.frombuffer(self._prod, dtype=np.uint32)

    def fileno(self) -> int:
        return self.fd

    def drain(self) -> list[tuple[int, int]]:
        out = []
        cons, prod = int(self._cpos[0]), int(self._ppos[0])
        while cons < prod:
            at = (PAGE + (cons & self.mask)) // 4
            head = int(self._words[at])
            if head & self.BUSY:
                break
            ln = head & ~(self.BUSY | self.DISCARD)
            if not head & self.DISCARD and ln >= 8:
                out.append((int(self._words[at + 2]), int(self._words[at + 3])))
            cons += (ln + 8 + 7) & ~7
        self._cpos[0] = cons
        return out


class RingMaps:
    """A node's maps by fd: the state words, its staged records (``local``) and stored finals
    (``result``) as numpy arrays over the mapped maps, the event ring, the counters."""

    def __init__(self, fds: dict[str, int], capacity: int, elems: int, owned: bool = True):
        self.fds, self.capacity, self.elems, self.owned = fds, capacity, elems, owned
        self.rec = proto.record_size(elems)
        self._maps: list[mmap.mmap] = []
        self._state = self._local = self._result = None
        self._events: RingEvents | None = None

    @classmethod
    def by_id(cls, ids: dict, capacity: int, elems: int) -> "RingMaps":
        fds: dict[str, int] = {}
        try:
            for name in MAPS:
                fd = fds[name] = libbpf.map_by_id(int(ids[name]))
                got = libbpf.map_info(fd)["name"]
                if got and not name.startswith(got):
                    raise NotFoundError(f"BPF map {ids[name]} is {got!r}, not the ring program's {name} "
                                        f"(the program was unloaded and its ids reused?)")
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return cls(fds, capacity, elems)

    def _map(self, name: str, length: int) -> np.ndarray:
        mm = mmap.mmap(self.fds[name], -(-length // PAGE) * PAGE, mmap.MAP_SHARED,
                       mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mm)
        return np.frombuffer(mm, dtype=np.uint8, count=length)

    @property
    def state(self) -> np.ndarray:
        """The AR_RING_ST_* words (u32, shared with the program)."""
        if self._state is None:
            self._state = self._map("ring_state", 4 * ST_WORDS).view(np.uint32)
        return self._state

    @property
    def local(self) -> np.ndarray:
        if self._local is None:
            self._local = self._map("ring_local", self.capacity * self.rec)
        return self._local

    @property
    def result(self) -> np.ndarray:
        if self._result is None:
            self._result = self._map("ring_result", self.capacity * self.rec)
        return self._result

    @property
    def events(self) -> RingEvents:
        if self._events is None:
            info = libbpf.map_info(self.fds["ring_events"])
            self._events = RingEvents(self.fds["ring_events"], info["max_entries"])
        return self._events

    def stats(self) -> dict[str, int]:
        """The counters summed over CPUs."""
        ncpu = libbpf.num_possible_cpus()
        n = len(STATS)
        buf = (ctypes.c_uint64 * (n * ncpu))()
        key = ctypes.c_uint32(0)
        if libbpf.lib().bpf_map_lookup_elem(self.fds["ring_stats"], ctypes.byref(key), buf) != 0:
            raise MapError("reading ring_stats failed")
        v = np.ctypeslib.as_array(buf).reshape(ncpu, n).sum(axis=0)
        return {name: int(v[i]) for i, name in enumerate(STATS)}

    def reset_stats(self) -> None:
        ncpu = libbpf.num_possible_cpus()
        buf = (ctypes.c_uint64 * (len(STATS) * ncpu))()
        key = ctypes.c_uint32(0)
        if libbpf.lib().bpf_map_update_elem(self.fds["ring_stats"], ctypes.byref(key), buf, 0) != 0:
            raise MapError("zeroing ring_stats failed")

    def reset(self) -> None:
        """Call 0, no record staged or stored: a fresh node (its program gates every call > 0)."""
        self.state[:] = 0
        if self.capacity:
            self.local.reshape(self.capacity, self.rec)[:, proto.FIELD_OFFSETS["epoch"]:][:, :4] = 0
            self.result.reshape(self.capacity, self.rec)[:, proto.FIELD_OFFSETS["epoch"]:][:, :4] = 0

    def close(self) -> None:
        self._state = self._local = self._result = None
        if self._events is not None:
            ev, self._events = self._events, None
            for m in (ev._cons, ev._prod):
                _unmap(m)
        for mm in self._maps:
            _unmap(mm)
        self._maps = []
        if self.owned:
            for fd in self.fds.values():
                if fd >= 0:
                    os.close(fd)
        self.fds = {}


def _unmap(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a numpy view still uses it: unmapped when that goes
        pass
