"""Jobs the XDP pool refuses, served by the AF_XDP engine beside it (``agg job add --fallback
afxdp``), as ATP falls back to its parameter server when the switch has no room.

The XDP aggregator stays attached: a handed-off job's id goes into its ``ar_xsk_jobs`` map, and
the program redirects that job's frames into its pinned XSKMAP (``ar_xsks``) instead of counting
them as no job's. An engine process (``nicoffload aggregator-afxdp --xsk-map``), started in the
aggregator's namespace and detached from the command that started it, puts its AF_XDP sockets
into that map and serves the job. A record next to the aggregator's state names each handed-off
job's process, its log and its counters file; ``agg job remove`` and ``agg unload`` stop it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from nicoffload.errors import NotFoundError, SetupError
from nicoffload.lab.launcher import CLI

#: seconds an engine may take to say it is ready (the first build of engine.c included)
START_TIMEOUT = 60.0
#: seconds an engine has to stop on SIGTERM before it is killed
STOP_TIMEOUT = 5.0


def _record_path(netns: str | None, iface: str) -> Path:
    from nicoffload.agg.control import state_file

    return state_file(netns, iface).with_suffix(".afxdp.json")


def _read(netns: str | None, iface: str) -> dict[str, dict]:
    p = _record_path(netns, iface)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except ValueError:
        return {}


def _write(netns: str | None, iface: str, rec: dict[str, dict]) -> None:
    p = _record_path(netns, iface)
    if not rec:
        p.unlink(missing_ok=True)
        return
    tmp = p.with_suffix(".tmp-afxdp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, p)


def _alive(pid: int) -> bool:
    """``pid`` runs and is an AF_XDP engine (not a recycled pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"aggregator-afxdp" in cmd


def _files(netns: str | None, iface: str, job: int) -> tuple[Path, Path]:
    base = _record_path(netns, iface).with_suffix("")
    return Path(f"{base}.afxdp-{job}.log"), Path(f"{base}.afxdp-{job}.stats.json")


def hand_off(agg, job: int, workers: int, group: str, worker_ips: list[str], slots: int,
             delivery: str = "multicast") -> dict:
    """Serve ``job`` with an AF_XDP engine beside the XDP aggregator ``agg`` (loaded with pins):
    start the engine, wait until it polls, then steer the job's frames to it. Returns the
    record (engine pid, log, how it runs)."""
    from nicoffload.ebpf import libbpf

    s = agg.spec
    rec = _read(s.netns, s.iface)
    if str(job) in rec and _alive(rec[str(job)]["pid"]):
        raise SetupError(f"job {job} is already served by the AF_XDP engine (pid {rec[str(job)]['pid']})")
    log, stats = _files(s.netns, s.iface, job)
    # by id: the engine runs under `ip netns exec`, whose /sys has no BPF filesystem (and no pins)
    map_id = libbpf.map_info(agg.b["ar_xsks"].map_fd)["id"]
    argv = [*CLI, "aggregator-afxdp", "--iface", s.iface, "--xsk-map", f"id:{map_id}",
            "--workers", str(workers), "--job", str(job), "--port", str(s.port), "--elems", str(s.elems),
            "--slots", str(slots), "--group", group, "--delivery", delivery, "--stats-file", str(stats), "--json"]
    for ip in worker_ips:
        argv += ["--worker-ip", ip]
    if s.netns:
        argv = ["ip", "netns", "exec", s.netns, *argv]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    info = None
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("ready"):
                info = json.loads(line[len("ready"):].strip() or "{}")
        if info is not None or p.poll() is not None:
            break
        time.sleep(0.05)
    if info is None:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait()
        tail = "\n".join(log.read_text().strip().splitlines()[-8:])
        raise SetupError(f"the AF_XDP engine for job {job} did not start; it said:\n{tail}")
    entry = {"job": job, "pid": p.pid, "log": str(log), "stats_file": str(stats), "workers": workers,
             "group": group, "slots": slots, "delivery": delivery, "worker_ips": list(worker_ips), **info}
    rec[str(job)] = entry
    _write(s.netns, s.iface, rec)
    agg.maps.hand_off(job)
    return entry


def _stop(entry: dict) -> None:
    pid = entry["pid"]
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def take_back(agg, job: int) -> dict:
    """Stop serving a handed-off job: its frames are no job's again, its engine stops. Returns
    its record with its last counters."""
    s = agg.spec
    rec = _read(s.netns, s.iface)
    entry = rec.pop(str(job), None)
    if entry is None:
        raise NotFoundError(f"job {job} is not served by the AF_XDP engine on {s.iface}")
    agg.maps.take_back(job)
    _stop(entry)
    entry["last"] = _stats_of(entry)
    for f in (entry["log"], entry["stats_file"]):
        Path(f).unlink(missing_ok=True)
    _write(s.netns, s.iface, rec)
    return entry


def stop_all(netns: str | None, iface: str) -> list[int]:
    """Stop every engine of handed-off jobs on ``iface`` (agg unload); the jobs it stopped."""
    rec = _read(netns, iface)
    for entry in rec.values():
        _stop(entry)
        for f in (entry["log"], entry["stats_file"]):
            Path(f).unlink(missing_ok=True)
    _record_path(netns, iface).unlink(missing_ok=True)
    return [int(j) for j in rec]


def _stats_of(entry: dict) -> dict:
    try:
        return json.loads(Path(entry["stats_file"]).read_text())
    except (OSError, ValueError):
        return {}


def handed_off(netns: str | None, iface: str) -> list[dict]:
    """The handed-off jobs: each record with ``alive`` and the engine's latest counters."""
    out = []
    for entry in _read(netns, iface).values():
        got = _stats_of(entry)
        out.append({**entry, "engine": "afxdp", "alive": _alive(entry["pid"]), "stats": got.get("stats", {}),
                    "engine_stats": got.get("engine", {})})
    return out


def groups_in_use(netns: str | None, iface: str) -> set[str]:
    return {e["group"] for e in _read(netns, iface).values()}
