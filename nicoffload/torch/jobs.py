"""The jobs a group holds at its aggregator services: rank 0 asks for them (with the token; the
others never talk to a service, rank 0 tells them why it could not), every rank builds its
communicator from the grants, rank 0 renews their leases and removes them when the group ends.

A grant carries the nonce of its job's key, never the key: every rank derives the key from the
nonce and the service's token, which it reads from its own ``NICOFFLOAD_TOKEN_FILE``
(:meth:`JobGrant.spec` with ``token``), so the rendezvous store, where the grants travel, holds
nothing that lets a host write into the job.

Several services (``NICOFFLOAD_SERVICE=URL1,URL2,...``): a job at each, every tensor sharded
over their aggregators (the port rule is the grant's: :meth:`JobGrant.spec` with ``shard``).
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from nicoffload.collective import Collective
from nicoffload.communicators import communicator
from nicoffload.errors import CapacityError, NicoffloadError, NotFoundError, SetupError
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.client import ServiceClient, read_token_file
from nicoffload.torch.config import BackendConfig
from nicoffload.torch.rendezvous import Rendezvous
from nicoffload.worker.comm import Communicator

log = logging.getLogger("nicoffload.torch")

#: seconds without any answer from the aggregator (which answers every retransmission) before an
#: offloaded call fails naming it: a slow rank keeps the others waiting, a gone aggregator does not
SILENCE = 30.0


class ServiceJobs:
    """One group's jobs: ``held`` is ``[(client, grant)]``, the group's own job at each service
    first (in the services' order), then its optimizer jobs."""

    def __init__(self, rdv: Rendezvous, config: BackendConfig, addresses: list[str], group_id: str,
                 timeout: float):
        self.rdv, self.config, self.addresses, self.group_id = rdv, config, addresses, group_id
        self.rank, self.size = rdv.rank, rdv.size
        self.timeout = timeout
        self.urls = [u.strip() for u in (config.service or "").split(",") if u.strip()]
        self.held: list[tuple[ServiceClient, JobGrant]] = []
        self._optimizer_jobs = 0
        self._request: tuple[list[str], int] = (list(addresses), 1)
        self._lost: set[int] = set()  # jobs the service no longer had (renewing them stops)
        self._token: str | None = None

    def token(self) -> str:
        """The service's token, read by every rank: the jobs' keys derive from it."""
        if self._token is None:
            if not self.config.token_file:
                raise SetupError(f"rank {self.rank}: the job's key derives from the service's token, and "
                                 f"NICOFFLOAD_TOKEN_FILE is not set here: every rank needs it")
            self._token = read_token_file(self.config.token_file)
        return self._token

    # --- what rank 0 asks for, every rank gets -------------------------------------------------
    def _clients(self) -> list[ServiceClient]:
        t = min(10.0, self.timeout)
        if self.rank == 0:
            return [ServiceClient.from_files(u, self.config.token_file, timeout=t) for u in self.urls]
        return [ServiceClient(u, timeout=t) for u in self.urls]

    def ask(self, workers: list[str] | None = None, lanes: int = 1) -> str | None:
        """Get the group's job at every service (rank 0 asks, every rank learns the grants): a
        job of ``workers`` (default: the group's ranks' addresses), or ``lanes`` jobs of them (one
        per lane: ``workers`` are then the hosts'; where the services have no room for that many,
        half as many, down to one: :attr:`lanes` says how many were granted). Returns None, or why
        the group takes the gloo path (a subgroup the services have no room for). Raises what
        stopped rank 0 on every rank."""
        if not self.urls:
            raise SetupError("the nicoffload backend needs its aggregator service: set NICOFFLOAD_SERVICE="
                             "http://HOST:PORT (and NICOFFLOAD_TOKEN_FILE), or NICOFFLOAD_MODE=ring")
        self._request = (list(self.addresses if workers is None else workers), lanes)
        made: list[ServiceClient] = []

        def make() -> dict:
            made.extend(self._clients())  # rank 0 reads the token here: its failure reaches every rank
            while True:
                try:
                    return {"grants": self.request(made)}
                except CapacityError as e:
                    hosts, asked = self._request
                    if asked > 1:  # fewer lanes: each local rank below them still sums its share
                        log.warning("group %s: no room for %d lanes (%s); asking for %d", self.group_id, asked,
                                    str(e).splitlines()[0], asked // 2)
                        self._request = (hosts, asked // 2)
                        continue
                    if self.group_id != "0":
                        return {"gloo": str(e).splitlines()[0]}  # a subgroup works on, through gloo
                    raise

        shared = self.rdv.share("job", make)
        if "gloo" in shared:
            return shared["gloo"]
        self.adopt(shared["grants"], made if self.rank == 0 else self._clients())
        self._request = (self._request[0], self.lanes)  # what a failover's request asks for again
        return None

    @property
    def lanes(self) -> int:
        """The lanes the group's job has (1 for a job of one rank per host)."""
        return len(self.grant.every_lane()) if self.grant is not None else 1

    def request(self, clients: list[ServiceClient] | None = None, failovers: int = 0) -> list[dict]:
        """Rank 0: the group's job (as ``ask`` asked for it) at every service, all or none."""
        clients = clients or [c for c, _g in self.held]
        workers, lanes = self._request
        owner = f"torchrun group {self.group_id} (rank 0 at {self.addresses[0]})" + \
            (f", after {failovers} failover(s)" if failovers else "")
        req = JobRequest(world=len(workers), workers=workers, lease_s=self.config.lease_s, owner=owner, lanes=lanes,
                         failovers=failovers)
        got: list[JobGrant] = []
        try:
            for c in clients:
                got.append(c.create_job(req))
        except BaseException:
            for c, g in zip(clients, got):
                self.remove(c, g.job)
            raise
        return [g.to_json() for g in got]

    def adopt(self, grants: list[dict], clients: list[ServiceClient] | None = None) -> None:
        """The group's jobs from now on: ``grants`` (one per service)."""
        clients = clients or [c for c, _g in self.held]
        self.held = list(zip(clients, [JobGrant.from_json(g) for g in grants]))

    @property
    def grant(self) -> JobGrant | None:
        """The group's (first) job."""
        return self.held[0][1] if self.held else None

    @property
    def client(self) -> ServiceClient | None:
        return self.held[0][0] if self.held else None

    def lane_communicator(self, lane: int, rank: int, world: int, local_ip: str, timeout: float) -> Collective:
        """Host ``rank``'s communicator of lane ``lane`` (its job at every service; several: a
        shard of the lane's share on each aggregator). Dense: the host communicator sends only
        the blocks non-zero somewhere."""
        grants = [g.every_lane()[lane] for _c, g in self.held]
        return communicator(rank, world, mode="aggregator", aggregator=",".join(g.aggregator for g in grants),
                            specs=[g.spec(timeout, shard=k, token=self.token()).replace(sparse=False)
                                   for k, g in enumerate(grants)],
                            local_ip=local_ip, **self.watch(timeout))

    def watch(self, timeout: float) -> dict:
        """How the communicators watch their aggregator: silent for NICOFFLOAD_FAILOVER seconds
        means gone (failover), and a call returns once every rank holds its results; without
        failover, silent for SILENCE seconds."""
        if self.config.failover:
            return {"silence": min(self.config.failover, timeout), "confirm": True}
        return {"silence": min(SILENCE, timeout)}

    def communicator(self, local_ip: str, timeout: float) -> Collective:
        """This rank's communicator of the group's jobs (one job: a Communicator; one at each of
        several services: a shard of every tensor on each aggregator). On failure rank 0 removes
        the jobs."""
        grants = [g for _c, g in self.held]
        try:
            return communicator(self.rank, self.size, mode="aggregator",
                                aggregator=",".join(g.aggregator for g in grants),
                                specs=[g.spec(timeout, shard=k, token=self.token()) for k, g in enumerate(grants)],
                                local_ip=local_ip, **self.watch(timeout))
        except BaseException:
            if self.rank == 0:
                self.remove_all()
            raise

    def optimizer_job(self, params: np.ndarray, optimizer, local_ip: str, timeout: float) -> Communicator:
        """A job at the (first) service that holds ``optimizer`` (an OptimizerSpec) and the flat
        initial ``params`` (rank 0's are uploaded); returns this rank's communicator for it."""
        client = self.client
        assert client is not None  # the backend asks only where the group has a job
        n = int(params.size)
        owner = f"torchrun optimizer of group {self.group_id} (rank 0 at {self.addresses[0]})"

        def make() -> dict:
            req = JobRequest(world=self.size, workers=list(self.addresses), lease_s=self.config.lease_s,
                             owner=owner, optimizer=optimizer, params=n)
            g = client.create_job(req)
            try:
                client.set_params(g.job, params)
            except BaseException:
                self.remove(client, g.job)
                raise
            return g.to_json()

        grant = JobGrant.from_json(self.rdv.share(f"optimizer/{self._optimizer_jobs}", make))
        self._optimizer_jobs += 1
        self.held.append((client, grant))
        return Communicator.from_spec(self.rank, self.size, grant.aggregator,
                                      grant.spec(timeout, token=self.token()).replace(sparse=False),
                                      local_ip=local_ip,
                                      # no failover: its state lived in the aggregator (fails naming it)
                                      silence=self.watch(timeout)["silence"])

    # --- leases and removal (rank 0) ------------------------------------------------------------
    def renew_forever(self, stop: threading.Event, on_lost) -> None:
        """Renew every job's lease a few times per lease until ``stop``; a job the service no
        longer has calls ``on_lost(error)`` and ends the loop (the data path does not need the
        service otherwise: a failed renewal is retried)."""
        every = max(0.5, (self.grant.lease_s if self.grant else 30.0) / 3)
        warned = False
        while not stop.wait(every):
            for c, g in list(self.held):
                if g.job in self._lost:
                    continue
                try:
                    c.renew(g.job)
                    warned = False
                except NotFoundError:
                    lost = (f"the service at {c.url} no longer has job {g.job} (its lease expired, an operator "
                            f"removed it, or the service was restarted without it)")
                    if not self.config.failover:
                        on_lost(NicoffloadError(lost))
                        return
                    if g.job not in self._lost:  # the failover takes the group on at its next call
                        self._lost.add(g.job)
                        log.warning("%s; the group fails over to its fallback path", lost)
                except NicoffloadError as e:
                    if not warned:
                        log.warning("renewing job %d's lease at %s failed (%s); the data path does not need the "
                                    "service, retrying", g.job, c.url, str(e).splitlines()[0])
                        warned = True

    @staticmethod
    def remove(client: ServiceClient, job: int) -> None:
        try:
            client.remove_job(job)
        except NotFoundError:
            pass
        except NicoffloadError as e:
            log.warning("removing job %d from the service at %s failed: %s (its lease frees it)", job, client.url, e)

    def remove_all(self) -> None:
        for c, g in self.held:
            self.remove(c, g.job)
