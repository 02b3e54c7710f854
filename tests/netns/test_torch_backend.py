"""The torch.distributed backend "nicoffload" as a user runs it: one ``torchrun --nnodes N
--nproc-per-node 1`` per testbed host (the master on worker 0), ``nicoffload agg serve`` on the
aggregator host, and a script whose only change from gloo is ``init_process_group("nicoffload")``
(tests/netns/torchrun_job.py, which checks every result on every rank). Every test stops the
service, which must leave nothing behind."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from nicoffload.agg import control as aggregator  # noqa: E402
from nicoffload.lab.launcher import Launch  # noqa: E402
from nicoffload.lab.train.torchrun import ServiceProcess, torchrun_specs, wait_for, write_token  # noqa: E402
from nicoffload.service.client import ServiceClient  # noqa: E402

JOB = Path(__file__).with_name("torchrun_job.py")


@pytest.fixture
def service(make_testbed, tmp_path):
    """``make(workers, **service_kwargs)`` -> (testbed, running service); stopped at the end, and
    checked to leave no aggregator behind."""
    made = []

    def make(workers: int, **kw):
        tb = make_testbed(workers)
        svc = ServiceProcess(tb, write_token(tmp_path / f"tok{len(made)}"), **kw).start()
        made.append((tb, svc))
        return tb, svc

    yield make
    for tb, svc in made:
        rc = svc.stop()
        assert rc == 0, "\n".join(svc.log[-20:])
        assert aggregator.loaded(tb.agg.netns) == [], "the service left an aggregator loaded"
        assert any("nothing left" in line for line in svc.log), svc.log[-5:]


def client(svc) -> ServiceClient:
    return ServiceClient(svc.url, svc.token_file.read_text().strip())


def run(tb, svc, out: Path, args: list[str], env: dict | None = None, timeout: float = 240.0, workers=None,
        nproc: int | list[int] = 1):
    out.mkdir(parents=True, exist_ok=True)
    specs = torchrun_specs(tb, JOB, ["--out", str(out), *args], env={**(svc.env() if svc else {}), **(env or {})},
                           workers=workers, nproc=nproc)
    with Launch(tb, specs) as launch:
        outcomes = launch.wait(time.monotonic() + timeout)
    reports = {}
    for f in sorted(out.glob("rank*.json")):
        d = json.loads(f.read_text())
        reports[d["rank"]] = d
    return outcomes, reports


def failed_checks(reports: dict) -> list:
    return [(r, c["name"], c["detail"]) for r, d in reports.items() for c in d["checks"] if not c["ok"]]


def with_service(client_in_tb, tb, fn):
    with tb.in_host(tb.workers[0]):
        return fn(client_in_tb)


def test_torchrun_collectives_ddp_fsdp_and_the_optimizer(service, tmp_path):
    tb, svc = service(3)
    outcomes, reports = run(tb, svc, tmp_path / "out", ["--phases", "collectives,ddp,fsdp,optimizer"])
    assert sorted(reports) == [0, 1, 2], [o.describe() for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert failed_checks(reports) == []
    assert all(o.ok for o in outcomes), [o.describe() for o in outcomes]
    names = {c["name"] for c in reports[0]["checks"]}
    assert {"ddp-vs-gloo", "fsdp2-vs-gloo", "fsdp1-vs-gloo", "optimizer-offload-vs-sgd", "optimizer-offload-vs-adamw", "new_group",
            "reduce_scatter_tensor-ReduceOp.SUM"} <= names or len(names) > 60
    assert reports[0]["backend"] == "nicoffload" and "aggregator" in reports[0]["group"]
    # every job the run asked for (the default group, the subgroup, the optimizer) is gone
    c = client(svc)
    assert with_service(c, tb, lambda c: c.jobs())["jobs"] == []
    metrics = with_service(c, tb, lambda c: c.metrics())
    assert "nicoffload_completions_total" in metrics and "nicoffload_service_uptime_seconds" in metrics


def test_ring_mode_through_the_backend(service, tmp_path):
    from nicoffload.jobspec import DEFAULT
    from nicoffload.lab.rings import RingPrograms

    tb, svc = service(3)
    spec = DEFAULT.replace(mode="ring", port=tb.port)
    with RingPrograms(tb, spec):
        outcomes, reports = run(tb, svc, tmp_path / "out", ["--phases", "collectives,ddp"],
                                env={"NICOFFLOAD_MODE": "ring"})
    assert sorted(reports) == [0, 1, 2], [o.describe() for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert failed_checks(reports) == []
    assert "ring" in reports[0]["group"]
    assert with_service(client(svc), tb, lambda c: c.jobs())["jobs"] == []  # ring mode asks the service nothing


def test_two_training_jobs_share_one_service_apart(service, tmp_path):
    tb, svc = service(4)
    specs = []
    for i, hosts in enumerate((tb.workers[:2], tb.workers[2:])):
        out = tmp_path / f"job{i}"
        out.mkdir()
        specs += torchrun_specs(tb, JOB, ["--out", str(out), "--phases", "train", "--steps", "60"], env=svc.env(),
                                workers=hosts)
    c = client(svc)
    with Launch(tb, specs) as launch:
        seen = wait_for(lambda: len(with_service(c, tb, lambda c: c.jobs())["jobs"]) == 2, 90,
                        "both jobs registered at the service")
        outcomes = launch.wait(time.monotonic() + 180)
    assert seen and all(o.ok for o in outcomes), [o.describe() for o in outcomes]
    for i in range(2):
        reports = [json.loads(f.read_text()) for f in sorted((tmp_path / f"job{i}").glob("rank*.json"))]
        assert len(reports) == 2 and not any("error" in d for d in reports)
        # the ranks of one job end with the same loss history: same model, same averaged gradients
    assert with_service(c, tb, lambda c: c.jobs())["jobs"] == []


def test_an_unreachable_service_and_a_wrong_token_fail_init_in_one_line(service, tmp_path):
    tb, svc = service(2)
    t0 = time.monotonic()
    outcomes, reports = run(tb, svc, tmp_path / "a", ["--phases", "collectives"],
                            env={"NICOFFLOAD_SERVICE": f"http://{tb.agg.ip}:{svc.port + 1}"}, timeout=120)
    assert not any(o.ok for o in outcomes)
    assert time.monotonic() - t0 < 60
    text = "\n".join(o.stderr for o in outcomes)
    assert f"http://{tb.agg.ip}:{svc.port + 1} is unreachable" in text, text[-2000:]
    bad = tmp_path / "bad.token"
    bad.write_text("not-the-token-at-all-0123\n")
    outcomes, _ = run(tb, svc, tmp_path / "b", ["--phases", "collectives"], env={"NICOFFLOAD_TOKEN_FILE": str(bad)},
                      timeout=120)
    text = "\n".join(o.stderr for o in outcomes)
    assert not any(o.ok for o in outcomes) and "refused the token (401)" in text, text[-2000:]
    assert with_service(client(svc), tb, lambda c: c.jobs())["jobs"] == []


def test_a_rank_killed_mid_training_is_named_and_its_job_freed(service, tmp_path):
    tb, svc = service(3, lease=4.0)
    t0 = time.monotonic()
    outcomes, reports = run(tb, svc, tmp_path / "out", ["--phases", "train", "--steps", "400", "--die-rank", "2",
                                                        "--die-at", "5"],
                            env={"NICOFFLOAD_LIVENESS": "3", "NICOFFLOAD_LEASE": "4"}, timeout=150)
    assert time.monotonic() - t0 < 120
    assert sorted(reports) == [0, 1], [o.describe() + o.stderr[-3000:] for o in outcomes]  # rank 2 died silently
    for r in (0, 1):
        assert "rank 2" in reports[r].get("error", ""), reports[r]
    c = client(svc)
    wait_for(lambda: with_service(c, tb, lambda c: c.jobs())["jobs"] == [], 30, "the dead job's removal")


def test_a_rank_whose_set_up_is_slow_is_not_taken_for_dead(service, tmp_path):
    """A first run compiles the kernels in the group's set-up, 10-20 s on a busy machine, and one
    rank may take that much longer than another (a lane's communicator): it beats all along, so
    the rank that was ready first does not name it gone after NICOFFLOAD_LIVENESS (3 s here)."""
    tb, svc = service(2)
    outcomes, reports = run(tb, svc, tmp_path / "out", ["--phases", "train", "--steps", "10", "--slow-setup", "1:8"],
                            env={"NICOFFLOAD_LIVENESS": "3"}, timeout=150)
    assert sorted(reports) == [0, 1], [o.describe() + o.stderr[-3000:] for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert reports[1]["init_s"] > 8 and "aggregator" in reports[0]["group"], reports[1]


def test_a_rank_killed_in_ring_mode_fails_the_others_naming_it_within_liveness(service, tmp_path):
    """Ring mode: the liveness watcher aborts the ring's call in flight (RingCommunicator.abort),
    so the living ranks fail naming the dead one within NICOFFLOAD_LIVENESS, not after the
    ring's own timeout (or never: the ring waits for a record that cannot come)."""
    from nicoffload.jobspec import DEFAULT
    from nicoffload.lab.rings import RingPrograms

    tb, svc = service(3)
    spec = DEFAULT.replace(mode="ring", port=tb.port)
    out = tmp_path / "out"
    with RingPrograms(tb, spec):
        outcomes, reports = run(tb, svc, out, ["--phases", "train", "--steps", "4000", "--die-rank", "2",
                                               "--die-at", "20"],
                                env={"NICOFFLOAD_MODE": "ring", "NICOFFLOAD_LIVENESS": "3",
                                     "NICOFFLOAD_TIMEOUT": "120"}, timeout=150)
    assert sorted(reports) == [0, 1], [o.describe() + o.stderr[-3000:] for o in outcomes]
    died = float((out / "died2").read_text())
    for r in (0, 1):
        assert "rank 2" in reports[r].get("error", ""), reports[r]
        # LIVENESS (3 s) plus a beat's period and a scheduler's slack; the ring's timeout is 120 s
        assert reports[r]["error_at"] - died < 3 + 7, (r, reports[r]["error_at"] - died)


def test_the_service_killed_and_restarted_mid_training(service, tmp_path):
    tb, svc = service(2)
    out = tmp_path / "out"
    out.mkdir()
    specs = torchrun_specs(tb, JOB, ["--out", str(out), "--phases", "train", "--steps", "1500"], env=svc.env())
    c = client(svc)
    with Launch(tb, specs) as launch:
        wait_for(lambda: with_service(c, tb, lambda c: c.jobs())["jobs"], 90, "the job at the service")
        svc.kill()  # a crash: the aggregator and its job stay pinned
        time.sleep(1.0)
        svc.start()  # takes the aggregator and the job over
        assert any("took over the aggregator" in line for line in svc.log), svc.log
        assert len(with_service(c, tb, lambda c: c.jobs())["jobs"]) == 1
        outcomes = launch.wait(time.monotonic() + 240)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert all(o.ok for o in outcomes), [o.describe() for o in outcomes]
    assert len(reports) == 2 and not any("error" in d for d in reports)
    assert reports[0]["loss"] == pytest.approx(reports[0]["loss"])  # finished its steps with a finite loss
    assert with_service(c, tb, lambda c: c.jobs())["jobs"] == []


@pytest.mark.parametrize("nproc", [1, 2], ids=["1-rank-per-host", "2-ranks-per-host"])
def test_a_job_over_two_services(make_testbed, tmp_path, nproc):
    """NICOFFLOAD_SERVICE=URL1,URL2: a job at each service, every tensor sharded over their
    aggregators (DDP training and the collectives' checks); with two ranks per host, each lane's
    share is sharded over both."""
    tb = make_testbed(2, aggregators=2)
    tok = write_token(tmp_path / "tok")
    svcs = [ServiceProcess(tb, tok, host=h).start() for h in tb.aggs]
    try:
        env = {"NICOFFLOAD_SERVICE": ",".join(s.url for s in svcs), "NICOFFLOAD_TOKEN_FILE": str(tok)}
        out = tmp_path / "out"
        outcomes, reports = run(tb, svcs[0], out, ["--phases", "collectives,ddp"], env=env, nproc=nproc)
        assert sorted(reports) == list(range(2 * nproc)), [o.describe() for o in outcomes]
        assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
        assert failed_checks(reports) == []
        for s in svcs:  # both held the job's shards, and both gave them back
            c = client(s)
            assert with_service(c, tb, lambda c: c.stats())["completed"] > 0
            assert with_service(c, tb, lambda c: c.jobs())["jobs"] == []
    finally:
        for s in svcs:
            assert s.stop() == 0
