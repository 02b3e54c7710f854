"""Small pyroute2 helpers: namespaces (and the BPF pins kept for them), a netlink socket inside
a namespace that never creates it by accident, sysctls of a namespace, rate shaping, and tolerant
deletion (teardown must not fail on objects that are already gone)."""
from __future__ import annotations

import contextlib
import errno
import time
from typing import Callable, Iterator

from pyroute2 import IPRoute, NetlinkError
from pyroute2 import netns as pyr_netns

from nicoffload.ebpf.loader import NETNS_DIR, PIN_ROOT, remove_pin_dir
from nicoffload.ebpf.loader import netns as enter_netns
from nicoffload.errors import NotFoundError, SetupError

#: errors that mean "it is already gone" during teardown
GONE = {errno.ENODEV, errno.ENOENT, errno.ESRCH, errno.EINVAL, errno.EBADF}


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def list_netns() -> list[str]:
    return sorted(pyr_netns.listnetns())


def create_netns(name: str) -> None:
    if netns_exists(name):
        raise FileExistsError(errno.EEXIST, f"network namespace {name!r} exists", name)
    pyr_netns.create(name)


def remove_netns(name: str) -> bool:
    """Unmount and remove /run/netns/NAME; False when it was not there."""
    if not netns_exists(name):
        return False
    try:
        pyr_netns.remove(name)
    except FileNotFoundError:
        return False
    return True


def remove_pins(ns: str) -> list[str]:
    """Remove the BPF pins kept for namespace ``ns`` under /sys/fs/bpf/nicoffload/NS (once the
    namespace is gone, its programs went with its interfaces; pins would keep maps alive)."""
    pins = PIN_ROOT / ns
    # with its parent /sys/fs/bpf/nicoffload when that is left empty
    return [str(pins)] if remove_pin_dir(pins) else []


def remove_netns_and_pins(ns: str) -> list[str]:
    """Remove namespace ``ns`` and then its pins; what was removed."""
    return ([ns] if remove_netns(ns) else []) + remove_pins(ns)


def pinned_netns() -> list[str]:
    """Namespaces that have a pin directory under /sys/fs/bpf/nicoffload/, sorted."""
    return sorted(d.name for d in PIN_ROOT.iterdir()) if PIN_ROOT.is_dir() else []


@contextlib.contextmanager
def ipr(ns: str) -> Iterator[IPRoute]:
    """An rtnetlink socket inside namespace ``ns`` (never creates the namespace)."""
    if not netns_exists(ns):
        raise NotFoundError(f"network namespace {ns!r} does not exist (ip netns list)")
    sock = IPRoute(netns=ns, flags=0)
    try:
        yield sock
    finally:
        sock.close()


def set_sysctl(ns: str, key: str, value: str | int) -> None:
    """Write /proc/sys/<key> as seen from namespace ``ns`` (net.* sysctls are per namespace)."""
    path = "/proc/sys/" + key.replace(".", "/")
    with enter_netns(ns):
        with open(path, "w") as f:
            f.write(str(value))


def tolerant(fn: Callable, *args, **kwargs) -> bool:
    """Run a deletion; True if it did something, False if the object was already gone."""
    try:
        fn(*args, **kwargs)
        return True
    except NetlinkError as e:
        if e.code in GONE:
            return False
        raise
    except (NotFoundError, FileNotFoundError):
        return False
    except OSError as e:
        if e.errno in GONE:
            return False
        raise


def link_index(sock: IPRoute, ifname: str) -> int:
    idx = sock.link_lookup(ifname=ifname)
    if not idx:
        raise NotFoundError(f"no interface {ifname!r}")
    return idx[0]


def wait_oper_up(sock: IPRoute, index: int, what: str, timeout: float = 3.0) -> None:
    """Poll until the link's operstate is UP (veth: both ends up)."""
    deadline = time.monotonic() + timeout
    while True:
        link = sock.get_links(index)[0]
        if link.get_attr("IFLA_OPERSTATE") == "UP":
            return
        if time.monotonic() > deadline:
            raise SetupError(f"{what} did not come up within {timeout:.0f} s "
                             f"(operstate {link.get_attr('IFLA_OPERSTATE')})")
        time.sleep(0.01)


# --- shaping (tbf: the kernel has no netem/fq; tbf and htb exist) ---------------------------
TBF_BURST_S = 0.004  # seconds of traffic the bucket holds (bytes = rate * this)
TBF_LATENCY = "20ms"  # queue bound: packets wait at most about this long, then tbf drops
#: a bucket smaller than a 64 KB GSO batch makes tbf cut the batch into datagrams
GSO_FRAME = 65536 + 14 + 20 + 8
PUSHBACK_LIMIT = 10000  # packets (pfifo)


def tbf_burst(rate_bps: int, mtu: int) -> int:
    """Bucket size in bytes: a few ms of traffic, never less than a few frames nor less than a
    whole 64 KB GSO batch (tbf segments a batch that does not fit its bucket)."""
    return max(int(rate_bps / 8 * TBF_BURST_S), 4 * (mtu + 14), 2 * GSO_FRAME)


def pushback(sock: IPRoute, index: int) -> None:
    """A pfifo root qdisc: a veth whose peer runs NAPI (XDP, or GRO) queues into a 256-entry
    ring and drops when it is full; with a qdisc the sender is pushed back instead."""
    sock.tc("replace", "pfifo", index, 0x10000, limit=PUSHBACK_LIMIT)


def shape(sock: IPRoute, index: int, rate_bps: int, mtu: int) -> None:
    """Root tbf at ``rate_bps`` on the egress of ``index`` (replaces whatever root was there)."""
    sock.tc("replace", "tbf", index, 0x10000, rate=rate_bps // 8, burst=tbf_burst(rate_bps, mtu),
            latency=TBF_LATENCY)


def limit(sock: IPRoute, index: int, rate_bps: int | None, mtu: int) -> None:
    """The egress qdisc of a testbed link: tbf at ``rate_bps``, or pfifo pushback if unshaped."""
    if rate_bps:
        shape(sock, index, rate_bps, mtu)
    else:
        pushback(sock, index)


def unshape(sock: IPRoute, index: int) -> bool:
    return tolerant(sock.tc, "del", index=index, handle=0x10000, parent=0xFFFFFFFF)


def qdisc_kinds(sock: IPRoute, index: int) -> list[str]:
    return [q.get_attr("TCA_KIND") for q in sock.get_qdiscs(index=index)]

