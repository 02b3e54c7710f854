"""NICOFFLOAD_BENCH_PROFILE: every bench rank writes its cProfile, also when the sweep ends it
with SIGTERM (how driven ranks are stopped) and when it fails."""
from __future__ import annotations

import os
import pstats
import signal
import subprocess
import sys
import time


def _rank(tmp_path, plan, system="xdp", rank="3"):
    env = {**os.environ, "NICOFFLOAD_BENCH_PROFILE": str(tmp_path / "prof")}
    return subprocess.Popen([sys.executable, "-m", "nicoffload.lab.bench.ranks", "--system", system,
                             "--plan", str(plan), "--rank", rank], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _loads(path) -> pstats.Stats:
    assert path.exists() and path.stat().st_size > 0, f"no profile at {path}"
    return pstats.Stats(str(path))


def test_a_rank_stopped_with_sigterm_leaves_its_profile(tmp_path):
    plan = tmp_path / "plan.fifo"
    os.mkfifo(plan)  # reading the plan blocks: the rank is inside main when SIGTERM comes
    p = _rank(tmp_path, plan)
    try:
        time.sleep(1.5)  # imports done, blocked on the FIFO
        assert p.poll() is None, p.stderr.read().decode()
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGTERM)  # a second one (the launcher may send it) must not cut the dump
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    st = _loads(tmp_path / "prof" / "xdp-rank3.prof")
    assert any(fn[2] == "_run" and fn[0].endswith("ranks.py") for fn in st.stats)


def test_a_sigterm_during_the_dump_does_not_cut_it_short(tmp_path, monkeypatch):
    """The launcher's SIGTERM can come while a rank that has finished writes its profile."""
    import cProfile

    from nicoffload.lab.bench import ranks

    dump = cProfile.Profile.dump_stats

    def dump_with_a_sigterm(self, path):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, before the first byte is written
        dump(self, path)

    monkeypatch.setattr(ranks, "_run", lambda args: 0)
    monkeypatch.setattr(cProfile.Profile, "dump_stats", dump_with_a_sigterm)
    monkeypatch.setenv("NICOFFLOAD_BENCH_PROFILE", str(tmp_path / "prof"))
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert ranks.main(["--system", "xdp", "--plan", "unused.json", "--rank", "2"]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    _loads(tmp_path / "prof" / "xdp-rank2.prof")


def test_a_rank_that_fails_still_writes_its_profile(tmp_path):
    p = _rank(tmp_path, tmp_path / "missing.json", system="gloo", rank="0")
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and b"missing.json" in err
    _loads(tmp_path / "prof" / "gloo-rank0.prof")


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("NICOFFLOAD_BENCH_PROFILE", raising=False)
    p = subprocess.run([sys.executable, "-m", "nicoffload.lab.bench.ranks", "--system", "xdp",
                        "--plan", str(tmp_path / "missing.json")], capture_output=True, cwd=tmp_path, timeout=60)
    assert p.returncode != 0
    assert not list(tmp_path.rglob("*.prof"))
