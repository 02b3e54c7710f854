"""The AF_XDP engine beside the aggregator as a service's engine (``afxdp``): with ``agg serve
--fallback afxdp`` a job the XDP pool refuses is handed to it (:mod:`nicoffload.agg.fallback`:
the XDP program steers the job's frames to the engine's sockets) and granted like any other:
the same aggregator address and port, a rank port of its own (``port + 1 + MAX_JOBS + k``, past
the XDP jobs' ``port + 1 + index``, kept in the job's lease), the engine's own slots from 0.
Its counters are read from the engine's counters file. Starting the engine the first time takes
a second or so; the service's one thread waits for it."""
from __future__ import annotations

import numpy as np

from nicoffload.agg import fallback
from nicoffload.agg.control import Aggregator
from nicoffload.agg.jobtable import JobEntry
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError, NotFoundError
from nicoffload.service.api import JobGrant
from nicoffload.service.engine import Admitted, NoOptimizer, Placement, Released
from nicoffload.service.leases import LeaseBook
from nicoffload.wire import proto


class AfxdpEngine:
    """The jobs the AF_XDP engine beside ``agg`` serves (handed off by a service, or by ``agg job
    add --fallback afxdp`` on this host), as its files said at the last :meth:`refresh`."""

    name = "afxdp"
    title = "the AF_XDP engine"

    def __init__(self, agg: Aggregator, leases: LeaseBook):
        self.agg = agg
        self.leases = leases  # read only: the service keeps the book
        self._handed: dict[int, dict] = {}

    def refresh(self) -> None:
        s = self.agg.spec
        self._handed = {h["job"]: h for h in fallback.handed_off(s.netns, s.iface)}

    def jobs(self) -> list[int]:
        return sorted(self._handed)

    def groups(self) -> set[str]:
        return {h["group"] for h in self._handed.values()}

    def check_free(self, job: int | None, group: str | None) -> None:
        if job is not None and job in self._handed:
            raise AlreadyExistsError(f"job {job} is already served by the AF_XDP engine; remove it first "
                                     f"(DELETE /v1/jobs/{job})")
        other = next((h["job"] for h in self._handed.values() if group is not None and h["group"] == group), None)
        if other is not None:
            raise InputError(f"multicast group {group} is already job {other}'s: give each job its own group, "
                             f"or its results would reach the other job's hosts")

    def admit(self, p: Placement) -> Admitted:
        req = p.req
        if req.optimizer is not None:
            why = f"{p.refused}; an optimizer job" if p.refused else "an optimizer job"
            raise CapacityError(f"{why} cannot fall back to the AF_XDP engine (it has no optimizer)")
        JobEntry(p.job, req.world, p.group, list(req.workers), delivery=p.delivery).validate()
        port = self._free_port()
        slots = req.slots or p.job_slots
        got = fallback.hand_off(self.agg, p.job, req.world, p.group, list(req.workers), slots, p.delivery,
                                key=p.key, key_nonce=p.key_nonce)
        self.refresh()
        return Admitted(port, f"handed to the AF_XDP engine (pid {got.get('pid')}; the XDP pool refused it: "
                              f"{p.refused}): {req.world} ranks, {slots} slots of its own, {p.delivery} delivery "
                              f"(group {p.group}), ranks' port {port}")

    def _port(self, job: int) -> int | None:
        """The port the ranks of a job this service handed to the engine bind (kept in its
        lease); None for one handed off by someone else."""
        le = self.leases.get(job)
        return le.local_port if le else None

    def _free_port(self) -> int:
        """``port + 1 + MAX_JOBS + k`` for the lowest k no handed-off job's ranks use (the XDP
        jobs' ranks use ``port + 1 + index``, index < MAX_JOBS)."""
        base = self.agg.spec.port + 1 + proto.MAX_JOBS
        used = {self._port(j) for j in self._handed}
        port = next((base + k for k in range(proto.MAX_JOBS) if base + k not in used), None)
        if port is None or len(self._handed) >= proto.MAX_JOBS:
            raise CapacityError(f"the AF_XDP engine beside the aggregator serves {proto.MAX_JOBS} jobs, its most: "
                                f"wait for a job to end, or remove one")
        return port

    def grant(self, job: int) -> JobGrant:
        h, s = self._handed[job], self.agg.spec
        le = self.leases.get(job)
        port = self._port(job)
        if port is None:
            raise NotFoundError(f"job {job} is served by the AF_XDP engine on {s.iface}, but was not handed "
                                f"to it by this service (agg job add --fallback afxdp): its ranks' port is theirs")
        return JobGrant(job=job, world=h["workers"], aggregator=s.agg_ip, port=s.port, local_port=port,
                        group=h["group"], slot_base=0, slots=h["slots"], elems=s.elems,
                        lease_s=le.lease_s if le else 0.0, delivery=h.get("delivery", "multicast"),
                        owner=le.owner if le else "", engine=self.name,
                        key_nonce=fallback.key_nonce(s.netns, s.iface, job))

    def describe(self, job: int) -> dict:
        """The fields an XDP job's description has (the engine reports no epoch state: epoch and
        joined read 0) and the engine's process."""
        h, s = self._handed[job], self.agg.spec
        n = h["workers"]
        return {"job": job, "workers": n, "group": h["group"], "agg_ip": s.agg_ip, "slot_base": 0,
                "slots": h["slots"], "delivery": h.get("delivery", "multicast"),
                "worker_ips": list(h.get("worker_ips") or [None] * n), "epoch": 0, "joined": 0,
                **self.leases.public(job), "local_port": self._port(job), "stats": self.stats(job),
                "engine": self.name, "pid": h.get("pid"), "alive": bool(h.get("alive"))}

    def slots(self, job: int) -> int:
        return self._handed[job]["slots"]

    def stats(self, job: int | None) -> dict[str, int]:
        """A job's counters as the engine last wrote them (every counter, 0 until then); None:
        summed over its jobs."""
        if job is not None:
            got = self._handed[job].get("stats") or {}
            return {**{k: 0 for k in proto.STATS}, **{k: int(v) for k, v in got.items()}}
        total: dict[str, int] = {}
        for j in self._handed:
            for k, v in self.stats(j).items():
                total[k] = total.get(k, 0) + v
        return total

    def traffic(self, job: int) -> int:
        return self.stats(job)["rx"]

    def release(self, job: int) -> Released:
        got = fallback.take_back(self.agg, job)
        self.refresh()
        return Released({"job": job, "engine": self.name, "slot_base": 0, "slots": got["slots"]},
                        f"the AF_XDP engine let it go after {got.get('last', {}).get('completed', 0)} rounds")

    def info(self) -> dict:
        return {"afxdp_jobs": len(self._handed)}

    # --- no optimizer -------------------------------------------------------------------------
    def _no_optimizer(self, job: int) -> NoOptimizer:
        return NoOptimizer(f"job {job} is served by the AF_XDP engine, which has no optimizer")

    def set_params(self, job: int, values: np.ndarray) -> dict:
        raise self._no_optimizer(job)

    def params(self, job: int) -> np.ndarray:
        raise self._no_optimizer(job)

    def set_lr(self, job: int, lr: float) -> dict:
        raise self._no_optimizer(job)
