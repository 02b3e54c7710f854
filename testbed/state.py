"""Where a live testbed is written down so another process can find it, extend it and take it
down: one JSON file per testbed under /run/nicoffload/testbeds/ (tmpfs: gone after a reboot,
like the namespaces it describes).

The file is written before the first namespace is created (status "creating") and rewritten
when the testbed is up; it is the last thing teardown removes. So whatever a crash leaves
behind is still described by a state file, and `nicoffload testbed down NAME` can remove it.
Names and subnets are claimed here too, under a lock, so two processes never share one.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from pathlib import Path
from typing import Iterator

from nicoffload.errors import AlreadyExistsError, NotFoundError, SetupError

from .netlink import list_netns, netns_exists
from .topology import SUBNET_MAX, SUBNET_MIN, Topology, derived_subnet, netns_prefix

STATE_DIR = Path(os.environ.get("NICOFFLOAD_STATE_DIR", "/run/nicoffload/testbeds"))
STATE_VERSION = 1


def state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Serialise name and subnet allocation between processes."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write(name: str, state: dict) -> None:
    """Atomically replace the state file of ``name``."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = state_path(name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": STATE_VERSION, **state}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read(name: str) -> dict:
    path = state_path(name)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFoundError(
            f"no testbed named {name!r} (no {path}); see 'nicoffload testbed list'") from None
    except json.JSONDecodeError as e:
        raise NotFoundError(f"the state file {path} is corrupt ({e}); 'nicoffload testbed clean' removes it") from None


def remove(name: str) -> bool:
    try:
        state_path(name).unlink()
        return True
    except FileNotFoundError:
        return False


def names() -> list[str]:
    """Names of every testbed that has a state file, sorted."""
    if not STATE_DIR.is_dir():
        return []
    return sorted(p.stem for p in STATE_DIR.glob("*.json") if not p.name.startswith("."))


def all_states() -> list[dict]:
    out = []
    for n in names():
        try:
            out.append(read(n))
        except NotFoundError:
            continue
    return out


def new_name() -> str:
    """A short unused testbed name ("tb" + 4 hex digits)."""
    taken = set(names())
    while True:
        n = "tb" + secrets.token_hex(2)
        if n not in taken and not any(ns.startswith(netns_prefix(n)) for ns in list_netns()):
            return n


def claim(topology: Topology) -> tuple[Topology, dict]:
    """Claim the name and a subnet of ``topology`` and write its state file (status "creating"),
    atomically between processes. Returns the topology with its subnet fixed, and the state."""
    name = topology.name
    with locked():
        if state_path(name).exists():
            raise AlreadyExistsError(
                f"a testbed named {name!r} exists; take it down with 'nicoffload testbed down {name}'")
        clash = [n for n in topology.netns_names() if netns_exists(n)]
        if clash:
            raise AlreadyExistsError(
                f"namespace {clash[0]} exists (left over?); 'nicoffload testbed clean' removes stale testbeds")
        used = {s.get("topology", {}).get("subnet") for s in all_states()}
        want = topology.subnet
        if want is not None and want in used:
            raise AlreadyExistsError(f"subnet index {want} (10.200.{want}.0/24) is used by another testbed")
        if want is None:
            span = SUBNET_MAX - SUBNET_MIN + 1
            first = derived_subnet(name)
            want = next((x for x in (SUBNET_MIN + (first - SUBNET_MIN + i) % span for i in range(span))
                         if x not in used), None)
            if want is None:
                raise SetupError(f"all {span} testbed subnets are in use; take some testbeds down")
            topology = topology.with_subnet(want)
        state = {"name": name, "status": "creating", "pid": os.getpid(), "created": time.time(),
                 "topology": topology.to_dict(), "netns": topology.netns_names(), "napi_xdp": [], "faults": {}}
        write(name, state)
    return topology, state
