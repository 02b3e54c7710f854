"""The toolkit's one binding of Debian's libbpf.so.1 (ctypes): program load with func_info,
XDP attach by fd, BPF_PROG_TEST_RUN, pins, raw map access by fd, a program's run-time stats and
the switch that makes the kernel collect them.

Everything that talks to the bpf(2) system call without bcc goes through here; bcc itself
(compile, typed tables) stays in :mod:`nicoffload.ebpf.loader`.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nicoffload.errors import MapError, NotFoundError, PrivilegeError, SetupError

BPF_PROG_TYPE_XDP = 6
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_STATS_RUN_TIME = 0

#: XDP verdicts (enum xdp_action)
XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)


class _TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts."""
    _fields_ = [
        ("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p), ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32),
    ]


class _ProgLoadOpts(ctypes.Structure):
    """struct bpf_prog_load_opts of libbpf 1.x (fields up to log_true_size)."""
    _fields_ = [
        ("sz", ctypes.c_size_t), ("attempts", ctypes.c_int), ("expected_attach_type", ctypes.c_int),
        ("prog_btf_fd", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32), ("prog_ifindex", ctypes.c_uint32),
        ("kern_version", ctypes.c_uint32), ("attach_btf_id", ctypes.c_uint32),
        ("attach_btf_obj_fd", ctypes.c_uint32), ("attach_prog_fd", ctypes.c_int),
        ("fd_array", ctypes.c_void_p), ("func_info", ctypes.c_void_p), ("func_info_cnt", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32), ("line_info", ctypes.c_void_p),
        ("line_info_cnt", ctypes.c_uint32), ("line_info_rec_size", ctypes.c_uint32),
        ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32), ("log_buf", ctypes.c_char_p),
        ("log_true_size", ctypes.c_uint32),
    ]


class _MapInfo(ctypes.Structure):
    """struct bpf_map_info up to its name (the kernel fills what fits)."""
    _u32 = ctypes.c_uint32
    _fields_ = [("type", _u32), ("id", _u32), ("key_size", _u32), ("value_size", _u32), ("max_entries", _u32),
                ("map_flags", _u32), ("name", ctypes.c_char * 16)]


class _FuncInfo(ctypes.Structure):
    """struct bpf_func_info."""
    _fields_ = [("insn_off", ctypes.c_uint32), ("type_id", ctypes.c_uint32)]


class _ProgInfo(ctypes.Structure):
    """struct bpf_prog_info up to run_cnt (uapi/linux/bpf.h; the kernel fills what fits)."""
    _u32, _u64 = ctypes.c_uint32, ctypes.c_uint64
    _fields_ = [
        ("type", _u32), ("id", _u32), ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", _u32),
        ("xlated_prog_len", _u32), ("jited_prog_insns", _u64), ("xlated_prog_insns", _u64),
        ("load_time", _u64), ("created_by_uid", _u32), ("nr_map_ids", _u32), ("map_ids", _u64),
        ("name", ctypes.c_char * 16), ("ifindex", _u32), ("gpl_compatible", _u32),
        ("netns_dev", _u64), ("netns_ino", _u64), ("nr_jited_ksyms", _u32), ("nr_jited_func_lens", _u32),
        ("jited_ksyms", _u64), ("jited_func_lens", _u64), ("btf_id", _u32), ("func_info_rec_size", _u32),
        ("func_info", _u64), ("nr_func_info", _u32), ("nr_line_info", _u32), ("line_info", _u64),
        ("jited_line_info", _u64), ("nr_jited_line_info", _u32), ("line_info_rec_size", _u32),
        ("jited_line_info_rec_size", _u32), ("nr_prog_tags", _u32), ("prog_tags", _u64),
        ("run_time_ns", _u64), ("run_cnt", _u64),
    ]


_lib = None


def lib():
    """libbpf.so.1 with the signatures the toolkit uses (loaded once)."""
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            handle = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise SetupError("libbpf.so.1 is missing: apt-get install libbpf1") from e
        vp, ci, cu, cp = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p
        sigs = {
            "bpf_prog_test_run_opts": ([ci, ctypes.POINTER(_TestRunOpts)], ci),
            "bpf_obj_pin": ([ci, cp], ci),
            "bpf_obj_get": ([cp], ci),
            "bpf_prog_load": ([ci, cp, cp, vp, ctypes.c_size_t, ctypes.POINTER(_ProgLoadOpts)], ci),
            "bpf_xdp_attach": ([ci, ci, cu, vp], ci),
            "bpf_map_update_elem": ([ci, vp, vp, ctypes.c_uint64], ci),
            "bpf_map_lookup_elem": ([ci, vp, vp], ci),
            "bpf_map_delete_elem": ([ci, vp], ci),
            "bpf_prog_get_fd_by_id": ([cu], ci),
            "bpf_map_get_fd_by_id": ([cu], ci),
            "bpf_obj_get_info_by_fd": ([ci, vp, ctypes.POINTER(cu)], ci),
            "bpf_enable_stats": ([ci], ci),
            "libbpf_num_possible_cpus": ([], ci),
            "btf__new_empty": ([], vp),
            "btf__free": ([vp], None),
            "btf__add_int": ([vp, cp, ctypes.c_size_t, ci], ci),
            "btf__add_func_proto": ([vp, ci], ci),
            "btf__add_func_param": ([vp, cp, ci], ci),
            "btf__add_func": ([vp, cp, ci, ci], ci),
            "btf__load_into_kernel": ([vp], ci),
            "btf__fd": ([vp], ci),
        }
        for fname, (args, res) in sigs.items():
            f = getattr(handle, fname)
            f.argtypes, f.restype = args, res
        _lib = handle
    return _lib


def _errno(rc: int) -> int:
    """libbpf 1.x returns -errno and also sets errno; take whichever says something."""
    return ctypes.get_errno() or (-rc if rc < 0 else 0)


def num_possible_cpus() -> int:
    return lib().libbpf_num_possible_cpus()


# --- pins ----------------------------------------------------------------------------------
def pin(fd: int, path: Path) -> None:
    """Pin a program or map fd at ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rc = lib().bpf_obj_pin(fd, str(path).encode())
    if rc != 0:
        err = _errno(rc)
        raise OSError(err, f"pinning {path} failed: {os.strerror(err)}")


def obj_get(path: Path) -> int:
    """Open a pinned object; the caller owns the fd."""
    rc = lib().bpf_obj_get(str(path).encode())
    if rc < 0:
        err = _errno(rc)
        if err == 1 or err == 13:
            raise PrivilegeError(f"opening {path} needs root")
        raise NotFoundError(f"{path} is not pinned ({os.strerror(err)})")
    return rc


class Map:
    """A map with u32 keys and one ctypes value type, reached by fd (e.g. from a pin). Per-CPU
    maps read and write one value per possible CPU; ``lookup`` then returns their sum."""

    def __init__(self, name: str, fd: int, value_type, percpu: bool = False):
        self.name, self.fd, self.value_type, self.percpu = name, fd, value_type, percpu
        self.ncpu = num_possible_cpus() if percpu else 1

    @classmethod
    def pinned(cls, path: Path, value_type, percpu: bool = False) -> "Map":
        return cls(path.name, obj_get(path), value_type, percpu)

    def _err(self, op: str, key: int, rc: int) -> MapError:
        return MapError(f"{op} {self.name}[{key}] failed: {os.strerror(_errno(rc))}")

    def update(self, key: int, value: int) -> None:
        k = ctypes.c_uint32(key)
        v = (self.value_type * self.ncpu)(*([value] * self.ncpu))
        rc = lib().bpf_map_update_elem(self.fd, ctypes.byref(k), ctypes.byref(v), 0)
        if rc != 0:
            raise self._err("writing", key, rc)

    def lookup(self, key: int) -> int | None:
        """The value (per-CPU: summed over CPUs); None when the key is absent."""
        k = ctypes.c_uint32(key)
        v = (self.value_type * self.ncpu)()
        if lib().bpf_map_lookup_elem(self.fd, ctypes.byref(k), ctypes.byref(v)) != 0:
            return None
        return sum(int(x) for x in v)

    def delete(self, key: int) -> bool:
        k = ctypes.c_uint32(key)
        return lib().bpf_map_delete_elem(self.fd, ctypes.byref(k)) == 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_by_id(map_id: int) -> int:
    """An fd of the map with this id (the caller owns it). Unlike a pin this works from any mount
    namespace (``ip netns exec`` gives a process its own /sys without the BPF filesystem)."""
    fd = lib().bpf_map_get_fd_by_id(map_id)
    if fd < 0:
        err = _errno(fd)
        if err in (1, 13):
            raise PrivilegeError(f"opening BPF map {map_id} needs root")
        raise NotFoundError(f"no BPF map with id {map_id} ({os.strerror(err)})")
    return fd


def _obj_info(fd: int, info, what: str):
    """``info`` (a _MapInfo or _ProgInfo) filled by BPF_OBJ_GET_INFO_BY_FD for ``fd``."""
    size = ctypes.c_uint32(ctypes.sizeof(info))
    rc = lib().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size))
    if rc != 0:
        err = _errno(rc)
        raise OSError(err, f"reading the info of {what} failed: {os.strerror(err)}")
    return info


def map_info(fd: int) -> dict:
    """id, name, type, key and value size, entries and flags of a map fd."""
    info = _obj_info(fd, _MapInfo(), f"BPF map fd {fd}")
    return {"id": info.id, "name": info.name.decode(errors="replace"), "type": info.type,
            "key_size": info.key_size, "value_size": info.value_size, "max_entries": info.max_entries,
            "flags": info.map_flags}


# --- program load, attach, test run --------------------------------------------------------
_BTF_FUNC_STATIC, _BTF_FUNC_GLOBAL = 0, 1


def func_btf(names: list[str]):
    """A BTF object holding one FUNC per subprogram (the verifier wants func_info once a program
    has callbacks). The entry point is global, callbacks are static; the types are nominal
    (static subprograms are verified from their code, not from their prototypes). Returns
    (btf handle, type ids); free the handle with ``lib().btf__free``."""
    L = lib()
    btf = L.btf__new_empty()
    if not btf:
        raise SetupError("libbpf could not create a BTF object")
    t_int = L.btf__add_int(btf, b"int", 4, 1)
    t_long = L.btf__add_int(btf, b"long", 8, 1)
    ids = []
    for k, name in enumerate(names):
        proto = L.btf__add_func_proto(btf, t_int if k == 0 else t_long)
        L.btf__add_func_param(btf, b"arg0", t_long)
        if k:
            L.btf__add_func_param(btf, b"arg1", t_long)
        ids.append(L.btf__add_func(btf, name.encode(), _BTF_FUNC_GLOBAL if k == 0 else _BTF_FUNC_STATIC, proto))
    if min(ids) < 0 or L.btf__load_into_kernel(btf) != 0:
        L.btf__free(btf)
        raise SetupError("loading a BTF object into the kernel failed (is CONFIG_DEBUG_INFO_BTF set?)")
    return btf, ids


def prog_load(prog_type: int, name: str, code: bytearray, *, prog_flags: int = 0,
              funcs: list[tuple[int, str]] = (), log: ctypes.Array | None = None) -> tuple[int, int]:
    """bpf_prog_load of raw instructions. ``funcs``: (first instruction, name) per subprogram,
    entry point first, given when the program has callbacks. ``log``: a buffer for the verifier
    log (level 1). Returns (fd or -1, errno)."""
    L = lib()
    btf, ids = func_btf([n for _, n in funcs]) if funcs else (None, [])
    try:
        fi = (_FuncInfo * len(ids))(*[_FuncInfo(s, t) for (s, _), t in zip(funcs, ids)])
        buf = (ctypes.c_char * len(code)).from_buffer(code)
        o = _ProgLoadOpts()
        o.sz = ctypes.sizeof(o)
        o.prog_flags = prog_flags
        if btf is not None:
            o.prog_btf_fd = L.btf__fd(btf)
            o.func_info = ctypes.cast(fi, ctypes.c_void_p)
            o.func_info_cnt = len(ids)
            o.func_info_rec_size = ctypes.sizeof(_FuncInfo)
        if log is not None:
            o.log_level, o.log_size = 1, len(log)
            o.log_buf = ctypes.cast(log, ctypes.c_char_p)
        fd = L.bpf_prog_load(prog_type, name[:15].encode(), b"GPL", buf, len(code) // 8, ctypes.byref(o))
        return (fd, 0) if fd >= 0 else (-1, _errno(fd))
    finally:
        if btf is not None:
            L.btf__free(btf)


def xdp_attach(ifindex: int, fd: int, flags: int) -> int:
    """bpf_xdp_attach; returns 0 or the errno."""
    rc = lib().bpf_xdp_attach(ifindex, fd, flags, None)
    return 0 if rc == 0 else _errno(rc)


@dataclass
class TestRunResult:
    __test__ = False  # not a pytest class
    verdict: int
    data: bytes
    duration_ns: int


def test_run(prog_fd: int, packet: bytes, repeat: int = 1, out_room: int = 4096) -> TestRunResult:
    """BPF_PROG_TEST_RUN: run the program once (or ``repeat`` times) on ``packet``; verdict,
    output frame and mean ns per run (that includes ~50 ns of the kernel's own timing)."""
    inbuf = ctypes.create_string_buffer(bytes(packet), len(packet))
    outbuf = ctypes.create_string_buffer(len(packet) + out_room)
    opts = _TestRunOpts()
    opts.sz = ctypes.sizeof(_TestRunOpts)
    opts.data_in = ctypes.cast(inbuf, ctypes.c_void_p)
    opts.data_size_in = len(packet)
    opts.data_out = ctypes.cast(outbuf, ctypes.c_void_p)
    opts.data_size_out = len(outbuf)
    opts.repeat = max(1, repeat)
    rc = lib().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts))
    if rc != 0:
        err = _errno(rc)
        raise OSError(err, f"BPF_PROG_TEST_RUN failed: {os.strerror(err)}")
    return TestRunResult(opts.retval, outbuf.raw[: opts.data_size_out], opts.duration)


test_run.__test__ = False  # type: ignore[attr-defined]


# --- run-time statistics -------------------------------------------------------------------
@dataclass(frozen=True)
class ProgStats:
    run_time_ns: int
    run_cnt: int

    def __sub__(self, other: "ProgStats") -> "ProgStats":
        return ProgStats(self.run_time_ns - other.run_time_ns, self.run_cnt - other.run_cnt)


def prog_stats(prog_id: int) -> ProgStats:
    """Total run time and run count of a loaded program (both grow only while stats are
    enabled, see :func:`stats_enabled`)."""
    L = lib()
    fd = L.bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        err = _errno(fd)
        if err in (1, 13):
            raise PrivilegeError("reading BPF program statistics needs root")
        raise NotFoundError(f"no BPF program with id {prog_id} ({os.strerror(err)})")
    try:
        info = _prog_info(fd, f"BPF program {prog_id}")
        return ProgStats(int(info.run_time_ns), int(info.run_cnt))
    finally:
        os.close(fd)


def prog_name(prog_id: int) -> str | None:
    """A loaded program's name (its first 15 characters), or None if there is none by that id."""
    fd = lib().bpf_prog_get_fd_by_id(prog_id)
    if fd < 0:
        return None
    try:
        return _prog_info(fd, f"BPF program {prog_id}").name.decode(errors="replace")
    finally:
        os.close(fd)


def _prog_info(fd: int, what: str) -> _ProgInfo:
    return _obj_info(fd, _ProgInfo(), what)


def prog_code(fd: int) -> tuple[str, int]:
    """A loaded program's tag (hex; the kernel's hash of its instructions) and its length in
    translated instructions: two builds of one source differ in these where their code does."""
    info = _prog_info(fd, f"the BPF program of fd {fd}")
    return bytes(info.tag).hex(), int(info.xlated_prog_len) // 8


@contextlib.contextmanager
def stats_enabled() -> Iterator[None]:
    """Make the kernel account every BPF program's run time while inside (BPF_ENABLE_STATS:
    held by an fd, so it ends with this block or with the process, whichever comes first, and
    never changes what ``kernel.bpf_stats_enabled`` says for anyone else)."""
    fd = lib().bpf_enable_stats(BPF_STATS_RUN_TIME)
    if fd < 0:
        err = _errno(fd)
        if err in (1, 13):
            raise PrivilegeError("enabling BPF run-time statistics needs root")
        raise OSError(err, f"enabling BPF run-time statistics failed: {os.strerror(err)}")
    try:
        yield
    finally:
        os.close(fd)
