"""The service's logic, apart from HTTP: jobs admitted into a loaded XDP aggregator's pool with
a lease each, removed, listed, renewed, reaped when their lease runs out; the snapshot the
metrics read. Every method is synchronous and quick (map writes, a state file under its lock);
the HTTP layer runs them one at a time on one thread."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from nicoffload.agg.control import Aggregator
from nicoffload.errors import CapacityError, InputError, NotFoundError
from nicoffload.jobspec import DEFAULT
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.leases import LeaseBook

log = logging.getLogger("nicoffload.service")


@dataclass
class ServiceConfig:
    lease_s: float = 30.0          # a job's lease unless its request names one
    job_slots: int = DEFAULT.slots  # a job's share unless its request names one (less if less is free)
    multicast: bool = True         # the network carries multicast (False: every job gets unicast delivery)


class Service:
    """The aggregator behind the API. ``agg`` is loaded (or reopened) and attached."""

    def __init__(self, agg: Aggregator, leases: LeaseBook, config: ServiceConfig | None = None):
        self.agg = agg
        self.leases = leases
        self.config = config or ServiceConfig()
        self.started = time.monotonic()

    # --- jobs ---------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """The job table as saved (another process, ``agg job add`` on this host, may change it)."""
        with self.agg._changing():
            pass

    def _free_id(self) -> int:
        used = set(self.agg.table.entries)
        return next(j for j in range(1, 1 << 16) if j not in used)

    def grant(self, job: int) -> JobGrant:
        e = self.agg.table.get(job)
        s = self.agg.spec
        le = self.leases.leases.get(job)
        return JobGrant(job=e.job, world=e.workers, aggregator=s.agg_ip, port=s.port,
                        local_port=self.local_port(e.index), group=e.group, slot_base=e.slot_base,
                        slots=e.slot_count, elems=s.elems, lease_s=le.lease_s if le else 0.0,
                        delivery=e.delivery, owner=le.owner if le else "", optimizer=e.optimizer,
                        params=e.params)

    def local_port(self, index: int) -> int:
        """The port a job's ranks bind: one per job entry, so ranks of several jobs share hosts."""
        return self.agg.spec.port + 1 + index

    def create_job(self, req: JobRequest) -> JobGrant:
        self._refresh()
        delivery = req.delivery or ("multicast" if self.config.multicast else "unicast")
        if delivery == "multicast" and not self.config.multicast:
            raise InputError("this network carries no multicast (the service runs with --no-multicast): ask for "
                             "unicast delivery, or leave delivery out")
        job = req.job if req.job is not None else self._free_id()
        slots = req.slots
        if slots is None and req.optimizer is None:
            largest = max((c for _, c in self.agg.table.free_ranges()), default=0)
            if largest < 1:
                raise CapacityError(f"the pool of {self.agg.spec.slots} slots is full "
                                    f"({len(self.agg.table.entries)} jobs): wait for a job to end, or remove one")
            slots = min(self.config.job_slots, largest)
        e = self.agg.add_job(job, req.world, req.group, req.workers, slots=slots, optimizer=req.optimizer,
                             params=req.params, delivery=delivery)
        lease = self.config.lease_s if req.lease_s is None else req.lease_s
        self.leases.add(e.job, lease, req.owner)
        log.info("job %d admitted: %d ranks, slots %d..%d, %s delivery (group %s), lease %gs, owner %r", e.job,
                 e.workers, e.slot_base, e.slot_base + e.slot_count - 1, e.delivery, e.group, lease, req.owner)
        return self.grant(e.job)

    def remove_job(self, job: int, why: str = "removed on request") -> dict:
        self._refresh()
        e = self.agg.remove_job(job)
        self.leases.remove(job)
        log.info("job %d %s: slots %d..%d free", job, why, e.slot_base, e.slot_base + e.slot_count - 1)
        return {"job": job, "slot_base": e.slot_base, "slots": e.slot_count, "free_slots": self.agg.table.free_slots()}

    def renew(self, job: int) -> dict:
        self._refresh()
        self.agg.table.get(job)  # NotFoundError: the job is gone (its lease expired, or it was removed)
        le = self.leases.renew(job)
        return {"job": job, "lease_s": le.lease_s if le else 0.0,
                "lease_remaining_s": le.remaining(self.leases.clock()) if le else None}

    def job(self, job: int) -> dict:
        self._refresh()
        e = self.agg.table.get(job)
        return self._describe(e.job)

    def _describe(self, job: int) -> dict:
        st = self.agg.job_state(job)
        le = self.leases.leases.get(job)
        lease = le.public(self.leases.clock()) if le else {"lease_s": 0.0, "owner": "", "created": None,
                                                            "lease_remaining_s": None}
        e = self.agg.table.get(job)
        return {**st, **lease, "local_port": self.local_port(e.index), "stats": self.agg.stats(job)}

    def jobs(self) -> dict:
        self._refresh()
        return {"jobs": [self._describe(j) for j in sorted(self.agg.table.entries)],
                "slots": self.agg.spec.slots, "free_slots": self.agg.table.free_slots(),
                "unattributed": self.agg.unattributed()}

    def stats(self, job: int | None) -> dict:
        self._refresh()
        if job is not None:
            self.agg.table.get(job)
        return self.agg.stats(job)

    # --- optimizer jobs -----------------------------------------------------------------------
    def _opt_job(self, job: int):
        self._refresh()
        e = self.agg.table.get(job)
        if not e.optimizer:
            raise InputError(f"job {job} has no optimizer")
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

    # --- upkeep -------------------------------------------------------------------------------
    def reap(self) -> list[int]:
        """Note each leased job's traffic, and remove the jobs whose lease ran out."""
        self._refresh()
        for job in list(self.leases.leases):
            if job not in self.agg.table.entries:  # removed by someone else
                self.leases.remove(job)
                continue
            self.leases.observe(job, self.agg.stats(job)["rx"])
        gone = []
        for job in self.leases.expired():
            le = self.leases.leases[job]
            try:
                self.remove_job(job, f"expired (owner {le.owner!r}: no renewal and no traffic for {le.lease_s:g}s)")
            except NotFoundError:
                self.leases.remove(job)
            self.leases.expired_total += 1
            gone.append(job)
        return gone

    def info(self) -> dict:
        s = self.agg.spec
        self._refresh()
        return {"aggregator": s.agg_ip, "port": s.port, "iface": s.iface, "netns": s.netns, "mode": s.mode,
                "slots": s.slots, "free_slots": self.agg.table.free_slots(), "elems": s.elems,
                "optimizer": bool(s.optimizer), "jobs": len(self.agg.table.entries),
                "lease_s": self.config.lease_s, "job_slots": self.config.job_slots,
                "delivery": ["multicast", "unicast"] if self.config.multicast else ["unicast"],
                "multicast": self.config.multicast,
                "uptime_s": time.monotonic() - self.started}

    def snapshot(self) -> dict:
        """What the metrics read (one pass over the maps)."""
        self._refresh()
        now = self.leases.clock()
        jobs = []
        for j in sorted(self.agg.table.entries):
            le = self.leases.leases.get(j)
            jobs.append({"job": j, "stats": self.agg.stats(j), "slots": self.agg.table.entries[j].slot_count,
                         "lease_remaining_s": le.remaining(now) if le else None})
        return {"jobs": jobs, "unattributed": self.agg.unattributed(), "slots": self.agg.spec.slots,
                "free_slots": self.agg.table.free_slots(), "uptime_s": time.monotonic() - self.started,
                "leases_expired": self.leases.expired_total}
