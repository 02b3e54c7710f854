"""The systems of one testbed interleaved rep by rep, so that their ratios come from one run.

A VM's speed drifts by tens of percent over minutes; systems measured one after the other carry
that drift into their ratio (gloo/xdp ranged 0.94 to 2.16 over five runs that way). Here every
system of a group has its ranks up at once, each idle on a FIFO, and the sweep hands out reps:
per point, every system's warm-up reps, then rounds of one timed rep per system (the order
reversed every other round: ABBA), each rep on an otherwise idle machine (the next starts when
every rank of the last has said it is done). Rep i of every system ran within the same second,
so ``t_a[i] / t_b[i]`` is a paired ratio; its median and quartiles go into the rows
(``paired``), with the machine's CPU, worker 0's bytes and the XDP program's run time read by
the sweep around each rep.

Side by side means apart: each system gets its own job id, ports and multicast group
(:func:`side_spec`); the XDP systems (xdp, xdpuni, xdp16) share one XDP aggregator per
aggregator host, a job each (:class:`SharedXdp`). Systems that install their own programs on the
shared hosts (xdpring on every worker, xdptorch's service on the aggregator) run alone, after the
group, and so does everything with ``--compute`` (its loop measures idle time around the reps).
The AF_XDP engine (afxdp) beside the XDP aggregator takes its job the way a job the XDP pool
refuses does (``agg job add --fallback afxdp``): the shared aggregator's program redirects the
job's frames into the engine's sockets (:class:`HandedOff`). On-path and off-path then share the
wire, the port and the reps' interleaving; alone, the engine attaches its own steering program.
"""
from __future__ import annotations

import ipaddress
import os
import time

import numpy as np

from nicoffload.jobspec import JobSpec
from nicoffload.lab import counters
from nicoffload.lab.bench.plan import XDP_AGG_SYSTEMS, BenchConfig, Point, shape_label
from nicoffload.wire import proto

#: systems that run alone: their programs or service would sit under every other system's traffic
ALONE = ("xdpring", "xdptorch")
#: each system's place on a shared testbed (0: the testbed's own job, port and group)
SIDE = {"xdp": 0, "xdpuni": 1, "xdp16": 2, "userspace": 3, "udpring": 4, "afxdp": 5}
#: systems whose numbers the paired ratios are taken against (nicoffload's own)
NICOFFLOAD = ("xdp", "xdp16", "xdpuni", "afxdp", "userspace", "xdptorch", "xdpring", "udpring")
#: tokens of ranks.run_driven_point
WARM, REP, NEXT = b"w", b"r", b"n"
#: lane j of a system with several ranks per host: job ids and groups LANE_STRIDE * j above the
#: system's (every SIDE fits below it), its ranks' port LANE_PORT_STRIDE * j above theirs
LANE_STRIDE, LANE_PORT_STRIDE = 8, 1000


def groups(cfg: BenchConfig, workers: int) -> list[list[str]]:
    """The systems of a testbed in the groups that run together, in order: everything that can
    share the testbed interleaved, then each system that runs alone."""
    if cfg.compute or workers > proto.MAX_WORKERS:  # two-level jobs hold the aggregator alone
        return [[s] for s in cfg.systems]
    together = [s for s in cfg.systems if s not in ALONE]
    return ([together] if together else []) + [[s] for s in cfg.systems if s in ALONE]


def side_spec(system: str, spec: JobSpec) -> JobSpec:
    """``spec`` (already on the testbed: its port and group) moved to ``system``'s own place: a
    job id, multicast group and rank port of its own; the user-space aggregator and ring their
    own server port (the XDP program takes the testbed's port only)."""
    k = SIDE.get(system, 0)
    if not k:
        return spec
    group = str(ipaddress.IPv4Address(spec.group) + k)
    if system in XDP_AGG_SYSTEMS or system == "afxdp":  # afxdp: the XDP program's port, beside it
        return spec.replace(job=spec.job + k, group=group, local_port=spec.port + 100 + k)
    return spec.replace(job=spec.job + k, group=group, port=spec.port + 30 + k, local_port=None)


def lane_spec(spec: JobSpec, j: int) -> JobSpec:
    """The job of lane ``j`` of a system whose hosts run several ranks (``spec``: the system's,
    its side_spec): local rank j of every host sums its share of each tensor there, as int32
    (32-bit records: the host packs 16-bit lanes into int32 words itself)."""
    group = str(ipaddress.IPv4Address(spec.group) + LANE_STRIDE * j)
    return spec.replace(job=spec.job + LANE_STRIDE * j, group=group, lanes=32, sparse=False,
                        local_port=(spec.local_port or spec.port) + LANE_PORT_STRIDE * j)


class SharedXdp:
    """One XDP aggregator per aggregator host of the testbed, holding a job for each XDP system
    of a group (``specs``: system -> its side_spec), or ``lanes`` jobs each (one rank per host
    in every one: lane_spec) where hosts run several ranks."""

    def __init__(self, tb, specs: dict[str, JobSpec], mode: str = "auto", lanes: int = 1):
        from nicoffload.agg.control import Aggregator, AggSpec
        from nicoffload.ebpf.iface import resolve_mode

        self.specs, self.aggs = specs, []
        self.jobs = {name: [lane_spec(s, j) if lanes > 1 else s for j in range(lanes)] for name, s in specs.items()}
        ips = [w.ip for w in tb.workers]
        first = next(iter(specs.values()))
        try:
            for h in tb.aggs:
                m, _why = resolve_mode(mode, h.iface, h.netns)
                if h.name == tb.agg.name:
                    tb.set_agg_napi(m == "native")
                every = [s for js in self.jobs.values() for s in js]
                agg = Aggregator.load(AggSpec(h.netns, h.iface, 0, sum(s.slots for s in every), first.elems,
                                              first.port, m))
                self.aggs.append(agg)
                for s in every:
                    agg.add_job(s.job, len(ips), s.group, ips, slots=s.slots, delivery=s.delivery, key=s.key)
        except BaseException:
            self.close()
            raise
        self.mode = self.aggs[0].spec.mode

    @property
    def prog_ids(self) -> list[int]:
        return [a.spec.prog_id for a in self.aggs]

    def stats(self, system: str) -> dict:
        """The counters of ``system``'s jobs (every lane's), summed over the aggregators."""
        out: dict = {}
        for a in self.aggs:
            for s in self.jobs[system]:
                for k, v in a.stats(s.job).items():
                    out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for a in self.aggs:
            try:
                a.close()
            except Exception:
                pass
        self.aggs = []


class HandedOff:
    """A job of the AF_XDP engine beside the shared XDP aggregator(s): handed off on each as a job
    the pool refused would be (one engine process per aggregator host), taken back at the end."""

    def __init__(self, tb, shared: SharedXdp, spec: JobSpec, tx: str | None = None):
        from nicoffload.agg import fallback

        self.shared, self.spec, self.entries = shared, spec, []
        ips = [w.ip for w in tb.workers]
        try:
            for a in shared.aggs:
                self.entries.append((a, fallback.hand_off(a, spec.job, len(ips), spec.group, ips, spec.slots,
                                                          spec.delivery, tx=tx, key=spec.key)))
        except BaseException:
            self.close()
            raise

    @property
    def engine_info(self) -> list[dict]:
        keep = ("engine", "mode", "copy_mode", "tx", "queues", "mtu", "pid")
        return [{k: e[k] for k in keep if k in e} for _, e in self.entries]

    def stats(self) -> dict:
        from nicoffload.agg import fallback

        out: dict = {}
        for a, _ in self.entries:
            for h in fallback.handed_off(a.spec.netns, a.spec.iface):
                if h["job"] == self.spec.job:
                    for k, v in h["stats"].items():
                        out[k] = out.get(k, 0) + v
        return out

    def close(self) -> dict:
        from nicoffload.agg import fallback

        st = self.stats() if self.entries else {}
        for a, _ in self.entries:
            try:
                fallback.take_back(a, self.spec.job)
            except Exception:
                pass
        self.entries = []
        return st


class Window:
    """What the sweep reads around one system's timed reps of a point, summed over them."""

    def __init__(self):
        self.cpu_busy = self.cpu_all = self.seconds = 0.0
        self.rx = self.tx = self.bpf_ns = self.bpf_cnt = 0
        self.has_net = self.has_bpf = True

    def around(self, iface: str, pid: int, prog_ids: list[int], fn):
        """Run ``fn()`` (one rep) between two readings (``iface`` in the namespace of process
        ``pid``); its result."""
        b0, n0, c0, t0 = _bpf(prog_ids), counters.iface_bytes(iface, pid), counters.cpu_ticks(), time.monotonic()
        got = fn()
        c1, t1 = counters.cpu_ticks(), time.monotonic()
        n1, b1 = counters.iface_bytes(iface, pid), _bpf(prog_ids)
        hz = os.sysconf("SC_CLK_TCK")
        self.cpu_busy += (c1[0] - c0[0]) / hz
        self.cpu_all += (c1[1] - c0[1]) / hz
        self.seconds += t1 - t0
        net, bpf = counters.delta(n1, n0), counters.delta(b1, b0)
        if net:
            self.rx, self.tx = self.rx + net[0], self.tx + net[1]
        else:
            self.has_net = False
        if bpf:
            self.bpf_ns, self.bpf_cnt = self.bpf_ns + bpf[0], self.bpf_cnt + bpf[1]
        else:
            self.has_bpf = False
        return got

    def record(self) -> dict:
        """The keys rank 0's record carries in a sweep that is not driven (report.measured_row)."""
        rec = {"cpu_busy_s": self.cpu_busy, "cpu_all_s": self.cpu_all, "window_s": self.seconds}
        if self.has_net:
            rec["rx_bytes"], rec["tx_bytes"] = self.rx, self.tx
        if self.has_bpf and self.bpf_cnt:
            rec["bpf_ns"], rec["bpf_cnt"] = self.bpf_ns, self.bpf_cnt
        return rec


def _bpf(prog_ids: list[int]) -> tuple[int, int] | None:
    got = [counters.bpf_runtime(p) for p in prog_ids]
    if not got or any(g is None for g in got):
        return None
    return sum(g[0] for g in got), sum(g[1] for g in got)


def schedule_done(cfg: BenchConfig, rounds: int, elapsed: dict[str, float], wall: float, systems: int) -> bool:
    """Whether a point has had enough rounds: ``max_reps``; or ``reps`` and ``min_time`` seconds
    of every system's reps; or (after one) ``max_point_s`` per system of wall time."""
    if rounds >= cfg.max_reps:
        return True
    if rounds >= 1 and wall > cfg.max_point_s * systems:
        return True
    return rounds >= cfg.reps and all(v >= cfg.min_time for v in elapsed.values())


def order(names: list[str], rnd: int) -> list[str]:
    """The systems' order in round ``rnd``: as given, reversed every other round (ABBA), so
    that no system always runs right after the same one."""
    return list(names) if rnd % 2 == 0 else list(reversed(names))


def paired(rows: list[dict]) -> None:
    """Each ok row of one point gets ``paired``: for every other ok row of the group, the median
    and quartiles of its reps' ratios t_this[i] / t_other[i] (rep i of each ran in the same
    round), and the number of pairs; ``paired_vs`` names the row's reference (nicoffload's first
    system, for the others; the first other system for it) and ``paired_ratio`` that median."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("times")]
    for r in ok:
        r["paired"] = {}
        for o in ok:
            if o is r:
                continue
            k = min(len(r["times"]), len(o["times"]))
            if not k:
                continue
            q = np.asarray(r["times"][:k]) / np.asarray(o["times"][:k])
            r["paired"][o["system"]] = {"median": float(np.median(q)), "q1": float(np.percentile(q, 25)),
                                        "q3": float(np.percentile(q, 75)), "pairs": k}
        ref = next((o["system"] for o in ok if o is not r and o["system"] in NICOFFLOAD),
                   next((o["system"] for o in ok if o is not r), None))
        if ref is not None and ref in r["paired"]:
            r["paired_vs"], r["paired_ratio"] = ref, r["paired"][ref]["median"]


def ratio_lines(rows: list[dict]) -> list[str]:
    """Lines naming each baseline's paired ratio to each nicoffload system of the same point:
    'gloo/xdp 1.42 [1.31..1.55] (20 pairs)'."""
    out = []
    seen = set()
    for r in rows:
        if r["system"] in NICOFFLOAD or not r.get("paired"):
            continue
        for other, p in r["paired"].items():
            if other not in NICOFFLOAD:
                continue
            key = (r["rate"], r["workers"], r["bytes"], r["sparsity"], r["system"], other)
            if key in seen:
                continue
            seen.add(key)
            from nicoffload.lab.inputs import format_size

            n = shape_label(r["workers"], r.get("ranks_per_host") or 1)
            out.append(f"{r['rate']:>9} {n:<4} {format_size(r['bytes']):>7} s={r['sparsity']:<4.2f} "
                       f"{r['system']}/{other} {p['median']:.2f} [{p['q1']:.2f}..{p['q3']:.2f}] ({p['pairs']} pairs)")
    return out


def point_of(points: list[Point], index: int) -> Point:
    return next(p for p in points if p.index == index)
