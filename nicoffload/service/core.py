"""The service's logic, apart from HTTP: jobs admitted, removed, renewed, listed, reaped when
their lease runs out; the snapshot the metrics read. Every method is synchronous and quick (map
writes, a state file under its lock); the HTTP layer runs them one at a time on one thread.

The jobs themselves run on engines (:mod:`nicoffload.service.engine`): the XDP slot pool, and
the engine a job the pool refuses falls back to (``ServiceConfig.fallback``). The service asks a
job's engine for whatever concerns the job, and keeps the leases (:mod:`.leases`) itself."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from nicoffload.agg.control import Aggregator
from nicoffload.agg.jobtable import first_free_group
from nicoffload.errors import CapacityError, InputError, NotFoundError, SetupError
from nicoffload.jobspec import DEFAULT
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.engine import Admitted, Engine, Placement, UnknownEngine, UnknownJob
from nicoffload.service.engines import registry
from nicoffload.service.leases import LeaseBook
from nicoffload.wire import keys

log = logging.getLogger("nicoffload.service")


@dataclass
class ServiceConfig:
    lease_s: float = 30.0          # a job's lease unless its request names one
    job_slots: int = DEFAULT.slots  # a job's share unless its request names one (less if less is free)
    multicast: bool = True         # the network carries multicast (False: every job gets unicast delivery)
    fallback: str | None = None    # an engine a job the XDP pool refuses goes to ("afxdp"; None: refused)


class Service:
    """The aggregator behind the API. ``agg`` is loaded (or reopened) and attached; ``engines``
    (default: one of each registered engine, the XDP pool first) serve its jobs."""

    def __init__(self, agg: Aggregator, leases: LeaseBook, config: ServiceConfig | None = None,
                 engines: list[Engine] | None = None, token: bytes = b""):
        self.agg = agg
        self.leases = leases
        self.token = token  # the bearer token: every job's key derives from it (and a nonce per job)
        self.config = config or ServiceConfig()
        self.engines: list[Engine] = engines if engines is not None else \
            [registry.create(name, agg, leases) for name in registry.names()]
        #: the engines a new job is offered to, in order: the first, then the fallback
        self.admitting: list[Engine] = [self.engines[0]]
        if self.config.fallback is not None:
            to = next((e for e in self.engines[1:] if e.name == self.config.fallback), None)
            if to is None:
                names = " or ".join(e.name for e in self.engines[1:]) or "no engine"
                raise UnknownEngine(f"a job the pool refuses can go to {names}, not {self.config.fallback!r}")
            self.admitting.append(to)
        self.started = time.monotonic()
        self.failovers_reported = 0  # failovers the groups that asked again reported (JobRequest.failovers)

    # --- jobs ---------------------------------------------------------------------------------
    def _refresh(self) -> None:
        """What every engine serves, as saved (another process, ``agg job add`` on this host, may
        change it)."""
        for e in self.engines:
            e.refresh()

    def _find(self, job: int) -> Engine | None:
        return next((e for e in self.engines if job in e.jobs()), None)

    def _engine_of(self, job: int) -> Engine:
        e = self._find(job)
        if e is None:
            known = ", ".join(str(j) for j in sorted(self._all_jobs())) or "none"
            raise UnknownJob(f"job {job} is not registered on this aggregator (registered: {known})")
        return e

    def _all_jobs(self) -> set[int]:
        return {j for e in self.engines for j in e.jobs()}

    def grant(self, job: int) -> JobGrant:
        return self._engine_of(job).grant(job)

    def create_job(self, req: JobRequest) -> JobGrant:
        """Admit ``req`` (its ``lanes``: that many jobs, all or none, released as one)."""
        if req.lanes == 1:
            got = self._create_one(req)
        else:
            got = self._create_lanes(req)
        self.failovers_reported += req.failovers
        return got

    def _create_lanes(self, req: JobRequest) -> JobGrant:
        """A request of several lanes: a job per lane, all or none, linked to be released as one.
        The lanes share one job's slots (each carries 1/lanes of every tensor), so that a host of
        many ranks takes no more of the pool than a host of one."""
        grants: list[JobGrant] = []
        share = max(1, self.config.job_slots // req.lanes)
        try:
            for k in range(req.lanes):
                grants.append(self._create_one(dataclasses.replace(req, lanes=1, job=req.job if k == 0 else None),
                                               share, lanes=req.lanes if k == 0 else 0))
                share = grants[0].slots  # every lane the first one's share: a lane with fewer holds the others back
        except BaseException:
            for g in grants:
                self.remove_job(g.job, "removed: another lane of its request was refused")
            raise
        self.leases.link(grants[0].job, [g.job for g in grants[1:]])
        return dataclasses.replace(grants[0], lanes=[g.to_json() for g in grants[1:]])

    def _create_one(self, req: JobRequest, job_slots: int | None = None, lanes: int = 1) -> JobGrant:
        self._refresh()
        delivery = req.delivery or ("multicast" if self.config.multicast else "unicast")
        if delivery == "multicast" and not self.config.multicast:
            raise InputError("this network carries no multicast (the service runs with --no-multicast): ask for "
                             "unicast delivery, or leave delivery out")
        for e in self.engines:  # an id or a group one engine has is taken on every engine
            e.check_free(req.job, req.group)
        used = self._all_jobs()
        job = req.job if req.job is not None else next(j for j in range(1, 1 << 16) if j not in used)
        group = req.group or first_free_group(job, set().union(*(e.groups() for e in self.engines)))
        nonce, key = self._job_key(job)
        share = job_slots or self.config.job_slots
        e, got = self._admit(Placement(req, job, group, delivery, share, key=key, key_nonce=nonce, lanes=lanes))
        lease = self.config.lease_s if req.lease_s is None else req.lease_s
        self.leases.add(job, lease, req.owner, local_port=got.local_port)
        log.info("job %d %s, lease %gs, owner %r", job, got.summary, lease, req.owner)
        return e.grant(job)

    def _job_key(self, job: int) -> tuple[str, int]:
        """A fresh nonce for the job and the key it derives from the token (keys.derive): the
        grant carries the nonce, every rank that holds the token derives the key. The service
        never registers a job without a key."""
        if not self.token:
            raise SetupError("the service has no token to derive the job's key from")
        return keys.new_nonce(self.token, job)

    def _admit(self, p: Placement) -> tuple[Engine, Admitted]:
        """Offer the job to each admitting engine in turn; the first with room takes it (the
        last one's refusal stands)."""
        *firsts, last = self.admitting
        for e in firsts:
            try:
                return e, e.admit(p)
            except CapacityError as refusal:
                p = dataclasses.replace(p, refused=str(refusal).splitlines()[0])
        return last, last.admit(p)

    def remove_job(self, job: int, why: str = "removed on request") -> dict:
        """Remove ``job`` (lane 0's job of a request of several lanes: every lane's)."""
        self._refresh()
        self._engine_of(job)  # UnknownJob before anything is removed
        answer: dict = {}
        for j in self.leases.lane_set(job):
            e = self._find(j)
            if e is None:
                continue
            gone = e.release(j)
            self.leases.remove(j)
            log.info("job %d %s: %s", j, why, gone.summary)
            answer = answer or gone.answer
        return {**answer, "free_slots": self.agg.table.free_slots()}

    def renew(self, job: int) -> dict:
        self._refresh()
        self._engine_of(job)  # UnknownJob: the job is gone (its lease expired, or it was removed)
        le = self.leases.renew(job)
        return {"job": job, "lease_s": le.lease_s if le else 0.0, "lease_remaining_s": self.leases.remaining(job)}

    def job(self, job: int) -> dict:
        self._refresh()
        return self._engine_of(job).describe(job)

    def jobs(self) -> dict:
        self._refresh()
        return {"jobs": [e.describe(j) for e in self.engines for j in e.jobs()],
                "slots": self.agg.spec.slots, "free_slots": self.agg.table.free_slots(),
                "unattributed": self.agg.unattributed()}

    def stats(self, job: int | None) -> dict:
        self._refresh()
        if job is not None:
            return self._engine_of(job).stats(job)
        total: dict[str, int] = {}
        for e in self.engines:  # every row's counters: the XDP program's and every engine's jobs'
            for k, v in e.stats(None).items():
                total[k] = total.get(k, 0) + v
        return total

    # --- optimizer jobs -----------------------------------------------------------------------
    def set_params(self, job: int, values: np.ndarray) -> dict:
        self._refresh()
        return self._engine_of(job).set_params(job, values)

    def params(self, job: int) -> np.ndarray:
        self._refresh()
        return self._engine_of(job).params(job)

    def set_lr(self, job: int, lr: float) -> dict:
        self._refresh()
        return self._engine_of(job).set_lr(job, lr)

    # --- upkeep -------------------------------------------------------------------------------
    def restore(self) -> list[int]:
        """Take back the leases an earlier service saved for the jobs the engines still serve
        (each a full lease from now); the jobs taken back."""
        self._refresh()
        return self.leases.load(self._all_jobs())

    def served(self) -> str:
        """How many jobs each engine serves, for the log: "3 job(s) and 1 on the AF_XDP engine"."""
        first, *others = self.engines
        return f"{len(first.jobs())} job(s)" + "".join(f" and {len(e.jobs())} on {e.title}"
                                                      for e in others if e.jobs())

    def reap(self) -> list[int]:
        """Note each leased job's traffic, and remove the jobs whose lease ran out."""
        self._refresh()
        for job in self.leases.jobs():
            e = self._find(job)
            if e is None:  # removed by someone else
                self.leases.remove(job)
            else:
                self.leases.observe(job, e.traffic(job))
        gone = []
        for job in self.leases.expired():
            le = self.leases.get(job)
            if le is None:
                continue  # another lane of its set expired first: the whole set is gone
            try:
                self.remove_job(job, f"expired (owner {le.owner!r}: no renewal and no traffic for {le.lease_s:g}s)")
            except NotFoundError:
                pass
            self.leases.expire(job)
            gone.append(job)
        return gone

    def info(self) -> dict:
        s = self.agg.spec
        self._refresh()
        extra = {k: v for e in self.engines for k, v in e.info().items()}
        return {"aggregator": s.agg_ip, "port": s.port, "iface": s.iface, "netns": s.netns, "mode": s.mode,
                "slots": s.slots, "free_slots": self.agg.table.free_slots(), "elems": s.elems,
                "optimizer": bool(s.optimizer), "jobs": len(self._all_jobs()), **extra,
                "fallback": self.config.fallback,
                "lease_s": self.config.lease_s, "job_slots": self.config.job_slots,
                "delivery": ["multicast", "unicast"] if self.config.multicast else ["unicast"],
                "multicast": self.config.multicast,
                "uptime_s": time.monotonic() - self.started}

    def snapshot(self) -> dict:
        """What the metrics read (one pass over the maps)."""
        self._refresh()
        jobs = [{"job": j, "stats": e.stats(j), "slots": e.slots(j), "lease_remaining_s": self.leases.remaining(j),
                 "engine": e.name} for e in self.engines for j in e.jobs()]
        return {"jobs": jobs, "unattributed": self.agg.unattributed(), "slots": self.agg.spec.slots,
                "free_slots": self.agg.table.free_slots(), "uptime_s": time.monotonic() - self.started,
                "leases_expired": self.leases.expired_total, "failovers_reported": self.failovers_reported}
