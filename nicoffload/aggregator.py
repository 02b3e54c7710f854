"""Control plane of the XDP aggregator: compile with the job's sizes, attach inside a network
namespace, pin program and maps so they outlive the process, configure the job, read counters
and slot state, detach and unpin. ``status``/``stats``/``slots`` from a later process reopen the
pinned maps through bcc's typed tables (no hand-written mirror of kernel structs)."""
from __future__ import annotations

import json
import secrets
import shutil
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import bpf, libbpf, proto
from .addr import ip_net, ip_str, mac_bytes, multicast_mac
from .errors import AlreadyExistsError, InputError, MapError, NotFoundError
from .jobspec import DEFAULT, JobSpec

STATE_DIR = Path("/run/nicoffload/aggregators")
SOURCE = "aggregator.c"
MAPS_HEADER = "agg_maps.h"
ENTRY, CALLBACKS = "ar_aggregate", ("ar_record",)
#: attach modes: auto picks the fastest that works on the interface (see resolve_mode)
MODES = ("auto", "generic", "native")


def resolve_mode(mode: str, iface: str, netns: str | None) -> tuple[str, str]:
    """(native|generic, why). Generic (skb) XDP sees a worker's UDP_SEGMENT send or a UDP GRO
    batch whole, so one program run aggregates up to 61 records and the result goes back as one
    frame; native XDP sees single datagrams. On veth generic is the fastest (measured: see the
    README); on other drivers native is the default (batches there need UDP GRO forwarding on
    the NIC, which generic mode with `ethtool -K IF rx-udp-gro-forwarding on` can use)."""
    if mode != "auto":
        return mode, f"{mode} XDP, as asked"
    driver = bpf.iface_driver(iface, netns)
    if driver == "veth":
        return "generic", "generic XDP (batches): veth hands UDP_SEGMENT sends to generic XDP whole"
    return "native", f"native XDP (per datagram): driver {driver or 'unknown'}; try --mode generic with " \
                     f"rx-udp-gro-forwarding for batches"
#: index of the job table entry that holds the job given at load time
DEFAULT_JOB_INDEX = 0


def pin_dir(netns: str | None, iface: str) -> Path:
    return bpf.PIN_ROOT / (netns or "root") / iface


def state_file(netns: str | None, iface: str) -> Path:
    return STATE_DIR / f"{netns or 'root'}__{iface}.json"


@dataclass
class AggSpec:
    """What is loaded where; saved next to the pins so later processes find it."""

    netns: str | None
    iface: str
    workers: int
    slots: int = DEFAULT.slots
    elems: int = DEFAULT.elems
    port: int = DEFAULT.port
    mode: str = "auto"
    job: int = DEFAULT.job
    group: str = DEFAULT.group
    worker_ips: list[str] = field(default_factory=list)
    prog_id: int | None = None
    mode_reason: str = ""

    def validate(self) -> None:
        if not 1 <= self.workers <= proto.MAX_WORKERS:
            raise InputError(f"--workers must be 1..{proto.MAX_WORKERS}, not {self.workers}")
        JobSpec(job=self.job, port=self.port, group=self.group, slots=self.slots, elems=self.elems).validate()
        if self.mode not in MODES:
            raise InputError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.worker_ips and len(self.worker_ips) != self.workers:
            raise InputError(f"{len(self.worker_ips)} worker addresses given for {self.workers} workers")

    def defines(self, pinned: bool) -> dict[str, int | str]:
        d: dict[str, int | str] = {"AR_ELEMS": self.elems, "AR_SLOTS": self.slots, "AR_PORT": self.port}
        if pinned:
            d["AR_PIN_DIR"] = f'"{pin_dir(self.netns, self.iface)}"'
        return d


def iface_addr(iface: str, netns: str | None) -> tuple[str, str, int]:
    """(ipv4, mac, mtu) of an interface inside a namespace."""
    from pyroute2 import IPRoute

    with bpf.netns(netns):
        idx = socket.if_nametoindex(iface) if _exists(iface) else 0
        if not idx:
            where = f" in namespace {netns!r}" if netns else ""
            raise NotFoundError(f"no interface {iface!r}{where}")
        with IPRoute() as ipr:
            link = ipr.get_links(idx)[0]
            addrs = ipr.get_addr(index=idx, family=socket.AF_INET)
    if not addrs:
        raise NotFoundError(f"interface {iface!r} has no IPv4 address; the aggregator sends results from it")
    return addrs[0].get_attr("IFA_ADDRESS"), link.get_attr("IFLA_ADDRESS"), link.get_attr("IFLA_MTU")


def _exists(iface: str) -> bool:
    try:
        socket.if_nametoindex(iface)
        return True
    except OSError:
        return False


class Aggregator:
    """A loaded XDP aggregator. Use :meth:`load` (attach + pin), :meth:`open` (find a loaded one)
    or :meth:`for_test` (load only, for BPF_PROG_TEST_RUN). Context manager; unload is idempotent."""

    def __init__(self, spec: AggSpec, b, prog: bpf.LoadedProgram | None = None,
                 attachment: bpf.XdpAttachment | None = None, owner: bool = True):
        self.spec = spec
        self.b = b
        self.prog = prog
        self.attachment = attachment
        # close() unloads only what this object loaded (not a test program, not an inspection)
        self._owner = owner
        self._closed = False

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, spec: AggSpec, configure: bool = True) -> "Aggregator":
        spec.validate()
        bpf.require_root("loading the XDP aggregator")
        bpf.ensure_bpffs()
        pdir = pin_dir(spec.netns, spec.iface)
        # checks that name the problem before anything is created
        ip, mac, mtu = iface_addr(spec.iface, spec.netns)
        if bpf.xdp_prog_id(spec.iface, spec.netns) is not None:
            raise AlreadyExistsError(
                f"{spec.iface} in {spec.netns or 'the root namespace'} already has an XDP program attached; "
                f"run: nicoffload agg unload --netns {spec.netns} --iface {spec.iface}")
        if pdir.exists() or state_file(spec.netns, spec.iface).exists():
            raise AlreadyExistsError(
                f"an aggregator is already recorded for {spec.iface} in {spec.netns} ({pdir}); "
                f"run: nicoffload agg unload --netns {spec.netns} --iface {spec.iface}")
        need_mtu = proto.mtu_for_elems(spec.elems)
        if mtu < need_mtu:
            raise InputError(f"{spec.elems} elements per packet need an MTU of {need_mtu}, {spec.iface} has {mtu}")
        spec.mode, spec.mode_reason = resolve_mode(spec.mode, spec.iface, spec.netns)
        pdir.mkdir(parents=True, exist_ok=True)
        agg = None
        try:
            b = bpf.compile_bpf(SOURCE, spec.defines(pinned=True))
            prog = bpf.load_linked(b, ENTRY, CALLBACKS, source_name=SOURCE)
            agg = cls(spec, b, prog)
            if configure:
                agg.configure(agg_ip=ip, agg_mac=mac)
            agg.attachment = bpf.attach_xdp_fd(prog.fd, spec.iface, spec.netns, spec.mode)
            libbpf.pin(prog.fd, pdir / "prog")
            spec.prog_id = bpf.xdp_prog_id(spec.iface, spec.netns)
            agg._save_state()
        except BaseException:
            if agg is not None and agg.attachment is not None:
                agg.attachment.detach()
            shutil.rmtree(pdir, ignore_errors=True)
            state_file(spec.netns, spec.iface).unlink(missing_ok=True)
            raise
        return agg

    @classmethod
    def for_test(cls, workers: int, slots: int = 64, elems: int = proto.DEFAULT_ELEMS,
                 port: int = DEFAULT.port, job: int = DEFAULT.job, group: str = DEFAULT.group,
                 agg_ip: str = "10.0.0.100", agg_mac: str = "02:00:00:00:00:64",
                 worker_ips: Sequence[str] = ()) -> "Aggregator":
        """Load (not attach, not pin) for BPF_PROG_TEST_RUN."""
        spec = AggSpec(None, "", workers, slots, elems, port, job=job, group=group,
                       worker_ips=list(worker_ips))
        spec.validate()
        b = bpf.compile_bpf(SOURCE, spec.defines(pinned=False))
        prog = bpf.load_linked(b, ENTRY, CALLBACKS, source_name=SOURCE)
        agg = cls(spec, b, prog, owner=False)
        agg.configure(agg_ip=agg_ip, agg_mac=agg_mac)
        return agg

    @classmethod
    def open(cls, netns: str | None, iface: str) -> "Aggregator":
        """Find an aggregator loaded by another process and reopen its pinned maps."""
        bpf.require_root("inspecting the XDP aggregator")
        sf = state_file(netns, iface)
        if not sf.exists():
            raise NotFoundError(f"no aggregator is loaded on {iface} in {netns or 'the root namespace'}")
        spec = AggSpec(**json.loads(sf.read_text()))
        pdir = pin_dir(netns, iface)
        if not (pdir / "ar_stats").exists():
            raise NotFoundError(f"aggregator state for {iface} in {netns} exists but its pins in {pdir} are gone; "
                                f"run: nicoffload agg unload --netns {netns} --iface {iface}")
        text = f'#include <uapi/linux/bpf.h>\n#include "{MAPS_HEADER}"\n'
        b = bpf.compile_bpf(MAPS_HEADER, spec.defines(pinned=True), text=text)
        return cls(spec, b, None, bpf.XdpAttachment(iface, netns, spec.mode,
                                                   attached=bpf.xdp_prog_id(iface, netns) is not None),
                   owner=False)

    def _save_state(self) -> None:
        sf = state_file(self.spec.netns, self.spec.iface)
        sf.parent.mkdir(parents=True, exist_ok=True)
        sf.write_text(json.dumps(asdict(self.spec)))

    # --- job configuration -----------------------------------------------------------------
    def configure(self, agg_ip: str | None = None, agg_mac: str | None = None, job: int | None = None,
                  worker_ips: Iterable[str] | None = None, group: str | None = None,
                  workers: int | None = None) -> None:
        """Validate, keep the shadow in ``spec``, then write the job table. Writing a job entry
        ends any epoch the job had: its workers must JOIN again."""
        s = self.spec
        if job is not None:
            s.job = job
        if group is not None:
            s.group = group
        if workers is not None:
            s.workers = workers
        if worker_ips is not None:
            s.worker_ips = list(worker_ips)
        s.validate()
        jobs = self.b["ar_jobs"]
        old = jobs[jobs.Key(DEFAULT_JOB_INDEX)]
        e = jobs.Leaf()
        e.agg_ip = ip_net(agg_ip) if agg_ip is not None else old.agg_ip
        e.agg_mac[:] = list(mac_bytes(agg_mac)) if agg_mac is not None else list(old.agg_mac)
        e.job = s.job
        e.workers = s.workers
        e.worker_mask = (1 << s.workers) - 1
        e.slot_base, e.slot_count = 0, s.slots
        e.mcast_ip = ip_net(s.group)
        e.mcast_mac[:] = list(mac_bytes(multicast_mac(s.group)))
        # epochs of a new entry start at a random point, so a worker of an earlier load of this
        # aggregator cannot hit a current epoch by chance
        e.live, e.epoch = 0, secrets.randbits(32)
        for r, ip in enumerate(s.worker_ips):
            e.worker_ip[r] = ip_net(ip)
        e.configured = 1
        index = self.b["ar_job_index"]
        for k in list(index.keys()):
            if index[k].value == DEFAULT_JOB_INDEX and k.value != s.job:
                del index[k]
        self._write(jobs, DEFAULT_JOB_INDEX, e)
        self._write(index, s.job, index.Leaf(DEFAULT_JOB_INDEX))
        if self.spec.iface and state_file(self.spec.netns, self.spec.iface).exists():
            self._save_state()  # a live aggregator: later processes read the spec from there

    def _write(self, table, key: int, value) -> None:
        try:
            table[table.Key(key)] = value
        except Exception as e:  # bcc raises plain Exception with errno text
            raise MapError(f"writing {table.name.decode() if isinstance(table.name, bytes) else table.name}"
                           f"[{key}] failed: {e}") from e

    def reset_slots(self) -> None:
        """Zero every slot. Not needed between runs (epochs keep them apart); for tests."""
        t = self.b["ar_slots"]
        empty = t.Leaf()
        for i in range(self.spec.slots):
            self._write(t, i, empty)

    def reset_stats(self) -> None:
        t = self.b["ar_stats"]
        for i in range(proto.MAX_JOBS + 1):
            t[t.Key(i)] = t.Leaf(*([t.sLeaf()] * t.total_cpu))

    # --- inspection ------------------------------------------------------------------------
    def stats(self, job: int | None = None) -> dict[str, int]:
        """Counters summed over CPUs: of one job (wire id), or over every row (``job=None``)."""
        t = self.b["ar_stats"]
        if job is None:
            rows = range(proto.MAX_JOBS + 1)
        else:
            idx = self._job_index(job)
            rows = [idx + 1]
        out = dict.fromkeys(proto.STATS, 0)
        for row in rows:
            for cpu in t[t.Key(row)]:
                for i, name in enumerate(proto.STATS):
                    out[name] += int(cpu.c[i])
        return out

    def _job_index(self, job: int) -> int:
        index = self.b["ar_job_index"]
        try:
            return int(index[index.Key(job)].value)
        except KeyError:
            raise NotFoundError(f"job {job} is not registered on this aggregator") from None

    def config(self) -> dict:
        """The default job's entry (addresses, ranks, epoch state)."""
        return self.job_state(self.spec.job)

    def job_state(self, job: int) -> dict:
        c = self.b["ar_jobs"][self.b["ar_jobs"].Key(self._job_index(job))]
        n = c.workers
        return {
            "job": c.job, "workers": n, "worker_mask": c.worker_mask, "configured": bool(c.configured),
            "agg_ip": ip_str(c.agg_ip), "group": ip_str(c.mcast_ip),
            "agg_mac": ":".join(f"{x:02x}" for x in c.agg_mac),
            "slot_base": c.slot_base, "slots": c.slot_count,
            "epoch": c.live, "last_epoch": c.epoch, "joined": c.joined,
            "nonces": [int(c.nonce[r]) for r in range(n)], "acks": [int(c.ack[r]) for r in range(n)],
            "worker_ips": [ip_str(c.worker_ip[r]) if c.worker_ip[r] else None for r in range(n)],
        }

    def slot(self, i: int, with_data: bool = False) -> dict:
        if not 0 <= i < self.spec.slots:
            raise InputError(f"slot {i} out of range 0..{self.spec.slots - 1}")
        t = self.b["ar_slots"]
        v = t[t.Key(i)]
        sets = []
        for k in range(2):
            s = v.set[k]
            exp = socket.ntohs(s.exp & 0xFFFF)
            d = {
                "set": k, "used": bool(s.epoch), "epoch": s.epoch, "round": s.round, "bitmap": s.bitmap,
                "mask": s.mask, "complete": bool(s.complete), "count": s.count,
                "exp": exp - 0x10000 if exp >= 0x8000 else exp, "op": proto.OPS.get(s.op, str(s.op)),
            }
            if with_data:
                import numpy as np

                d["acc"] = np.ctypeslib.as_array(s.acc).view("<i4").copy()
            sets.append(d)
        return {"slot": i, "sets": sets}

    def status(self) -> dict:
        return {
            "netns": self.spec.netns, "iface": self.spec.iface, "mode": self.spec.mode,
            "mode_reason": self.spec.mode_reason,
            "attached": bool(self.spec.iface) and bpf.xdp_prog_id(self.spec.iface, self.spec.netns) is not None,
            "prog_id": self.spec.prog_id, "workers": self.spec.workers, "slots": self.spec.slots,
            "elems": self.spec.elems, "port": self.spec.port, "job": self.spec.job,
            "group": self.spec.group, "pins": str(pin_dir(self.spec.netns, self.spec.iface)),
        }

    # --- test run --------------------------------------------------------------------------
    def run(self, packet: bytes, repeat: int = 1) -> libbpf.TestRunResult:
        if self.prog is None:
            raise MapError("this aggregator was opened for inspection; it has no program to run")
        return libbpf.test_run(self.prog.fd, packet, repeat=repeat)

    # --- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Unload: detach, remove pins and state. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            unload(self.spec.netns, self.spec.iface, missing_ok=True)
        if self.prog is not None:
            self.prog.close()
            self.prog = None
        if self.b is not None:
            self.b.cleanup()
            self.b = None

    def __enter__(self) -> "Aggregator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unload(netns: str | None, iface: str, missing_ok: bool = False) -> bool:
    """Detach the aggregator from ``iface`` and remove its pins and state. Returns whether
    anything was there. Without ``missing_ok``, nothing to unload is a NotFoundError."""
    bpf.require_root("unloading the XDP aggregator")
    sf = state_file(netns, iface)
    pdir = pin_dir(netns, iface)
    mode = "native"
    if sf.exists():
        try:
            mode = json.loads(sf.read_text()).get("mode", "native")
        except ValueError:
            pass
    found = sf.exists() or pdir.exists()
    try:
        detached = bpf.detach_xdp(iface, netns, mode)
    except NotFoundError:
        detached = False
    shutil.rmtree(pdir, ignore_errors=True)
    # remove empty parents up to the root pin dir
    for parent in (pdir.parent, bpf.PIN_ROOT):
        try:
            parent.rmdir()
        except OSError:
            pass
    sf.unlink(missing_ok=True)
    if not (found or detached) and not missing_ok:
        raise NotFoundError(f"nothing is loaded on {iface} in {netns or 'the root namespace'}")
    return found or detached


def loaded(netns_prefix: str = "") -> list[tuple[str | None, str]]:
    """(netns, iface) of every aggregator recorded on this machine (optionally only those in
    namespaces whose name starts with ``netns_prefix``), for cleanup by whoever owns them."""
    out = []
    for f in sorted(STATE_DIR.glob("*__*.json")) if STATE_DIR.is_dir() else ():
        ns, _, iface = f.stem.partition("__")
        if ns.startswith(netns_prefix):
            out.append((None if ns == "root" else ns, iface))
    return out
