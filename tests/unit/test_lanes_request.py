"""A group of several ranks per host asks the service for a job of one lane per local rank.
Where the service has no room for that many, rank 0 asks for half as many, down to one, and
every rank learns how many it got (a failover's request asks for the same again); a subgroup
that gets none at all takes the gloo path."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from nicoffload.errors import CapacityError  # noqa: E402
from nicoffload.service.api import JobGrant  # noqa: E402
from nicoffload.torch.config import BackendConfig  # noqa: E402
from nicoffload.torch.jobs import ServiceJobs  # noqa: E402
from nicoffload.torch.rendezvous import Rendezvous  # noqa: E402


class Service:
    """Room for ``room`` lanes; records what it was asked for."""

    def __init__(self, room: int):
        self.room, self.asked, self.next = room, [], 1

    def create_job(self, req):
        self.asked.append(req.lanes)
        if req.lanes > self.room:
            raise CapacityError(f"no room for {req.lanes} lanes")
        grants = []
        for _ in range(req.lanes):
            grants.append(JobGrant(job=self.next, world=req.world, aggregator="10.0.0.1", port=1, local_port=2,
                                   group="239.1.1.1", slot_base=0, slots=64, elems=256, lease_s=0.0))
            self.next += 1
        return JobGrant(**{**grants[0].__dict__, "lanes": [g.to_json() for g in grants[1:]]})

    def remove_job(self, job):
        pass


def jobs(svc: Service, group: str = "0") -> ServiceJobs:
    rdv = Rendezvous(dist.HashStore(), 0, 1, 5.0)
    j = ServiceJobs(rdv, BackendConfig(service="http://10.0.0.1:7470"), ["10.0.0.2"], group, 5.0)
    j._clients = lambda: [svc]  # no HTTP: the service above
    return j


@pytest.mark.parametrize("room, want", [(8, 8), (5, 4), (3, 2), (1, 1)])
def test_fewer_lanes_where_the_service_has_no_room_for_all(room, want):
    svc = Service(room)
    j = jobs(svc)
    assert j.ask(workers=["10.0.0.2", "10.0.0.3"], lanes=8) is None
    assert j.lanes == want and j._request == (["10.0.0.2", "10.0.0.3"], want)
    assert svc.asked == [8, 4, 2, 1][:[8, 4, 2, 1].index(want) + 1]


def test_no_room_even_for_one_lane():
    with pytest.raises(CapacityError, match="no room for 1 lanes"):  # the default group: every rank says why
        jobs(Service(0)).ask(workers=["10.0.0.2", "10.0.0.3"], lanes=4)
    assert "no room for 1 lanes" in jobs(Service(0), group="3").ask(workers=["10.0.0.2"], lanes=4)  # gloo path
