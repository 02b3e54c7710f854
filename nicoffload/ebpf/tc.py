"""tc (clsact) ingress filters of the toolkit: attach a SCHED_CLS program fd at an interface's
ingress inside a namespace, under the toolkit's own priority (one filter of ours per interface),
list and remove them; an attachment that detaches idempotently and removes the clsact qdisc when
it holds nothing else. Unicast delivery's per-rank clones (``ar_fanout``) run here.
"""
from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from nicoffload.ebpf.loader import ifindex, netns
from nicoffload.errors import AttachError, NotFoundError

#: where the toolkit's tc filters sit (ingress), and their priority: one of ours per interface
TC_INGRESS = "ffff:fff2"
TC_PRIO = 0xC0DE


@dataclass
class TcAttachment:
    """One tc ingress filter (cls_bpf, direct-action) of ours on an interface; the clsact qdisc
    is removed with it when it holds nothing else. detach() is idempotent."""

    ifname: str
    netns: str | None
    attached: bool = True

    def detach(self) -> bool:
        if not self.attached:
            return False
        self.attached = False
        return detach_tc(self.ifname, self.netns)


def attach_tc_ingress(fd: int, ifname: str, ns: str | None, name: str) -> TcAttachment:
    """Attach a SCHED_CLS program fd at ``ifname``'s tc ingress inside ``ns`` (clsact added when
    missing), under the toolkit's priority; an existing filter of ours is replaced."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with netns(ns):
        idx = ifindex(ifname, ns)
        with IPRoute() as ipr:
            try:
                ipr.tc("add", "clsact", idx)
            except NetlinkError as e:
                if e.code != errno.EEXIST:
                    raise AttachError(f"adding a clsact qdisc to {ifname}: {os.strerror(e.code)}") from None
            try:
                ipr.tc("replace-filter", "bpf", idx, 1, fd=fd, name=name, parent=TC_INGRESS, classid=1,
                       direct_action=True, prio=TC_PRIO)
            except NetlinkError as e:
                raise AttachError(f"attaching {name} to the tc ingress of {ifname} in {ns or 'the root namespace'}: "
                                  f"{os.strerror(e.code)}") from None
    return TcAttachment(ifname, ns)


def tc_ingress_names(ifname: str, ns: str | None) -> list[str]:
    """Names of the BPF programs of our priority at ``ifname``'s tc ingress."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with netns(ns):
        idx = ifindex(ifname, ns)
        with IPRoute() as ipr:
            try:
                filters = ipr.get_filters(idx, parent=TC_INGRESS)
            except NetlinkError:
                return []
    out = []
    for f in filters:
        if f.get("info", 0) >> 16 != TC_PRIO:
            continue
        opts = f.get_attr("TCA_OPTIONS")
        name = opts.get_attr("TCA_BPF_NAME") if opts is not None else None
        if name:
            out.append(name)
    return out


def detach_tc(ifname: str, ns: str | None) -> bool:
    """Remove our tc ingress filter from ``ifname`` (and the clsact qdisc when nothing else uses
    it). True if something was removed; harmless when the interface or the filter is gone."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        with netns(ns):
            idx = ifindex(ifname, ns)
            with IPRoute() as ipr:
                removed = False
                try:
                    ipr.tc("del-filter", "bpf", idx, 1, parent=TC_INGRESS, prio=TC_PRIO)
                    removed = True
                except NetlinkError:
                    pass
                try:
                    left = ipr.get_filters(idx, parent=TC_INGRESS) + ipr.get_filters(idx, parent="ffff:fff3")
                except NetlinkError:
                    left = []
                if not [f for f in left if f.get_attr("TCA_KIND")]:
                    try:
                        ipr.tc("del", "clsact", idx)
                        removed = True
                    except NetlinkError:
                        pass
                return removed
    except NotFoundError:
        return False
