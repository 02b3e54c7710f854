"""The optimizer in the aggregator takes one rank per host. A group of several ranks per host
must say so on every rank, also when its communicator sits behind the failover (the default
across hosts), instead of asking the service for a job whose ranks share an address (which the
service refuses with a 400 that names neither the cause nor the way out)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from nicoffload.errors import NicoffloadError  # noqa: E402
from nicoffload.local.host import HostCommunicator  # noqa: E402
from nicoffload.torch.backend import ProcessGroupNicoffload  # noqa: E402


class NoService:
    def optimizer_job(self, *a, **kw):
        raise AssertionError("asked the service for an optimizer job")


@pytest.mark.parametrize("behind_failover", [False, True])
def test_several_ranks_per_host_are_refused_before_the_service_is_asked(behind_failover):
    host = object.__new__(HostCommunicator)  # its type is what counts: no segment, no lane
    comm = SimpleNamespace(primary=host) if behind_failover else host
    pg = SimpleNamespace(comm=comm, config=SimpleNamespace(mode="aggregator"), jobs=NoService(),
                         local_ip="10.0.0.1", comm_timeout=5.0)
    with pytest.raises(NicoffloadError, match="one rank per host.*keep the optimizer on the ranks"):
        ProcessGroupNicoffload.optimizer_job(pg, np.zeros(4, np.float32), None)
