"""bcc plumbing shared by every program: compile with the job's constants, load with the
verifier log captured, attach XDP inside a network namespace (a bcc function, or a program fd),
the BPF filesystem and pin directories. Programs with bpf_loop callbacks, which bcc cannot link,
are loaded by :mod:`.linker`; tc ingress filters are :mod:`.tc`; raw bpf(2) calls (test runs,
pins, maps, stats) are in :mod:`.libbpf`.

bcc prints verifier logs to stderr only and does not track XDP attachments; this module wraps
both: ``load_func`` raises :class:`VerifierError` carrying the log, and :class:`XdpAttachment`
detaches idempotently.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from nicoffload.ebpf import libbpf
from nicoffload.errors import AttachError, NotFoundError, PrivilegeError, SetupError, VerifierError
from nicoffload.wire.proto import xdp_dir

NETNS_DIR = Path("/run/netns")
BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "nicoffload"

XDP_FLAGS_UPDATE_IF_NOEXIST = 1 << 0
XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
#: largest MTU native XDP accepts on veth for a program without frags
MAX_NATIVE_MTU = 3506
MODES = {"native": XDP_FLAGS_DRV_MODE, "generic": XDP_FLAGS_SKB_MODE}

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_ns_lock = threading.RLock()


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise PrivilegeError(f"{what} needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN): run it with sudo")


def import_bcc():
    try:
        import bcc  # noqa: F401  (Debian's python3-bpfcc, from the system site packages)
    except ImportError as e:
        raise SetupError(
            "bcc is not importable: install Debian's python3-bpfcc and use a virtual environment made "
            "with '/usr/bin/python3 -m venv --system-site-packages' (scripts/setup.sh does both)"
        ) from e
    return bcc


@contextlib.contextmanager
def netns(name: str | None) -> Iterator[None]:
    """Enter the *network* namespace ``name`` (only that one) in this thread; None: stay."""
    if not name:
        yield
        return
    path = NETNS_DIR / name
    if not path.exists():
        raise NotFoundError(f"network namespace {name!r} does not exist (ip netns list)")
    with _ns_lock:
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    if err == errno.EPERM:
                        raise PrivilegeError(f"entering network namespace {name!r} needs root")
                    raise NotFoundError(f"entering network namespace {name!r} failed: {os.strerror(err)}")
            finally:
                os.close(fd)
            try:
                yield
            finally:
                if _libc.setns(orig, _CLONE_NEWNET) != 0:  # pragma: no cover - would be fatal
                    raise OSError(ctypes.get_errno(), "returning to the original network namespace failed")
        finally:
            os.close(orig)


def ensure_bpffs() -> None:
    """Mount the BPF filesystem on /sys/fs/bpf when it is missing (it is, on a new machine)."""
    st = os.statvfs(BPFFS) if BPFFS.exists() else None
    with open("/proc/mounts") as f:
        mounted = any(line.split()[1] == str(BPFFS) and line.split()[2] == "bpf" for line in f)
    if mounted:
        return
    if st is None:
        raise SetupError(f"{BPFFS} does not exist; is sysfs mounted?")
    rc = os.system(f"mount -t bpf bpf {BPFFS}")
    if rc != 0:
        raise SetupError(f"mounting the BPF filesystem on {BPFFS} failed; run: mount -t bpf bpf {BPFFS}")


def make_pin_dir(path: Path, attempts: int = 10) -> None:
    """Create the pin directory ``path`` under :data:`PIN_ROOT` with its missing parents.
    Another process's :func:`remove_pin_dir` may remove a parent this call has just made (it
    was empty for a moment): then the chain is made again."""
    for left in range(attempts - 1, -1, -1):
        try:
            path.mkdir(parents=True, exist_ok=True)
            return
        except FileNotFoundError:
            if not left:
                raise


def remove_pin_dir(path: Path) -> bool:
    """Remove the pin directory ``path`` with its pins, then each parent up to and including
    :data:`PIN_ROOT` that it leaves empty. A parent another process uses holds that process's
    directory, so it is not empty and stays. Returns whether ``path`` existed."""
    existed = path.exists()
    shutil.rmtree(path, ignore_errors=True)
    for parent in path.parents:
        if not parent.is_relative_to(PIN_ROOT):
            break
        try:
            parent.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: in use
            break
    return existed


@contextlib.contextmanager
def _capture_stderr() -> Iterator[list[str]]:
    """Capture what C code writes to fd 2 (bcc writes compiler errors and verifier logs there)."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _call_capturing(fn, *args):
    """Call ``fn(*args)`` with fd 2 captured: (result, exception or None, what C code printed)."""
    with _capture_stderr() as err:
        try:
            res, exc = fn(*args), None
        except Exception as e:  # bcc raises plain Exception
            res, exc = None, e
    return res, exc, (err[0] if err else "")


def cflags_from(defines: Mapping[str, int | str]) -> list[str]:
    flags = [f"-I{xdp_dir()}"]
    for k, v in defines.items():
        flags.append(f"-D{k}={v}")
    return flags


_OWN_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"/]+)"[ \t]*$')


def main_file(text: str, name: str, where: Path | None = None) -> str:
    """The text bcc compiles for ``text`` (the source ``name``): each ``#include "x.h"`` of one of
    the project's own headers (a file in ``where``, default xdp/) replaced by the header's text,
    once per header (as its include guard would have it), between #line markers, so that the
    compiler's messages still name the header and its line. bcc rewrites map accesses
    (``map.lookup()``, ``map.redirect_map()``) and compiles programs and bpf_loop callbacks only
    in its main file; spliced in, a header may hold them as the source itself may. System headers
    (``<...>``) stay includes."""
    where = xdp_dir() if where is None else where
    seen: set[str] = set()

    def splice(src: str, fname: str) -> str:
        out = []
        for n, line in enumerate(src.splitlines(keepends=True), 1):
            m = _OWN_INCLUDE.match(line.rstrip("\n"))
            if not m or not (where / m.group(1)).is_file():
                out.append(line)
                continue
            inc = m.group(1)
            if inc not in seen:
                seen.add(inc)
                body = splice((where / inc).read_text(), inc)
                out.append(f'#line 1 "{inc}"\n{body}{"" if body.endswith(chr(10)) else chr(10)}')
                out.append(f'#line {n + 1} "{fname}"\n')
            else:
                out.append("\n")
        return "".join(out)

    return splice(text, name)


def compile_bpf(source_name: str, defines: Mapping[str, int | str] | None = None, text: str | None = None):
    """Compile ``xdp/<source_name>`` (or ``text``) with bcc, the project's headers spliced in
    (:func:`main_file`); compiler errors become SetupError."""
    require_root(f"compiling {source_name}")
    bcc = import_bcc()
    src = main_file(text if text is not None else (xdp_dir() / source_name).read_text(), source_name)
    b, exc, log = _call_capturing(lambda: bcc.BPF(text=src, cflags=cflags_from(defines or {})))
    if exc is not None:
        if "linux/" in log and "not found" in log or "kernel headers" in str(exc).lower():
            raise SetupError(f"compiling {source_name} failed: kernel headers missing; run scripts/setup.sh\n{log}")
        raise VerifierError(f"compiling {source_name} failed: {exc}; the compiler said:\n{log.strip()[-4000:]}", log)
    return b


def load_func(b, fn_name: str, prog_type_name: str = "XDP", source_name: str = "program"):
    """Load one function; a verifier rejection raises VerifierError carrying the log."""
    bcc = import_bcc()
    prog_type = getattr(bcc.BPF, prog_type_name)
    fn, exc, log = _call_capturing(b.load_func, fn_name, prog_type)
    if exc is not None:
        if "Permission denied" in str(exc) and os.geteuid() != 0:
            raise PrivilegeError(f"loading {fn_name} needs root")
        tail = "\n".join(log.strip().splitlines()[-25:])
        raise VerifierError(
            f"the kernel verifier rejected {fn_name} from {source_name}: {exc}\n"
            f"last lines of the verifier log:\n{tail}", log)
    return fn


@dataclass
class XdpAttachment:
    """One XDP program attached to one interface in one namespace; detach() is idempotent."""

    ifname: str
    netns: str | None
    mode: str = "native"
    attached: bool = True

    def detach(self) -> bool:
        """Detach; returns True if something was detached. Harmless when already gone."""
        if not self.attached:
            return False
        self.attached = False
        return detach_xdp(self.ifname, self.netns, self.mode)


def ifindex(ifname: str, ns: str | None) -> int:
    idx = _libc.if_nametoindex(ifname.encode())
    if idx == 0:
        where = f" in namespace {ns!r}" if ns else ""
        raise NotFoundError(f"no interface {ifname!r}{where} (ip -n {ns or '<ns>'} link)")
    return idx


def xdp_prog_id(ifname: str, ns: str | None) -> int | None:
    """The id of the XDP program attached to ifname (None when nothing is attached)."""
    from pyroute2 import IPRoute

    with netns(ns):
        idx = ifindex(ifname, ns)
        with IPRoute() as ipr:
            link = ipr.get_links(idx)[0]
    xdp = link.get_attr("IFLA_XDP")
    if not xdp:
        return None
    pid = xdp.get_attr("IFLA_XDP_PROG_ID")
    return pid or None


def attach_xdp(fn, ifname: str, ns: str | None, mode: str = "native") -> XdpAttachment:
    """Attach ``fn`` to ``ifname`` inside ``ns``; refuses to replace an existing program."""
    bcc = import_bcc()
    if mode not in MODES:
        raise AttachError(f"unknown XDP mode {mode!r}; choose native or generic")
    with netns(ns):
        ifindex(ifname, ns)
        _, exc, log = _call_capturing(bcc.BPF.attach_xdp, ifname, fn, MODES[mode] | XDP_FLAGS_UPDATE_IF_NOEXIST)
    if exc is not None:
        log = log.strip()
        hint = "; try --mode generic" if mode == "native" else ""
        if "Device or resource busy" in log or "busy" in str(exc).lower():
            raise AttachError(f"{ifname} already has an XDP program attached; unload it first")
        raise AttachError(f"attaching XDP to {ifname} in {mode} mode failed: {log or exc}{hint}")
    return XdpAttachment(ifname, ns, mode)


def detach_xdp(ifname: str, ns: str | None, mode: str = "native") -> bool:
    """Remove whatever XDP program is attached in ``mode``; False if there was none or no such link."""
    bcc = import_bcc()
    try:
        if xdp_prog_id(ifname, ns) is None:
            return False
    except NotFoundError:
        return False
    with netns(ns):
        with _capture_stderr():
            try:
                bcc.BPF.remove_xdp(ifname, MODES.get(mode, 0))
            except Exception:
                pass
        # a program attached in the other mode: remove that too
        for flags in MODES.values():
            with _capture_stderr():
                try:
                    bcc.BPF.remove_xdp(ifname, flags)
                except Exception:
                    pass
    return True


def attach_xdp_fd(fd: int, ifname: str, ns: str | None, mode: str = "native") -> XdpAttachment:
    """Attach a program fd to ``ifname`` inside ``ns``; refuses to replace an existing program."""
    if mode not in MODES:
        raise AttachError(f"unknown XDP mode {mode!r}; choose native or generic")
    with netns(ns):
        idx = ifindex(ifname, ns)
        err = libbpf.xdp_attach(idx, fd, MODES[mode] | XDP_FLAGS_UPDATE_IF_NOEXIST)
    if err:
        where = f"{ifname} in {ns or 'the root namespace'}"
        if err in (errno.EBUSY, errno.EEXIST):
            raise AttachError(f"{where} already has an XDP program attached; unload it first")
        hint = "; try --mode generic" if mode == "native" else ""
        if err == errno.ERANGE:
            hint = (f"; the MTU of {ifname} is too large for native XDP on this driver "
                    f"(veth: at most {MAX_NATIVE_MTU}){hint}")
        raise AttachError(f"attaching XDP to {where} in {mode} mode failed: {os.strerror(err)}{hint}")
    return XdpAttachment(ifname, ns, mode)
