"""``nicoffload agg serve`` from the outside, as a client on the network sees it: the token on
every control request (401 and nothing changed without it), 4xx with a reason for bad requests,
jobs admitted, listed, renewed and removed, leases that free a dead job's slots, Prometheus
metrics, the CLI's ``--service``, and nothing left after SIGTERM."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from e2ekit import run_ranks

from nicoffload.errors import CapacityError, InputError, PrivilegeError
from nicoffload.lab.train.torchrun import ServiceProcess, wait_for, write_token
from nicoffload.service.api import JobGrant, JobRequest
from nicoffload.service.client import ServiceClient
from nicoffload.wire import keys
from nicoffload.worker import Communicator


def raw(tb, method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One HTTP request from worker 0's namespace: (status, JSON body)."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with tb.in_host(tb.workers[0]):
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


def granted_sum(tb, grant, xs: list, token: str, timeout: float = 10.0) -> list:
    """Every testbed worker's Communicator for the job the service granted (its key derived from
    the grant's nonce and the service's ``token``, as every rank derives it) sums its xs[r]; the
    results by rank (None where a rank raised)."""
    comms = []
    for r, w in enumerate(tb.workers):
        with tb.in_host(w):
            comms.append(Communicator.from_spec(r, len(xs), grant.aggregator, grant.spec(timeout, token=token),
                                                local_ip=w.ip))
    try:
        outs, _errs = run_ranks(lambda r: comms[r].allreduce(xs[r]), len(xs), 30)
    finally:
        for c in comms:
            c.close()
    return outs


def check_the_grants_key(tb, g, xs: list, token: str, call) -> int:
    """The grant carries the nonce of the job's key, never the key: ranks without the token
    cannot make the job's records (ranks that try anyway are dropped as bad_key). The key."""
    key = g.spec(10.0, token=token).key
    assert key and g.key_nonce and keys.show(key) not in json.dumps(g.to_json())
    with pytest.raises(InputError, match="NICOFFLOAD_TOKEN_FILE"):
        g.spec(10.0)
    outs = granted_sum(tb, g, xs, "not-the-token-of-this-service", timeout=2.0)
    assert outs == [None, None] and call(lambda c: c.stats(g.job))["bad_key"] > 0
    return key


def check_the_clis_key(tb, add: list, token: str, call) -> None:
    """``agg job add --service`` derives the job's key as every rank does, and prints it; it
    refuses --no-key (the service registers no job without a key)."""
    r = tb.run(tb.workers[0], [*add, "--lease", "0", "--json"], capture_output=True, text=True, timeout=60)
    added = json.loads(r.stdout)
    assert r.returncode == 0 and keys.parse(added["key"]) == JobGrant.from_json(added).spec(1, token=token).key
    r = tb.run(tb.workers[0], [*add, "--no-key"], capture_output=True, text=True, timeout=60)
    assert r.returncode == InputError.exit_code and "refuses a job without one" in r.stderr, r.stderr
    call(lambda c: c.remove_job(added["job"]))


def test_the_service_api_tokens_limits_leases_and_metrics(make_testbed, tmp_path):
    tb = make_testbed(2)
    token_file = write_token(tmp_path)
    token = token_file.read_text().strip()
    svc = ServiceProcess(tb, token_file, lease=3.0, slots=2048).start()
    try:
        assert any("plain HTTP" in line and "in clear" in line for line in svc.log), svc.log  # not on loopback
        url = svc.url + "/v1/jobs"
        c = ServiceClient(svc.url, token)

        def call(fn):
            with tb.in_host(tb.workers[0]):
                return fn(c)

        job = {"world": 2, "workers": [w.ip for w in tb.workers], "owner": "test"}
        body = json.dumps(job).encode()
        js = {"Content-Type": "application/json"}
        # no token, a wrong one, another scheme: 401 with a reason, and nothing changes
        for h in ({}, {"Authorization": "Bearer " + "x" * len(token)}, {"Authorization": f"Basic {token}"}):
            status, d = raw(tb, "POST", url, body, {**js, **h})
            assert status == 401 and d["error"], (h, status, d)
        assert raw(tb, "DELETE", url + "/1", None, {"Authorization": "Bearer nope"})[0] == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert raw(tb, "GET", url, None, auth)[1]["jobs"] == []
        # malformed requests: 4xx with a one-line reason, nothing admitted
        for b, h, want in ((b'{"world": 2', js, 400), (b'[1, 2]', js, 400), (b'{"world": 99}', js, 400),
                           (b'{"world": 2, "workers": ["10.0.0.1"]}', js, 400),
                           (b'{"world": 2, "lease_s": 0.5}', js, 400), (b'{"world": 2, "evil": 1}', js, 400),
                           (body, {"Content-Type": "text/plain"}, 415), (b"x" * 70000, js, 413)):
            status, d = raw(tb, "POST", url, b, {**h, **auth})
            assert status == want and "\n" not in d["error"], (b[:40], status, d)
        assert raw(tb, "GET", url + "/abc", None, auth)[0] == 400
        assert raw(tb, "GET", url + "/77", None, auth)[0] == 404
        assert raw(tb, "DELETE", url + "/77", None, auth)[0] == 404
        assert call(lambda c: c.jobs())["jobs"] == []
        # a job: admitted, usable at once, listed with its lease
        g = call(lambda c: c.create_job(JobRequest(world=2, workers=[w.ip for w in tb.workers], owner="t")))
        assert g.slots == 1024 and g.aggregator == tb.agg.ip and g.port == tb.port
        xs = [np.arange(5000, dtype=np.int32) * (r + 1) for r in range(2)]
        key = check_the_grants_key(tb, g, xs, token, call)
        outs = granted_sum(tb, g, xs, token)
        assert all(np.array_equal(o, xs[0] + xs[1]) for o in outs)
        listed = call(lambda c: c.jobs())["jobs"]
        assert [j["job"] for j in listed] == [g.job] and listed[0]["owner"] == "t"
        assert listed[0]["stats"]["completed"] > 0 and keys.show(key) not in json.dumps(listed)
        # the optimizer's parameters and learning rate through the API
        from nicoffload.optim import OptimizerSpec

        o = call(lambda c: c.create_job(JobRequest(world=2, optimizer=OptimizerSpec(lr=0.1), params=600, lease_s=0)))
        p0 = np.linspace(-1, 1, 600)
        call(lambda c: c.set_params(o.job, p0))
        back = call(lambda c: c.params(o.job))
        assert np.abs(back - p0).max() < 1e-8
        assert call(lambda c: c.set_lr(o.job, 0.01))["lr"] == 0.01
        with pytest.raises(InputError):
            call(lambda c: c.set_params(o.job, np.zeros(5)))
        # the pool fills: a refusal naming the room left (409 -> CapacityError)
        with pytest.raises(CapacityError, match="slots"):
            call(lambda c: c.create_job(JobRequest(world=2, slots=4000)))
        # a short pool: the next jobs get half of what is left each, not a refusal (another group's room)
        left = 2048 - g.slots - o.slots
        more = [call(lambda c: c.create_job(JobRequest(world=2, lease_s=0))) for _ in range(2)]
        assert [m.slots for m in more] == [left // 2, (left - left // 2) // 2], (left, more)
        # ... and a request of two lanes is sized as one job, its lanes splitting that equally
        rest = left - sum(m.slots for m in more)
        lanes = call(lambda c: c.create_job(JobRequest(world=2, lanes=2, lease_s=0))).every_lane()
        assert [x.slots for x in lanes] == [min(rest, max(64, rest // 2)) // 2] * 2, (rest, lanes)
        for m in (*more, lanes[0]):
            call(lambda c: c.remove_job(m.job))
        # metrics: per-job counters as labels, the pool, the jobs, the uptime; no token needed
        text = call(lambda c: c.metrics())
        assert f'nicoffload_completions_total{{job="{g.job}"}}' in text
        assert 'nicoffload_dropped_total{job="none",reason="bad_magic"}' in text
        assert re.search(rf'nicoffload_dropped_total{{job="{g.job}",reason="bad_key"}} [1-9]', text)
        assert "nicoffload_pool_slots" in text and "nicoffload_jobs 2.0" in text
        # the CLI talks to the service too
        cli = [sys.executable, "-m", "nicoffload.cli", "agg"]
        where = ["--service", svc.url, "--token-file", str(token_file)]
        r = tb.run(tb.workers[0], [*cli, "job", "list", *where], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "lease" in r.stdout, r.stderr
        check_the_clis_key(tb, [*cli, "job", "add", "--workers", "1", *where], token, call)
        r = tb.run(tb.workers[0], [*cli, "job", "remove", "--job", str(o.job), *where], capture_output=True,
                   text=True, timeout=60)
        assert r.returncode == 0 and "removed" in r.stdout, r.stderr
        bad = tmp_path / "bad"
        bad.write_text("wrong-token-wrong-token\n")
        r = tb.run(tb.workers[0], [*cli, "job", "list", "--service", svc.url, "--token-file", str(bad)],
                   capture_output=True, text=True, timeout=60)
        assert r.returncode == PrivilegeError.exit_code and "refused the token (401)" in r.stderr, r.stderr
        # the job goes silent and nobody renews it: after its lease (3 s) its slots are free
        wait_for(lambda: call(lambda c: c.jobs())["jobs"] == [], 20, "the silent job's removal")
        assert any(f"job {g.job} expired" in line for line in svc.log)
        assert "nicoffload_leases_expired_total 1.0" in call(lambda c: c.metrics())
    finally:
        rc = svc.stop()
    assert rc == 0 and any("nothing left" in line for line in svc.log), svc.log[-5:]
    from nicoffload.agg import control

    assert control.loaded(tb.agg.netns) == []


def test_serve_refuses_what_it_cannot_do_in_one_line(make_testbed, tmp_path):
    tb = make_testbed(1)
    cli = [sys.executable, "-m", "nicoffload.cli", "agg", "serve", "--netns", tb.agg.netns, "--iface", "eth0"]
    short = tmp_path / "short"
    short.write_text("abc\n")
    for extra, words in ((["--listen", f"{tb.agg.ip}:7470", "--token-file", str(tmp_path / "none")], "does not exist"),
                         (["--listen", f"{tb.agg.ip}:7470", "--token-file", str(short)], "at least 16"),
                         (["--listen", "nonsense", "--token-file", str(write_token(tmp_path))], "ADDR:PORT"),
                         (["--listen", "10.99.99.99:7470", "--token-file", str(write_token(tmp_path))],
                          "cannot listen")):
        r = subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and words in r.stderr, (extra, r.stderr)
        assert len([ln for ln in r.stderr.splitlines() if ln.startswith("nicoffload: error")]) == 1
    from nicoffload.agg import control

    assert control.loaded(tb.agg.netns) == []  # the refused listen unloaded what it had loaded


def test_a_service_without_multicast_grants_unicast_jobs(make_testbed, tmp_path):
    """``agg serve --no-multicast`` on a fabric that drops multicast: jobs get unicast delivery
    by default (what the torch backend asks for), a multicast one is refused, and the granted
    job sums exactly."""
    tb = make_testbed(2, multicast=False)
    token_file = write_token(tmp_path)
    svc = ServiceProcess(tb, token_file, extra=["--no-multicast"]).start()
    try:
        c = ServiceClient(svc.url, token_file.read_text().strip())

        def call(fn):
            with tb.in_host(tb.workers[0]):
                return fn(c)

        info = call(lambda c: c.info())
        assert info["multicast"] is False and info["delivery"] == ["unicast"]
        with pytest.raises(InputError, match="no multicast"):
            call(lambda c: c.create_job(JobRequest(world=2, workers=[w.ip for w in tb.workers],
                                                   delivery="multicast")))
        with pytest.raises(InputError, match="every rank's address"):
            call(lambda c: c.create_job(JobRequest(world=2)))
        g = call(lambda c: c.create_job(JobRequest(world=2, workers=[w.ip for w in tb.workers])))
        assert g.delivery == "unicast" and g.spec(10, token=token_file.read_text().strip()).delivery == "unicast"
        xs = [np.random.default_rng(r).standard_normal(70_000).astype(np.float32) for r in range(2)]
        outs = granted_sum(tb, g, xs, token_file.read_text().strip())
        from nicoffload.lab import reference

        want = reference.quantized(xs)
        assert all(o is not None and want.check(o).within_bound for o in outs)
        assert call(lambda c: c.stats(g.job))["copies"] > 0
    finally:
        assert svc.stop() == 0


def test_a_job_the_pool_refuses_is_handed_to_the_afxdp_engine(make_testbed, tmp_path):
    """``agg serve --fallback afxdp``: with the pool full, a job is granted on the AF_XDP engine
    beside the aggregator (same address and port, a rank port past the XDP jobs', slots of its
    own), its ranks sum int32 exactly through the unchanged worker library, it is listed, leased
    and counted like an XDP job, an optimizer job is still refused, and DELETE stops the engine."""
    import subprocess as sp

    from nicoffload.optim import OptimizerSpec
    from nicoffload.wire import proto

    def engines() -> set[int]:
        return {int(p) for p in sp.run(["pgrep", "-f", "aggregator-afxdp"], capture_output=True,
                                       text=True).stdout.split()}

    tb = make_testbed(2)
    token_file = write_token(tmp_path)
    svc = ServiceProcess(tb, token_file, slots=64, extra=["--fallback", "afxdp", "--job-slots", "64"]).start()
    try:
        c = ServiceClient(svc.url, token_file.read_text().strip())

        def call(fn):
            with tb.in_host(tb.workers[0]):
                return fn(c)

        ips = [w.ip for w in tb.workers]
        first = call(lambda c: c.create_job(JobRequest(world=2, workers=ips, owner="xdp")))
        assert (first.engine, first.slots, call(lambda c: c.info())["free_slots"]) == ("xdp", 64, 0)
        with pytest.raises(CapacityError, match="cannot fall back"):
            call(lambda c: c.create_job(JobRequest(world=2, optimizer=OptimizerSpec(lr=0.1), params=100)))
        g = call(lambda c: c.create_job(JobRequest(world=2, workers=ips, owner="fb")))
        assert g.engine == "afxdp" and g.job != first.job and g.group != first.group, g
        assert (g.aggregator, g.port, g.slot_base, g.slots) == (tb.agg.ip, tb.port, 0, 64), g
        assert g.local_port == tb.port + 1 + proto.MAX_JOBS != first.local_port
        rng = np.random.default_rng(5)
        xs = [rng.integers(-(2**30), 2**30, 30 * 256 + 5).astype(np.int32) for _ in range(2)]
        outs = granted_sum(tb, g, xs, token_file.read_text().strip())
        want = (xs[0].astype(np.int64) + xs[1]).astype(np.int32)
        assert all(o is not None and np.array_equal(np.asarray(o).astype(np.int32), want) for o in outs)
        assert call(lambda c: c.renew(g.job))["lease_s"] == 30.0
        wait_for(lambda: call(lambda c: c.stats(g.job))["completed"] > 0, 5, "the engine's counters")
        listed = {j["job"]: j for j in call(lambda c: c.jobs())["jobs"]}
        assert listed[g.job]["engine"] == "afxdp" and listed[first.job]["engine"] == "xdp"
        pid = listed[g.job]["pid"]
        assert listed[g.job]["alive"] and pid in engines() and listed[g.job]["local_port"] == g.local_port
        assert f'nicoffload_job_engine{{engine="afxdp",job="{g.job}"}} 1.0' in call(lambda c: c.metrics())
        d = call(lambda c: c.remove_job(g.job))
        assert d["engine"] == "afxdp" and pid not in engines()
        assert [j["job"] for j in call(lambda c: c.jobs())["jobs"]] == [first.job]
    finally:
        assert svc.stop() == 0
    # the service unloaded its aggregator: nothing of the engine is left beside its state (its
    # lock once was, after the engine's last job had been taken back)
    from nicoffload.agg import fallback

    left = [str(f) for f in fallback.paths(tb.agg.netns, tb.agg.iface).values() if f.exists()]
    assert left == [], left
