"""Leases: a job the service admitted lives while its owner renews it or its ranks send traffic.
A crashed training run stops both, and after ``lease_s`` seconds of neither the service removes
the job and frees its slots, so a dead run never leaks the pool. The book is kept in a JSON file
beside the aggregator's state, so a restarted service knows which jobs it leased (each gets a
full lease again from the restart: the outage is not the owner's fault). A job handed to the
AF_XDP engine (``agg serve --fallback afxdp``) keeps its ranks' port in its lease too, so the
grant a restarted service describes is the one its ranks were given."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Lease:
    job: int
    lease_s: float        # 0: none (the job stays until removed)
    owner: str
    created: float        # wall clock, for people
    renewed: float = 0.0  # monotonic: the owner's last renewal
    traffic: int = -1     # the job's frame counter when last seen
    active: float = 0.0   # monotonic: when that counter last moved
    local_port: int | None = None  # a job the AF_XDP engine serves: its ranks' port (None: an XDP job's)
    lanes: tuple = ()     # lane 0's job of a request of several lanes: the jobs of lanes 1, 2, ...
    head: int | None = None  # the job of another lane: lane 0's job (renewed and removed with it)

    def idle(self, now: float) -> float:
        """Seconds since the owner renewed or the ranks sent anything, whichever is later."""
        return now - max(self.renewed, self.active)

    def remaining(self, now: float) -> float | None:
        return None if not self.lease_s else max(0.0, self.lease_s - self.idle(now))

    def public(self, now: float) -> dict:
        lanes = {"lanes": list(self.lanes)} if self.lanes else {"lane_of": self.head} if self.head is not None else {}
        return {"lease_s": self.lease_s, "owner": self.owner, "created": self.created,
                "lease_remaining_s": self.remaining(now), **lanes}


class LeaseBook:
    """The leases of the jobs of one service, by job id; saved after every change. Nothing
    outside it changes a lease or its counter: they ask it (``get``, ``remaining``, ``public``)."""

    def __init__(self, path: Path | None, clock=time.monotonic):
        self.path = path
        self.clock = clock
        self._leases: dict[int, Lease] = {}
        self._expired = 0

    @property
    def expired_total(self) -> int:
        """The leases that ran out (:meth:`expire`) since the service started."""
        return self._expired

    def get(self, job: int) -> Lease | None:
        return self._leases.get(job)

    def jobs(self) -> list[int]:
        """The leased jobs, in order."""
        return sorted(self._leases)

    def remaining(self, job: int) -> float | None:
        """Seconds before ``job``'s lease runs out if nothing moves (None: no lease)."""
        le = self._leases.get(job)
        return le.remaining(self.clock()) if le else None

    def public(self, job: int) -> dict:
        """``job``'s lease as the API shows it (a job without one: lease 0, no owner)."""
        le = self._leases.get(job)
        return le.public(self.clock()) if le else {"lease_s": 0.0, "owner": "", "created": None,
                                                    "lease_remaining_s": None}

    def add(self, job: int, lease_s: float, owner: str, local_port: int | None = None) -> Lease:
        now = self.clock()
        le = self._leases[job] = Lease(job, lease_s, owner, time.time(), renewed=now, active=now,
                                       local_port=local_port)
        self.save()
        return le

    def link(self, head: int, lanes: list[int]) -> None:
        """The jobs ``lanes`` are the other lanes of ``head``'s request: one set from now on."""
        self._leases[head].lanes = tuple(lanes)
        for j in lanes:
            self._leases[j].head = head
        self.save()

    def lane_set(self, job: int) -> list[int]:
        """Every job of ``job``'s set of lanes (lane 0's first; just ``job`` if it has none)."""
        le = self._leases.get(job)
        if le is None:
            return [job]
        head = self._leases.get(le.head) if le.head is not None else le
        return [head.job, *head.lanes] if head is not None else [job]

    def remove(self, job: int) -> None:
        if self._leases.pop(job, None) is not None:
            self.save()

    def expire(self, job: int) -> None:
        """``job``'s lease ran out (its job is removed): count it, and drop the lease if still there."""
        self._expired += 1
        self.remove(job)

    def renew(self, job: int) -> Lease | None:
        """Renew ``job``'s lease (lane 0's renews every lane of its set)."""
        le = self._leases.get(job)
        if le is not None:
            le.renewed = self.clock()
            for j in le.lanes:
                if j in self._leases:
                    self._leases[j].renewed = le.renewed
        return le

    def observe(self, job: int, traffic: int) -> None:
        """The job's frame counter as read now: traffic keeps a lease alive like a renewal."""
        le = self._leases.get(job)
        if le is not None and traffic != le.traffic:
            le.traffic, le.active = traffic, self.clock()

    def expired(self) -> list[int]:
        now = self.clock()
        return sorted(j for j, le in self._leases.items() if le.lease_s and le.idle(now) > le.lease_s)

    # --- persistence --------------------------------------------------------------------------
    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        keep = ("job", "lease_s", "owner", "created", "local_port", "lanes", "head")
        rows = [{k: v for k, v in asdict(le).items() if k in keep and v is not None and v != ()}
                for le in self._leases.values()]
        tmp.write_text(json.dumps({"leases": rows}))
        os.replace(tmp, self.path)

    def load(self, jobs: set[int]) -> list[int]:
        """Take back the leases saved by an earlier service for the ``jobs`` still registered;
        each starts a full lease now. Returns the jobs taken back."""
        if self.path is None or not self.path.exists():
            return []
        try:
            rows = json.loads(self.path.read_text()).get("leases", [])
        except (OSError, ValueError):
            return []
        now = self.clock()
        for r in rows:
            if r.get("job") in jobs:
                port = r.get("local_port")
                head = r.get("head")
                self._leases[r["job"]] = Lease(r["job"], float(r.get("lease_s", 0)), str(r.get("owner", "")),
                                               float(r.get("created", 0)), renewed=now, active=now,
                                               local_port=port if isinstance(port, int) else None,
                                               lanes=tuple(j for j in r.get("lanes", []) if j in jobs),
                                               head=head if isinstance(head, int) else None)
        self.save()
        return sorted(self._leases)

    def discard_file(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".tmp").unlink(missing_ok=True)
