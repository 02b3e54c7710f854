"""The systems ``nicoffload bench`` compares: what each is, whether it can run on this machine,
how its rank processes start on a testbed, and how its data crosses the links.

========== =====================================================================================
xdp        nicoffload workers, the XDP aggregator on the aggregator's NIC (UDP, int32 fixed
           point, all-zero blocks skipped)
afxdp      nicoffload workers, the AF_XDP aggregator engine on the aggregator host (same
           protocol): its XDP program steers the job's frames into AF_XDP sockets and a compiled
           poll loop sums them (copy mode on veth); needs gcc and libxdp-dev (xdp/xsk.h). Its
           program takes the aggregator's XDP hook, so it never shares a testbed with the XDP
           aggregator's systems (drive.groups)
userspace  nicoffload workers, the user-space aggregator process (same protocol)
ring       nicoffload.lab.bench.tcpring: Ring AllReduce (reduce-scatter + all-gather) over a TCP ring
           between the workers, float32 summed in float32 with numpy
gloo       torch.distributed ``all_reduce`` with the gloo backend (TCP), if torch imports
mpi        Open MPI ``MPI_Allreduce`` through mpi4py, BTL ``tcp,self`` (the shared-memory BTL
           is excluded: every namespace shares one machine's memory and would bypass the
           network), if mpirun and mpi4py exist
xdpring    nicoffload's ring mode with the ring offload (DirectReduce): every worker's XDP adds
           its staged record into the passing packet and sends it on (UDP, int32 fixed point)
udpring    the same ring protocol with every hop in user space (the user-space UDP ring)
xdpuni     the XDP aggregator with unicast delivery: every result cloned to each rank's address at
           the aggregator's tc ingress (for fabrics without multicast: ``--no-multicast``)
xdptorch   torch.distributed ``all_reduce`` with the backend "nicoffload": the job granted by
           ``nicoffload agg serve`` on the aggregator host (the XDP aggregator), the tensor
           reduced in place like gloo's (its input copied into it first, as for gloo)
xdp16      the XDP aggregator with 16-bit lanes (op SUM16: half the bytes of xdp, the
           precision of half-precision training); the float32 input quantized in the timed call
gloobf16   gloo all-reducing a bfloat16 copy of the gradients, as DDP's ``bf16_compress_hook``
           does; the casts to bfloat16 and back are outside the timed call (favouring gloo)
gloofp16   the same in float16 (``fp16_compress_hook``)
========== =====================================================================================

Ranks: one process per worker namespace running :mod:`nicoffload.lab.bench.ranks` (K of them with
``--ranks-per-host K``: ranks hK..hK+K-1 in worker h; :mod:`.hostranks`); for mpi,
``mpirun`` in worker 0's namespace launching the other ranks through an rsh agent that enters
their namespaces.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from nicoffload.datapath.transport import MAX_GSO_SEGS
from nicoffload.jobspec import JobSpec
from nicoffload.lab.aggregators import on_testbed
from nicoffload.lab.bench.drive import lane_spec, side_spec
from nicoffload.lab.bench.plan import AGG_SYSTEMS, RING_SYSTEMS, BenchConfig
from nicoffload.lab.launcher import RankSpec, program
from nicoffload.lab.rings import capacity_for
from nicoffload.lab.rings import on_testbed as ring_on_testbed
from nicoffload.wire import proto

DESCRIPTION = {
    "xdp": "nicoffload workers + XDP aggregator (UDP, int32 fixed point, zero blocks skipped)",
    "afxdp": ("nicoffload workers + AF_XDP aggregator engine (compiled poll loop over AF_XDP sockets, "
              "copy mode on veth)"),
    "userspace": "nicoffload workers + user-space aggregator (same protocol)",
    "ring": "Ring AllReduce over a TCP ring (reduce-scatter + all-gather), float32 summed in float32",
    "gloo": "torch.distributed all_reduce, gloo backend (TCP)",
    "mpi": "Open MPI MPI_Allreduce via mpi4py, btl tcp,self (no shared memory)",
    "xdpring": "nicoffload ring offload: every worker's XDP adds and forwards (UDP, int32 fixed point)",
    "udpring": "nicoffload user-space UDP ring (the same protocol, every hop in the worker process)",
    "xdptorch": "torch.distributed all_reduce through the nicoffload backend (XDP aggregator via agg serve)",
    "xdpuni": "nicoffload workers + XDP aggregator, unicast delivery (a copy per rank, cloned in tc)",
    "xdp16": "nicoffload workers + XDP aggregator, 16-bit lanes (op SUM16, half the bytes)",
    "gloobf16": "torch.distributed all_reduce of bfloat16 tensors, gloo backend (DDP's bf16 compress hook)",
    "gloofp16": "torch.distributed all_reduce of float16 tensors, gloo backend (DDP's fp16 compress hook)",
}
#: gloo-based systems: torch.distributed over TCP between the workers
GLOO_SYSTEMS = ("gloo", "gloobf16", "gloofp16")
PORT_OFFSET = {"ring": 21, "gloo": 22, "xdptorch": 23, "gloobf16": 24, "gloofp16": 25}  # above the nicoffload port
RANKS = "nicoffload.lab.bench.ranks"


# --- can it run here? -----------------------------------------------------------------------
def _python_check(code: str, timeout: float = 120.0) -> tuple[bool, str]:
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"'{code}' took longer than {timeout:.0f}s"
    if r.returncode != 0:
        return False, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return True, r.stdout.strip()


def _probe_gloo() -> tuple[str | None, str]:
    ok, msg = _python_check("import torch, torch.distributed as d; "
                            "print(torch.__version__ if d.is_available() and d.is_gloo_available() else 'NOGLOO')")
    if not ok:
        if "No module named 'torch'" in msg:
            return "torch is not installed (pip install torch==2.13.0)", ""
        return f"torch does not import: {msg}", ""
    if msg.endswith("NOGLOO"):
        return "this torch build has no gloo backend", msg
    return None, f"torch {msg.splitlines()[-1]}"


def _probe_mpi(mpirun: str) -> tuple[str | None, str]:
    if not shutil.which(mpirun):
        return f"mpirun not found ({mpirun}); apt-get install openmpi-bin python3-mpi4py", ""
    ok, msg = _python_check("import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])", 60)
    if not ok:
        return f"mpi4py is not importable ({msg}); apt-get install python3-mpi4py", ""
    return None, msg


def _probe_afxdp() -> tuple[str | None, str]:
    """The AF_XDP engine is compiled (gcc, libxdp's and libbpf's headers) and its steering
    program is built with bcc, like the XDP aggregator's."""
    from nicoffload.afxdp import build
    from nicoffload.errors import NicoffloadError

    cc = os.environ.get("CC", "gcc")
    if not shutil.which(cc):
        return (f"{cc} not found: the AF_XDP engine is compiled when it starts "
                "(apt-get install gcc libxdp-dev libbpf-dev, or run scripts/setup.sh)"), ""
    for h in build.HEADERS:
        if not Path(h).exists():
            return (f"{h} is missing: the AF_XDP engine needs libxdp-dev and libbpf-dev "
                    "(apt-get install libxdp-dev libbpf-dev, or run scripts/setup.sh)"), ""
    why, _ = probe("xdp")
    if why:
        return why, ""
    try:
        lib = build.library_path()  # built once per source, cached: later starts load it
    except NicoffloadError as e:
        return f"the AF_XDP engine does not build: {str(e).splitlines()[0]}", ""
    return None, f"libxdp, {lib.name}"


def probe(system: str, mpirun: str = "mpirun") -> tuple[str | None, str]:
    """(reason the system cannot run or None, version/description)."""
    if system in ("xdp", "xdpring", "xdpuni", "xdp16"):
        try:
            from nicoffload.ebpf import loader as bpf

            bpf.import_bcc()
        except Exception as e:
            return f"bcc is not importable ({e}); run scripts/setup.sh", ""
        return None, "bcc"
    if system == "afxdp":
        return _probe_afxdp()
    if system in ("userspace", "ring", "udpring"):
        return None, "nicoffload"
    if system in GLOO_SYSTEMS:
        return _probe_gloo()
    if system == "xdptorch":
        why, version = _probe_gloo()
        if why is None:
            why, _ = probe("xdp")
        return why, version
    if system == "mpi":
        return _probe_mpi(mpirun)
    return f"unknown system {system!r}", ""


# --- how its ranks start --------------------------------------------------------------------
def rank_params(tb, system: str, cfg: BenchConfig, side: bool = False) -> dict:
    """What a rank of ``system`` needs beyond the plan: the nicoffload job, or its TCP port.
    ``side``: the system shares the testbed with others (its own job, ports and group:
    drive.side_spec)."""
    place = (lambda s: side_spec(system, s)) if side else (lambda s: s)
    if system in AGG_SYSTEMS:
        spec = place(on_testbed(tb, agg_spec(system, cfg).replace(timeout=cfg.timeout)))
        out = {"aggregator": ",".join(a.ip for a in tb.aggs), "spec": spec.to_dict()}
        if cfg.ranks_per_host > 1 and len(tb.workers) > 1:  # local rank j's job across hosts
            out["lane_specs"] = [lane_spec(spec, j).to_dict() for j in range(cfg.ranks_per_host)]
        return out
    if system in RING_SYSTEMS:
        spec = place(ring_on_testbed(tb, cfg.spec.replace(timeout=cfg.timeout, lanes=32)))  # the ring: 32-bit lanes
        return {"peers": [w.ip for w in tb.workers], "spec": spec.to_dict(), "offload": system == "xdpring",
                "capacity": ring_capacity(cfg)}
    if system == "xdptorch":
        return {"port": tb.port + PORT_OFFSET[system], "spec": cfg.spec.replace(timeout=cfg.timeout).to_dict()}
    if system in PORT_OFFSET:
        return {"port": tb.port + PORT_OFFSET[system]}
    return {}


def agg_spec(system: str, cfg: BenchConfig) -> JobSpec:
    """The job of an aggregator system: xdpuni's results go by unicast, xdp16 sums in 16-bit lanes."""
    if system == "xdpuni":
        return cfg.spec.replace(delivery="unicast")
    if system == "xdp16":
        return cfg.spec.replace(lanes=16)
    return cfg.spec


def agg_kind(system: str) -> str:
    """The aggregator of an aggregator system (lab.aggregators.AggregatorProcess's kind)."""
    return "xdp" if system in ("xdpuni", "xdp16") else system


def ring_capacity(cfg: BenchConfig) -> int:
    """Records per call of the ring programs (and the user-space ring's buffers): one pass for
    the largest size of the sweep."""
    return capacity_for(max(cfg.sizes), cfg.spec.elems)


def job_spec(params: dict) -> JobSpec:
    """The JobSpec :func:`rank_params` handed a rank."""
    return JobSpec.from_dict(params["spec"])


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


def _mpirun(tb, cfg: BenchConfig, work: Path) -> list[str]:
    n, ifc = len(tb.workers), tb.workers[0].iface
    argv = [shutil.which(cfg.mpirun) or cfg.mpirun, "--allow-run-as-root", "-np", str(n),
            "--host", ",".join(f"{w.ip}:1" for w in tb.workers), "--bind-to", "none",
            "--mca", "plm_rsh_agent", str(_mpi_agent(work / "mpi-agent.sh", tb)), "--mca", "plm_rsh_no_tree_spawn", "1",
            # ob1 + tcp only: pml ucx, btl vader, coll sm/han and osc ucx/sm would move data through
            # shared memory (every namespace shares the machine's memory), bypassing the network
            "--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "coll", "^sm,han",
            "--mca", "osc", "^ucx,sm", "--mca", "btl_tcp_if_include", ifc, "--mca", "oob_tcp_if_include", ifc]
    return argv + (["--mca", "mpi_yield_when_idle", "1"] if n > 2 else [])


def rank_hosts(tb, cfg: BenchConfig) -> list:
    """The worker host of every rank: ``ranks_per_host`` consecutive ranks on each."""
    return [w for w in tb.workers for _ in range(cfg.ranks_per_host)]


def rank_specs(tb, system: str, plan_path: Path, params: dict, work: Path, cfg: BenchConfig) -> list[RankSpec]:
    """The processes of one (testbed, system): one rank per worker host (``ranks_per_host`` of
    them, each in its host's namespace), or mpirun."""
    base = program(RANKS) + ["--system", system, "--plan", str(plan_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if system == "mpi":
        return [RankSpec("mpirun", tb.workers[0], _mpirun(tb, cfg, work) + base, env)]
    specs = []
    for rank, w in enumerate(rank_hosts(tb, cfg)):
        e = dict(env)
        if system in GLOO_SYSTEMS or system == "xdptorch":
            e.update(GLOO_SOCKET_IFNAME=w.iface, MASTER_ADDR=tb.workers[0].ip, MASTER_PORT=str(params["port"]))
        if system == "xdptorch":
            e.update(NICOFFLOAD_SERVICE=params["service"], NICOFFLOAD_TOKEN_FILE=params["token_file"],
                     NICOFFLOAD_TIMEOUT=str(cfg.timeout), NICOFFLOAD_LANES=str(cfg.spec.lanes))
        specs.append(RankSpec(f"rank {rank}", w, base + ["--rank", str(rank)], e))
    return specs


# --- how its data crosses the links ---------------------------------------------------------
def packet_shape(system: str, mode: str | None, spec: JobSpec) -> dict:
    """The aggregator's (or the ring programs') XDP mode and the packets of a system, for the rows."""
    if system in RING_SYSTEMS:
        rec = proto.record_size(spec.elems)
        per = min(MAX_GSO_SEGS, proto.max_records(spec.elems))
        xdp = system == "xdpring"
        seen = {"generic": "seen whole by generic XDP on every hop", "native": "one datagram per XDP run"}.get(
            mode, "") if xdp else "received with UDP_GRO"
        return {"mode": mode if xdp else "userspace",
                "shape": f"UDP_SEGMENT batches of <= {per} x {rec} B records around the ring, {seen}"}
    if system not in AGG_SYSTEMS and system != "xdptorch":
        return {"mode": "-", "shape": {"ring": "TCP streams", "gloo": "TCP streams (gloo)",
                                       "gloobf16": "TCP streams (gloo), bfloat16",
                                       "gloofp16": "TCP streams (gloo), float16",
                                       "mpi": "TCP streams (Open MPI btl tcp)"}.get(system, "-")}
    rec = proto.record_size(spec.elems)
    per = min(MAX_GSO_SEGS, proto.max_records(spec.elems))
    mode = mode or "userspace"
    batch = {"generic": f"UDP_SEGMENT batches of <= {per} x {rec} B records, seen whole by generic XDP",
             "native": f"{rec} B datagrams (the veth peer segments batches before native XDP)",
             "userspace": f"UDP_SEGMENT batches of <= {per} x {rec} B records, received with UDP_GRO",
             "afxdp": f"UDP_SEGMENT batches of <= {per} x {rec} B records, steered whole into AF_XDP sockets "
                      f"(copy mode on veth) and gathered from UMEM frames"}[mode]
    return {"mode": mode, "shape": batch}
