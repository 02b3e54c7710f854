"""Chaos: abrupt kills (SIGKILL, no handler runs) of a worker in the middle of a job, of
`nicoffload agg load` at each of its steps, of a CLI process that owns a whole testbed
(`allreduce`, `demo`), and the aggregator unloaded and reloaded under running workers.

After each: whoever is left fails clearly (exit code and a message naming the cause), never with
a wrong result; `agg unload` / `testbed clean` leave nothing behind (namespaces, attached XDP
programs, pins, state files, orphan processes, empty directories under /sys/fs/bpf/nicoffload);
and the next job is exact. Every name carries the test's uid, or is the random name of a
testbed found by the pid of the process that made it, so other sessions are never touched."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from chaoskit import (
    CLI,
    MARK,
    agg_leftovers,
    agg_load_args,
    agg_where,
    assert_no_empty_pin_root,
    clean_testbed,
    cli,
    cmdline,
    exact_job,
    holds_program,
    int_inputs,
    interrupt_verification,
    kill_when,
    leftovers,
    marked,
    ok,
    one_line_error,
    start_workers,
    wait_orphans_gone,
    wait_running,
)

from nicoffload.agg import control as aggregator
from nicoffload.agg.control import Aggregator, pin_dir, state_file
from nicoffload.ebpf import loader as bpf
from nicoffload.errors import AlreadyExistsError, NotFoundError, ProtocolError, TimeoutError_
from nicoffload.lab.links import enable_gro
from nicoffload.testbed import state as tbstate


@pytest.fixture
def marked_env(uid, tmp_path):
    """(mark, environment, testbed names): the environment of a command the test starts is
    marked and puts its scratch files in tmp_path; the testbeds those commands made (their names
    are added to the list as they are found) are cleaned at the end, whatever happened."""
    from nicoffload.testbed import clean

    mark, names = f"chaos-{uid}", []
    yield mark, dict(os.environ, **{MARK: mark, "NICOFFLOAD_TMP": str(tmp_path)}), names
    wait_orphans_gone(mark)
    for name in names:
        for ns, iface in aggregator.loaded(f"nco-{name}-"):
            aggregator.unload(ns, iface, missing_ok=True)
        clean(name)


# --- killing at a known step ----------------------------------------------------------------------


def test_a_killed_worker_fails_the_others_by_name_and_the_next_run_is_exact(make_testbed, tmp_path, uid):
    """SIGKILL of rank 2 in the middle of a job on an aggregator loaded by `agg load`: the
    others fail with TimeoutError_ naming rank 2 within their timeout; the same job run again on
    the same aggregator is exact; `testbed clean` leaves nothing."""
    tb = make_testbed(3)
    enable_gro(tb)
    ok(cli(*agg_load_args(tb)))
    ins, outs, _ = int_inputs(tmp_path, "long", 3, 1 << 21, seed=1)
    procs = start_workers(tb, ins, outs, reps=500, timeout=2)
    wait_running(tb, procs)
    procs[2].kill()
    t0 = time.monotonic()
    errs = [p.communicate(timeout=30)[1] for p in procs[:2]]
    took = time.monotonic() - t0
    procs[2].wait()
    assert [p.returncode for p in procs[:2]] == [TimeoutError_.exit_code] * 2, errs
    for r, err in enumerate(errs):
        assert f"rank {r}: allreduce timed out" in err and "no contribution from rank(s) 2" in err, err
    assert took < 2 + 8, f"the ranks took {took:.1f}s to give up (timeout 2s)"
    assert not any(o.exists() for o in outs), "a rank of the failed job wrote a result"
    exact_job(tb, tmp_path, "again")
    clean_testbed(f"t{uid}")


# --- 2. agg load killed ---------------------------------------------------------------------------
#: the steps of `agg load` at which it is killed (see the test for what marks each)
LOAD_STEPS = ("starting", "compiling", "loading", "attached", "saving")


def test_agg_load_killed_at_each_step_is_cleaned_by_unload(make_testbed, tmp_path, uid):
    """SIGKILL of `nicoffload agg load` while the interpreter starts, while bcc compiles (the pin
    directory is made), once the maps are pinned (the program is being verified), the moment the
    program is attached (its state not yet saved), and while it writes its state file. Each time:
    `agg status` and a second `agg load` say clearly what is wrong and what to run, never a
    traceback; `agg unload` removes the attached program, the pins, their empty parents and any
    state. Then a load, stopped and continued 30 times while the verifier runs, and a job are exact."""
    tb = make_testbed(2)
    ns, ifc = tb.agg.netns, tb.agg.iface
    pdir, sf = pin_dir(ns, ifc), state_file(ns, ifc)

    def attached() -> bool:
        return bpf.xdp_prog_id(ifc, ns) is not None

    for step in LOAD_STEPS:
        for attempt in range(5):
            t0 = time.monotonic()
            p = subprocess.Popen(CLI + [str(a) for a in agg_load_args(tb)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
            reached, slices = {
                "starting": (lambda: time.monotonic() - t0 > 0.05, None),
                "compiling": (pdir.exists, None),
                "loading": ((pdir / "ar_stats").exists, None),
                "attached": (attached, lambda: holds_program(p.pid)),
                "saving": (attached, lambda: holds_program(p.pid)),
            }[step]
            killed = kill_when(p, reached, slices)
            err = "" if killed else p.stderr.read()
            p.stderr.close()
            if not killed:
                # ended first: on a busy machine this test can be descheduled for longer than the
                # window from the second program's load to the process's exit (the slices start at
                # that load); only there, and that load is whole (it exits 0), so again
                assert step in ("attached", "saving") and p.returncode == 0, f"{step}: agg load ended first: {err}"
                aggregator.unload(ns, ifc)
                continue
            if not (step in ("attached", "saving") and sf.exists()):
                break
            # the kill landed after the state was saved: on a busy machine this test's 1 ms slices
            # can stretch past the window between attach and save; that load is whole, so again
            aggregator.unload(ns, ifc)
        else:
            pytest.fail(f"{step}: five loads of `agg load` ran past the point to kill them")
        if step == "saving":
            # a kill inside the state file's write (microseconds: too narrow to hit) leaves this too
            sf.with_suffix(".tmp").write_text('{"netns": "')
            assert (ns, ifc) in aggregator.loaded(f"nco-t{uid}"), "testbed clean would not unload it"
        left = agg_leftovers(ns, ifc)
        if step == "starting":
            assert left == [], left  # killed long before it makes anything
        else:
            assert pdir.exists() and not sf.exists(), (step, left)
            assert attached() == (step in ("attached", "saving")), (step, left)
        r = cli("agg", "status", *agg_where(tb))
        if left:
            one_line_error(r, NotFoundError.exit_code, "half loaded", "nicoffload agg unload")
        else:
            one_line_error(r, NotFoundError.exit_code, "no aggregator is loaded")
        if step == "attached":
            one_line_error(cli(*agg_load_args(tb)), AlreadyExistsError.exit_code, "nicoffload agg unload")
        r = cli("agg", "unload", *agg_where(tb))
        if left:
            ok(r)
        else:
            one_line_error(r, NotFoundError.exit_code, "nothing is loaded")
        assert agg_leftovers(ns, ifc) == [], f"after a kill while {step}, agg unload left {agg_leftovers(ns, ifc)}"
    p = subprocess.Popen(CLI + [str(a) for a in agg_load_args(tb)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    stops = interrupt_verification(p, (pdir / "ar_stats").exists)
    assert p.wait(120) == 0, p.stderr.read()
    assert stops > 5, f"only {stops} stops landed in the verification (libbpf alone retries 5 times)"
    assert attached() and sf.exists()
    exact_job(tb, tmp_path, "afterkills")
    clean_testbed(f"t{uid}")


# --- 3. the owner of a testbed killed -------------------------------------------------------------
def owned_testbed(pid: int) -> str | None:
    """The name of the testbed process ``pid`` made (its state file records the pid)."""
    for f in tbstate.STATE_DIR.glob("*.json"):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if s.get("pid") == pid:
            return s.get("name")
    return None


class Watched:
    """A CLI command that makes its own testbed, started with the test's mark; ``name`` is its
    testbed's once seen."""

    def __init__(self, args: list, marked: tuple, tmp_path: Path, tag: str):
        self.mark, env, self._names = marked
        self.out, self.err = tmp_path / f"{tag}.stdout", tmp_path / f"{tag}.stderr"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.p = subprocess.Popen(CLI + [str(a) for a in args], stdout=o, stderr=e, env=env)
        self.name: str | None = None

    def saw(self) -> str | None:
        if self.name is None:
            self.name = owned_testbed(self.p.pid)
            if self.name is not None:
                self._names.append(self.name)  # for the fixture's cleanup
        return self.name

    def children(self, word: str) -> list[int]:
        return [pid for pid in marked(self.mark) if pid != self.p.pid and word in cmdline(pid)]

    def finish(self, timeout: float = 120.0) -> tuple[int, str, str]:
        deadline = time.monotonic() + timeout
        while self.p.poll() is None:
            self.saw()
            assert time.monotonic() < deadline, f"{self.p.args} did not finish"
            time.sleep(0.01)
        return self.p.returncode, self.out.read_text(), self.err.read_text()


#: where the owner dies: (command, what must have happened)
OWNER_KILLS = [
    ("allreduce", "testbed"),      # its state file is written, namespaces are being made
    ("allreduce", "aggregator"),   # the XDP aggregator is compiling in the testbed
    ("allreduce", "workers"),      # the worker processes have started
    ("demo", "afxdp"),             # the AF_XDP engine runs (its sockets and XDP link are the process's)
    ("demo", "userspace"),         # the user-space aggregator runs (it said it is ready: its workers run)
]


def test_killed_owner_of_a_testbed_leaves_nothing_after_testbed_clean(tmp_path, marked_env):
    """SIGKILL of `nicoffload allreduce` / `nicoffload demo` at several moments of its testbed's
    life: its children (workers, the AF_XDP engine, the user-space aggregator) die with it; `testbed clean
    --name-prefix` with its testbed's name removes everything (namespaces, attached programs,
    pins, aggregator and testbed state); a plain `nicoffload allreduce` afterwards is exact and
    leaves nothing either, /sys/fs/bpf/nicoffload included."""
    mark, env, _ = marked_env
    ins, _, want = int_inputs(tmp_path, "ar", 2, 1 << 20, seed=3)
    for i, (command, moment) in enumerate(OWNER_KILLS):
        args = (["allreduce", *ins, "-o", tmp_path / "killed.npy"] if command == "allreduce" else
                ["demo", "--workers", "2", "--size", "1MiB", "--reps", "1"])
        w = Watched(args, marked_env, tmp_path, f"kill{i}")
        reached = {
            "testbed": w.saw,
            "aggregator": lambda: w.saw() and (bpf.PIN_ROOT / f"nco-{w.name}-agg").exists(),
            "workers": lambda: w.saw() and len(w.children(" worker ")) == 2,
            "afxdp": lambda: w.saw() and w.children("aggregator-afxdp") and len(w.children(" worker ")) == 2,
            "userspace": lambda: w.saw() and w.children("aggregator-userspace") and len(w.children(" worker ")) == 2,
        }[moment]
        assert kill_when(w.p, reached), f"{command} ended before {moment}: {w.err.read_text()[-2000:]}"
        assert w.name, "the killed command's testbed was not found"
        orphans = wait_orphans_gone(mark)
        assert orphans == [], f"{command} killed at {moment}: its children outlived it: {orphans}"
        if i == 0:  # a lock an AF_XDP engine's aggregator left (as `agg job remove` did once): clean takes it
            aggregator.STATE_DIR.mkdir(parents=True, exist_ok=True)
            (aggregator.STATE_DIR / f"nco-{w.name}-agg__eth0.afxdp.lock").touch()
        r = clean_testbed(w.name, env)
        assert r["busy"] == {}, r
    # the next job, on a fresh testbed
    w = Watched(["allreduce", *ins, "-o", tmp_path / "sum.npy", "--json"], marked_env, tmp_path, "final")
    rc, out, err = w.finish()
    assert rc == 0, err
    assert np.array_equal(np.load(tmp_path / "sum.npy"), want)
    assert w.name and leftovers(w.name) == [], leftovers(w.name or "?")
    assert_no_empty_pin_root()


# --- 4. the aggregator reloaded under running workers ----------------------------------------
def test_aggregator_unloaded_and_reloaded_under_running_workers(make_testbed, tmp_path, uid):
    """`agg unload` and `agg load` again while three ranks are in the middle of a job: their
    retransmissions reach the new program, which knows no epoch of theirs; every rank fails with
    a message naming the cause (ProtocolError: the aggregator was reloaded; or TimeoutError_),
    within its timeout of the reload, and writes no result. A new run on the reloaded aggregator
    is exact."""
    timeout = 10.0
    tb = make_testbed(3)
    enable_gro(tb)
    ok(cli(*agg_load_args(tb)))
    ins, outs, _ = int_inputs(tmp_path, "long", 3, 1 << 21, seed=4)
    procs = start_workers(tb, ins, outs, reps=500, timeout=timeout)
    wait_running(tb, procs)
    ok(cli("agg", "unload", *agg_where(tb)))
    ok(cli(*agg_load_args(tb)))
    t_reloaded = time.monotonic()
    errs = [p.communicate(timeout=timeout + 30)[1] for p in procs]
    took = time.monotonic() - t_reloaded
    codes = [p.returncode for p in procs]
    assert set(codes) <= {ProtocolError.exit_code, TimeoutError_.exit_code}, (codes, errs)
    for r, (code, err) in enumerate(zip(codes, errs)):
        last = err.strip().splitlines()[-1]
        if code == ProtocolError.exit_code:
            assert f"rank {r}: the aggregator no longer runs epoch" in last and "reloaded" in last, last
        else:
            assert f"rank {r}: allreduce timed out" in last, last
    assert took < timeout + 5, f"the ranks gave up {took:.1f}s after the reload (timeout {timeout:g}s)"
    assert not any(o.exists() for o in outs), "a rank of the broken job wrote a result"
    if ProtocolError.exit_code in codes:  # told so by the new program: it saw their old epoch
        with Aggregator.open(tb.agg.netns, tb.agg.iface) as view:
            assert view.stats()["stale_epoch"] > 0, view.stats()
    exact_job(tb, tmp_path, "reloaded")
    clean_testbed(f"t{uid}")


# --- 5. nothing left in bpffs ---------------------------------------------------------------------
def test_pin_directories_go_with_their_empty_parents_only(tmp_path, monkeypatch):
    """An aggregator's and a testbed's pin directories are removed with the parents they leave
    empty, up to and including the pin root, never a parent that holds another directory (another
    aggregator's, testbed's or session's). On a pin root of its own (the machine's is shared by
    every session, so it is rarely empty there)."""
    from nicoffload.testbed import netlink

    root = tmp_path / "nicoffload"
    monkeypatch.setattr(bpf, "PIN_ROOT", root)
    monkeypatch.setattr(netlink, "PIN_ROOT", root)
    agg = pin_dir("nco-tx-agg", "eth0")
    fault = root / "nco-tx-br" / "fault"
    assert agg.is_relative_to(root)
    for d in (agg, fault):
        bpf.make_pin_dir(d)
        (d / "pin").touch()
    assert bpf.remove_pin_dir(agg)
    assert not agg.parent.exists() and fault.is_dir(), "a parent in use went, or an empty one stayed"
    assert netlink.remove_pins("nco-tx-br") == [str(root / "nco-tx-br")]
    assert not root.exists(), "the pin root was left behind, empty"
    assert not bpf.remove_pin_dir(agg) and netlink.remove_pins("nco-tx-br") == []


def test_allreduce_with_faults_leaves_nothing_in_bpffs(tmp_path, marked_env):
    """A normal `nicoffload allreduce` with loss and duplication (the aggregator's pins and the
    fault injector's) and a normal `nicoffload demo`: exact / within the bound, and nothing of
    theirs is left, no empty /sys/fs/bpf/nicoffload either."""
    mark, env, _ = marked_env
    ins, _, want = int_inputs(tmp_path, "f", 2, 50_000, seed=5)
    w = Watched(["allreduce", *ins, "-o", tmp_path / "sum.npy", "--drop", "0.02", "--dup", "0.02"], marked_env,
                tmp_path, "faults")
    rc, out, err = w.finish()
    assert rc == 0, err
    assert np.array_equal(np.load(tmp_path / "sum.npy"), want)
    assert w.name and leftovers(w.name) == [], leftovers(w.name or "?")
    assert_no_empty_pin_root()
    w = Watched(["demo", "--workers", "2", "--size", "256KiB", "--reps", "1", "--json"], marked_env, tmp_path, "demo")
    rc, out, err = w.finish()
    assert rc == 0, err
    assert all(run["within_bound"] for run in json.loads(out)["runs"])
    assert w.name and leftovers(w.name) == [], leftovers(w.name or "?")
    assert_no_empty_pin_root()
    assert wait_orphans_gone(mark) == []
