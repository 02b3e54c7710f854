"""The service's logic, apart from HTTP: jobs admitted into a loaded XDP aggregator's pool with
a lease each, removed, listed, renewed, reaped when their lease runs out; the snapshot the
metrics read. Every method is synchronous and quick (map writes, a state file under its lock);
the HTTP layer runs them one at a time on one thread.

With ``--fallback afxdp`` a job the XDP pool refuses is handed to the AF_XDP engine beside the
aggregator (:mod:`nicoffload.agg.fallback`: the XDP program steers its frames to the engine's
sockets) and granted like any other: the same aggregator address and port, a rank port of its
own (``port + 1 + MAX_JOBS + k``, past the XDP jobs' ``port + 1 + index``), the engine's own
slots from 0, ``engine: "afxdp"``. Its lease, removal, listing and counters (read from the
engine's counters file) work as for an XDP job. Starting the engine the first time takes a
second or so; the service's one thread waits for it."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from nicoffload.agg import fallback
from nicoffload.agg.control import Aggregator
from nicoffload.agg.jobtable import JobEntry, default_group
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError, NotFoundError
from nicoffload.jobspec import DEFAULT
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.leases import LeaseBook
from nicoffload.wire import proto

log = logging.getLogger("nicoffload.service")


@dataclass
class ServiceConfig:
    lease_s: float = 30.0          # a job's lease unless its request names one
    job_slots: int = DEFAULT.slots  # a job's share unless its request names one (less if less is free)
    multicast: bool = True         # the network carries multicast (False: every job gets unicast delivery)
    fallback: str | None = None    # "afxdp": a job the XDP pool refuses goes to the AF_XDP engine (None: refused)


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

    def _handed(self) -> dict[int, dict]:
        """The jobs the AF_XDP engine beside the aggregator serves (handed off by this service,
        or by ``agg job add --fallback afxdp`` on this host), by id, with its latest counters."""
        s = self.agg.spec
        return {h["job"]: h for h in fallback.handed_off(s.netns, s.iface)}

    def _free_id(self, handed: dict[int, dict]) -> int:
        used = set(self.agg.table.entries) | set(handed)
        return next(j for j in range(1, 1 << 16) if j not in used)

    def _free_group(self, job: int, handed: dict[int, dict]) -> str:
        """The first default group neither an XDP job nor a handed-off job uses."""
        return default_group(job, self.agg.table, (h["group"] for h in handed.values()))

    def grant(self, job: int) -> JobGrant:
        handed = self._handed()
        if job in handed:
            return self._afxdp_grant(handed[job])
        e = self.agg.table.get(job)
        s = self.agg.spec
        le = self.leases.leases.get(job)
        return JobGrant(job=e.job, world=e.workers, aggregator=s.agg_ip, port=s.port,
                        local_port=self.local_port(e.index), group=e.group, slot_base=e.slot_base,
                        slots=e.slot_count, elems=s.elems, lease_s=le.lease_s if le else 0.0,
                        delivery=e.delivery, owner=le.owner if le else "", optimizer=e.optimizer,
                        params=e.params, engine="xdp")

    def _afxdp_grant(self, h: dict) -> JobGrant:
        s = self.agg.spec
        le = self.leases.leases.get(h["job"])
        port = self._afxdp_port(h["job"])
        if port is None:
            raise NotFoundError(f"job {h['job']} is served by the AF_XDP engine on {s.iface}, but was not handed "
                                f"to it by this service (agg job add --fallback afxdp): its ranks' port is theirs")
        return JobGrant(job=h["job"], world=h["workers"], aggregator=s.agg_ip, port=s.port, local_port=port,
                        group=h["group"], slot_base=0, slots=h["slots"], elems=s.elems,
                        lease_s=le.lease_s if le else 0.0, delivery=h.get("delivery", "multicast"),
                        owner=le.owner if le else "", engine="afxdp")

    def local_port(self, index: int) -> int:
        """The port a job's ranks bind: one per job entry, so ranks of several jobs share hosts."""
        return self.agg.spec.port + 1 + index

    def _afxdp_port(self, job: int) -> int | None:
        """The port the ranks of a job this service handed to the AF_XDP engine bind (kept in its
        lease); None for one handed off by someone else."""
        le = self.leases.leases.get(job)
        return le.local_port if le else None

    def _free_afxdp_port(self, handed: dict[int, dict]) -> int:
        """``port + 1 + MAX_JOBS + k`` for the lowest k no handed-off job's ranks use (the XDP
        jobs' ranks use ``port + 1 + index``, index < MAX_JOBS)."""
        base = self.agg.spec.port + 1 + proto.MAX_JOBS
        used = {self._afxdp_port(j) for j in handed}
        port = next((base + k for k in range(proto.MAX_JOBS) if base + k not in used), None)
        if port is None or len(handed) >= proto.MAX_JOBS:
            raise CapacityError(f"the AF_XDP engine beside the aggregator serves {proto.MAX_JOBS} jobs, its most: "
                                f"wait for a job to end, or remove one")
        return port

    def create_job(self, req: JobRequest) -> JobGrant:
        self._refresh()
        delivery = req.delivery or ("multicast" if self.config.multicast else "unicast")
        if delivery == "multicast" and not self.config.multicast:
            raise InputError("this network carries no multicast (the service runs with --no-multicast): ask for "
                             "unicast delivery, or leave delivery out")
        handed = self._handed()
        if req.job is not None and req.job in handed:
            raise AlreadyExistsError(f"job {req.job} is already served by the AF_XDP engine; remove it first "
                                     f"(DELETE /v1/jobs/{req.job})")
        if req.group is not None and any(h["group"] == req.group for h in handed.values()):
            other = next(h["job"] for h in handed.values() if h["group"] == req.group)
            raise InputError(f"multicast group {req.group} is already job {other}'s: give each job its own group, "
                             f"or its results would reach the other job's hosts")
        job = req.job if req.job is not None else self._free_id(handed)
        group = req.group or self._free_group(job, handed)
        slots = req.slots
        try:
            if slots is None and req.optimizer is None:
                largest = max((c for _, c in self.agg.table.free_ranges()), default=0)
                if largest < 1:
                    raise CapacityError(f"the pool of {self.agg.spec.slots} slots is full "
                                        f"({len(self.agg.table.entries)} jobs): wait for a job to end, or remove one")
                slots = min(self.config.job_slots, largest)
            e = self.agg.add_job(job, req.world, group, req.workers, slots=slots, optimizer=req.optimizer,
                                 params=req.params, delivery=delivery)
        except CapacityError as refusal:
            if self.config.fallback != "afxdp":
                raise
            if req.optimizer is not None:
                raise CapacityError(f"{str(refusal).splitlines()[0]}; an optimizer job cannot fall back to the "
                                    f"AF_XDP engine (it has no optimizer)") from None
            return self._hand_off(job, req, group, delivery, handed, str(refusal).splitlines()[0])
        lease = self.config.lease_s if req.lease_s is None else req.lease_s
        self.leases.add(e.job, lease, req.owner)
        log.info("job %d admitted: %d ranks, slots %d..%d, %s delivery (group %s), lease %gs, owner %r", e.job,
                 e.workers, e.slot_base, e.slot_base + e.slot_count - 1, e.delivery, e.group, lease, req.owner)
        return self.grant(e.job)

    def _hand_off(self, job: int, req: JobRequest, group: str, delivery: str, handed: dict[int, dict],
                  why: str) -> JobGrant:
        """The XDP pool refused ``req``: the AF_XDP engine beside the aggregator takes it."""
        JobEntry(job, req.world, group, list(req.workers), delivery=delivery).validate()
        port = self._free_afxdp_port(handed)
        slots = req.slots or self.config.job_slots
        got = fallback.hand_off(self.agg, job, req.world, group, list(req.workers), slots, delivery)
        lease = self.config.lease_s if req.lease_s is None else req.lease_s
        self.leases.add(job, lease, req.owner, local_port=port)
        log.info("job %d handed to the AF_XDP engine (pid %s; the XDP pool refused it: %s): %d ranks, %d slots of "
                 "its own, %s delivery (group %s), ranks' port %d, lease %gs, owner %r", job, got.get("pid"), why,
                 req.world, slots, delivery, group, port, lease, req.owner)
        return self.grant(job)

    def remove_job(self, job: int, why: str = "removed on request") -> dict:
        self._refresh()
        if job in self._handed():
            got = fallback.take_back(self.agg, job)
            self.leases.remove(job)
            log.info("job %d %s: the AF_XDP engine let it go after %d rounds", job, why,
                     got.get("last", {}).get("completed", 0))
            return {"job": job, "engine": "afxdp", "slot_base": 0, "slots": got["slots"],
                    "free_slots": self.agg.table.free_slots()}
        e = self.agg.remove_job(job)
        self.leases.remove(job)
        log.info("job %d %s: slots %d..%d free", job, why, e.slot_base, e.slot_base + e.slot_count - 1)
        return {"job": job, "engine": "xdp", "slot_base": e.slot_base, "slots": e.slot_count,
                "free_slots": self.agg.table.free_slots()}

    def renew(self, job: int) -> dict:
        self._refresh()
        if job not in self._handed():
            self.agg.table.get(job)  # NotFoundError: the job is gone (its lease expired, or it was removed)
        le = self.leases.renew(job)
        return {"job": job, "lease_s": le.lease_s if le else 0.0,
                "lease_remaining_s": le.remaining(self.leases.clock()) if le else None}

    def job(self, job: int) -> dict:
        self._refresh()
        handed = self._handed()
        if job in handed:
            return self._describe_afxdp(handed[job])
        e = self.agg.table.get(job)
        return self._describe(e.job)

    def _lease(self, job: int) -> dict:
        le = self.leases.leases.get(job)
        return le.public(self.leases.clock()) if le else {"lease_s": 0.0, "owner": "", "created": None,
                                                           "lease_remaining_s": None}

    def _describe(self, job: int) -> dict:
        st = self.agg.job_state(job)
        e = self.agg.table.get(job)
        return {**st, **self._lease(job), "local_port": self.local_port(e.index), "stats": self.agg.stats(job),
                "engine": "xdp"}

    def _describe_afxdp(self, h: dict) -> dict:
        """A handed-off job, with the fields an XDP job's description has (the engine reports no
        epoch state: epoch and joined read 0) and the engine's process."""
        s = self.agg.spec
        n = h["workers"]
        return {"job": h["job"], "workers": n, "group": h["group"], "agg_ip": s.agg_ip, "slot_base": 0,
                "slots": h["slots"], "delivery": h.get("delivery", "multicast"),
                "worker_ips": list(h.get("worker_ips") or [None] * n), "epoch": 0, "joined": 0,
                **self._lease(h["job"]), "local_port": self._afxdp_port(h["job"]), "stats": _afxdp_stats(h),
                "engine": "afxdp", "pid": h.get("pid"), "alive": bool(h.get("alive"))}

    def jobs(self) -> dict:
        self._refresh()
        handed = self._handed()
        xdp = [self._describe(j) for j in sorted(self.agg.table.entries)]
        return {"jobs": xdp + [self._describe_afxdp(handed[j]) for j in sorted(handed)],
                "slots": self.agg.spec.slots, "free_slots": self.agg.table.free_slots(),
                "unattributed": self.agg.unattributed()}

    def stats(self, job: int | None) -> dict:
        self._refresh()
        handed = self._handed()
        if job is not None:
            if job in handed:
                return _afxdp_stats(handed[job])
            self.agg.table.get(job)
            return self.agg.stats(job)
        total = self.agg.stats(None)
        for h in handed.values():  # every job's counters: the engine's jobs too
            for k, v in _afxdp_stats(h).items():
                total[k] = total.get(k, 0) + v
        return total

    # --- optimizer jobs -----------------------------------------------------------------------
    def _opt_job(self, job: int):
        self._refresh()
        if job in self._handed():
            raise InputError(f"job {job} is served by the AF_XDP engine, which has no optimizer")
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
        """Note each leased job's traffic (a handed-off job's: the engine's rx counter), and
        remove the jobs whose lease ran out."""
        self._refresh()
        handed = self._handed()
        for job in list(self.leases.leases):
            if job in self.agg.table.entries:
                self.leases.observe(job, self.agg.stats(job)["rx"])
            elif job in handed:
                self.leases.observe(job, _afxdp_stats(handed[job])["rx"])
            else:  # removed by someone else
                self.leases.remove(job)
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
        handed = self._handed()
        return {"aggregator": s.agg_ip, "port": s.port, "iface": s.iface, "netns": s.netns, "mode": s.mode,
                "slots": s.slots, "free_slots": self.agg.table.free_slots(), "elems": s.elems,
                "optimizer": bool(s.optimizer), "jobs": len(self.agg.table.entries) + len(handed),
                "afxdp_jobs": len(handed), "fallback": self.config.fallback,
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
                         "lease_remaining_s": le.remaining(now) if le else None, "engine": "xdp"})
        for j, h in sorted(self._handed().items()):
            le = self.leases.leases.get(j)
            jobs.append({"job": j, "stats": _afxdp_stats(h), "slots": h["slots"],
                         "lease_remaining_s": le.remaining(now) if le else None, "engine": "afxdp"})
        return {"jobs": jobs, "unattributed": self.agg.unattributed(), "slots": self.agg.spec.slots,
                "free_slots": self.agg.table.free_slots(), "uptime_s": time.monotonic() - self.started,
                "leases_expired": self.leases.expired_total}


def _afxdp_stats(h: dict) -> dict[str, int]:
    """A handed-off job's counters as the engine last wrote them (every counter, 0 until then)."""
    return {**{k: 0 for k in proto.STATS}, **{k: int(v) for k, v in (h.get("stats") or {}).items()}}
