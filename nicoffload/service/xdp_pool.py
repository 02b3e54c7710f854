"""The XDP slot pool as a service's engine (``xdp``): jobs admitted into a share of the loaded
XDP aggregator's pool, with a row of its job table and counters each (:mod:`nicoffload.agg`).
A job's ranks bind ``port + 1 + index``, one port per row of the table."""
from __future__ import annotations

import numpy as np

from nicoffload.agg.control import Aggregator
from nicoffload.agg.jobtable import JobEntry
from nicoffload.errors import CapacityError, InputError
from nicoffload.service.api import JobGrant
from nicoffload.service.engine import Admitted, NoOptimizer, Placement, Released
from nicoffload.service.leases import LeaseBook

#: the least a job is given while the pool is short, unless less is free (slots)
MIN_SHARE = 64


def share(job_slots: int, largest: int) -> int:
    """The slots a job that names none is given, from the pool's largest free range: its full
    share while another full share stays free; after that half of what is left (at least
    MIN_SHARE, or all of it where less is free), so that a job's next groups still find room on
    the aggregator instead of taking gloo, with a smaller window each. A request of several lanes
    is sized as one job, and its lanes split that share equally."""
    if largest >= 2 * job_slots:
        return job_slots
    return min(largest, job_slots, max(MIN_SHARE, largest // 2))


class XdpPool:
    """The jobs of the XDP aggregator ``agg`` (loaded, or reopened, and attached)."""

    name = "xdp"
    title = "the XDP pool"

    def __init__(self, agg: Aggregator, leases: LeaseBook):
        self.agg = agg
        self.leases = leases  # read only: the service keeps the book

    def refresh(self) -> None:
        """The job table as saved (``agg job add`` on this host may change it)."""
        with self.agg._changing():
            pass

    def jobs(self) -> list[int]:
        return sorted(self.agg.table.entries)

    def groups(self) -> set[str]:
        return {e.group for e in self.agg.table.entries.values()}

    def check_free(self, job: int | None, group: str | None) -> None:
        self.agg.table.check_free(job, group)

    def admit(self, p: Placement) -> Admitted:
        req, slots = p.req, p.req.slots
        if slots is None and req.optimizer is None:
            largest = max((c for _, c in self.agg.table.free_ranges()), default=0)
            if largest < 1:
                raise CapacityError(f"the pool of {self.agg.spec.slots} slots is full "
                                    f"({len(self.agg.table.entries)} jobs): wait for a job to end, or remove one; "
                                    f"a service for many groups at once is started with a smaller --job-slots "
                                    f"(a job takes up to {p.job_slots} now)")
            if p.lanes == 0:  # a later lane of a request: the first lane's share, where it fits
                slots = min(p.job_slots, largest)
            else:  # a job, or a request's first lane: the request's share, split among its lanes
                slots = max(1, share(p.job_slots * p.lanes, largest) // p.lanes)
        e = self.agg.add_job(p.job, req.world, p.group, req.workers, slots=slots, optimizer=req.optimizer,
                             params=req.params, delivery=p.delivery, key=p.key, key_nonce=p.key_nonce)
        return Admitted(None, f"admitted: {e.workers} ranks, slots {e.slot_base}..{e.slot_base + e.slot_count - 1}, "
                              f"{e.delivery} delivery (group {e.group})")

    def local_port(self, index: int) -> int:
        """The port a job's ranks bind: one per job entry, so ranks of several jobs share hosts."""
        return self.agg.spec.port + 1 + index

    def grant(self, job: int) -> JobGrant:
        e = self.agg.table.get(job)
        s = self.agg.spec
        le = self.leases.get(job)
        return JobGrant(job=e.job, world=e.workers, aggregator=s.agg_ip, port=s.port,
                        local_port=self.local_port(e.index), group=e.group, slot_base=e.slot_base,
                        slots=e.slot_count, elems=s.elems, lease_s=le.lease_s if le else 0.0,
                        delivery=e.delivery, owner=le.owner if le else "", optimizer=e.optimizer,
                        params=e.params, engine=self.name, key_nonce=e.key_nonce)

    def describe(self, job: int) -> dict:
        st = self.agg.job_state(job)
        e = self.agg.table.get(job)
        return {**st, **self.leases.public(job), "local_port": self.local_port(e.index), "stats": self.agg.stats(job),
                "engine": self.name}

    def slots(self, job: int) -> int:
        return self.agg.table.get(job).slot_count

    def stats(self, job: int | None) -> dict[str, int]:
        """One job's counters, or (None) every row's: its jobs' and traffic that named no job."""
        return self.agg.stats(job)

    def traffic(self, job: int) -> int:
        return self.agg.stats(job)["rx"]

    def release(self, job: int) -> Released:
        e = self.agg.remove_job(job)
        return Released({"job": job, "engine": self.name, "slot_base": e.slot_base, "slots": e.slot_count},
                        f"slots {e.slot_base}..{e.slot_base + e.slot_count - 1} free")

    def info(self) -> dict:
        return {}

    # --- optimizer jobs -----------------------------------------------------------------------
    def _opt_job(self, job: int) -> JobEntry:
        e = self.agg.table.get(job)
        if not e.optimizer:
            raise NoOptimizer(f"job {job} has no optimizer")
        return e

    def set_params(self, job: int, values: np.ndarray) -> dict:
        e = self._opt_job(job)
        if values.size != e.params:
            raise InputError(f"job {job} has {e.params} parameters, the upload holds {values.size}")
        if not np.isfinite(values).all():
            raise InputError("the parameters hold NaN or Inf")
        self.agg.set_params(job, values)
        return {"job": job, "params": int(values.size)}

    def params(self, job: int) -> np.ndarray:
        self._opt_job(job)
        return np.asarray(self.agg.params(job), dtype=np.float64)

    def set_lr(self, job: int, lr: float) -> dict:
        self._opt_job(job)
        self.agg.set_lr(job, lr)
        return {"job": job, "lr": lr}
