"""The aggregator side of a job on a testbed: the XDP aggregator loaded and attached from this
process, or the user-space aggregator as a process on the aggregator host (and that process's
own side, :func:`serve_userspace`)."""
from __future__ import annotations

import json
import os
import queue
import signal
import time
from pathlib import Path
from typing import Callable, Iterable

from ..errors import InputError
from ..jobspec import DEFAULT, JobSpec
from ..wire import proto
from . import counters
from .launcher import CLI, Launch, RankSpec

KINDS = ("xdp", "afxdp", "userspace")
#: seconds the user-space aggregator may take to say it is ready (imports, first compile)
START_TIMEOUT = 120.0
#: the fields of a job the aggregator must know
AGG_FIELDS = ("job", "port", "group", "slots", "elems", "delivery", "key")


def on_testbed(tb, spec: JobSpec) -> JobSpec:
    """``spec`` with the testbed's port and multicast group."""
    return spec.replace(port=tb.port, group=tb.mcast_group)


class AggregatorProcess:
    """The aggregator of one job on testbed ``tb``: ``xdp`` (loaded and attached here, in
    ``mode``), ``afxdp`` (``nicoffload aggregator-afxdp`` on the aggregator host: the AF_XDP engine)
    or ``userspace`` (``nicoffload aggregator-userspace`` there)."""

    def __init__(self, tb, kind: str, spec: JobSpec = DEFAULT, mode: str = "auto", host=None,
                 placed: bool = False, spin_us: int | None = None, tx: str | None = None):
        self.tb, self.kind = tb, kind
        self.spin_us, self.tx = spin_us, tx  # the afxdp engine's options (None: its defaults)
        self.engine_info: dict = {}      # what the afxdp engine said when ready (mode, copy mode, ...)
        self.engine_counters: dict = {}  # the afxdp engine's own counters, when it stopped
        self.host = host or tb.agg  # the aggregator host (a testbed may have several: tb.aggs)
        # placed: the spec already names its port and group on this testbed (jobs side by side)
        self.spec = spec if placed else on_testbed(tb, spec)
        self.agg = None
        self.launch: Launch | None = None
        self.mode: str | None = None
        if kind == "xdp":
            self._load_xdp(mode)
        elif kind == "userspace":
            self._start_userspace()
        elif kind == "afxdp":
            self._start_afxdp()
        else:
            raise InputError(f"unknown aggregator {kind!r}: choose {' or '.join(KINDS)}")

    def _load_xdp(self, mode: str) -> None:
        from nicoffload.agg.control import Aggregator, AggSpec
        from nicoffload.ebpf.iface import resolve_mode

        a, s = self.host, self.spec
        mode, _why = resolve_mode(mode, a.iface, a.netns)
        if a.name == self.tb.agg.name:
            self.tb.set_agg_napi(mode == "native")  # native XDP_TX on veth needs it; generic must not have it
        ips = [w.ip for w in self.tb.workers]
        if len(ips) > proto.MAX_WORKERS:  # two levels of jobs (nicoffload.worker.hier)
            from nicoffload.worker.hier import plan

            leaves, root = plan(s, len(ips))
            levels = [*leaves, root]
            self.agg = Aggregator.load(AggSpec(a.netns, a.iface, 0, s.slots * len(levels), s.elems, s.port, mode))
            try:
                for lv in levels:
                    self.agg.add_job(lv.job, len(lv.ranks), lv.group, [ips[r] for r in lv.ranks], slots=s.slots,
                                     delivery=s.delivery, key=s.key)
            except BaseException:
                self.agg.close()
                raise
        else:
            self.agg = Aggregator.load(AggSpec(a.netns, a.iface, len(ips), s.slots, s.elems, s.port, mode,
                                               s.job, s.group, ips, delivery=s.delivery, key=s.key))
        self.mode = self.agg.spec.mode

    def _start_userspace(self) -> None:
        self._start_process("aggregator-userspace", "the user-space aggregator")

    def _start_afxdp(self) -> None:
        self.mode = "afxdp"
        extra = ["--spin-us", str(self.spin_us)] if self.spin_us is not None else []
        if self.tx is not None:
            extra += ["--tx", self.tx]
        self._start_process("aggregator-afxdp", "the AF_XDP aggregator engine", extra)

    def _start_process(self, command: str, what: str, extra: list[str] | None = None) -> None:
        if len(self.tb.workers) > proto.MAX_WORKERS:
            raise InputError(f"{what} serves jobs of up to {proto.MAX_WORKERS} ranks; "
                             f"{len(self.tb.workers)} need the XDP aggregator's two levels of jobs")
        argv = CLI + [command, "--workers", str(len(self.tb.workers)), *self.spec.argv(AGG_FIELDS),
                      "--local-ip", self.host.ip, "--json", *(extra or [])]
        for w in self.tb.workers:
            argv += ["--worker-ip", w.ip]
        self.launch = Launch(self.tb, [RankSpec(f"{what} on {self.host.name}", self.host, argv)])
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                _, line = self.launch.next_line(deadline - time.monotonic())
            except queue.Empty:
                line = None
            if line is not None and line.startswith("ready"):
                rest = line[len("ready"):].strip()
                self.engine_info = json.loads(rest) if rest.startswith("{") else {}
                return
            if line is None:  # it ended, or said nothing in time
                o = self.launch.wait(time.monotonic() + 1.0)[0]
                self.launch = None
                raise o.error_class(f"{what} did not start: {o.reason}")

    @property
    def prog_id(self) -> int | None:
        return self.agg.spec.prog_id if self.agg is not None else None

    def bpf_runtime(self) -> tuple[int, int] | None:
        """(run_time_ns, run_cnt) of the XDP program so far; None for the user-space one."""
        return counters.bpf_runtime(self.prog_id)

    def stats(self) -> dict:
        return self.agg.stats() if self.agg is not None else {}

    def close(self) -> dict:
        """Stop the aggregator; its counters."""
        st: dict = {}
        if self.agg is not None:
            try:
                st = self.agg.stats()
            finally:
                self.agg.close()
                self.agg = None
        if self.launch is not None:
            o = self.launch.stop()[0]
            self.launch = None
            for line in o.json_lines():
                d = json.loads(line)
                st = d.get("stats", st)
                self.engine_counters = d.get("engine", {})
        return st

    def __enter__(self) -> "AggregatorProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_afxdp(workers: int, spec: JobSpec = DEFAULT, local_ip: str | None = None,
                worker_ips: Iterable[str] = (), duration: float | None = None,
                ready: Callable[[dict], None] = lambda d: None, iface: str | None = None, mode: str = "auto",
                spin_us: int | None = None, xsk_map: str | None = None, stats_file: str | None = None,
                tx: str = "auto", jobs_file: str | None = None) -> dict:
    """Run the AF_XDP engine in this process until SIGTERM/SIGINT (or ``duration`` seconds), with
    one job (``workers`` ranks of ``spec``), or with the jobs listed in ``jobs_file`` (JSON: job
    id -> job, workers, group, slots, delivery, worker_ips, key), followed as it changes. ``ready``
    gets the engine's description once it polls; ``stats_file``: counters written there (JSON)
    every tenth of a second, per job, with the jobs it refused and why. Returns the description
    with the counters of every job together (``stats``), per job (``jobs``) and the engine's
    own (``engine``)."""
    from nicoffload.afxdp.engine import DEFAULT_SPIN_US, AfxdpEngine
    from nicoffload.errors import SetupError

    eng = AfxdpEngine(iface, spec.port, spec.elems, mode, DEFAULT_SPIN_US if spin_us is None else spin_us,
                      xsk_map, local_ip=local_ip, tx=tx)
    run = _EngineJobs(eng, jobs_file, stats_file)
    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True
        eng.request_stop()

    try:
        if jobs_file:
            run.follow()
        else:
            eng.add_job(spec.job, workers, spec.slots, spec.group, list(worker_ips), spec.delivery, key=spec.key)
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        eng.start()
        ready(eng.describe())
        end = None if duration is None else time.monotonic() + duration
        while not stop["now"] and eng.running:
            if end is not None and time.monotonic() > end:
                break
            if jobs_file:
                run.follow()
            run.save()
            time.sleep(0.1)
        eng.request_stop()
        if eng.error:
            raise SetupError(f"the AF_XDP engine stopped: {eng.error}")
        out = run.report()
        run.save()
        return out
    finally:
        eng.close()


class _EngineJobs:
    """What :func:`serve_afxdp` keeps of a running engine: the jobs file it follows, the jobs it
    refused (and why), and the counters it writes to the stats file."""

    def __init__(self, eng, jobs_file: str | None, stats_file: str | None):
        self.eng, self.jobs_file, self.stats_file = eng, jobs_file, stats_file
        self.refused: dict[str, str] = {}
        self.mtime: int | None = None

    def follow(self) -> None:
        """Serve exactly the jobs the file lists (a job that cannot be served: refused, and why)."""
        from nicoffload.errors import NicoffloadError

        eng = self.eng
        try:
            mtime = os.stat(self.jobs_file).st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        if mtime == self.mtime:
            return
        self.mtime = mtime
        try:
            want = json.loads(Path(self.jobs_file).read_text()) if mtime != -1 else {}
        except (OSError, ValueError):
            self.mtime = None  # being written: read it again next time
            return
        served = {str(j["job"]) for j in eng.jobs}
        for j in served - set(want):
            eng.remove_job(int(j))
        for j in set(want) - served:
            w = want[j]
            try:
                eng.add_job(int(w["job"]), int(w["workers"]), int(w["slots"]), w["group"], w.get("worker_ips", []),
                            w.get("delivery", "multicast"), key=int(w.get("key", 0)))
                self.refused.pop(j, None)
            except NicoffloadError as e:
                self.refused[j] = str(e)
        for j in list(self.refused):
            if j not in want:
                del self.refused[j]

    def report(self) -> dict:
        eng = self.eng
        return {**eng.describe(), "stats": eng.stats(), "engine": eng.engine_stats(),
                "jobs": {str(j["job"]): eng.stats(j["job"]) for j in eng.jobs}, "refused": dict(self.refused)}

    def save(self) -> None:
        if self.stats_file:
            tmp = f"{self.stats_file}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.report(), f)
            os.replace(tmp, self.stats_file)


def serve_userspace(workers: int, spec: JobSpec = DEFAULT, local_ip: str | None = None,
                    worker_ips: Iterable[str] = (), duration: float | None = None,
                    ready: Callable[[], None] = lambda: None) -> dict:
    """Run the user-space aggregator in this process until SIGTERM/SIGINT (or ``duration``
    seconds); ``ready`` is called once it listens. Returns its counters."""
    from nicoffload.userspace.aggregator import UserspaceAggregator

    agg = UserspaceAggregator(workers, spec.port, spec.slots, spec.elems, spec.job, spec.group, local_ip,
                              list(worker_ips), delivery=spec.delivery, key=spec.key)

    def on_term(signum, frame):
        agg.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    ready()
    try:
        agg.serve(until=None if duration is None else time.monotonic() + duration)
    finally:
        agg.close()
    return agg.stats



class AggregatorSet:
    """The aggregators of one job on every aggregator host of the testbed (one, or K for a job
    sharded over K aggregators): the same job on each, started together, closed together."""

    def __init__(self, tb, kind: str, spec: JobSpec = DEFAULT, mode: str = "auto", placed: bool = False,
                 **engine):
        """``engine``: the afxdp engine's options (spin_us, tx)."""
        self.procs: list[AggregatorProcess] = []
        try:
            for h in tb.aggs:
                self.procs.append(AggregatorProcess(tb, kind, spec, mode, host=h, placed=placed, **engine))
        except BaseException:
            self.close()
            raise
        self.kind, self.mode = kind, self.procs[0].mode

    @property
    def addresses(self) -> str:
        """The workers' --aggregator: every aggregator's address, comma-separated."""
        return ",".join(p.host.ip for p in self.procs)

    @property
    def prog_id(self) -> int | None:
        return self.procs[0].prog_id

    def bpf_runtime(self) -> tuple[int, int] | None:
        got = [p.bpf_runtime() for p in self.procs]
        if any(g is None for g in got):
            return None
        return sum(g[0] for g in got), sum(g[1] for g in got)

    def stats(self) -> dict:
        return _summed([p.stats() for p in self.procs])

    def close(self) -> dict:
        out = []
        for p in self.procs:
            try:
                out.append(p.close())
            except Exception:
                pass
        return _summed(out)

    def __enter__(self) -> "AggregatorSet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _summed(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        for k, v in r.items():
            out[k] = out.get(k, 0) + v
    return out
