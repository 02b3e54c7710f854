"""What a control plane (:mod:`nicoffload.agg.control`, :mod:`nicoffload.ring`) keeps of a program
it loaded on an interface: the state file that records it for other processes (one JSON file per
namespace and interface, written atomically through a ``.tmp``), the list of what is recorded
(also loads killed while they wrote theirs: only the ``.tmp`` is there), and releasing the loaded
program and its bcc module."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from nicoffload.errors import InputError


def check_names(netns: str | None, iface: str) -> None:
    """A namespace and an interface name that can name files: no path separator, not . or ..
    (``--iface ..`` must never reach the BPF filesystem's parent directory)."""
    if not iface or len(iface) > 15 or "/" in iface or iface in (".", "..") or not iface.isprintable() \
            or any(c.isspace() for c in iface):
        raise InputError(f"{iface!r} is not an interface name (1..15 characters, no '/' or spaces, not . or ..)")
    if netns is not None and (not netns or "/" in netns or netns in (".", "..") or not netns.isprintable()
                              or len(netns) > 255):
        raise InputError(f"{netns!r} is not a network namespace name (no '/', not . or ..)")


def state_file(state_dir: Path, netns: str | None, iface: str) -> Path:
    check_names(netns, iface)
    return state_dir / f"{netns or 'root'}__{iface}.json"


def save(sf: Path, record: dict) -> None:
    """Write ``record`` to the state file ``sf`` (a reader sees the old file or the new one),
    readable by its owner only: it holds the jobs' keys."""
    sf.parent.mkdir(parents=True, exist_ok=True)
    tmp = sf.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a .tmp left by an older version may have other modes
        f.write(json.dumps(record))
    tmp.replace(sf)


def recorded(state_dir: Path, netns_prefix: str = "") -> list[tuple[str | None, str]]:
    """(netns, iface) of every state file in ``state_dir`` (optionally only in namespaces whose
    name starts with ``netns_prefix``; None: the root namespace)."""
    if not state_dir.is_dir():
        return []
    files = {f.stem: f for pat in ("*__*.tmp", "*__*.json") for f in state_dir.glob(pat)}  # .json wins
    out = []
    for stem, f in sorted(files.items()):
        try:  # the file says where (a namespace's name may hold "__" too)
            d = json.loads(f.read_text())
            ns, iface = d["netns"] or "root", d["iface"]
            if not isinstance(ns, str) or not isinstance(iface, str):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError):  # cut short: the name says where
            ns, _, iface = stem.rpartition("__")
        if ns.startswith(netns_prefix):
            out.append((None if ns == "root" else ns, iface))
    return sorted(set(out), key=lambda t: (t[0] or "", t[1]))


def remove_strays(state_dir: Path, netns_prefix: str, live: Iterable[str] | None = None) -> list[str]:
    """Remove what is left in ``state_dir`` (locks, logs, records of engines) of namespaces whose
    name starts with ``netns_prefix`` and that no longer exist (``live``: those that do; default,
    those under /run/netns); the paths removed. Called once their programs are unloaded and their
    namespaces gone (``testbed clean``). A file belongs to a live namespace when its name starts
    with that name and ``__`` (a namespace's name may hold ``__`` itself)."""
    if not netns_prefix or not state_dir.is_dir():
        return []
    if live is None:
        live = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    owners = tuple(f"{ns}__" for ns in live)
    out = []
    for f in sorted(state_dir.iterdir()):
        name = f.name.lstrip(".")
        if name.startswith(netns_prefix) and "__" in name and not name.startswith(owners) and f.is_file():
            f.unlink(missing_ok=True)
            out.append(str(f))
    return out


def release(prog, b) -> None:
    """Close a loaded program's fd and clean up the bcc module it came from (either may be None);
    the caller drops its references."""
    if prog is not None:
        prog.close()
    if b is not None:
        b.cleanup()
