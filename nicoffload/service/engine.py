"""What aggregates a service's jobs: the :class:`Engine` interface, its errors, and the registry
of engines by name, in one place (as torch.distributed.elastic's ``rendezvous/api.py``).

An engine serves the jobs it admitted and answers for them. Two are registered, in this order:

    xdp    the XDP program's slot pool (:mod:`nicoffload.service.xdp_pool`): admits first
    afxdp  the AF_XDP engine beside it (:mod:`nicoffload.service.afxdp_engine`): takes what the
           pool refuses under ``agg serve --fallback afxdp``

The service holds every registered engine, so it sees every job on the interface (a job handed
to the AF_XDP engine by ``agg job add --fallback afxdp`` too); it offers a new job to the first
engine and then to the ``--fallback`` one. A job belongs to the one engine whose ``jobs()``
lists it; the service asks that engine, never which engine it is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol, runtime_checkable

import numpy as np

from nicoffload.errors import InputError, NotFoundError
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.leases import LeaseBook

if TYPE_CHECKING:
    from nicoffload.agg.control import Aggregator


# --- errors (an engine with no room for a job raises CapacityError from ``admit``) -----------
class UnknownEngine(InputError):
    """A name the registry does not hold (``--fallback NAME``)."""


class UnknownJob(NotFoundError):
    """No engine of the service serves the job."""


class NoOptimizer(InputError):
    """The job's engine has no optimizer (``PUT .../params``, ``POST .../lr`` on its job)."""


# --- the interface --------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """A job request with what the service decided for it, as offered to an engine."""

    req: JobRequest
    job: int                   # its id (free on every engine)
    group: str                 # its multicast group (free on every engine)
    delivery: str              # multicast or unicast
    job_slots: int             # its share unless the request names one (``--job-slots``)
    refused: str | None = None  # why the engine before this one refused it (one line), None for the first
    key: int = 0               # the job's key, derived from the service's token and key_nonce
    key_nonce: str = ""        # what the grant carries instead of the key (hex)
    lanes: int = 1             # the request's lanes, on its first (their shares are sized together); 0 on the
                               # later lanes, which take the first one's share (job_slots) where it fits


class Admitted(NamedTuple):
    local_port: int | None  # the ranks' port for the lease to keep (None: the engine knows it)
    summary: str            # what the job got, for the log ("admitted: 2 ranks, slots 0..63, ...")


class Released(NamedTuple):
    answer: dict            # DELETE's answer: job, engine, slot_base, slots (the service adds free_slots)
    summary: str            # what was freed, for the log


@runtime_checkable
class Engine(Protocol):
    """A pool a service's jobs run on. A method that takes a ``job`` (``check_free`` aside) is
    only asked about one it serves (``job in jobs()``). What another process may change, it
    reads again in ``refresh``, which the service calls once at the start of every request."""

    name: str   # the grant's, the listing's and the metrics' "engine": "xdp", "afxdp"
    title: str  # for people: "the XDP pool", "the AF_XDP engine"

    def refresh(self) -> None:
        """Read again what it serves (``agg job add`` on this host may have changed it)."""

    def jobs(self) -> list[int]:
        """The ids of the jobs it serves, in order."""

    def groups(self) -> set[str]:
        """The multicast groups of its jobs."""

    def check_free(self, job: int | None, group: str | None) -> None:
        """Raise AlreadyExistsError if it serves ``job``, InputError if one of its jobs has ``group``."""

    def admit(self, p: Placement) -> Admitted:
        """Serve a new job. Raises CapacityError when it has no room (the service then offers
        the job to the next engine), or the error that makes the request wrong."""

    def grant(self, job: int) -> JobGrant:
        """What the job's ranks build their communicators from."""

    def describe(self, job: int) -> dict:
        """The job as ``GET /v1/jobs/{job}`` shows it: share, group, epoch state, lease, counters."""

    def slots(self, job: int) -> int:
        """The job's share (its slots)."""

    def stats(self, job: int | None) -> dict[str, int]:
        """The job's counters (every counter of the program); None: of every row it counts."""

    def traffic(self, job: int) -> int:
        """The job's frame counter, which keeps its lease alive while it moves."""

    def release(self, job: int) -> Released:
        """Stop serving the job; its room is free at once."""

    def info(self) -> dict:
        """Fields of its own for ``GET /v1/info``."""

    def set_params(self, job: int, values: np.ndarray) -> dict:
        """An optimizer job's parameters (NoOptimizer if it has none)."""

    def params(self, job: int) -> np.ndarray:
        """An optimizer job's parameters, read back as float64."""

    def set_lr(self, job: int, lr: float) -> dict:
        """An optimizer job's learning rate from the next step on."""


# --- the registry ---------------------------------------------------------------------------
Factory = Callable[["Aggregator", LeaseBook], Engine]


class EngineRegistry:
    """Engines by name, in the order they were registered: the first is the one that admits
    first, every later one may be a service's fallback."""

    def __init__(self) -> None:
        self._factories: dict[str, Factory] = {}

    def register(self, name: str, factory: Factory) -> None:
        if name in self._factories:
            raise ValueError(f"an engine named {name!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return list(self._factories)

    def fallbacks(self) -> list[str]:
        """The names a service's ``--fallback`` takes: every engine but the first."""
        return self.names()[1:]

    def create(self, name: str, agg: "Aggregator", leases: LeaseBook) -> Engine:
        try:
            factory = self._factories[name]
        except KeyError:
            raise UnknownEngine(f"no engine is named {name!r}; there are {', '.join(self._factories)}") from None
        return factory(agg, leases)
