"""The aggregator's job table as data: which jobs are registered, with which ranks, addresses,
multicast group and share of the slot pool, and the rules for admitting a new one. No BPF here:
:class:`nicoffload.agg.Aggregator` writes what this decides into the kernel's maps.

Rules (each refusal names what to do):
- at most ``proto.MAX_JOBS`` jobs; job ids are unique;
- a job's share is a contiguous range of the pool, never overlapping another job's (a job's
  packets can only touch its own slots: the XDP program adds ``slot_base`` to the record's slot
  and checks it against ``slot_count``); a new job gets the first free range that fits
  (first fit); when none fits the job is refused (:class:`CapacityError`) with the largest free
  range in the message;
- every job has its own multicast group (results of one job must never reach another's hosts);
- ranks' source addresses are registered per job; a rank whose address is given can only
  contribute from that address (the XDP program counts anything else as ``bad_src``);
- every job has its key (:mod:`nicoffload.wire.keys`; 0: registered without one), which every
  record of it must carry (the XDP program counts anything else as ``bad_key``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

from nicoffload import optim
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError, NotFoundError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.optim import OptimizerSpec
from nicoffload.wire import keys, proto
from nicoffload.wire.addr import require_ipv4s


#: how a job's results reach its ranks (xdp/nicoffload_proto.h, AR_DELIVERY_*)
DELIVERIES = ("multicast", "unicast")

@dataclass
class JobEntry:
    """One registered job: ``index`` is its row of the kernel's job table (its counters are in
    row ``index + 1`` of the stats map; row 0 counts traffic of no job)."""

    job: int
    workers: int
    group: str
    worker_ips: list[str] = field(default_factory=list)
    slot_base: int = 0
    slot_count: int = 0
    index: int = 0
    optimizer: dict | None = None   # an OptimizerSpec as a dict: the aggregator applies it (op SGD)
    params: int = 0                 # parameters of an optimizer job
    delivery: str = "multicast"     # how results reach the ranks: multicast or unicast (DELIVERIES)
    worker_macs: list[str] = field(default_factory=list)  # unicast: the next hop's MAC towards each rank
    key: int = 0                    # the job's key (0: none); secret: kept in the state file, never listed
    key_nonce: str = ""             # a service's job: the nonce its grant carries (the key derives from it)

    def validate(self) -> "JobEntry":
        if not 1 <= self.workers <= proto.MAX_WORKERS:
            raise InputError(f"a job has 1..{proto.MAX_WORKERS} workers, not {self.workers}")
        JobSpec(job=self.job, group=self.group).validate()
        if self.worker_ips and len(self.worker_ips) != self.workers:
            raise InputError(f"{len(self.worker_ips)} worker addresses given for {self.workers} workers")
        require_ipv4s(self.worker_ips, "worker address", f"job {self.job}: two ranks registered with the same address")
        if self.delivery not in DELIVERIES:
            raise InputError(f"--delivery must be {' or '.join(DELIVERIES)}, not {self.delivery!r}")
        if self.delivery == "unicast" and len(self.worker_ips) != self.workers:
            raise InputError(f"job {self.job}: unicast delivery sends each rank its copy at its registered address: "
                             f"give every rank's address (--worker-ip, {self.workers} of them)")
        if not 0 <= self.key <= keys.MAX:
            raise InputError(f"job {self.job}: a key is 64 bits")
        return self

    @property
    def slots(self) -> range:
        return range(self.slot_base, self.slot_base + self.slot_count)

    @property
    def spec(self) -> OptimizerSpec | None:
        return OptimizerSpec(**self.optimizer) if self.optimizer else None

    def to_dict(self) -> dict:
        return asdict(self)

    def public(self) -> dict:
        """The entry as listings show it: without the key and its nonce."""
        d = asdict(self)
        del d["key"], d["key_nonce"]
        return {**d, "keyed": bool(self.key)}


class JobTable:
    """The registered jobs of one aggregator whose pool has ``pool`` slots."""

    def __init__(self, pool: int, entries: list[JobEntry] | None = None):
        self.pool = pool
        self.entries: dict[int, JobEntry] = {e.job: e for e in entries or []}

    @classmethod
    def from_dicts(cls, pool: int, rows: list[dict]) -> "JobTable":
        return cls(pool, [JobEntry(**r) for r in rows])

    def to_dicts(self) -> list[dict]:
        return [e.to_dict() for e in sorted(self.entries.values(), key=lambda e: e.slot_base)]

    def get(self, job: int) -> JobEntry:
        try:
            return self.entries[job]
        except KeyError:
            known = ", ".join(str(j) for j in sorted(self.entries)) or "none"
            raise NotFoundError(f"job {job} is not registered on this aggregator (registered: {known})") from None

    def free_ranges(self) -> list[tuple[int, int]]:
        """(base, count) of every unused range of the pool, in order."""
        out, at = [], 0
        for e in sorted(self.entries.values(), key=lambda e: e.slot_base):
            if e.slot_base > at:
                out.append((at, e.slot_base - at))
            at = max(at, e.slot_base + e.slot_count)
        if at < self.pool:
            out.append((at, self.pool - at))
        return out

    def free_slots(self) -> int:
        return sum(c for _, c in self.free_ranges())

    def admit(self, job: int, workers: int, group: str, worker_ips: list[str] | tuple = (),
              slots: int | None = None, optimizer: OptimizerSpec | None = None, params: int = 0,
              elems: int = DEFAULT.elems, delivery: str = "multicast", key: int = 0,
              key_nonce: str = "") -> JobEntry:
        """Register a job: its share is ``slots`` slots (None: the largest free range; an
        optimizer job gets exactly one slot per block of its ``params`` and its exponent rounds).
        Raises AlreadyExistsError, InputError or CapacityError, naming the conflict; changes
        nothing then."""
        self.check_free(job, None)
        entry = JobEntry(job, workers, group, list(worker_ips), delivery=delivery, key=key,
                         key_nonce=key_nonce).validate()
        if optimizer is not None:
            optimizer.validate()
            if params < 1:
                raise InputError("an optimizer job needs its number of parameters (--params)")
            if elems > optim.MAX_ELEMS:
                raise InputError(f"an optimizer job takes at most {optim.MAX_ELEMS} elements per record, "
                                 f"the aggregator has {elems}")
            need = optim.share(params, elems)
            if slots is not None and slots != need:
                raise InputError(f"an optimizer job of {params} parameters takes exactly {need} slots "
                                 f"({optim.meta_slots(params, elems)} for exponents, one per block), not {slots}")
            slots = need
            entry.optimizer, entry.params = optimizer.to_dict(), params
        self.check_free(None, group)
        if len(self.entries) >= proto.MAX_JOBS:
            raise CapacityError(f"the aggregator holds {proto.MAX_JOBS} jobs, its most; remove one first")
        if slots is not None and slots < 1:
            raise InputError(f"job {job}: a job's share of the pool (--slots) is at least 1 slot, not {slots}")
        free = self.free_ranges()
        largest = max((c for _, c in free), default=0)
        want = largest if slots is None else slots
        if want < 1:
            raise CapacityError(f"no free slots left in the pool of {self.pool}: remove a job, or load the "
                                f"aggregator with more --slots")
        fit = next(((b, c) for b, c in free if c >= want), None)
        if fit is None:
            raise CapacityError(
                f"job {job} asks for {want} slots, but the largest free range of the pool holds {largest} "
                f"({self.free_slots()} of {self.pool} free): ask for fewer (--slots), remove a job, or load the "
                f"aggregator with more --slots")
        used = {e.index for e in self.entries.values()}
        entry.index = min(i for i in range(proto.MAX_JOBS) if i not in used)
        entry.slot_base, entry.slot_count = fit[0], want
        self.entries[job] = entry
        return entry

    def check_free(self, job: int | None, group: str | None) -> None:
        """Raise AlreadyExistsError if ``job`` is registered, InputError if another job has ``group``."""
        if job is not None and job in self.entries:
            raise AlreadyExistsError(f"job {job} is already registered; remove it first (agg job remove --job {job})")
        other = next((e for e in self.entries.values() if group is not None and e.group == group), None)
        if other is not None:
            raise InputError(f"multicast group {group} is already job {other.job}'s: give each job its own "
                             f"group (--group), or its results would reach the other job's hosts")

    def remove(self, job: int) -> JobEntry:
        entry = self.get(job)
        del self.entries[job]
        return entry


def default_group(job: int, table: JobTable, taken: Iterable[str] = ()) -> str:
    """A multicast group no registered job uses (nor any of ``taken``: the groups of the jobs the
    AF_XDP engine serves beside the pool): see :func:`first_free_group`."""
    return first_free_group(job, {e.group for e in table.entries.values()} | set(taken))


def first_free_group(job: int, used: Iterable[str]) -> str:
    """The first multicast group not in ``used``: DEFAULT.group for the first job, then
    239.77.0.x counting up (the testbed's groups are 239.77.X.1 with X >= 1)."""
    taken = set(used)
    if DEFAULT.group not in taken:
        return DEFAULT.group
    for x in range(2, 255):
        g = f"239.77.0.{x}"
        if g not in taken:
            return g
    raise InputError(f"no free default multicast group for job {job}: give one with --group")
