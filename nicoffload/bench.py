"""``nicoffload bench``: nicoffload against what users run today, side by side, on one testbed.

Systems (each one AllReduce of the same float32 gradients, on the same namespace testbed):

========== =====================================================================================
xdp        nicoffload workers, the XDP aggregator on the aggregator's NIC (UDP, int32 fixed
           point, all-zero blocks skipped)
userspace  nicoffload workers, the user-space aggregator process (same protocol)
ring       nicoffload.ring: Ring AllReduce (reduce-scatter + all-gather) over a TCP ring between
           the workers, float32 summed in float32 with numpy
gloo       torch.distributed ``all_reduce`` with the gloo backend (TCP), if torch imports
mpi        Open MPI ``MPI_Allreduce`` through mpi4py, BTL ``tcp,self`` (the shared-memory BTL
           is excluded: every namespace shares one machine's memory and would bypass the
           network), if mpirun and mpi4py exist
========== =====================================================================================

How one (testbed, system) pair runs: ONE set of rank processes (one per worker namespace; for
mpi, ``mpirun`` in worker 0's namespace launching the other ranks through an rsh agent that
enters their namespaces) goes through every point of the sweep in turn, so start-up costs
(imports, connection set-up, compiling the XDP program) are paid once. Per point every rank
loads its input, runs ``warmup`` untimed AllReduces, then timed ones: each is preceded by a
one-element AllReduce of the same system that is the barrier and carries rank 0's decision to
go on (at least ``reps`` reps and ``min_time`` seconds, at most ``max_reps`` and
``max_point_s``). A rep's time is the slowest rank's. Rank 0 reads /proc/stat (the whole
machine: every rank, the aggregator, softirqs) and the XDP program's bpf stats just before the
first timed rep and just after the final barrier: ``cpu_s`` and ``bpf_ns`` are those deltas
divided by the reps (the window holds reps AllReduces and reps+1 barriers; /proc/stat ticks are
10 ms, hence ``min_time``).

Links: every system runs on the testbed as it is built (GRO enabled on every worker's interface
for all of them). The testbed keeps its NAPI XDP_PASS program on the aggregator's bridge-side
veth for every system, so TSO/GSO stays off on the aggregator's own interface throughout; worker
links carry no XDP for any system (TSO on). Only during xdp runs does the aggregator's program on
its interface also turn TSO off on the bridge side of that link (traffic of the other systems
never crosses it). The state of each system's links is recorded in meta.json.

Shaped sweeps: every worker link at R, the aggregator's at N x R. An AllReduce of M bytes cannot
finish sooner than M/R through an aggregator (``bound_agg_s``), nor sooner than 2(N-1)M/(NR)
through a ring or any host-only algorithm (``bound_ring_s``). Bounds count payload bytes only
(headers are overhead) and are for dense data: sparse inputs let nicoffload beat M/R.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import libbpf
from .errors import NicoffloadError

SYSTEMS = ("xdp", "userspace", "ring", "gloo", "mpi")
AGG_SYSTEMS = ("xdp", "userspace")
DESCRIPTION = {
    "xdp": "nicoffload workers + XDP aggregator (UDP, int32 fixed point, zero blocks skipped)",
    "userspace": "nicoffload workers + user-space aggregator (same protocol)",
    "ring": "Ring AllReduce over a TCP ring (reduce-scatter + all-gather), float32 summed in float32",
    "gloo": "torch.distributed all_reduce, gloo backend (TCP)",
    "mpi": "Open MPI MPI_Allreduce via mpi4py, btl tcp,self (no shared memory)",
}
RING_PORT_OFFSET, GLOO_PORT_OFFSET = 21, 22  # above the testbed's nicoffload port

FIELDS = ["system", "workers", "bytes", "sparsity", "rate", "rate_bps", "status", "reason", "reps",
          "median_s", "min_s", "max_s", "goodput_bps", "cpu_s", "cpu_util", "bpf_ns", "bpf_cnt",
          "bound_agg_s", "bound_ring_s", "bound_s", "bound_fraction", "max_abs_err", "within_bound",
          "packets", "retransmissions", "w0_tx_bytes", "w0_rx_bytes", "mode", "shape"]


# --- configuration ----------------------------------------------------------------------------
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
    timeout: float = 20.0       # a rank without progress for this long fails
    start_timeout: float = 180.0
    slots: int = 1024
    elems: int = 256
    mode: str = "auto"          # XDP attach mode of the aggregator (auto: generic batches on veth)
    dtype: str = "float32"      # of the gradients: float32 (quantized to int32) or int32 (exact)

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        d = dict(workers=[2], sizes=[4 << 10, 256 << 10], sparsities=[0.0, 0.5], rates=["unshaped", "200mbit"],
                 reps=3, warmup=1, min_time=0.05, max_reps=20, max_point_s=5.0)
        d.update(kw)
        return cls(**d)


@dataclass(frozen=True)
class Point:
    index: int
    bytes: int
    sparsity: float


def centre_workers(workers: list[int]) -> int:
    ws = sorted(workers)
    return 4 if 4 in ws else ws[len(ws) // 2]


def reference_size(sizes: list[int]) -> int:
    small = [s for s in sizes if s <= 16 << 20]
    return max(small) if small else min(sizes)


def plan_points(cfg: BenchConfig, workers: int) -> list[Point]:
    """Points of one testbed. Default: every size at the lowest sparsity, and at the centre worker
    count every sparsity at the reference size (the axes the plots need). ``full``: the cross product."""
    base = min(cfg.sparsities)
    pts: list[tuple[int, float]] = []
    if cfg.full:
        pts = [(b, s) for b in cfg.sizes for s in cfg.sparsities]
    else:
        pts = [(b, base) for b in cfg.sizes]
        if workers == centre_workers(cfg.workers):
            ref = reference_size(cfg.sizes)
            pts += [(ref, s) for s in cfg.sparsities if s != base]
    seen, out = set(), []
    for b, s in pts:
        if (b, s) not in seen:
            seen.add((b, s))
            out.append(Point(len(out), b, s))
    return out


def rate_bps(rate: str) -> int | None:
    from nicoffload.testbed.topology import parse_rate

    return parse_rate(rate)


def rate_label(rate: str) -> str:
    from nicoffload.testbed.topology import format_rate

    return format_rate(rate_bps(rate))


def bounds(nbytes: int, workers: int, rbps: int | None) -> tuple[float | None, float | None]:
    """(aggregator bound M/R, ring bound 2(N-1)M/(NR)) in seconds; None when unshaped."""
    if not rbps:
        return None, None
    t = nbytes * 8 / rbps
    return t, (2 * (workers - 1) * t / workers if workers > 1 else 0.0)


# --- machine probes ---------------------------------------------------------------------------
def tbf_burst_bytes(rbps: int) -> int:
    """The shaper's bucket: a transfer smaller than this passes at full speed (see testbed.netlink)."""
    from nicoffload.testbed.netlink import tbf_burst

    return tbf_burst(rbps, 1500)


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine from /proc/stat's first line."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    v = [int(x) for x in parts[1:9]] + [0] * max(0, 9 - len(parts))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def iface_bytes(ifname: str) -> tuple[int, int] | None:
    """(rx_bytes, tx_bytes) of an interface of this process's network namespace."""
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    v = rest.split()
                    return int(v[0]), int(v[8])
    except OSError:
        pass
    return None


def bpf_runtime(prog_id: int | None) -> tuple[int, int] | None:
    """(run_time_ns, run_cnt) of a BPF program (counted while stats are enabled)."""
    if not prog_id:
        return None
    try:
        st = libbpf.prog_stats(prog_id)
    except (OSError, NicoffloadError):
        return None
    return st.run_time_ns, st.run_cnt


def _python_check(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"'{code}' took longer than {timeout:.0f}s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["failed"])[-1]
        return False, last
    return True, r.stdout.strip()


def probe(system: str, mpirun: str = "mpirun", python: str | None = None) -> tuple[str | None, str]:
    """(reason the system cannot run or None, version/description)."""
    if system == "xdp":
        try:
            from . import bpf

            bpf.import_bcc()
        except Exception as e:
            return f"bcc is not importable ({e}); run scripts/setup.sh", ""
        return None, "bcc"
    if system in ("userspace", "ring"):
        return None, "nicoffload"
    if system == "gloo":
        ok, msg = _python_check("import torch, torch.distributed as d; "
                                "print(torch.__version__ if d.is_available() and d.is_gloo_available() else 'NOGLOO')")
        if not ok:
            if "No module named 'torch'" in msg:
                return "torch is not installed (pip install torch==2.13.0)", ""
            return f"torch does not import: {msg}", ""
        if msg.endswith("NOGLOO"):
            return "this torch build has no gloo backend", msg
        return None, f"torch {msg.splitlines()[-1]}"
    if system == "mpi":
        exe = shutil.which(mpirun)
        if not exe:
            return f"mpirun not found ({mpirun}); apt-get install openmpi-bin python3-mpi4py", ""
        ok, msg = _python_check("import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])", 60)
        if not ok:
            return f"mpi4py is not importable ({msg}); apt-get install python3-mpi4py", ""
        return None, msg
    return f"unknown system {system!r}", ""


# =============================================================================================
# Rank side: `python -m nicoffload.bench rank --system S --plan FILE [--rank R]`
# =============================================================================================
class _Adapter:
    rank: int

    def allreduce(self, x: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def flag(self, v: int) -> int:
        raise NotImplementedError

    def emit(self, rec: dict) -> None:
        print(json.dumps(rec), flush=True)

    def counters(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class _Nicoffload(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from .worker import Communicator

        p = plan["params"]
        self.rank = rank
        self.c = Communicator(rank, plan["world"], p["aggregator"], group=p["group"], local_ip=plan["ips"][rank],
                              job=p["job"], port=p["port"], slots=p["slots"], elems=p["elems"],
                              timeout=plan["timeout"])
        self._one = np.zeros(1, dtype=np.int32)

    def allreduce(self, x, out):
        self.c.allreduce(x, out=out)

    def flag(self, v):
        self._one[0] = v
        return int(self.c.allreduce(self._one)[0])

    def counters(self):
        s = self.c.stats
        return {"packets": s.packets_sent, "retransmissions": s.retransmissions}

    def close(self):
        self.c.close()


class _Ring(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from .ring import RingComm

        self.rank = rank
        self.r = RingComm(rank, plan["world"], plan["ips"], plan["params"]["port"], plan["timeout"])
        self._f = np.zeros(plan["world"], dtype=np.int32)

    def allreduce(self, x, out):
        self.r.allreduce(x, out)

    def flag(self, v):
        self._f[:] = 0
        self._f[0] = v
        return int(self.r.allreduce(self._f)[0])

    def close(self):
        self.r.close()


class _Gloo(_Adapter):
    def __init__(self, plan: dict, rank: int):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        self.rank, self.torch, self.dist = rank, torch, dist
        dist.init_process_group("gloo", rank=rank, world_size=plan["world"],
                                timeout=timedelta(seconds=max(60.0, plan["timeout"] * 3)))
        self._f = torch.zeros(1, dtype=torch.int32)

    def allreduce(self, x, out):
        np.copyto(out, x)
        self.dist.all_reduce(self.torch.from_numpy(out))

    def flag(self, v):
        self._f[0] = v
        self.dist.all_reduce(self._f)
        return int(self._f[0])

    def close(self):
        self.dist.destroy_process_group()


class _Mpi(_Adapter):
    def __init__(self, plan: dict, rank: int | None):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        if self.comm.Get_size() != plan["world"]:
            raise RuntimeError(f"mpirun started {self.comm.Get_size()} ranks, the plan has {plan['world']}")
        _check_local_ip(plan["ips"][self.rank], f"MPI rank {self.rank}")
        self._f, self._g = np.zeros(1, dtype=np.int32), np.zeros(1, dtype=np.int32)

    def allreduce(self, x, out):
        self.comm.Allreduce(x, out, op=self.MPI.SUM)

    def flag(self, v):
        self._f[0] = v
        self.comm.Allreduce(self._f, self._g, op=self.MPI.SUM)
        return int(self._g[0])

    def emit(self, rec):
        # mpirun merges every rank's stdout: gather to rank 0, which prints whole lines
        recs = self.comm.gather(rec, root=0)
        if self.rank == 0:
            for r in recs:
                print(json.dumps(r), flush=True)


def _check_local_ip(ip: str, who: str) -> None:
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind((ip, 0))
    except OSError:
        raise RuntimeError(f"{who} is not on the host with address {ip} (placement went wrong)") from None
    finally:
        s.close()


ADAPTERS = {"xdp": _Nicoffload, "userspace": _Nicoffload, "ring": _Ring, "gloo": _Gloo, "mpi": _Mpi}


def run_point(a: _Adapter, x: np.ndarray, out: np.ndarray, lead: bool, plan: dict) -> dict:
    """Warm-up, then timed reps, each behind a one-element AllReduce (barrier + rank 0's go-on)."""
    for _ in range(plan["warmup"]):
        a.flag(1)
        a.allreduce(x, out)
    c_before = a.counters()
    b0 = bpf_runtime(plan.get("prog_id")) if lead else None
    n0 = iface_bytes(plan["iface"]) if lead else None
    cpu0 = cpu_ticks() if lead else (0, 0)
    w0 = time.monotonic()
    times: list[float] = []
    while True:
        want = 0
        if lead:
            el = time.monotonic() - w0
            want = int(not times or (len(times) < plan["max_reps"] and el < plan["max_point_s"]
                                     and (len(times) < plan["reps"] or el < plan["min_time"])))
        if a.flag(want) == 0:
            break
        t0 = time.perf_counter()
        a.allreduce(x, out)
        times.append(time.perf_counter() - t0)
    rec: dict = {"times": times}
    if lead:
        cpu1 = cpu_ticks()
        w1 = time.monotonic()
        n1 = iface_bytes(plan["iface"])
        b1 = bpf_runtime(plan.get("prog_id"))
        hz = os.sysconf("SC_CLK_TCK")
        rec["cpu_busy_s"] = (cpu1[0] - cpu0[0]) / hz
        rec["cpu_all_s"] = (cpu1[1] - cpu0[1]) / hz
        rec["window_s"] = w1 - w0
        if b0 and b1:
            rec["bpf_ns"], rec["bpf_cnt"] = b1[0] - b0[0], b1[1] - b0[1]
        if n0 and n1:
            rec["rx_bytes"], rec["tx_bytes"] = n1[0] - n0[0], n1[1] - n0[1]
    c_after = a.counters()
    if c_after:
        rec["counters"] = {k: c_after[k] - c_before.get(k, 0) for k in c_after}
    return rec


def rank_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nicoffload.bench",
                                description="internal: one rank of a `nicoffload bench` run")
    p.add_argument("role", choices=["rank"])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--rank", type=int, default=None, help="(not for mpi: the rank comes from MPI)")
    args = p.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    try:
        a = ADAPTERS[args.system](plan, args.rank)
        rank = a.rank
        a.emit({"ready": True, "rank": rank})
        for pt in plan["points"]:
            x = np.load(pt["inputs"][rank], allow_pickle=False)
            out = np.empty_like(x)
            rec = run_point(a, x, out, rank == 0, plan)
            if rank == 0 and pt.get("output"):
                np.save(pt["output"], out)
            a.emit({"point": pt["index"], "rank": rank, **rec})
            del x, out
        a.close()
    except Exception as e:
        print(f"{args.system} rank {args.rank if args.rank is not None else '?'}: {e.__class__.__name__}: {e}",
              file=sys.stderr, flush=True)
        if args.system == "mpi":
            try:
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(1)
            except Exception:
                pass
        return 1
    return 0


# =============================================================================================
# Bench side
# =============================================================================================
class RankJob:
    """The rank processes of one (testbed, system): stdout lines funnelled into one queue,
    stderr into files (for the error message)."""

    def __init__(self, procs: list[tuple[str, subprocess.Popen, Path]]):
        self.procs = procs
        self.q: queue.Queue = queue.Queue()
        self.threads = []
        for label, p, _ in procs:
            t = threading.Thread(target=self._read, args=(label, p), daemon=True)
            t.start()
            self.threads.append(t)

    def _read(self, label: str, p: subprocess.Popen) -> None:
        try:
            for line in p.stdout:
                self.q.put((label, line))
        finally:
            self.q.put((label, None))

    def next(self, timeout: float):
        return self.q.get(timeout=max(0.01, timeout))

    def errors(self) -> str:
        msgs = []
        for label, p, err in self.procs:
            if p.poll() not in (None, 0):
                text = err.read_text(errors="replace").strip() if err.exists() else ""
                lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("[W")]
                msgs.append(f"{label} exited {p.returncode}: {lines[-1] if lines else '(no message)'}")
        return "; ".join(msgs)

    def stop(self) -> None:
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for _, p, _ in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(timeout=2)
        for _, p, _ in self.procs:
            if p.stdout:
                p.stdout.close()


def _mpi_agent(path: Path, tb) -> Path:
    """The rsh agent mpirun uses to start its daemons: 'ssh HOST CMD' becomes 'run CMD in
    HOST's network namespace' (hosts are the workers' addresses)."""
    cases = "\n".join(f'  {w.ip}) ns={w.netns} ;;' for w in tb.workers)
    path.write_text(
        "#!/bin/sh\n# nicoffload bench: mpirun's rsh agent, entering the host's network namespace\n"
        'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
        'host="$1"; shift\ncase "$host" in\n' + cases + "\n"
        '  *) echo "nicoffload mpi agent: unknown host $host" >&2; exit 1 ;;\nesac\n'
        'exec ip netns exec "$ns" /bin/sh -c "$*"\n')
    path.chmod(0o755)
    return path


def launch(tb, system: str, plan_path: Path, plan: dict, work: Path, cfg: BenchConfig) -> RankJob:
    base = [sys.executable, "-m", "nicoffload.bench", "rank", "--system", system, "--plan", str(plan_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = []
    if system == "mpi":
        n = len(tb.workers)
        agent = _mpi_agent(work / "mpi-agent.sh", tb)
        argv = [shutil.which(cfg.mpirun) or cfg.mpirun, "--allow-run-as-root", "-np", str(n),
                "--host", ",".join(f"{w.ip}:1" for w in tb.workers), "--bind-to", "none",
                "--mca", "plm_rsh_agent", str(agent), "--mca", "plm_rsh_no_tree_spawn", "1",
                # ob1 + tcp only: pml ucx, btl vader, coll sm/han and osc ucx/sm would move data through
                # shared memory (every namespace shares the machine's memory), bypassing the network
                "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "coll", "^sm,han",
                "--mca", "osc", "^ucx,sm", "--mca", "btl_tcp_if_include", tb.workers[0].iface,
                "--mca", "oob_tcp_if_include", tb.workers[0].iface]
        if n > 2:
            argv += ["--mca", "mpi_yield_when_idle", "1"]
        err = work / f"{system}-mpirun.err"
        with open(err, "w") as ef:
            p = tb.popen(tb.workers[0], argv + base, stdout=subprocess.PIPE, stderr=ef, text=True, env=env)
        procs.append(("mpirun", p, err))
        return RankJob(procs)
    for w in tb.workers:
        e = dict(env)
        if system == "gloo":
            e.update(GLOO_SOCKET_IFNAME=w.iface, MASTER_ADDR=tb.workers[0].ip,
                     MASTER_PORT=str(plan["params"]["port"]))
        err = work / f"{system}-rank{w.rank}.err"
        with open(err, "w") as ef:
            p = tb.popen(w, base + ["--rank", str(w.rank)], stdout=subprocess.PIPE, stderr=ef, text=True, env=e)
        procs.append((f"rank {w.rank}", p, err))
    return RankJob(procs)


def link_state(tb) -> dict:
    """TSO/GSO/GRO and XDP of the links every system uses (w0's link and the aggregator's)."""
    from pyroute2.ethtool import Ethtool

    from . import bpf

    keys = {"tx-tcp-segmentation": "tso", "tx-udp-segmentation": "udp_gso",
            "tx-generic-segmentation": "gso", "rx-gro": "gro"}
    out = {}
    for ns, ifc, label in ((tb.workers[0].netns, tb.workers[0].iface, f"w0:{tb.workers[0].iface}"),
                           (tb.bridge_netns, tb.workers[0].peer, f"br:{tb.workers[0].peer}"),
                           (tb.agg.netns, tb.agg.iface, f"agg:{tb.agg.iface}"),
                           (tb.bridge_netns, tb.agg.peer, f"br:{tb.agg.peer}")):
        d: dict = {}
        try:
            with bpf.netns(ns):
                e = Ethtool()
                try:
                    f = e.get_features(ifc).features
                    d = {short: bool(f[k].enable) for k, short in keys.items() if k in f}
                finally:
                    e.close()
            d["xdp_prog"] = bpf.xdp_prog_id(ifc, ns)
        except Exception as ex:  # informational only
            d = {"error": str(ex)}
        out[label] = d
    return out


@dataclass
class PointData:
    inputs: list[Path]  # one .npy per rank


class Reference:
    """Exact sums and error bounds of the points, computed lazily (after the rank processes are
    gone, so they never load the CPU windows) and kept for the other systems of the testbed."""

    def __init__(self, workers: int, elems: int):
        self.workers, self.elems = workers, elems
        self.cache: dict[int, dict] = {}

    def get(self, idx: int, inputs: list[Path]) -> dict:
        if idx not in self.cache:
            from .quant import block_exponents, error_bound

            xs = [np.load(p, mmap_mode="r") for p in inputs]
            n = xs[0].size
            if xs[0].dtype == np.int32:  # every system must be exact (wrapping modulo 2^32)
                exact = np.zeros(n, dtype=np.int32)
                for x in xs:
                    exact += x
                zero = np.zeros(n)
                self.cache[idx] = {"exact": exact.astype(np.float64), "qbound": zero, "fbound": zero,
                                   "int": exact}
                return self.cache[idx]
            exact = np.zeros(n, dtype=np.float64)
            abs_sum = np.zeros(n, dtype=np.float64)
            E = self.elems
            nb = -(-n // E)
            exps = None
            for x in xs:
                x64 = np.asarray(x, dtype=np.float64)
                exact += x64
                abs_sum += np.abs(x64)
                pad = np.zeros(nb * E, dtype=np.float32)
                pad[:n] = x
                e = block_exponents(pad.reshape(nb, E))
                exps = e if exps is None else np.maximum(exps, e)
            qb = np.repeat(error_bound(exps, self.workers), E)[:n]
            half_ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) / 2
            # float32 summation in any order of N terms: |err| <= N * 2^-24 * sum|x_i| (incl. the last rounding)
            fb = self.workers * 2.0 ** -24 * abs_sum
            self.cache[idx] = {"exact": exact, "qbound": qb + half_ulp, "fbound": fb + half_ulp}
        return self.cache[idx]


def _row(system: str, workers: int, pt: Point, rate: str, rbps: int | None, **kw) -> dict:
    ba, br = bounds(pt.bytes, workers, rbps)
    r = {k: None for k in FIELDS}
    r.update(system=system, workers=workers, bytes=pt.bytes, sparsity=pt.sparsity, rate=rate, rate_bps=rbps,
             bound_agg_s=ba, bound_ring_s=br, bound_s=ba if system in AGG_SYSTEMS else br)
    r.update(kw)
    return r


def _measured_row(system: str, workers: int, pt: Point, rate: str, rbps: int | None, recs: list[dict]) -> dict:
    recs = sorted(recs, key=lambda d: d["rank"])
    nrep = min(len(d["times"]) for d in recs)
    reps = [max(d["times"][i] for d in recs) for i in range(nrep)]
    lead = recs[0]
    med = float(np.median(reps))
    row = _row(system, workers, pt, rate, rbps, status="ok", reason="", reps=nrep, median_s=med,
               min_s=float(min(reps)), max_s=float(max(reps)), goodput_bps=pt.bytes * 8 / med,
               cpu_s=lead["cpu_busy_s"] / nrep, times=reps,
               cpu_util=(lead["cpu_busy_s"] / lead["cpu_all_s"]) if lead.get("cpu_all_s") else None)
    if "tx_bytes" in lead:
        row["w0_tx_bytes"], row["w0_rx_bytes"] = lead["tx_bytes"] / nrep, lead["rx_bytes"] / nrep
    if "bpf_ns" in lead:
        row["bpf_ns"], row["bpf_cnt"] = lead["bpf_ns"] / nrep, lead["bpf_cnt"] / nrep
    if all("counters" in d for d in recs):
        row["packets"] = sum(d["counters"]["packets"] for d in recs)
        row["retransmissions"] = sum(d["counters"]["retransmissions"] for d in recs)
    if row["bound_s"]:
        row["bound_fraction"] = row["bound_s"] / med
    return row


class Progress:
    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.t0, self.stream = total, 0, time.monotonic(), stream

    def _stamp(self) -> str:
        el = time.monotonic() - self.t0
        return f"[{self.done:>3}/{self.total} {int(el // 60)}m{int(el % 60):02d}s]"

    def note(self, msg: str) -> None:
        print(f"{self._stamp()} {msg}", file=self.stream, flush=True)

    def row(self, r: dict) -> None:
        self.done += 1
        print(f"{self._stamp()} {_fmt_row(r)}", file=self.stream, flush=True)


def run_system(tb, system: str, points: list[Point], data: list[PointData], rate: str, rbps: int | None,
               cfg: BenchConfig, work: Path, ref: Reference, prog: Progress, meta: dict) -> tuple[list[dict], str | None]:
    """All points of one system on one testbed. Returns (rows, start-up failure or None)."""
    from .runner import AggregatorProcess

    n = len(tb.workers)
    outputs = [work / f"{system}-out{pt.index}.npy" for pt in points]
    params: dict = {}
    if system in AGG_SYSTEMS:
        params = {"aggregator": tb.agg.ip, "group": tb.mcast_group, "port": tb.port, "job": 1,
                  "slots": cfg.slots, "elems": cfg.elems}
    elif system == "ring":
        params = {"port": tb.port + RING_PORT_OFFSET}
    elif system == "gloo":
        params = {"port": tb.port + GLOO_PORT_OFFSET}
    plan = {"system": system, "world": n, "ips": [w.ip for w in tb.workers], "iface": tb.workers[0].iface,
            "params": params,
            "warmup": cfg.warmup, "reps": cfg.reps, "min_time": cfg.min_time, "max_reps": cfg.max_reps,
            "max_point_s": cfg.max_point_s, "timeout": cfg.timeout, "prog_id": None,
            "points": [{"index": pt.index, "inputs": [str(p) for p in d.inputs], "output": str(o)}
                       for pt, d, o in zip(points, data, outputs)]}
    rows: dict[int, dict] = {}
    ap = None
    job = None
    failure = None
    startup_failure = None
    try:
        if system in AGG_SYSTEMS:
            try:
                ap = AggregatorProcess(tb, system, cfg.slots, cfg.elems, 1, mode=cfg.mode)
            except Exception as e:
                startup_failure = f"the {system} aggregator did not start: {e}"
                raise _Abort(startup_failure)
            if ap.agg is not None:
                plan["prog_id"] = ap.agg.spec.prog_id
                plan["mode"] = ap.agg.spec.mode
        meta["links"][system] = link_state(tb)
        plan_path = work / f"{system}-plan.json"
        plan_path.write_text(json.dumps(plan))
        prog.note(f"{system}: starting {n} ranks on {rate} x{n}")
        job = launch(tb, system, plan_path, plan, work, cfg)
        pending: dict[int, list[dict]] = {}
        ready: set[int] = set()
        ended = 0
        limit = cfg.start_timeout
        last = time.monotonic()
        while len(rows) < len(points):
            try:
                label, line = job.next(limit - (time.monotonic() - last))
            except queue.Empty:
                what = "did not start" if len(ready) < n else "made no progress"
                failure = f"{system} {what} within {limit:.0f}s"
                if len(ready) < n:
                    startup_failure = failure
                break
            if line is None:
                ended += 1
                if ended == len(job.procs):
                    time.sleep(0.2)
                    failure = job.errors() or f"{system} ranks exited before finishing"
                    if len(ready) < n:
                        startup_failure = failure
                    break
                continue
            if not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            last = time.monotonic()
            if d.get("ready"):
                ready.add(d["rank"])
                if len(ready) == n:
                    limit = max(120.0, 3 * cfg.max_point_s + 4 * cfg.timeout)
                continue
            if "point" in d:
                lst = pending.setdefault(d["point"], [])
                lst.append(d)
                if len(lst) == n:
                    pt = points[d["point"]]
                    row = _measured_row(system, n, pt, rate, rbps, lst)
                    rows[pt.index] = row
                    prog.row(row)
        if failure and job.errors():
            failure = f"{failure}: {job.errors()}" if job.errors() not in failure else failure
    except _Abort as e:
        failure = str(e)
    finally:
        if job is not None:
            job.stop()
        if ap is not None:
            try:
                meta.setdefault("aggregator_stats", {}).setdefault(system, []).append(
                    {"workers": n, "rate": rate, "stats": ap.close()})
            except Exception:
                pass
    shape = packet_shape(system, plan.get("mode"), cfg)
    out = []
    for pt, d, o in zip(points, data, outputs):
        r = rows.get(pt.index)
        if r is None:
            r = _row(system, n, pt, rate, rbps, status="error", reason=failure or "no result")
            prog.row(r)
        else:
            _verify(r, system, o, ref.get(pt.index, d.inputs))
        r.update(shape)
        try:
            o.unlink()
        except FileNotFoundError:
            pass
        out.append(r)
    return out, startup_failure


class _Abort(Exception):
    pass


def packet_shape(system: str, mode: str | None, cfg: BenchConfig) -> dict:
    """How a system's data crossed the testbed: the aggregator's XDP mode and the packets."""
    from . import proto

    if system in AGG_SYSTEMS:
        rec = proto.record_size(cfg.elems)
        mode = mode or "userspace"
        per = min(64, proto.max_records(cfg.elems))
        batch = {"generic": f"UDP_SEGMENT batches of <= {per} x {rec} B records, seen whole by generic XDP",
                 "native": f"{rec} B datagrams (the veth peer segments batches before native XDP)",
                 "userspace": f"UDP_SEGMENT batches of <= {per} x {rec} B records, received with UDP_GRO"}[mode]
        return {"mode": mode, "shape": batch}
    return {"mode": "-", "shape": {"ring": "TCP streams", "gloo": "TCP streams (gloo)",
                                   "mpi": "TCP streams (Open MPI btl tcp)"}.get(system, "-")}


def _verify(row: dict, system: str, output: Path, ref: dict) -> None:
    try:
        raw = np.load(output)
        y = raw.astype(np.float64)
    except Exception as e:
        row.update(status="error", reason=f"no output to check ({e})")
        return
    if "int" in ref:
        bad = np.flatnonzero(raw != ref["int"])
        row["max_abs_err"] = float(np.abs(y - ref["exact"]).max()) if raw.size else 0.0
        row["within_bound"] = not len(bad)
        if len(bad):
            row.update(status="error", reason=f"int32 sum not exact at {len(bad)} elements (first {int(bad[0])})")
        return
    err = np.abs(y - ref["exact"])
    bound = ref["qbound"] if system in AGG_SYSTEMS else ref["fbound"]
    row["max_abs_err"] = float(err.max()) if err.size else 0.0
    row["within_bound"] = bool((err <= bound).all())
    if not row["within_bound"]:
        i = int(np.argmax(err - bound))
        row.update(status="error", reason=f"result outside the error bound at element {i}: "
                                          f"|err| {err[i]:.3g} > {bound[i]:.3g}")


def make_inputs(points: list[Point], workers: int, seed: int, work: Path, elems: int,
                dtype: str = "float32") -> list[PointData]:
    from .cli_worker import make_gradients

    out = []
    for pt in points:
        n = max(1, pt.bytes // 4)
        sd = seed + 7919 * pt.index + 104729 * workers
        grads = make_gradients(workers, n, pt.sparsity, sd, elems)
        if dtype == "int32":
            rng = np.random.default_rng(sd)
            grads = [np.where(g != 0, rng.integers(-(1 << 20), 1 << 20, n, dtype=np.int32), 0).astype(np.int32)
                     for g in grads]
        paths = []
        for r, g in enumerate(grads):
            p = work / f"in{pt.index}-r{r}.npy"
            np.save(p, g)
            paths.append(p)
        out.append(PointData(paths))
    return out


def run(cfg: BenchConfig, argv: list[str] | None = None) -> tuple[list[dict], list[Path]]:
    """The whole sweep; writes results.json, results.csv, meta.json and the plots into cfg.out."""
    from nicoffload.testbed.testbed import running
    from nicoffload.testbed.topology import Link

    from .runner import enable_gro, tempdir

    cfg.out.mkdir(parents=True, exist_ok=True)
    avail: dict[str, str | None] = {}
    versions: dict[str, str] = {}
    for s in cfg.systems:
        avail[s], versions[s] = probe(s, cfg.mpirun)
    meta: dict = {"command": argv, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
                  "systems": {s: {"description": DESCRIPTION[s], "available": avail[s] is None,
                                  "reason": avail[s], "version": versions[s]} for s in cfg.systems},
                  "cpus": os.cpu_count(), "kernel": os.uname().release, "testbeds": []}
    plans = [(rate, n, plan_points(cfg, n)) for rate in cfg.rates for n in cfg.workers]
    total = sum(len(p) for _, _, p in plans) * len(cfg.systems)
    prog = Progress(total)
    for s in cfg.systems:
        if avail[s]:
            prog.note(f"{s}: skipped ({avail[s]})")
    rows: list[dict] = []
    with libbpf.stats_enabled():
        for rate, n, points in plans:
            rbps = rate_bps(rate)
            label = rate_label(rate)
            if all(avail[s] for s in cfg.systems):  # nothing can run: no testbed needed
                for s in cfg.systems:
                    for pt in points:
                        r = _row(s, n, pt, label, rbps, status="skipped", reason=avail[s])
                        rows.append(r)
                        prog.row(r)
                continue
            links = {"agg": Link(rate=n * rbps)} if rbps else None
            prog.note(f"testbed: {n} workers, links {label}" + (f", aggregator {n}x" if rbps else ""))
            tbmeta = {"workers": n, "rate": label, "agg_rate_bps": n * rbps if rbps else None, "links": {}}
            meta["testbeds"].append(tbmeta)
            with running(n, rate=rbps, links=links) as tb, tempdir() as d:
                work = Path(d)
                enable_gro(tb)
                data = make_inputs(points, n, cfg.seed, work, cfg.elems, cfg.dtype)
                ref = Reference(n, cfg.elems)
                for s in cfg.systems:
                    if avail[s]:
                        for pt in points:
                            r = _row(s, n, pt, label, rbps, status="skipped", reason=avail[s])
                            rows.append(r)
                            prog.row(r)
                        continue
                    got, start_fail = run_system(tb, s, points, data, label, rbps, cfg, work, ref, prog, tbmeta)
                    rows += got
                    if start_fail:
                        avail[s] = f"failed to start on an earlier testbed: {start_fail}"
                        meta["systems"][s]["reason"] = start_fail
                    _write(cfg.out, rows, meta)  # partial results survive an interruption
    _write(cfg.out, rows, meta)
    pngs = plot(rows, cfg)
    return rows, pngs


def _write(out: Path, rows: list[dict], meta: dict) -> None:
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in FIELDS})


# --- the table --------------------------------------------------------------------------------
def fmt_size(b: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m and b % m == 0:
            return f"{b // m}{unit}"
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= m:
            return f"{b / m:.3g}{unit}"
    return f"{b}B"


def _fmt_t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f}ms" if s < 1 else f"{s:.3f}s"


def _fmt_row(r: dict) -> str:
    head = f"{r['rate']:>9} N={r['workers']:<2} {fmt_size(r['bytes']):>7} s={r['sparsity']:<4.2f} {r['system']:<9}"
    if r["status"] == "skipped":
        return f"{head} skipped: {r['reason']}"
    if r["status"] == "error" and r["median_s"] is None:
        return f"{head} ERROR: {r['reason']}"
    s = (f"{head} {_fmt_t(r['median_s']):>10} [{_fmt_t(r['min_s'])}..{_fmt_t(r['max_s'])}] "
         f"{r['goodput_bps'] / 1e9:7.3f} Gb/s  cpu {_fmt_t(r['cpu_s'])}")
    if r.get("bpf_ns") is not None:
        s += f"  xdp {r['bpf_ns'] / 1e6:.2f}ms"
    if r.get("bound_fraction") is not None:
        s += f"  {r['bound_fraction']:.0%} of bound"
    if r["status"] == "error":
        s += f"  ERROR: {r['reason']}"
    return s


def table(rows: list[dict]) -> str:
    hdr = (f"{'rate':>9} {'N':>2} {'size':>7} {'sparse':>6} {'system':<9} {'median':>10} {'min':>10} {'max':>10} "
           f"{'goodput':>10} {'cpu/AR':>10} {'xdp/AR':>9} {'bound%':>7} {'reps':>4}  status")
    lines = [hdr, "-" * len(hdr)]
    key = lambda r: (r["rate"] != "unshaped", r["rate_bps"] or 0, r["workers"], r["bytes"], r["sparsity"],  # noqa: E731
                     SYSTEMS.index(r["system"]) if r["system"] in SYSTEMS else 99)
    prev = None
    for r in sorted(rows, key=key):
        grp = key(r)[:5]
        if prev is not None and grp != prev:
            lines.append("")
        prev = grp
        base = f"{r['rate']:>9} {r['workers']:>2} {fmt_size(r['bytes']):>7} {r['sparsity']:>6.2f} {r['system']:<9} "
        if r["median_s"] is None:
            lines.append(base + f"{r['status']}: {r['reason']}")
            continue
        bpf = f"{r['bpf_ns'] / 1e6:.2f}ms" if r.get("bpf_ns") is not None else "-"
        frac = f"{r['bound_fraction']:.0%}" if r.get("bound_fraction") is not None else "-"
        st = "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        lines.append(base + f"{_fmt_t(r['median_s']):>10} {_fmt_t(r['min_s']):>10} {_fmt_t(r['max_s']):>10} "
                     f"{r['goodput_bps'] / 1e9:>5.2f}Gb/s {_fmt_t(r['cpu_s']):>10} {bpf:>9} {frac:>7} "
                     f"{r['reps']:>4}  {st}")
    return "\n".join(lines)


# --- plots ------------------------------------------------------------------------------------
COLORS = {"xdp": "tab:red", "userspace": "tab:orange", "ring": "tab:blue", "gloo": "tab:green", "mpi": "tab:purple"}


def _ok(rows):
    return [r for r in rows if r.get("median_s") is not None]


def _series(ax, rows, xkey, system, xscale=1.0):
    rs = sorted((r for r in rows if r["system"] == system), key=lambda r: r[xkey])
    if not rs:
        return
    x = np.array([r[xkey] * xscale for r in rs], dtype=float)
    y = np.array([r["median_s"] for r in rs])
    lo = y - np.array([r["min_s"] for r in rs])
    hi = np.array([r["max_s"] for r in rs]) - y
    ax.errorbar(x, y * 1e3, yerr=[lo * 1e3, hi * 1e3], marker="o", ms=4, capsize=3, label=system,
                color=COLORS.get(system))


def _bound_lines(ax, xs, fa, fr, xscale=1.0):
    xs = sorted(set(xs))
    if not xs:
        return
    ax.plot([x * xscale for x in xs], [fa(x) * 1e3 for x in xs], "k--", lw=1, label="bound M/R (aggregator)")
    ax.plot([x * xscale for x in xs], [fr(x) * 1e3 for x in xs], "k:", lw=1.2, label="bound 2(N-1)M/(NR) (ring)")


def plot(rows: list[dict], cfg: BenchConfig) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = cfg.out
    ok = _ok(rows)
    rates = list(dict.fromkeys(rate_label(r) for r in cfg.rates))
    systems = [s for s in cfg.systems]
    nc = centre_workers(cfg.workers)
    ref = reference_size(cfg.sizes)
    base = min(cfg.sparsities)
    paths = []

    def panels(title):
        fig, axes = plt.subplots(1, len(rates), figsize=(6.2 * len(rates), 4.6), squeeze=False)
        fig.suptitle(title)
        return fig, axes[0]

    def finish(fig, axes, name):
        for ax in axes:
            h, lab = ax.get_legend_handles_labels()
            if h:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no measurements", ha="center", va="center", transform=ax.transAxes)
            ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    # 1. latency vs size
    fig, axes = panels(f"AllReduce time vs size ({nc} workers, sparsity {base:g}; median, min..max)")
    for ax, rate in zip(axes, rates):
        sel = [r for r in ok if r["rate"] == rate and r["workers"] == nc and r["sparsity"] == base]
        for s in systems:
            _series(ax, sel, "bytes", s)
        rb = rate_bps(rate)
        if rb:
            _bound_lines(ax, [r["bytes"] for r in sel], lambda m: bounds(m, nc, rb)[0],
                         lambda m: bounds(m, nc, rb)[1])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per worker")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"links {rate}" + (f", aggregator {nc}x" if rb else ""))
    finish(fig, axes, "latency_vs_size.png")

    # 2. time vs workers
    fig, axes = panels(f"AllReduce time vs workers ({fmt_size(ref)}, sparsity {base:g})")
    for ax, rate in zip(axes, rates):
        sel = [r for r in ok if r["rate"] == rate and r["bytes"] == ref and r["sparsity"] == base]
        for s in systems:
            _series(ax, sel, "workers", s)
        rb = rate_bps(rate)
        if rb:
            _bound_lines(ax, [r["workers"] for r in sel], lambda n: bounds(ref, n, rb)[0],
                         lambda n: bounds(ref, n, rb)[1])
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"links {rate}")
    finish(fig, axes, "time_vs_workers.png")

    # 3. time vs sparsity
    fig, axes = panels(f"AllReduce time vs sparsity ({nc} workers, {fmt_size(ref)}; fraction of zero 1 KiB blocks)")
    for ax, rate in zip(axes, rates):
        sel = [r for r in ok if r["rate"] == rate and r["bytes"] == ref and r["workers"] == nc]
        for s in systems:
            _series(ax, sel, "sparsity", s)
        rb = rate_bps(rate)
        if rb:
            _bound_lines(ax, [r["sparsity"] for r in sel], lambda s: bounds(ref, nc, rb)[0],
                         lambda s: bounds(ref, nc, rb)[1])
        ax.set_yscale("log")
        ax.set_xlabel("sparsity")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"links {rate}")
    finish(fig, axes, "time_vs_sparsity.png")

    # 4. shaped goodput as a fraction of the bound
    shaped = [r for r in rates if rate_bps(r)]
    fig, axes = plt.subplots(1, max(1, len(shaped)), figsize=(6.2 * max(1, len(shaped)), 4.6), squeeze=False)
    axes = axes[0]
    fig.suptitle(f"Shaped links: goodput as a fraction of the bound ({nc} workers, sparsity {base:g})\n"
                 "xdp/userspace vs M/R, ring/gloo/mpi vs 2(N-1)M/(NR)", fontsize=10)
    for ax, rate in zip(axes, shaped):
        sel = [r for r in ok if r["rate"] == rate and r["workers"] == nc and r["sparsity"] == base
               and r.get("bound_fraction") is not None]
        for s in systems:
            rs = sorted((r for r in sel if r["system"] == s), key=lambda r: r["bytes"])
            if rs:
                ax.plot([r["bytes"] for r in rs], [r["bound_fraction"] for r in rs], marker="o", label=s,
                        color=COLORS.get(s))
        ax.axhline(1.0, color="k", ls="--", lw=1, label="bound")
        burst = tbf_burst_bytes(rate_bps(rate))
        ax.axvline(burst, color="gray", ls=":", lw=1, label=f"tbf bucket ({fmt_size(burst)}): smaller can beat the bound")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, max([1.15] + [r["bound_fraction"] * 1.05 for r in sel]))
        ax.set_xlabel("bytes per worker")
        ax.set_ylabel("fraction of the bound")
        ax.set_title(f"links {rate}, aggregator {nc}x")
    if not shaped:
        axes[0].text(0.5, 0.5, "no shaped rate in this sweep (--rate 1gbit)", ha="center", va="center",
                     transform=axes[0].transAxes)
        axes[0].set_axis_off()
        fig.tight_layout()
        p = out / "shaped_bound_fraction.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    else:
        finish(fig, axes, "shaped_bound_fraction.png")
    return paths


if __name__ == "__main__":
    sys.exit(rank_main())
