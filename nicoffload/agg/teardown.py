"""Taking down what an aggregator's load left on an interface, found from its pins and state
file alone (no process of the load need be alive): :func:`unload` (the program, the tc fan-out,
the AF_XDP engines of handed-off jobs, pins, state), :func:`loaded` (every recorded aggregator,
for cleanup), and the clear error for a load that was interrupted half way.
"""
from __future__ import annotations

import json

from nicoffload.agg.spec import ENTRY, STATE_DIR, pin_dir, state_file
from nicoffload.ebpf import libbpf, loadstate, tc
from nicoffload.ebpf import loader as bpf
from nicoffload.errors import NotFoundError


def check_half_loaded(netns: str | None, iface: str) -> None:
    """Nothing is recorded for ``iface``: say so clearly if a load was interrupted there (pins
    left, or a program attached, but no state file), with the command that cleans it up."""
    left = []
    if pin_dir(netns, iface).exists():
        left.append(f"pins in {pin_dir(netns, iface)}")
    try:
        if bpf.xdp_prog_id(iface, netns) is not None:
            left.append("an XDP program attached")
    except NotFoundError:
        pass
    if left:
        raise NotFoundError(
            f"the aggregator on {iface} in {netns or 'the root namespace'} is half loaded ({' and '.join(left)}, "
            f"but no state file: was 'agg load' interrupted?); run: nicoffload agg unload --netns {netns} "
            f"--iface {iface}")


def unload(netns: str | None, iface: str, missing_ok: bool = False) -> bool:
    """Detach the aggregator from ``iface`` and remove its pins and state. Returns whether
    anything was there. Without ``missing_ok``, nothing to unload is a NotFoundError."""
    bpf.require_root("unloading the XDP aggregator")
    from nicoffload.agg import fallback

    fallback.stop_all(netns, iface)  # engines of jobs it handed off (agg job add --fallback afxdp)
    sf = state_file(netns, iface)
    pdir = pin_dir(netns, iface)
    mode, ours = "native", None
    if sf.exists():
        try:
            saved = json.loads(sf.read_text())
            mode, ours = saved.get("mode", "native"), saved.get("prog_id")
        except ValueError:
            pass
    found = sf.exists() or pdir.exists() or sf.with_suffix(".tmp").exists()
    try:
        attached = bpf.xdp_prog_id(iface, netns)
    except NotFoundError:  # no such interface (any more)
        attached = None
    detached = False
    # only the aggregator: the one its state names, else (a load killed before it saved its
    # state) one by the aggregator's name; a ring program there is not ours to remove
    if attached is not None and (attached == ours or ours is None and libbpf.prog_name(attached) in (None, ENTRY)):
        try:
            detached = bpf.detach_xdp(iface, netns, mode)
        except NotFoundError:
            pass
    elif attached is not None and not found and not missing_ok:
        raise NotFoundError(f"no aggregator is loaded on {iface} in {netns or 'the root namespace'}: it runs XDP "
                            f"program {attached} ({libbpf.prog_name(attached) or '?'}), left attached")
    detached = tc.detach_tc(iface, netns) or detached  # unicast delivery's ar_fanout
    bpf.remove_pin_dir(pdir)  # and its parents it leaves empty
    sf.unlink(missing_ok=True)
    sf.with_suffix(".lock").unlink(missing_ok=True)
    sf.with_suffix(".tmp").unlink(missing_ok=True)  # a load killed while saving its state
    if not (found or detached) and not missing_ok:
        raise NotFoundError(f"nothing is loaded on {iface} in {netns or 'the root namespace'}")
    return found or detached


def loaded(netns_prefix: str = "") -> list[tuple[str | None, str]]:
    """(netns, iface) of every aggregator recorded on this machine (optionally only those in
    namespaces whose name starts with ``netns_prefix``), for cleanup by whoever owns them; also
    those whose load was killed while it wrote the state file (only its ``.tmp`` is there)."""
    return loadstate.recorded(STATE_DIR, netns_prefix)
