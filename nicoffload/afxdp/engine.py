"""The AF_XDP aggregator engine from Python: open it on an interface (its own steering program,
or a pinned XSKMAP of the XDP aggregator for jobs handed off to it), register jobs, run the
poll loop in a thread (the loop is C: ctypes releases the GIL while it runs), read counters,
close (sockets, UMEM, the XDP link: nothing stays behind, even if the process is killed)."""
from __future__ import annotations

import ctypes
import ipaddress
import secrets
import socket
import threading
from pathlib import Path
from typing import Sequence

from nicoffload.ebpf import loader as bpf
from nicoffload.ebpf.iface import iface_addr, iface_driver, iface_holding, rx_queues
from nicoffload.errors import AlreadyExistsError, InputError, NotFoundError, SetupError
from nicoffload.jobspec import DEFAULT
from nicoffload.wire import keys, proto

from . import build
from .build import ENGINE_STATS

#: XDP_* bind flags (linux/if_xdp.h) and XDP_FLAGS_* attach modes (linux/if_link.h)
XDP_COPY = 1 << 1
XDP_ZEROCOPY = 1 << 2
XDP_USE_SG = 1 << 4
XDP_FLAGS = {"generic": 1 << 1, "native": 1 << 2}
#: how results leave: ``xsk`` (frames built by the engine on the AF_XDP tx ring) or ``socket`` (a
#: UDP socket, a batch of records per UDP_SEGMENT send); ``auto``: socket in copy mode, where the
#: tx ring is no faster than a socket and cannot ask for segmentation (every record would be its
#: own skb through the fabric), the tx ring with a zero-copy driver
TX_MODES = ("auto", "xsk", "socket")
#: microseconds the loop keeps polling the rings after the last frame before it sleeps in poll():
#: on the 2-core testbed a longer spin takes the CPU the ranks need (see the README)
DEFAULT_SPIN_US = 20
STEER_SOURCE = "afxdp.c"
STEER_FN = "afx_steer"
#: what ``--mode auto`` picks, and why
AUTO_WHY = {
    "veth": "generic XDP: veth hands a worker's UDP_SEGMENT batch to generic XDP whole, and the engine "
            "gathers it from a chain of UMEM frames (multi-buffer AF_XDP, copy mode: veth has no zero-copy)",
}


def _ip_be(ip: str) -> int:
    return int.from_bytes(socket.inet_aton(str(ipaddress.IPv4Address(ip))), "little")


def open_xsk_map(ref: str | Path) -> int:
    """An fd of the XSKMAP ``ref`` names: ``id:N`` (a map id: works from any mount namespace,
    ``ip netns exec`` hides the BPF filesystem) or a pinned path."""
    from nicoffload.ebpf import libbpf

    text = str(ref)
    fd = libbpf.map_by_id(int(text[3:])) if text.startswith("id:") else libbpf.obj_get(Path(text))
    info = libbpf.map_info(fd)
    if info["type"] != 17:  # BPF_MAP_TYPE_XSKMAP
        import os

        os.close(fd)
        raise InputError(f"{text} is not an XSKMAP (map type {info['type']})")
    return fd


def only_iface() -> str:
    """The one interface of this namespace besides lo (an engine given neither --iface nor an address)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = [lk.get_attr("IFLA_IFNAME") for lk in ipr.get_links()]
    names = [n for n in names if n != "lo"]
    if len(names) != 1:
        raise InputError(f"say which interface the engine takes (--iface): this namespace has {names}")
    return names[0]


class AfxdpEngine:
    """One engine on one interface, serving up to AR_MAX_JOBS jobs.

    ``xsk_map``: an XSKMAP (``id:N`` or a pinned path) to put the sockets in (the XDP aggregator's, for the jobs it hands
    off; it steers them) instead of loading the engine's own steering program. ``mode``: how the
    steering program is attached (auto, generic, native); ``spin_us``: busy polling after the
    last frame before the loop sleeps; ``netns``: open it inside that network namespace."""

    def __init__(self, iface: str | None = None, port: int = DEFAULT.port, elems: int = DEFAULT.elems,
                 mode: str = "auto", spin_us: int = DEFAULT_SPIN_US, xsk_map: str | Path | None = None,
                 netns: str | None = None, local_ip: str | None = None, zero_copy: bool | None = None,
                 tx: str = "auto"):
        if tx not in TX_MODES:
            raise InputError(f"tx must be one of {', '.join(TX_MODES)}, not {tx!r}")
        if elems < 2 or elems % 2:
            raise InputError(f"elems must be even and at least 2, not {elems}")
        if mode not in ("auto", "generic", "native"):
            raise InputError(f"mode must be auto, generic or native, not {mode!r}")
        bpf.require_root("the AF_XDP engine (AF_XDP sockets and its XDP program)")
        self.lib = build.load()
        self.port, self.elems, self.netns = port, elems, netns
        self._e = None
        self._b = None
        self._map_fd = -1
        self._thread: threading.Thread | None = None
        self._jobs: dict[int, dict] = {}
        self.error: str | None = None
        with bpf.netns(netns):
            self.iface = iface or (iface_holding(local_ip) if local_ip else only_iface())
            self.local_ip, self.mac, self.mtu = iface_addr(self.iface, None)
            self.queues, self.driver = rx_queues(self.iface, None), iface_driver(self.iface, None)
            if proto.record_size(elems) > self.mtu - 28:
                raise InputError(f"{elems} elements per record need an MTU of {proto.mtu_for_elems(elems)}, "
                                 f"{self.iface} has {self.mtu}")
            if mode == "auto":
                mode = "generic" if self.driver == "veth" else "native"
            self.mode = mode
            # copy mode where there is no zero-copy driver (veth, generic XDP); else let the kernel pick
            if zero_copy is None:
                zero_copy = False if (mode == "generic" or self.driver == "veth") else None
            bind = XDP_USE_SG | (XDP_COPY if zero_copy is False else XDP_ZEROCOPY if zero_copy else 0)
            self.copy_mode = zero_copy is not True
            self.tx = ("socket" if self.copy_mode else "xsk") if tx == "auto" else tx
            prog_fd = -1
            try:
                if xsk_map is not None:
                    self._map_fd = open_xsk_map(xsk_map)
                    map_fd = self._map_fd
                else:
                    self._b = bpf.compile_bpf(STEER_SOURCE, {"AR_PORT": port, "AFX_QUEUES": max(self.queues, 1)})
                    fn = bpf.load_func(self._b, STEER_FN, "XDP", STEER_SOURCE)
                    prog_fd = fn.fd
                    map_fd = self._b["afx_xsks"].map_fd
                ok = ctypes.c_int(0)
                mac = (ctypes.c_uint8 * 6)(*bytes.fromhex(self.mac.replace(":", "")))
                self._e = self.lib.afx_open(self.iface.encode(), self.queues, map_fd, prog_fd, XDP_FLAGS[mode],
                                            port, elems, self.mtu, _ip_be(self.local_ip), mac, bind, spin_us,
                                            int(self.tx == "socket"), ctypes.byref(ok))
                if not self._e:
                    raise SetupError("the AF_XDP engine: out of memory")
                if not ok.value:
                    raise SetupError(f"the AF_XDP engine on {self.iface}: "
                                     f"{self.lib.afx_error(self._e).decode()}")
            except BaseException:
                self.close()
                raise

    # --- jobs -------------------------------------------------------------------------------
    def add_job(self, job: int = DEFAULT.job, workers: int = 1, slots: int = DEFAULT.slots,
                group: str = DEFAULT.group, worker_ips: Sequence[str] = (), delivery: str = "multicast",
                worker_macs: Sequence[str] | None = None, key: int = 0) -> None:
        """Serve a job: its ranks (their addresses, checked as each frame's source when given),
        its share of slots (the engine's own memory), its group, its delivery (unicast: a copy
        of each result to every rank, through ``worker_macs``, default: the neighbour table), its
        key (every record must carry it: ``bad_key`` otherwise; 0: a job without one)."""
        if not 1 <= workers <= proto.MAX_WORKERS:
            raise InputError(f"workers must be 1..{proto.MAX_WORKERS}, not {workers}")
        if not 1 <= slots <= 1 << 24:
            raise InputError(f"slots must be 1..{1 << 24}, not {slots}")
        if delivery not in ("multicast", "unicast"):
            raise InputError(f"delivery must be multicast or unicast, not {delivery!r}")
        ips = list(worker_ips)
        if ips and len(ips) != workers:
            raise InputError(f"job {job}: {len(ips)} worker addresses for {workers} ranks")
        if delivery == "unicast" and not ips:
            raise InputError("unicast delivery sends each rank its copy at its address: give every rank's "
                             "address (--worker-ip)")
        g = ipaddress.IPv4Address(group)
        if delivery == "multicast" and not g.is_multicast:
            raise InputError(f"group {group} is not an IPv4 multicast address")
        arr = (ctypes.c_uint32 * max(workers, 1))(*[_ip_be(ip) for ip in ips]) if ips else None
        macs = None
        if delivery == "unicast":
            if worker_macs is None:  # the next hop towards each rank, from the neighbour table
                from nicoffload.ebpf.iface import neighbour_mac

                worker_macs = [neighbour_mac(ip, self.iface, self.netns, timeout=2.0,
                                             hint="is the worker up and reachable from the engine's host?")
                               for ip in ips]
            if len(worker_macs) != workers:
                raise InputError(f"job {job}: {len(worker_macs)} worker MACs for {workers} ranks")
            raw = b"".join(bytes.fromhex(m.replace(":", "")) for m in worker_macs)
            macs = (ctypes.c_uint8 * len(raw))(*raw)
        rc = self.lib.afx_add_job(self._e, job, workers, slots, _ip_be(group), arr, macs,
                                  proto.DELIVERY_UNICAST if delivery == "unicast" else proto.DELIVERY_MULTICAST,
                                  secrets.randbits(32), keys.wire(key))
        if rc == -17:
            raise AlreadyExistsError(f"job {job} is already served by this engine")
        if rc == -28:
            raise InputError(f"this engine serves {proto.MAX_JOBS} jobs at most")
        if rc:
            raise SetupError(f"adding job {job}: {__import__('os').strerror(-rc)}")
        self._jobs[job] = {"job": job, "workers": workers, "slots": slots, "group": group, "worker_ips": ips,
                           "delivery": delivery}

    def remove_job(self, job: int) -> dict:
        if self.lib.afx_remove_job(self._e, job):
            raise NotFoundError(f"job {job} is not served by this engine")
        return self._jobs.pop(job)

    @property
    def jobs(self) -> list[dict]:
        return [{**j, **self.job_state(j["job"])} for j in self._jobs.values()]

    def job_state(self, job: int) -> dict:
        out = (ctypes.c_uint32 * 3)()
        if self.lib.afx_job_state(self._e, job, out):
            raise NotFoundError(f"job {job} is not served by this engine")
        return {"live_epoch": out[0], "joined": out[1], "gate": out[2]}

    # --- counters -----------------------------------------------------------------------------
    def stats(self, job: int | None = None) -> dict[str, int]:
        """The protocol's counters (AR_STAT_*): of one job, or of every job and of traffic that
        named none (``job=None``)."""
        ids = [job] if job is not None else [*self._jobs, 0xFFFFFFFF]
        out = {k: 0 for k in proto.STATS}
        buf = (ctypes.c_uint64 * len(proto.STATS))()
        for j in ids:
            if self.lib.afx_job_stats(self._e, j, buf):
                raise NotFoundError(f"job {j} is not served by this engine")
            for i, k in enumerate(proto.STATS):
                out[k] += buf[i]
        return out

    def unattributed(self) -> dict[str, int]:
        return self.stats(0xFFFFFFFF)

    def engine_stats(self) -> dict[str, int]:
        buf = (ctypes.c_uint64 * len(ENGINE_STATS))()
        self.lib.afx_engine_stats(self._e, buf)
        return dict(zip(ENGINE_STATS, buf))

    # --- the loop -------------------------------------------------------------------------------
    def serve(self, until: float | None = None) -> None:
        """Run the poll loop in this thread until stop() (or ``until``, time.monotonic())."""
        until_ns = 0 if until is None else int(until * 1e9)
        rc = self.lib.afx_run(self._e, until_ns)
        if rc:
            self.error = self.lib.afx_error(self._e).decode()
            raise SetupError(f"the AF_XDP engine's loop stopped: {self.error}")

    @property
    def running(self) -> bool:
        """The loop runs in its thread (False once it stopped, by stop() or by an error)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "AfxdpEngine":
        def run():
            try:
                self.serve()
            except SetupError:
                pass  # self.error says why

        self._thread = threading.Thread(target=run, name="nicoffload-afxdp", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Make serve() return soon (safe from a signal handler)."""
        if self._e:
            self.lib.afx_stop(self._e)

    def close(self) -> None:
        """Stop the loop; close the sockets, the UMEM and the steering program's link."""
        if self._e:
            self.lib.afx_stop(self._e)
            if self._thread is not None:
                self._thread.join(timeout=5)
                if self._thread.is_alive():  # pragma: no cover - the loop wakes every 50 ms
                    raise SetupError("the AF_XDP engine's loop did not stop in 5 s")
            self.lib.afx_close(self._e)
            self._e = None
        self._thread = None
        if self._b is not None:
            try:
                self._b.cleanup()
            except Exception:
                pass
            self._b = None
        if self._map_fd >= 0:
            import os

            os.close(self._map_fd)
            self._map_fd = -1

    stop = close

    def __enter__(self) -> "AfxdpEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        return {"engine": "afxdp", "iface": self.iface, "address": self.local_ip, "mode": self.mode,
                "copy_mode": self.copy_mode, "tx": self.tx, "queues": self.queues, "mtu": self.mtu, "port": self.port,
                "elems": self.elems}


