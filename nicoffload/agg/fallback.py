"""Jobs the XDP pool refuses, served by the AF_XDP engine beside the aggregator (``agg job add
--fallback afxdp``), as ATP falls back to its parameter server when the switch has no room.

The XDP aggregator stays attached: a handed-off job's id goes into its ``ar_xsk_jobs`` map and
the program redirects that job's frames into its XSKMAP (``ar_xsks``, one socket per rx queue)
instead of counting them as no job's. One engine process per interface serves every handed-off
job (its sockets own the XSKMAP's entries): ``nicoffload aggregator-afxdp --xsk-map id:N
--jobs-file F``, started in the aggregator's namespace and detached from the command that
started it. It serves the jobs listed in F, follows the file as jobs come and go, and writes its
counters every few tenths of a second. A record next to the aggregator's state names the engine
process, its log, its jobs and counters files; ``agg job remove`` and ``agg unload`` stop it.

Nothing here imports the engine: it runs as its own process (the engine is nicoffload.afxdp)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nicoffload.errors import AlreadyExistsError, NotFoundError, SetupError

#: the command line of the engine's process
CLI = [sys.executable, "-m", "nicoffload.cli"]
#: seconds an engine may take to say it is ready (the first build of engine.c included)
START_TIMEOUT = 60.0
#: seconds the engine has to take a job on or let it go (it reads its jobs file every 0.1 s)
CHANGE_TIMEOUT = 10.0
#: seconds an engine has to stop on SIGTERM before it is killed
STOP_TIMEOUT = 5.0


def _base(netns: str | None, iface: str) -> Path:
    from nicoffload.agg.spec import state_file

    return state_file(netns, iface).with_suffix("")


def paths(netns: str | None, iface: str) -> dict[str, Path]:
    b = str(_base(netns, iface))
    return {"record": Path(f"{b}.afxdp.json"), "jobs": Path(f"{b}.afxdp-jobs.json"),
            "stats": Path(f"{b}.afxdp-stats.json"), "log": Path(f"{b}.afxdp.log"),
            "lock": Path(f"{b}.afxdp.lock")}


@contextlib.contextmanager
def _locked(netns: str | None, iface: str):
    p = paths(netns, iface)["lock"]
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _read_json(p: Path, default):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return default


def _write_json(p: Path, value) -> None:
    """Atomically, readable by its owner only (the jobs file holds the jobs' keys)."""
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(json.dumps(value))
    os.replace(tmp, p)


def _public(entry: dict) -> dict:
    """A handed-off job's entry as listings show it: without its key and the key's nonce."""
    return {**{k: v for k, v in entry.items() if k not in ("key", "key_nonce")}, "keyed": bool(entry.get("key"))}


def _alive(pid: int | None) -> bool:
    """``pid`` runs and is an AF_XDP engine (not a recycled pid)."""
    if not pid:
        return False
    try:
        return b"aggregator-afxdp" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _engine_stats(p: dict[str, Path]) -> dict:
    return _read_json(p["stats"], {})


def _wait_for(p: dict[str, Path], pid: int, cond, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _engine_stats(p)
        if cond(got):
            return got
        if not _alive(pid):
            break
        time.sleep(0.05)
    tail = "\n".join(_read_json_text(p["log"]).strip().splitlines()[-8:])
    raise SetupError(f"the AF_XDP engine did not {what}; its log ({p['log']}) ends:\n{tail}")


def _read_json_text(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _start(agg, p: dict[str, Path], extra: list[str]) -> dict:
    """Start the interface's engine on the jobs file; its record once it polls."""
    from nicoffload.ebpf import libbpf

    s = agg.spec
    # the XSKMAP by id: the engine runs under `ip netns exec`, whose /sys has no BPF filesystem
    map_id = libbpf.map_info(agg.b["ar_xsks"].map_fd)["id"]
    argv = [*CLI, "aggregator-afxdp", "--iface", s.iface, "--xsk-map", f"id:{map_id}", "--port", str(s.port),
            "--elems", str(s.elems), "--jobs-file", str(p["jobs"]), "--stats-file", str(p["stats"]), *extra]
    if s.netns:
        argv = ["ip", "netns", "exec", s.netns, *argv]
    p["stats"].unlink(missing_ok=True)
    with open(p["log"], "w") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    info = None
    try:
        while time.monotonic() < deadline and info is None and proc.poll() is None:
            for line in _read_json_text(p["log"]).splitlines():
                if line.startswith("ready"):
                    info = json.loads(line[len("ready"):].strip() or "{}")
            time.sleep(0.05)
    except BaseException:  # interrupted (Ctrl-C) while it starts: it is in a session of its own
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        raise
    if info is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        tail = "\n".join(_read_json_text(p["log"]).strip().splitlines()[-8:])
        raise SetupError(f"the AF_XDP engine on {s.iface} did not start; it said:\n{tail}")
    rec = {"pid": proc.pid, "log": str(p["log"]), "stats_file": str(p["stats"]), "jobs_file": str(p["jobs"]),
           **info}
    _write_json(p["record"], rec)
    return rec


def _stop(pid: int | None) -> None:
    if not pid:
        return
    if _alive(pid):
        _end(pid)
    # started by this process (a service): collect its exit status (it is a zombie by now, not
    # "alive"), or it lingers; someone else's child: nothing to collect
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _end(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.01)


def hand_off(agg, job: int, workers: int, group: str, worker_ips: list[str], slots: int,
             delivery: str = "multicast", tx: str | None = None, key: int = 0, key_nonce: str = "") -> dict:
    """Serve ``job`` (its ``key``: 0, none; ``key_nonce``: a service's, for its grants) by the
    AF_XDP engine beside the XDP aggregator ``agg`` (loaded, pinned): start the interface's
    engine unless it runs (``tx``: how its results leave, its default unless given; an engine
    that runs keeps its own), make it take the job, then steer the job's frames to it. Returns
    the job's entry (with the engine's pid and how it runs; its key stays in the jobs file, which
    only its owner reads)."""
    s = agg.spec
    p = paths(s.netns, s.iface)
    with _locked(s.netns, s.iface):
        jobs: dict = _read_json(p["jobs"], {})
        if str(job) in jobs:
            raise AlreadyExistsError(f"job {job} is already served by the AF_XDP engine on {s.iface}")
        entry = {"job": job, "workers": workers, "group": group, "slots": slots, "delivery": delivery,
                 "worker_ips": list(worker_ips), "key": key, "key_nonce": key_nonce}
        _write_json(p["jobs"], {**jobs, str(job): entry})
        try:
            rec = _read_json(p["record"], {})
            if not _alive(rec.get("pid")):
                rec = _start(agg, p, ["--tx", tx] if tx else [])
            got = _wait_for(p, rec["pid"], lambda st: str(job) in st.get("jobs", {}) or str(job) in st.get("refused", {}),
                            CHANGE_TIMEOUT, f"take job {job}")
            if str(job) in got.get("refused", {}):
                raise SetupError(f"the AF_XDP engine refused job {job}: {got['refused'][str(job)]}")
        except BaseException:
            _write_json(p["jobs"], jobs)
            if not jobs:
                _stop(_read_json(p["record"], {}).get("pid"))
                _cleanup(p)
            raise
        agg.maps.hand_off(job)
        return {**_public(entry), **{k: v for k, v in rec.items() if k not in entry}}


def take_back(agg, job: int) -> dict:
    """Stop serving a handed-off job: its frames are no job's again; the engine lets it go (and
    stops with its last job). Returns the job's entry with its last counters (``last``)."""
    s = agg.spec
    p = paths(s.netns, s.iface)
    with _locked(s.netns, s.iface):
        jobs: dict = _read_json(p["jobs"], {})
        entry = jobs.pop(str(job), None)
        if entry is None:
            raise NotFoundError(f"job {job} is not served by the AF_XDP engine on {s.iface}")
        agg.maps.take_back(job)
        rec = _read_json(p["record"], {})
        entry["last"] = _engine_stats(p).get("jobs", {}).get(str(job), {})
        entry["pid"] = rec.get("pid")
        _write_json(p["jobs"], jobs)
        if not jobs:
            _stop(rec.get("pid"))
            _cleanup(p)
        elif _alive(rec.get("pid")):
            _wait_for(p, rec["pid"], lambda st: str(job) not in st.get("jobs", {}), CHANGE_TIMEOUT, f"let job {job} go")
        return _public(entry)


def _cleanup(p: dict[str, Path]) -> None:
    for k in ("record", "jobs", "stats", "log"):
        p[k].unlink(missing_ok=True)


def stop_all(netns: str | None, iface: str) -> list[int]:
    """Stop the engine of the handed-off jobs on ``iface`` (agg unload); the jobs it served."""
    p = paths(netns, iface)
    jobs: dict = {}
    if p["record"].exists() or p["jobs"].exists():
        with _locked(netns, iface):
            jobs = _read_json(p["jobs"], {})
            _stop(_read_json(p["record"], {}).get("pid"))
            _cleanup(p)
    # the lock outlives the engine of jobs that were all taken back (agg job remove): it goes
    # with the aggregator
    p["lock"].unlink(missing_ok=True)
    return [int(j) for j in jobs]


def handed_off(netns: str | None, iface: str) -> list[dict]:
    """The handed-off jobs: each entry with the engine's pid, ``alive``, and its latest counters
    (``stats``)."""
    p = paths(netns, iface)
    jobs = _read_json(p["jobs"], {})
    if not jobs:
        return []
    rec = _read_json(p["record"], {})
    st = _engine_stats(p)
    alive = _alive(rec.get("pid"))
    return [{**_public(e), "engine": "afxdp", "pid": rec.get("pid"), "log": rec.get("log"), "alive": alive,
             "stats": st.get("jobs", {}).get(j, {}), "engine_stats": st.get("engine", {})}
            for j, e in sorted(jobs.items(), key=lambda kv: int(kv[0]))]


def key_nonce(netns: str | None, iface: str, job: int) -> str:
    """The key nonce of a handed-off job ("" when it has none, or is not handed off): a service's
    grant carries it."""
    return str(_read_json(paths(netns, iface)["jobs"], {}).get(str(job), {}).get("key_nonce", ""))


def groups_in_use(netns: str | None, iface: str) -> set[str]:
    return {e["group"] for e in _read_json(paths(netns, iface)["jobs"], {}).values()}
