"""Helpers of the chaos tests (tests/netns/test_chaos.py): CLI calls, what a test may leave
behind, processes marked by the test, kills at chosen moments, jobs checked exact."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from nicoffload.agg import control as aggregator
from nicoffload.agg.control import Aggregator, pin_dir, state_file
from nicoffload.ebpf import loader as bpf
from nicoffload.errors import NotFoundError
from nicoffload.lab.jobs import run_workers
from nicoffload.testbed import state as tbstate
from nicoffload.testbed.netlink import ipr, list_netns
from nicoffload.wire import keys

CLI = [sys.executable, "-m", "nicoffload.cli"]
#: every process a test starts carries this variable, and so do their children: how orphans are found
MARK = "NICOFFLOAD_CHAOS_MARK"
#: seconds an orphan may take to die after its parent was killed
ORPHAN_GRACE = 5.0


# --- what is left ---------------------------------------------------------------------------------
def cli(*args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, (r.args, r.returncode, r.stderr[-3000:])
    return r


def one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, (r.args, r.returncode, err[-3000:])
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err


def xdp_attached(namespaces: list[str]) -> list[str]:
    """Every interface in ``namespaces`` with an XDP program attached."""
    out = []
    for ns in namespaces:
        try:
            with ipr(ns) as sock:
                for link in sock.get_links():
                    xdp = link.get_attr("IFLA_XDP")
                    if xdp is not None and xdp.get_attr("IFLA_XDP_PROG_ID"):
                        out.append(f"XDP program {xdp.get_attr('IFLA_XDP_PROG_ID')} on "
                                   f"{ns}/{link.get_attr('IFLA_IFNAME')}")
        except NotFoundError:  # gone meanwhile
            pass
    return out


def leftovers(name: str) -> list[str]:
    """What is left of the testbed(s) whose name starts with ``name``: namespaces, XDP programs
    attached in them, pin directories, aggregator and testbed state files (temporary ones too)."""
    prefix = f"nco-{name}"
    nss = [ns for ns in list_netns() if ns.startswith(prefix)]
    left = [f"namespace {ns}" for ns in nss] + xdp_attached(nss)
    for what, d, start in (("pins", bpf.PIN_ROOT, prefix), ("aggregator state", aggregator.STATE_DIR, prefix),
                           ("testbed state", tbstate.STATE_DIR, name)):
        if d.is_dir():
            left += [f"{what} {f}" for f in d.iterdir() if f.name.lstrip(".").startswith(start)]
    return left


def agg_leftovers(ns: str, iface: str) -> list[str]:
    """What is left of an aggregator on ``iface`` (its testbed still up)."""
    sf, pdir = state_file(ns, iface), pin_dir(ns, iface)
    left = xdp_attached([ns])
    left += [str(p) for p in (pdir, pdir.parent) if p.exists()]
    left += [str(f) for f in (sf, sf.with_suffix(".tmp"), sf.with_suffix(".lock")) if f.exists()]
    return left


def assert_no_empty_pin_root(wait: float = 1.0) -> None:
    """/sys/fs/bpf/nicoffload is gone, or holds something (other sessions' pins): never left
    empty. Another session may be between making it and filling it, so only a directory that
    stays empty for ``wait`` seconds counts."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if any(bpf.PIN_ROOT.iterdir()):
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"{bpf.PIN_ROOT} was left behind, empty"
        time.sleep(0.05)


def marked(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``MARK=mark``."""
    want = f"{MARK}={mark}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if want in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def wait_orphans_gone(mark: str) -> list[str]:
    """Until no process of ``mark`` is left (ORPHAN_GRACE at most); the command lines of the
    ones that are (then SIGKILLed: they are this test's)."""
    deadline = time.monotonic() + ORPHAN_GRACE
    while (pids := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [cmdline(p) for p in pids]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (or the process gone)."""
    try:
        for t in Path(f"/proc/{pid}/task").iterdir():
            if (t / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "tTZX":
                return False
    except (FileNotFoundError, ProcessLookupError):
        pass
    return True


def holds_program(pid: int, programs: int = 2) -> bool:
    """Process ``pid`` holds ``programs`` loaded BPF programs, so their verification is over. An
    aggregator load has two: ar_aggregate (XDP), then ar_fanout (tc, for unicast delivery)."""
    try:
        return sum(os.readlink(f) == "anon_inode:bpf-prog" for f in Path(f"/proc/{pid}/fd").iterdir()) >= programs
    except OSError:
        return False


def kill_when(p: subprocess.Popen, reached: Callable[[], bool], step: Callable[[], bool] | None = None,
              limit: float = 90.0) -> bool:
    """SIGKILL ``p`` as soon as ``reached()``. Once ``step()`` holds, ``p`` runs in slices of
    about a millisecond and ``reached()`` is checked while it is stopped, so it cannot run past
    a short window unseen (not while the verifier runs: a stop interrupts it, and it starts over).
    Whether ``p`` was killed (False: it ended first)."""
    deadline = time.monotonic() + limit
    stepping = False
    while p.poll() is None:
        assert time.monotonic() < deadline, f"{p.args} never reached the point to kill it"
        stepping = stepping or (step is not None and step())
        if stepping:
            p.send_signal(signal.SIGSTOP)
            while not _stopped(p.pid):
                time.sleep(0.0002)
        if reached():
            p.kill()
            p.wait()
            return True
        if stepping:
            p.send_signal(signal.SIGCONT)
        time.sleep(0.001)
    return False


def interrupt_verification(p: subprocess.Popen, started: Callable[[], bool], times: int = 30) -> int:
    """Once ``started()``, stop and continue ``p`` ``times`` times, 10 ms apart, while it holds no
    loaded program yet (Ctrl-Z and fg, again and again, while the verifier runs; each stop makes
    the verifier give up with EAGAIN). How many stops landed before the program was loaded."""
    while not started():
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.001)
    n = 0
    while n < times and p.poll() is None and not holds_program(p.pid):
        p.send_signal(signal.SIGSTOP)
        while not _stopped(p.pid):
            time.sleep(0.0002)
        p.send_signal(signal.SIGCONT)
        n += 1
        time.sleep(0.01)
    return n


# --- jobs -----------------------------------------------------------------------------------------
#: the key of the job `agg load` registers (given, so that the ranks started later carry it)
KEY = keys.new_key()


def agg_load_args(tb) -> list:
    a = ["agg", "load", "--netns", tb.agg.netns, "--iface", tb.agg.iface, "--workers", len(tb.workers),
         "--group", tb.mcast_group, "--port", tb.port, "--key", keys.show(KEY)]
    for w in tb.workers:
        a += ["--worker-ip", w.ip]
    return a


def agg_where(tb) -> list:
    return ["--netns", tb.agg.netns, "--iface", tb.agg.iface]


def int_inputs(tmp_path: Path, tag: str, world: int, n: int, seed: int) -> tuple[list[Path], list[Path], np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(-100_000, 100_000, n, dtype=np.int32) for _ in range(world)]
    ins = [tmp_path / f"{tag}in{r}.npy" for r in range(world)]
    outs = [tmp_path / f"{tag}out{r}.npy" for r in range(world)]
    for a, p in zip(arrays, ins):
        np.save(p, a)
    return ins, outs, np.sum(np.stack(arrays), axis=0, dtype=np.int32)


def start_workers(tb, ins, outs, reps: int, timeout: float) -> list[subprocess.Popen]:
    n = len(tb.workers)
    return [tb.popen(w, CLI + ["worker", "--rank", str(w.rank), "--world", str(n), "--aggregator", tb.agg.ip,
                               "--group", tb.mcast_group, "--port", str(tb.port), "--local-ip", w.ip,
                               "--input", str(ins[w.rank]), "--output", str(outs[w.rank]), "--timeout",
                               str(timeout), "--reps", str(reps), "--key", keys.show(KEY)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in tb.workers]


def wait_running(tb, procs, rounds: int = 200, timeout: float = 60.0) -> None:
    """Until the ranks have formed an epoch and completed ``rounds`` rounds: in the middle of the job."""
    deadline = time.monotonic() + timeout
    with Aggregator.open(tb.agg.netns, tb.agg.iface) as view:
        while not (view.stats()["epoch_formed"] and view.stats()["completed"] >= rounds):
            dead = [p.stderr.read() for p in procs if p.poll() is not None]
            assert not dead, dead
            assert time.monotonic() < deadline, f"the ranks never got going: {view.stats()}"
            time.sleep(0.05)
    assert all(p.poll() is None for p in procs), "a rank ended before the fault"


def exact_job(tb, tmp_path: Path, tag: str) -> None:
    """A job on the loaded aggregator (all ranks, a fresh start) gives the exact int32 sum."""
    ins, outs, want = int_inputs(tmp_path, tag, len(tb.workers), 70_001, seed=len(tag))
    run_workers(tb, ins, outs, timeout=5, key=KEY)
    for r, out in enumerate(outs):
        assert np.array_equal(np.load(out), want), f"{tag}: rank {r}'s sum is wrong"


def clean_testbed(name: str, env: dict | None = None) -> dict:
    """`nicoffload testbed clean --name-prefix NAME`, then nothing of NAME is left."""
    r = json.loads(ok(cli("testbed", "clean", "--name-prefix", name, "--json", env=env)).stdout)
    assert leftovers(name) == [], f"testbed clean left {leftovers(name)}"
    assert_no_empty_pin_root()
    return r


# --- 1. a worker killed -------------------------------------------------------------------------
