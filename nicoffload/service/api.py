"""The service's requests and answers as data: what a job request may hold, checked field by
field with a one-line reason for the first bad one (the HTTP layer turns it into a 400), and the
job description every rank builds its communicator from. Pure: no sockets, no maps."""
from __future__ import annotations

import ipaddress
import math
from dataclasses import MISSING, asdict, dataclass, field, fields

from nicoffload.errors import InputError
from nicoffload.optim import KINDS, OptimizerSpec
from nicoffload.wire import keys, proto

#: the API's version, the first part of every path
PREFIX = "/v1"
#: the largest JSON body a control request may carry (bytes)
MAX_JSON = 64 * 1024
#: the largest parameter upload (bytes): 32 Mi float64 parameters
MAX_PARAMS_BYTES = 256 * 1024 * 1024
#: a lease shorter than this would expire between two renewals of a busy owner (seconds)
MIN_LEASE = 2.0
MAX_LEASE = 7 * 24 * 3600.0
#: how results reach the ranks
DELIVERIES = ("multicast", "unicast")

_FIELDS = {"world", "workers", "job", "slots", "group", "lease_s", "owner", "optimizer", "params", "delivery",
           "lanes", "failovers"}
#: the most lanes one request may ask for (the ranks one host runs)
MAX_LANES = 64
_OPT_FIELDS = {"kind", "lr", "momentum", "dampening", "weight_decay", "nesterov", "betas", "eps", "amsgrad", "maximize"}


def _int(d: dict, name: str, lo: int, hi: int) -> int | None:
    """The integer field ``name`` in lo..hi, None where it is absent or null."""
    v = d.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{name} must be an integer, not {type(v).__name__}")
    if not lo <= v <= hi:
        raise InputError(f"{name} must be {lo}..{hi}, not {v}")
    return v


def finite_number(v) -> bool:
    """A JSON number that is a finite float (an integer of 400 digits is not one)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _number(d: dict, name: str, lo: float, hi: float, default=None) -> float | None:
    v = d.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not finite_number(v):
        raise InputError(f"{name} must be a finite number, not {str(v)[:40]}")
    if not lo <= v <= hi:
        raise InputError(f"{name} must be {lo:g}..{hi:g}, not {v:g}")
    return float(v)


@dataclass
class JobRequest:
    """A job a client asks the service for (``POST /v1/jobs``)."""

    world: int
    workers: list[str] = field(default_factory=list)  # each rank's source address, by rank ([]: unchecked)
    job: int | None = None          # a job id of its own (default: the service picks the lowest free one)
    slots: int | None = None        # its share of the pool (default: the service's per-job default)
    group: str | None = None        # its multicast group (default: the first one no job uses)
    lease_s: float | None = None    # seconds the job lives without renewal and without traffic (0: no lease)
    owner: str = ""                 # who asked (free text, shown in listings and logs)
    optimizer: OptimizerSpec | None = None
    params: int = 0                 # the optimizer's parameter count
    delivery: str | None = None     # multicast or unicast (None: the service's default for its network)
    # hosts that run several ranks each: one job per lane (local rank j of every host sums the
    # j-th share of each tensor in job j), granted together and released together
    lanes: int = 1
    # a group that asks again after failing over: how many failovers it had (the service counts
    # them, nicoffload_failovers_reported; 0 is left out of the request)
    failovers: int = 0

    @classmethod
    def from_json(cls, d) -> "JobRequest":
        if not isinstance(d, dict):
            raise InputError("the body must be a JSON object")
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise InputError(f"unknown field(s) {', '.join(unknown)}; a job request takes {', '.join(sorted(_FIELDS))}")
        world = _int(d, "world", 1, proto.MAX_WORKERS)
        if world is None:  # absent, or null
            raise InputError("world (the job's number of ranks) is required")
        workers = d.get("workers", [])
        if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
            raise InputError("workers must be a list of IPv4 addresses (strings), one per rank")
        if workers and len(workers) != world:
            raise InputError(f"workers lists {len(workers)} address(es) for a world of {world}")
        for w in workers:
            try:
                ipaddress.IPv4Address(w)
            except ValueError:
                raise InputError(f"workers: {w!r} is not an IPv4 address") from None
        group = d.get("group")
        if group is not None:
            try:
                ok = isinstance(group, str) and ipaddress.IPv4Address(group).is_multicast
            except ValueError:
                ok = False
            if not ok:
                raise InputError(f"group {group!r} is not an IPv4 multicast address")
        lease = _number(d, "lease_s", 0, MAX_LEASE)
        if lease is not None and 0 < lease < MIN_LEASE:
            raise InputError(f"lease_s must be 0 (no lease) or at least {MIN_LEASE:g} s, not {lease:g}")
        owner = d.get("owner", "")
        if not isinstance(owner, str) or len(owner) > 200 or not owner.isprintable():
            raise InputError("owner must be printable text of at most 200 characters")
        delivery = d.get("delivery")
        if delivery is not None and delivery not in DELIVERIES:
            raise InputError(f"delivery {delivery!r} is not one this service offers: {', '.join(DELIVERIES)}")
        opt = None
        if d.get("optimizer") is not None:
            o = d["optimizer"]
            if not isinstance(o, dict) or set(o) - _OPT_FIELDS:
                raise InputError(f"optimizer must be an object with fields among {', '.join(sorted(_OPT_FIELDS))}")
            if not isinstance(o.get("kind", "sgd"), str) or o.get("kind", "sgd") not in KINDS:
                raise InputError(f"optimizer kind {o.get('kind')!r} is not one the aggregator has: {', '.join(KINDS)}")
            for k in ("lr", "momentum", "dampening", "weight_decay"):
                _number(o, k, 0.0, 1.0)
            _number(o, "eps", 0.0, 1.0)
            for k in ("nesterov", "amsgrad", "maximize"):
                if not isinstance(o.get(k, False), bool):
                    raise InputError(f"optimizer.{k} must be true or false")
            betas = o.get("betas", [0.9, 0.999])
            if not (isinstance(betas, list) and len(betas) == 2 and all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
                raise InputError("optimizer.betas must be a list of two numbers")
            opt = OptimizerSpec.from_dict(o)  # torch.optim.AdamW's defaults where not given
        params = _int(d, "params", 0, 1 << 28) or 0
        if opt is not None and params < 1:
            raise InputError("an optimizer job needs params (its parameter count)")
        if opt is None and params:
            raise InputError("params is only for an optimizer job")
        lanes = _int(d, "lanes", 1, MAX_LANES) or 1
        if lanes > 1 and (opt is not None or d.get("group") is not None):
            raise InputError("a job of several lanes takes no optimizer and no group of its own (each lane gets one)")
        return cls(world=world, workers=list(workers), job=_int(d, "job", 1, 0xFFFFFFFF),
                   slots=_int(d, "slots", 1, 1 << 20), group=group, lease_s=lease, owner=owner, optimizer=opt,
                   params=params, delivery=delivery, lanes=lanes,
                   failovers=_int(d, "failovers", 0, 1 << 30) or 0)

    def to_json(self) -> dict:
        d = asdict(self)
        d["optimizer"] = self.optimizer.to_dict() if self.optimizer else None
        return {k: v for k, v in d.items() if v is not None and v != [] and not (k == "params" and not v)
                and not (k == "lanes" and v == 1) and not (k == "failovers" and not v)}


#: ports between the ranks' sockets of two shards of one group (JobGrant.spec)
SHARD_PORT_STRIDE = 64


@dataclass(frozen=True)
class JobGrant:
    """What the service answers a job request with: everything a rank needs to build its
    communicator (:meth:`nicoffload.worker.Communicator.from_spec` with :meth:`spec`)."""

    job: int
    world: int
    aggregator: str        # the aggregator's address (where contributions go)
    port: int              # the aggregator's UDP port
    local_port: int        # the port every rank binds and sends from (results come back to it)
    group: str
    slot_base: int
    slots: int
    elems: int
    lease_s: float
    delivery: str = "multicast"
    owner: str = ""
    optimizer: dict | None = None
    params: int = 0
    # who aggregates: "xdp" (the XDP program, a share of its pool) or "afxdp" (the pool refused
    # the job and the service runs with --fallback afxdp: the AF_XDP engine beside it, on the
    # same interface and port, with slots of its own and slot_base 0). Ranks use either alike;
    # a client that predates the field ignores it, and an answer without it is "xdp".
    engine: str = "xdp"
    # a request of several lanes: the grants of lanes 1, 2, ... (this grant is lane 0's); removing
    # or renewing lane 0's job removes or renews them all
    lanes: list = field(default_factory=list)
    # the nonce the job's key derives from (hex; nicoffload.wire.keys.derive with the service's
    # token): the grant never carries the key itself, so a grant read in the rendezvous store
    # gives nothing away to whoever lacks the token. "": a job without a key
    key_nonce: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        if not self.lanes:
            del d["lanes"]
        return d

    def every_lane(self) -> list["JobGrant"]:
        """This grant and those of its other lanes, in lane order."""
        return [self] + [JobGrant.from_json(g) for g in self.lanes]

    @classmethod
    def from_json(cls, d: dict) -> "JobGrant":
        if not isinstance(d, dict):
            raise InputError("the service's answer is not a JSON object")
        fs = fields(cls)
        names = {f.name for f in fs}
        missing = sorted(f.name for f in fs if f.name not in d and f.default is MISSING and
                         f.default_factory is MISSING)
        if missing:
            raise InputError(f"the service's answer lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def spec(self, timeout: float, shard: int = 0, token: str | bytes | None = None):
        """The :class:`~nicoffload.jobspec.JobSpec` of this job for its ranks, with the job's key
        derived from ``token`` (the service's, which every rank reads from its token file);
        ``shard``: this job's place among the jobs of one sharded group, each at its own
        service. Every service numbers its jobs' ports alike (its port + 1 + the job's entry), so
        the ranks' sockets of shard k sit SHARD_PORT_STRIDE * k ports higher, where no other
        shard's can be."""
        from nicoffload.jobspec import JobSpec

        key = 0
        if self.key_nonce:
            if not token:
                raise InputError(f"job {self.job}'s key derives from the service's token, and this rank has none: "
                                 f"every rank needs the token file (NICOFFLOAD_TOKEN_FILE)")
            key = keys.derive(token, self.job, self.key_nonce)
        return JobSpec(job=self.job, port=self.port, group=self.group, slots=self.slots, elems=self.elems,
                       timeout=timeout, local_port=self.local_port + SHARD_PORT_STRIDE * shard,
                       delivery=self.delivery, key=key).validate()
