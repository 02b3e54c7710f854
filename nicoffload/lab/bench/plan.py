"""What a ``nicoffload bench`` sweep runs: its configuration, the points of each testbed, the
rates, and the bounds a shaped link puts on an AllReduce. Pure: no root, no sockets.

Shaped sweeps: every worker link at R, the aggregator's at N x R (a dedicated aggregator node)
unless ``agg_rate`` says otherwise (a rate, or a multiple of R: ``1x`` is an aggregator with the
workers' NIC). An AllReduce of M bytes cannot finish sooner than M/R through an aggregator, nor
sooner than N x M over the aggregators' links together (every contribution crosses one:
``bound_agg_s`` is the larger), nor sooner than 2(N-1)M/(NR) through a ring or any host-only
algorithm (``bound_ring_s``). Bounds count payload bytes only (headers are overhead: 1 KiB
records on a 1500-byte MTU put 1114 bytes on the wire per 1024 of payload with wire version 3's
48-byte header, so 91.9% of a bound is the most a link can give) and are for dense data: sparse inputs let nicoffload beat M/R.
With K ranks per host (``--ranks-per-host``) N counts hosts and the bounds are a host's link's:
the host's ranks reduce inside it, so it moves the tensor once each way (M/R through an aggregator).

``--scaling`` is a preset of the sweep: time against N at fixed worker link rates (SCALING).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from nicoffload.errors import InputError
from nicoffload.jobspec import DEFAULT, JobSpec
from nicoffload.lab.inputs import parse_size

SYSTEMS = ("xdp", "afxdp", "userspace", "ring", "gloo", "mpi", "xdpring", "udpring", "xdptorch", "xdpuni",
           "xdp16", "gloobf16", "gloofp16")
#: systems that sum through a nicoffload aggregator (fixed point; bound M/R)
AGG_SYSTEMS = ("xdp", "afxdp", "userspace", "xdpuni", "xdp16")
#: systems whose aggregator is the XDP program (xdpuni: with unicast delivery; xdp16: 16-bit lanes)
XDP_AGG_SYSTEMS = ("xdp", "xdpuni", "xdp16")
#: gloo all-reducing half-precision copies of the gradients (DDP's bf16/fp16 compress hooks)
HALF_GLOO = {"gloobf16": "bfloat16", "gloofp16": "float16"}
#: systems that move two bytes per element: their bounds are those of half the bytes
HALF_SYSTEMS = ("xdp16", *HALF_GLOO)
#: nicoffload's ring mode: the ring offload in XDP and the user-space UDP ring (fixed point; ring bound)
RING_SYSTEMS = ("xdpring", "udpring")
#: torch.distributed's all_reduce through the backend "nicoffload" (the XDP aggregator the service runs)
TORCH_SYSTEMS = ("xdptorch",)
#: systems that sum through an aggregator: bound M/R on shaped links
STAR_SYSTEMS = AGG_SYSTEMS + TORCH_SYSTEMS
#: systems whose results go through nicoffload's fixed point (checked against its bound)
QUANTIZED = AGG_SYSTEMS + RING_SYSTEMS + TORCH_SYSTEMS
#: systems that run K ranks in each worker host (``--ranks-per-host K``): nicoffload's through a
#: HostCommunicator (shared memory inside the host; across hosts a lane per local rank, a job
#: each on the XDP aggregator, or for the ring modes one lane, the ring of the hosts), gloo's as
#: torch places them (one process group of every rank)
HOST_SYSTEMS = ("xdp", "xdp16", "xdpring", "udpring", "gloo", "gloobf16", "gloofp16")
#: the most ranks per host a sweep runs: 8 lanes of xdp and of xdp16 are the 16 jobs
#: (AR_MAX_JOBS) one aggregator holds
MAX_RANKS_PER_HOST = 8


def reference_kind(system: str, spec: JobSpec) -> str:
    """Which reference a system's result is held to: nicoffload's fixed point in 32-bit lanes
    (``q32``) or 16-bit ones (``q16``), a host sum in float32 (``host``), or in a half type."""
    if system in HALF_GLOO:
        return HALF_GLOO[system]
    if system == "xdp16" or (system in AGG_SYSTEMS + TORCH_SYSTEMS and spec.lanes == 16):
        return "q16"
    return "q32" if system in QUANTIZED else "host"


#: the largest size the sparsity and worker axes are measured at
REFERENCE_MAX = 16 << 20
#: seconds of reps per point at least when a compute loop runs beside the ranks
COMPUTE_MIN_TIME = 1.0


@dataclass
class BenchConfig:
    workers: list[int] = field(default_factory=lambda: [2, 4, 8])
    sizes: list[int] = field(default_factory=lambda: [4 << 10, 64 << 10, 1 << 20])
    sparsities: list[float] = field(default_factory=lambda: [0.0, 0.5, 0.75])
    rates: list[str] = field(default_factory=lambda: ["unshaped", "1gbit"])
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    reps: int = 5               # at least this many timed reps per point
    warmup: int = 1
    min_time: float = 0.2       # ... and at least this many seconds of them (CPU tick resolution)
    max_reps: int = 200
    max_point_s: float = 10.0   # stop a point after this long once it has one rep
    full: bool = False          # the whole cross product instead of the axes around a centre
    out: Path = Path("bench-out")
    seed: int = 0
    mpirun: str = "mpirun"
    timeout: float = 20.0       # a rank (of any system) without progress for this long fails
    start_timeout: float = 180.0
    spec: JobSpec = DEFAULT     # the nicoffload job (slots, record size) of xdp, afxdp and userspace
    mode: str = "auto"          # XDP attach mode of the aggregator (auto: generic batches on veth)
    dtype: str = "float32"      # of the gradients: float32 (quantized to int32) or int32 (exact)
    compute: bool = False       # a compute loop beside every rank: how much of it each AllReduce takes
    multicast: bool = True      # False: the testbed's fabric drops multicast frames (unicast delivery needed)
    aggregators: int = 1        # aggregator hosts; a job of xdp/afxdp/userspace/xdpuni is sharded over them
    agg_rate: str | None = None  # each aggregator's link on shaped testbeds (default: N x the worker rate)
    afxdp_tx: str = "auto"      # how the AF_XDP engine's results leave (auto, xsk: its tx ring, socket)
    zero_run: int = 1           # the inputs' zero blocks come in runs of this many neighbouring blocks
    ranks_per_host: int = 1     # rank processes in each worker host (ranks = workers x this)

    QUICK = dict(workers=[2], sizes=[4 << 10, 256 << 10], sparsities=[0.0, 0.5], rates=["unshaped", "200mbit"],
                 reps=3, warmup=1, min_time=0.05, max_reps=20, max_point_s=5.0)
    #: ``--scaling``: time against N at fixed worker link rates, dense, the systems whose bounds
    #: differ in N (the aggregator's is flat, the ring's grows towards 2M/R)
    SCALING = dict(workers=[2, 4, 8, 16], sizes=[16 << 20, 64 << 20], sparsities=[0.0], rates=["200mbit", "1gbit"],
                   systems=["xdp", "xdp16", "ring", "gloo"], reps=3, max_point_s=60.0)

    @classmethod
    def scaling(cls, **kw) -> "BenchConfig":
        """The ``--scaling`` preset; ``kw`` overrides."""
        return cls(**{**copy.deepcopy(cls.SCALING), **kw})

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        """A tiny sweep for tests; ``kw`` overrides."""
        return cls(**{**copy.deepcopy(cls.QUICK), **kw})

    def validate(self) -> "BenchConfig":
        """Raise InputError on a setting no sweep can run; settle max_reps >= reps; return self."""
        if self.reps < 1 or self.max_reps < 1:
            raise InputError(f"--{'reps' if self.reps < 1 else 'max-reps'} must be at least 1")
        if self.warmup < 0 or self.min_time < 0 or self.max_point_s <= 0:
            raise InputError("--warmup and --min-time cannot be negative, --max-point-time must be positive")
        if self.zero_run < 1:
            raise InputError(f"--zero-run is a number of blocks, at least 1 (not {self.zero_run})")
        agg_rate_bps(self.agg_rate, 2, 10**9)  # raises InputError on a bad --agg-rate
        for what, values, known in (("systems", self.systems, SYSTEMS), ("workers", self.workers, None)):
            if not values:
                raise InputError(f"no {what} to run")
            if known and set(values) - set(known):
                raise InputError(f"unknown {what}: {', '.join(sorted(set(values) - set(known)))}")
        self.systems = [s for s in SYSTEMS if s in self.systems]
        self._check_ranks_per_host()
        self.max_reps = max(self.max_reps, self.reps)
        if self.compute:  # the compute loop's rate needs a second or so of each to be worth reading
            self.min_time = max(self.min_time, COMPUTE_MIN_TIME)
        return self

    def _check_ranks_per_host(self) -> None:
        K = self.ranks_per_host
        if not 1 <= K <= MAX_RANKS_PER_HOST:
            raise InputError(f"--ranks-per-host must be 1..{MAX_RANKS_PER_HOST}, not {K}")
        if K == 1:
            return
        other = [s for s in self.systems if s not in HOST_SYSTEMS]
        if other:
            raise InputError(f"--ranks-per-host {K} runs the systems {', '.join(HOST_SYSTEMS)}, not "
                             f"{', '.join(other)}")
        if self.compute or self.aggregators > 1:
            raise InputError(f"--ranks-per-host {K} does not take "
                             f"{'--compute' if self.compute else '--aggregators'} (one aggregator, no compute loop)")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(out=str(self.out), spec=self.spec.public())
        return d


@dataclass(frozen=True)
class Point:
    index: int
    bytes: int
    sparsity: float


def centre_workers(workers: list[int]) -> int:
    """The worker count the sparsity axis is measured at: 4 if swept, else the middle one."""
    ws = sorted(workers)
    return 4 if 4 in ws else ws[len(ws) // 2]


def reference_size(sizes: list[int]) -> int:
    """The size the sparsity and worker axes are measured at: the largest up to 16 MiB."""
    small = [s for s in sizes if s <= REFERENCE_MAX]
    return max(small) if small else min(sizes)


def plan_points(cfg: BenchConfig, workers: int) -> list[Point]:
    """Points of one testbed. Default: every size at the lowest sparsity, and at the centre worker
    count every sparsity at the reference size (the axes the plots need). ``full``: the cross product."""
    base = min(cfg.sparsities)
    if cfg.full:
        pts = [(b, s) for b in cfg.sizes for s in cfg.sparsities]
    else:
        pts = [(b, base) for b in cfg.sizes]
        if workers == centre_workers(cfg.workers):
            ref = reference_size(cfg.sizes)
            pts += [(ref, s) for s in cfg.sparsities if s != base]
    out: list[Point] = []
    for b, s in dict.fromkeys(pts):
        out.append(Point(len(out), b, s))
    return out


def sweep_plan(cfg: BenchConfig) -> list[tuple[str, int, list[Point]]]:
    """Every testbed of the sweep, in the order it runs: (rate, workers, its points)."""
    return [(rate, n, plan_points(cfg, n)) for rate in cfg.rates for n in cfg.workers]


# --- rates and bounds -----------------------------------------------------------------------
def rate_bps(rate: str) -> int | None:
    """Bits per second of a rate (``1gbit``, ``200mbit``, ...); None for ``unshaped``."""
    from nicoffload.testbed.topology import parse_rate

    return parse_rate(rate)


def rate_label(rate: str) -> str:
    """The canonical spelling of a rate (how rows and plots name it)."""
    from nicoffload.testbed.topology import format_rate

    return format_rate(rate_bps(rate))


def agg_rate_bps(agg_rate: str | None, workers: int, rbps: int | None) -> int | None:
    """Each aggregator's link on a testbed of ``workers`` at ``rbps``: ``agg_rate`` (a rate, or
    ``Kx``: K x the worker rate), by default N x the worker rate; None when unshaped."""
    if agg_rate is None:
        return workers * rbps if rbps else None
    text = agg_rate.strip().lower()
    if not text.endswith("x"):
        rate_bps(agg_rate)  # raises InputError with the accepted forms
        return rate_bps(agg_rate) if rbps else None
    try:
        k = float(text[:-1])
    except ValueError:
        raise InputError(f"bad --agg-rate {agg_rate!r}: a rate (800mbit) or a multiple of the worker rate (1x)") \
            from None
    if k <= 0:
        raise InputError(f"--agg-rate {agg_rate}: the multiple must be positive")
    return int(k * rbps) if rbps else None


def bounds(nbytes: int, workers: int, rbps: int | None,
           agg_bps: int | None = None) -> tuple[float | None, float | None]:
    """(aggregator bound, ring bound 2(N-1)M/(NR)) in seconds; None when unshaped. The
    aggregator's is M/R, or N x M through ``agg_bps`` (the aggregators' links together; default
    N x R, where the two agree) if that is longer."""
    if not rbps:
        return None, None
    t = nbytes * 8 / rbps
    agg = max(t, workers * nbytes * 8 / agg_bps) if agg_bps else t
    return agg, (2 * (workers - 1) * t / workers if workers > 1 else 0.0)


def shape_label(workers: int, ranks_per_host: int = 1) -> str:
    """How rows and progress name a testbed's ranks: ``N=4``, or ``N=2x2`` (hosts x ranks each)."""
    return f"N={workers}" if ranks_per_host == 1 else f"N={workers}x{ranks_per_host}"


def tbf_burst_bytes(rbps: int) -> int:
    """The shaper's bucket: a transfer smaller than this passes at full speed (see testbed.netlink)."""
    from nicoffload.testbed.netlink import tbf_burst

    return tbf_burst(rbps, 1500)


# --- command-line values --------------------------------------------------------------------
def parse_list(conv, text: str) -> list:
    """``a,b,c`` with each item converted by ``conv`` (which raises ValueError or InputError)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise InputError("empty list")
    return [conv(t) for t in items]


def size(t: str) -> int:
    n = parse_size(t)
    if n < 4:
        raise InputError("at least 4 bytes (one float32)")
    return n


def sparsity(t: str) -> float:
    v = float(t)
    if not 0.0 <= v <= 1.0:
        raise InputError("a fraction in [0, 1]")
    return v


def workers(t: str) -> int:
    """A worker count: up to 200 (more than AR_MAX_WORKERS: two levels of aggregator jobs)."""
    v = int(t)
    if not 1 <= v <= 200:
        raise InputError("1..200")
    return v


def rate(t: str) -> str:
    rate_bps(t)  # raises InputError with the accepted forms
    return t


def system(t: str) -> str:
    if t not in SYSTEMS:
        raise InputError(f"choose from {','.join(SYSTEMS)}")
    return t
