"""Control plane of the XDP aggregator: compile with the pool's sizes, attach inside a network
namespace, pin program and maps so they outlive the process, register and remove jobs (each with
its ranks, addresses, multicast group and share of the slot pool: :mod:`nicoffload.agg.jobtable`),
read counters and slot state, detach and unpin. A later process reopens the pinned maps through
bcc's typed tables (:mod:`nicoffload.agg.maps`; no hand-written mirror of kernel structs); the
jobs and addresses are recorded next to the pins (:mod:`nicoffload.agg.spec`), and changed under
a lock, so several processes can add and remove jobs of one aggregator. Unloading needs only
what is recorded (:mod:`nicoffload.agg.teardown`); both are re-exported here."""
from __future__ import annotations

import contextlib
import fcntl
from dataclasses import asdict
from typing import Iterator, Sequence

import numpy as np

from nicoffload import optim
from nicoffload.agg.jobtable import JobEntry, JobTable, default_group
from nicoffload.agg.maps import AggMaps
from nicoffload.agg.optimizer import OptimizerControl
# the spec, where a loaded aggregator lives, and its teardown: re-exported, callers import them from here
from nicoffload.agg.spec import (ENTRY, FANOUT, MAPS_HEADER, SOURCE, STATE_DIR, AggSpec,  # noqa: F401
                                 callbacks, pin_dir, read_spec, state_file)
from nicoffload.agg.teardown import check_half_loaded, loaded, unload  # noqa: F401
from nicoffload.ebpf import libbpf, linker, loadstate, tc
from nicoffload.ebpf import loader as bpf
from nicoffload.ebpf.iface import iface_addr, neighbour_mac, resolve_mode
from nicoffload.errors import AlreadyExistsError, InputError, MapError, NotFoundError
from nicoffload.jobspec import DEFAULT
from nicoffload.optim import OptimizerSpec
from nicoffload.wire import proto


class Aggregator(OptimizerControl):
    """A loaded XDP aggregator. Use :meth:`load` (attach + pin), :meth:`open` (find a loaded one)
    or :meth:`for_test` (load only, for BPF_PROG_TEST_RUN). Context manager; unload is idempotent."""

    def __init__(self, spec: AggSpec, b, prog: linker.LoadedProgram | None = None,
                 attachment: bpf.XdpAttachment | None = None, owner: bool = True):
        self.spec = spec
        self.b = b
        self.fanout = None       # the tc ingress attachment of ar_fanout (load only)
        self.fanout_prog = None  # its program (the filter holds it too)
        self.maps = AggMaps(b, spec.slots)
        self.table = JobTable.from_dicts(spec.slots, spec.jobs)
        self.prog = prog
        self.attachment = attachment
        # close() unloads only what this object loaded (not a test program, not an inspection)
        self._owner = owner
        self._closed = False

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, spec: AggSpec) -> "Aggregator":
        spec.validate()
        bpf.require_root("loading the XDP aggregator")
        bpf.ensure_bpffs()
        pdir = pin_dir(spec.netns, spec.iface)
        # checks that name the problem before anything is created
        spec.agg_ip, spec.agg_mac, mtu = iface_addr(spec.iface, spec.netns)
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
        spec.jobs = []
        bpf.make_pin_dir(pdir)
        agg = None
        try:
            b = bpf.compile_bpf(SOURCE, spec.defines(pinned=True))
            prog = linker.load_linked(b, ENTRY, callbacks(spec.optimizer), source_name=SOURCE)
            agg = cls(spec, b, prog)
            agg.maps.reset_stats()
            with bpf.netns(spec.netns):
                spec.ifindex = bpf.ifindex(spec.iface, spec.netns)
            if spec.workers:
                agg._admit(spec.job, spec.workers, spec.group, spec.worker_ips, spec.job_slots,
                           delivery=spec.delivery, key=spec.key)
            # unicast delivery's fan-out sits at tc ingress from the start: jobs of either delivery
            # can come and go while the program runs (it passes every other frame untouched)
            # loaded like the XDP program: a verifier that signals interrupt starts over (EAGAIN)
            agg.fanout_prog = linker.load_linked(b, FANOUT, prog_type=libbpf.BPF_PROG_TYPE_SCHED_CLS,
                                                 source_name=SOURCE)
            agg.fanout = tc.attach_tc_ingress(agg.fanout_prog.fd, spec.iface, spec.netns, FANOUT)
            agg.attachment = bpf.attach_xdp_fd(prog.fd, spec.iface, spec.netns, spec.mode)
            libbpf.pin(prog.fd, pdir / "prog")
            spec.prog_id = bpf.xdp_prog_id(spec.iface, spec.netns)
            agg._save_state()
        except BaseException:
            if agg is not None and agg.attachment is not None:
                agg.attachment.detach()
            if agg is not None and agg.fanout is not None:
                agg.fanout.detach()
            bpf.remove_pin_dir(pdir)
            state_file(spec.netns, spec.iface).unlink(missing_ok=True)
            raise
        return agg

    @classmethod
    def for_test(cls, workers: int, slots: int = 64, elems: int = proto.DEFAULT_ELEMS,
                 port: int = DEFAULT.port, job: int = DEFAULT.job, group: str = DEFAULT.group,
                 agg_ip: str = "10.0.0.100", agg_mac: str = "02:00:00:00:00:64",
                 worker_ips: Sequence[str] = (), defines: dict | None = None,
                 optimizer: OptimizerSpec | None = None, params: int = 0,
                 key: int = 0x5EC2E7000000C0DE) -> "Aggregator":
        """Load (not attach, not pin) for BPF_PROG_TEST_RUN, with one job over the whole pool
        (``workers`` 0: none; with ``optimizer``: an optimizer job of ``params`` parameters, and
        room for optimizer state) whose key is ``key`` (the packet generators' default).
        ``defines``: extra compile-time constants (tests)."""
        spec = AggSpec(None, "", workers, slots, elems, port, job=job, group=group,
                       worker_ips=list(worker_ips), agg_ip=agg_ip, agg_mac=agg_mac, optimizer=optimizer is not None,
                       key=key)
        spec.validate()
        b = bpf.compile_bpf(SOURCE, {**spec.defines(pinned=False), **(defines or {})})
        prog = linker.load_linked(b, ENTRY, callbacks(spec.optimizer), source_name=SOURCE)
        agg = cls(spec, b, prog, owner=False)
        agg.maps.reset_stats()
        if workers:
            agg._admit(job, workers, group, list(worker_ips), None, optimizer, params, key=key)
        return agg

    @classmethod
    def open(cls, netns: str | None, iface: str) -> "Aggregator":
        """Find an aggregator loaded by another process and reopen its pinned maps."""
        bpf.require_root("inspecting the XDP aggregator")
        try:
            spec = read_spec(netns, iface)
        except NotFoundError:
            check_half_loaded(netns, iface)
            raise
        pdir = pin_dir(netns, iface)
        if not (pdir / "ar_stats").exists():
            raise NotFoundError(f"aggregator state for {iface} in {netns} exists but its pins in {pdir} are gone; "
                                f"run: nicoffload agg unload --netns {netns} --iface {iface}")
        text = f'#include <uapi/linux/bpf.h>\n#include "{MAPS_HEADER}"\n'
        b = bpf.compile_bpf(MAPS_HEADER, spec.defines(pinned=True), text=text)
        return cls(spec, b, None, bpf.XdpAttachment(iface, netns, spec.mode,
                                                   attached=bpf.xdp_prog_id(iface, netns) is not None),
                   owner=False)

    def release(self) -> None:
        """Leave the aggregator loaded when this object goes away (``agg load`` exits after this)."""
        self._owner = False

    @property
    def live(self) -> bool:
        """Attached and recorded (jobs changed here are saved for later processes)."""
        return bool(self.spec.iface) and state_file(self.spec.netns, self.spec.iface).exists()

    def _save_state(self) -> None:
        self.spec.jobs = self.table.to_dicts()
        loadstate.save(state_file(self.spec.netns, self.spec.iface), asdict(self.spec))

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Change the jobs of a live aggregator under its lock, from the latest saved table."""
        if not self.live:
            yield
            return
        lock = state_file(self.spec.netns, self.spec.iface).with_suffix(".lock")
        with open(lock, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self.spec.jobs = read_spec(self.spec.netns, self.spec.iface).jobs
            self.table = JobTable.from_dicts(self.spec.slots, self.spec.jobs)
            yield
            self._save_state()

    # --- jobs ------------------------------------------------------------------------------
    def add_job(self, job: int, workers: int, group: str | None = None, worker_ips: Sequence[str] = (),
                slots: int | None = None, optimizer: OptimizerSpec | None = None, params: int = 0,
                initial: np.ndarray | None = None, delivery: str = "multicast",
                worker_macs: Sequence[str] | None = None, key: int = 0, key_nonce: str = "") -> JobEntry:
        """Register a job with its own share of the pool (``slots``; None: the largest free
        range), its own multicast group (None: the first one no job uses, see
        :func:`nicoffload.agg.jobtable.default_group`) and its ``key`` (0: none; ``key_nonce``: a
        service's, which its grants carry). Refused with CapacityError when the pool has no room. With an
        ``optimizer``, the aggregator keeps ``params`` master weights (``initial``, else 0) and
        the optimizer's state, and answers each step with the updated parameters. ``delivery``
        "unicast": each result goes to every rank's registered address (a copy per rank, cloned
        at the interface's tc ingress; ``worker_macs``: the next hop towards each, default: looked
        up in the namespace's neighbour table), for networks that carry no multicast."""
        if initial is not None:  # refused before anything reaches the kernel (a NaN, the wrong size)
            init = np.asarray(initial).reshape(-1)
            if init.size != params:
                raise InputError(f"job {job} has {params} parameters, {init.size} initial values given")
            optim.to_fixed(init)
        taken: set[str] = set()
        if self.spec.iface:  # the groups of the jobs the AF_XDP engine serves beside the pool
            from nicoffload.agg import fallback

            taken = fallback.groups_in_use(self.spec.netns, self.spec.iface)
        if group is not None and group in taken:
            raise InputError(f"multicast group {group} is already that of a job the AF_XDP engine serves on "
                             f"{self.spec.iface}: give each job its own group (--group)")
        with self._changing():
            g = group or default_group(job, self.table, taken)
            e = self._admit(job, workers, g, list(worker_ips), slots, optimizer, params, delivery, worker_macs,
                            key, key_nonce)
            if initial is not None:
                try:
                    self.set_params(job, initial)
                except BaseException:  # no job half made: out of the kernel's maps and the table
                    self.maps.erase_job(self.table.remove(job))
                    raise
            return e

    def _admit(self, job: int, workers: int, group: str, worker_ips: list[str], slots: int | None,
               optimizer: OptimizerSpec | None = None, params: int = 0, delivery: str = "multicast",
               worker_macs: Sequence[str] | None = None, key: int = 0, key_nonce: str = "") -> JobEntry:
        if optimizer is not None and not self.spec.optimizer:
            raise InputError("this aggregator was loaded without optimizer state: load it with --optimizer")
        e = self.table.admit(job, workers, group, worker_ips, slots, optimizer, params, self.spec.elems, delivery,
                             key, key_nonce)
        try:
            if delivery == "unicast":
                e.worker_macs = list(worker_macs) if worker_macs else self._next_hops(worker_ips)
                if len(e.worker_macs) != workers:
                    raise InputError(f"job {job}: {len(e.worker_macs)} worker MACs for {workers} ranks")
            self.maps.clear_slots(e.slots)
            self.maps.reset_stats([e.index + 1])
            self.maps.write_hyper(e, self.spec.elems)
            if optimizer is not None:
                self.maps.write_state(e, self.spec.elems, np.zeros(params, np.int64))
            self.maps.write_job(e, self.spec.agg_ip, self.spec.agg_mac, self.spec.ifindex)
        except BaseException:
            self.table.remove(job)
            self.maps.erase_job(e)
            raise
        return e

    def _next_hops(self, ips: Sequence[str]) -> list[str]:
        """The MAC each rank's unicast copy leaves with (its own, or its gateway's)."""
        if not self.spec.iface:
            raise InputError("unicast delivery needs each rank's MAC (worker_macs) on an aggregator without an "
                             "interface")
        return [neighbour_mac(ip, self.spec.iface, self.spec.netns, timeout=2.0,
                              hint="is the worker up and reachable from the aggregator?") for ip in ips]

    def remove_job(self, job: int) -> JobEntry:
        """Unregister a job: its packets are counted as bad_job from now on; its slots are free."""
        with self._changing():
            e = self.table.remove(job)
            self.maps.erase_job(e)
            return e

    def reset_jobs(self) -> None:
        """Write every job's entry anew: every epoch ends, workers must JOIN again (tests)."""
        for e in self.table.entries.values():
            self.maps.write_job(e, self.spec.agg_ip, self.spec.agg_mac, self.spec.ifindex)

    def reset_slots(self) -> None:
        """Zero every slot. Not needed between runs (epochs keep them apart); for tests."""
        self.maps.clear_slots(range(self.spec.slots))

    def reset_stats(self) -> None:
        self.maps.reset_stats()

    # --- inspection ------------------------------------------------------------------------
    def stats(self, job: int | None = None) -> dict[str, int]:
        """Counters summed over CPUs: of one job (wire id), or over every row (``job=None``)."""
        rows = range(proto.MAX_JOBS + 1) if job is None else [self.maps.job_index(job) + 1]
        return self.maps.stats(rows)

    def unattributed(self) -> dict[str, int]:
        """Counters of traffic that named no registered job (row 0)."""
        return self.maps.stats([0])

    def job_state(self, job: int) -> dict:
        return self.maps.job_state(job)

    def config(self) -> dict:
        """The load-time job's entry (addresses, ranks, epoch state)."""
        return self.job_state(self.spec.job)

    def jobs(self) -> list[dict]:
        """Every registered job: its share, group and addresses, epoch state and counters."""
        out = []
        for e in sorted(self.table.entries.values(), key=lambda e: e.slot_base):
            out.append({**self.job_state(e.job), "stats": self.stats(e.job)})
        return out

    def slot(self, i: int, with_data: bool = False) -> dict:
        return self.maps.slot(i, with_data)

    def status(self) -> dict:
        s = self.spec
        return {
            "netns": s.netns, "iface": s.iface, "mode": s.mode, "mode_reason": s.mode_reason,
            "attached": bool(s.iface) and bpf.xdp_prog_id(s.iface, s.netns) is not None,
            "fanout_attached": bool(s.iface) and FANOUT in tc.tc_ingress_names(s.iface, s.netns),
            "prog_id": s.prog_id, "slots": s.slots, "elems": s.elems, "port": s.port,
            "agg_ip": s.agg_ip, "pins": str(pin_dir(s.netns, s.iface)),
            "jobs": [e.public() for e in sorted(self.table.entries.values(), key=lambda e: e.slot_base)],
            "free_slots": self.table.free_slots(),
            # the load-time job, as before several jobs could share an aggregator
            "job": s.job, "workers": s.workers, "group": s.group,
        }

    # --- test run --------------------------------------------------------------------------
    def run(self, packet: bytes, repeat: int = 1) -> libbpf.TestRunResult:
        if self.prog is None:
            raise MapError("this aggregator was opened for inspection; it has no program to run")
        return libbpf.test_run(self.prog.fd, packet, repeat=repeat)

    # --- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Unload what this object loaded (detach, remove pins and state); release the rest.
        Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            unload(self.spec.netns, self.spec.iface, missing_ok=True)
        if self.fanout_prog is not None:
            self.fanout_prog.close()
            self.fanout_prog = None
        loadstate.release(self.prog, self.b)
        self.prog = self.b = None

    def __enter__(self) -> "Aggregator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
