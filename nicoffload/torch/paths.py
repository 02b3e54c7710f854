"""Which path a group takes, and its communicator: the offload of its ranks (a job at the
service, or the ring), shared memory with lanes across hosts where hosts run several ranks, or
the gloo path (said once per group at warning level; an error with NICOFFLOAD_REQUIRE_OFFLOAD).
A mixin of :class:`~nicoffload.torch.backend.ProcessGroupNicoffload` (its set-up)."""
from __future__ import annotations

import json
import logging
import secrets
import threading
from typing import Callable

from nicoffload.collective import Collective
from nicoffload.communicators import communicator
from nicoffload.errors import NicoffloadError, SetupError
from nicoffload.jobspec import DEFAULT
from nicoffload.local.host import HostCommunicator
from nicoffload.local.segment import HostGroup
from nicoffload.torch.config import BackendConfig
from nicoffload.torch.failover import Failover
from nicoffload.torch.fixedgloo import FixedGloo
from nicoffload.torch.gloo import GlooPath
from nicoffload.torch.jobs import ServiceJobs
from nicoffload.torch.placement import Place, Placement, placement
from nicoffload.torch.rendezvous import Rendezvous

log = logging.getLogger("nicoffload.torch")


class GroupPaths:
    """The set-up half of a process group (``self`` is the group: its rank, size, rendezvous,
    places, jobs and config)."""

    # what the group has when its set-up runs (ProcessGroupNicoffload.__init__)
    _rank: int
    _size: int
    group_id: str
    config: BackendConfig
    rdv: Rendezvous
    places: list[Place]
    addresses: list[str]
    local_ip: str
    comm_timeout: float
    jobs: ServiceJobs
    gloo: GlooPath
    _stop: threading.Event
    _abort: Callable[[BaseException], None]
    # what it makes
    comm: Collective | None
    path: str

    def _setup_offload(self) -> None:
        """Choose the group's path (``self.path``) and build its communicator; a group that takes
        the gloo path says why, once, at warning level (an error with NICOFFLOAD_REQUIRE_OFFLOAD)."""
        if self._size < 2:
            self.path = "gloo (a group of one rank)"
            return  # nothing to sum with anyone: the gloo path does a group of one
        plan, why = placement(self.places)
        if plan is not None and plan.kmax > 1:
            why = self._setup_hosts(plan)
        elif plan is not None:
            why = self._setup_ranks()
        if self.comm is None:
            self._gloo_path(why)

    def _gloo_path(self, why: str) -> None:
        self.path = f"gloo ({why})"
        msg = (f"group {self.group_id} (rank {self._rank} of {self._size}): every call takes the gloo path: {why}")
        if self.config.require_offload:
            raise SetupError(msg + " (NICOFFLOAD_REQUIRE_OFFLOAD=1)")
        log.warning("%s", msg)

    def _setup_ranks(self) -> str:
        """One rank per host: a job of the group's ranks at the service, or the ring of them."""
        if self.config.mode == "ring":
            if self.group_id != "0":
                return "the ring offload serves the default group only (one ring node per host)"
            spec = DEFAULT.replace(mode="ring", timeout=self.comm_timeout)
            self.comm = communicator(self._rank, self._size, mode="ring", peers=self.addresses, spec=spec)
            self.path = "ring"
            return ""
        why = self.jobs.ask()
        if why is not None:
            return f"the service has no room for its job ({why})"
        self._renew()
        grant = self.jobs.grant
        assert grant is not None  # asked for above
        self.comm = self._failover(lambda: self.jobs.communicator(self.local_ip, self.comm_timeout), grant.elems)
        self.path = "aggregator"
        return ""

    def _setup_hosts(self, plan: Placement) -> str:
        """Several ranks on a host: shared memory inside it, lanes across hosts (local rank j of
        every host: a job of one rank per host, or the ring of the hosts' first ranks)."""
        h, me = plan.where(self._rank)
        H, L = len(plan.hosts), plan.lanes
        mode = self.config.mode
        if H > 1 and mode == "ring":
            if self.group_id != "0":
                return "the ring offload serves the default group only (one ring node per host)"
            L = 1
        token = self.rdv.share("shm", lambda: {"token": secrets.token_hex(6)})["token"]
        elems = DEFAULT.elems
        if H > 1 and mode == "aggregator":
            why = self.jobs.ask(workers=list(plan.ips), lanes=L)
            if why is not None:
                return f"the service has no room for its lanes ({why})"
            self._renew()
            assert self.jobs.grant is not None  # asked for above
            elems, L = self.jobs.grant.elems, self.jobs.lanes  # fewer lanes where the service had no room
        built = [0]

        def build() -> HostCommunicator:  # again on rejoining: segments and lanes of their own
            name = f"nicoffload-{token}-g{self.group_id}-h{h}" + (f"-r{built[0]}" if built[0] else "")
            built[0] += 1
            host = HostGroup(name, me, list(plan.hosts[h]), self.comm_timeout)
            lane = None
            try:
                if H > 1 and me < L and mode == "ring":
                    spec = DEFAULT.replace(mode="ring", timeout=self.comm_timeout)
                    lane = communicator(h, H, mode="ring", peers=list(plan.ips), spec=spec)
                elif H > 1 and me < L:
                    lane = self.jobs.lane_communicator(me, h, H, self.local_ip, self.comm_timeout)
                return HostCommunicator(self._rank, self._size, host, H, h, L, elems=elems, lane=lane,
                                        half_lanes=mode == "aggregator")
            except BaseException:
                if lane is not None:
                    lane.close()
                host.close()
                raise

        self.comm = self._failover(build, elems) if H > 1 and mode == "aggregator" else build()
        across = f" + {mode} across hosts" if H > 1 else ""
        self.path = f"shared memory{across} ({plan.describe()}, {L} lane(s))"
        return ""

    def _failover(self, build, elems: int):
        """``build()``'s communicator, with a way out when its aggregator is lost (the failover,
        NICOFFLOAD_FAILOVER seconds of silence; 0: none): the group's gloo group summing the same
        fixed point, and back on a job rank 0 gets again (every NICOFFLOAD_REJOIN seconds)."""
        comm = build()
        if not self.config.failover:
            return comm

        def again(grants: str):
            self.jobs.adopt(json.loads(grants))
            return build()

        f = Failover(comm, FixedGloo(self.gloo.group, self._rank, self._size, elems), self.rdv, self.group_id,
                     elems, make_primary=again, wait_s=max(30.0, self.comm_timeout))
        if self._rank == 0:
            threading.Thread(target=self._rejoin_forever, args=(f,), name=f"nicoffload-rejoin-{self.group_id}",
                             daemon=True).start()
        return f

    def _rejoin_forever(self, f) -> None:
        """Rank 0, while the group is on the fallback: ask the services for its job again every
        NICOFFLOAD_REJOIN seconds; a job granted is published for every rank to take."""
        while not self._stop.wait(self.config.rejoin):
            if not f.on_fallback or f.rejoin_ready > f.generation:
                continue
            try:
                self.jobs.remove_all()  # the jobs that were lost, where the service still has them
                grants = self.jobs.request(failovers=f.failovers)
            except NicoffloadError as e:
                log.info("group %s: no job again yet (%s); still on the fallback", self.group_id,
                         str(e).splitlines()[0])
                continue
            f.publish_rejoin(json.dumps(grants))

    def _renew(self) -> None:
        """Rank 0 renews the jobs' leases from now on (a slow set-up must not let them run out)."""
        if self._rank == 0 and self.jobs.grant is not None and self.jobs.grant.lease_s:
            threading.Thread(target=self.jobs.renew_forever, args=(self._stop, self._abort),
                             name=f"nicoffload-lease-{self.group_id}", daemon=True).start()
