"""The service's pure parts: job requests checked field by field, leases against a clock, the
backend's configuration from the environment, and the HTTP layer's token and limits on a
stand-in service (aiohttp's test client; the real aggregator is tests/netns/test_service.py)."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nicoffload.errors import InputError, NotFoundError, SetupError
from nicoffload.service.api import MAX_JSON, JobGrant, JobRequest
from nicoffload.service.leases import LeaseBook
from nicoffload.torch.config import BackendConfig
from nicoffload.wire import keys

#: a service's token (keys derive from it)
TOKEN = "0123456789abcdef-a-test-token"


def test_a_good_request_and_its_defaults():
    r = JobRequest.from_json({"world": 3, "workers": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "owner": "me"})
    assert (r.world, r.job, r.slots, r.lease_s, r.delivery) == (3, None, None, None, None)
    assert JobRequest.from_json(r.to_json()) == r


@pytest.mark.parametrize("body, words", [
    ([], "JSON object"), ({}, "world"), ({"world": None}, "world .* is required"),
    ({"world": 1, "params": None, "optimizer": {"lr": 0.1}}, "needs params"),
    ({"world": 0}, "world must be"), ({"world": 33}, "world must be"),
    ({"world": True}, "integer"), ({"world": 2, "workers": ["10.0.0.1"]}, "1 address"),
    ({"world": 1, "workers": ["10.0.0"]}, "IPv4"), ({"world": 1, "group": "10.0.0.1"}, "multicast"),
    ({"world": 1, "lease_s": 1}, "lease_s"), ({"world": 1, "lease_s": float("nan")}, "finite"),
    ({"world": 1, "owner": "a\nb"}, "printable"), ({"world": 1, "delivery": "carrier pigeon"}, "delivery"),
    ({"world": 1, "optimizer": {"kind": "adam"}}, "kind"), ({"world": 1, "optimizer": {"lr": 2}}, "lr"),
    ({"world": 1, "optimizer": {"lr": 0.1}}, "params"), ({"world": 1, "params": 5}, "only for an optimizer"),
    ({"world": 1, "slots": 0}, "slots"), ({"world": 1, "job": -1}, "job"), ({"world": 1, "x": 1}, "unknown"),
    ({"world": 1, "lease_s": 10 ** 400}, "finite"), ({"world": 1, "params": 1, "optimizer": {"kind": []}}, "kind"),
    ({"world": 1, "params": 1, "optimizer": {"lr": -10 ** 400}}, "finite"),
    ({"world": 1, "failovers": -1}, "failovers"),
])
def test_bad_requests_are_refused_naming_the_field(body, words):
    with pytest.raises(InputError, match=words):
        JobRequest.from_json(body)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["world", "workers", "job", "slots", "group", "lease_s", "owner", "optimizer",
                                        "params", "delivery", "zz"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 33), st.floats(), st.text(max_size=5),
                                 st.lists(st.text(max_size=8), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                            st.integers(), max_size=2))))
def test_any_json_is_a_request_or_an_input_error(body):
    try:
        JobRequest.from_json(body)
    except InputError as e:
        assert "\n" not in str(e)


def test_a_grant_carries_what_a_rank_needs():
    g = JobGrant(job=3, world=2, aggregator="10.0.0.100", port=4791, local_port=4794, group="239.77.0.3",
                 slot_base=1024, slots=512, elems=256, lease_s=30.0)
    assert JobGrant.from_json(json.loads(json.dumps(g.to_json()))) == g
    s = g.spec(7.0)
    assert (s.job, s.port, s.local_port, s.group, s.slots, s.timeout) == (3, 4791, 4794, "239.77.0.3", 512, 7.0)
    with pytest.raises(InputError, match="lacks"):
        JobGrant.from_json({"job": 1})


def test_leases_expire_only_without_renewals_and_without_traffic(tmp_path):
    now = [100.0]
    book = LeaseBook(tmp_path / "leases.json", clock=lambda: now[0])
    book.add(1, 10.0, "a")
    book.add(2, 0.0, "forever")
    now[0] += 8
    book.renew(1)
    now[0] += 8
    assert book.expired() == []            # renewed 8 s ago
    book.observe(1, 500)                   # traffic moved: alive
    now[0] += 9
    book.observe(1, 500)                   # no more traffic
    assert book.expired() == []
    now[0] += 2
    assert book.expired() == [1]           # neither for 11 s > 10
    # a restarted service takes the leases back, each with a full lease from now
    again = LeaseBook(tmp_path / "leases.json", clock=lambda: now[0])
    assert again.load({1, 2, 3}) == [1, 2] and again.expired() == []
    assert again.remaining(2) is None and again.get(1).owner == "a"


def test_the_backend_reads_its_environment():
    c = BackendConfig.from_env({"NICOFFLOAD_SERVICE": "http://10.0.0.1:7470", "NICOFFLOAD_TOKEN_FILE": "/t",
                                "NICOFFLOAD_TIMEOUT": "12.5", "NICOFFLOAD_LEASE": "0"})
    assert (c.mode, c.service, c.token_file, c.timeout, c.lease_s, c.liveness) == \
        ("aggregator", "http://10.0.0.1:7470", "/t", 12.5, 0.0, 10.0)
    assert BackendConfig.from_env({"NICOFFLOAD_MODE": "ring"}).mode == "ring"
    # no service: fine for a group on one host (the jobs ask for it, naming NICOFFLOAD_SERVICE)
    assert BackendConfig.from_env({}).service is None
    assert BackendConfig.from_env({"NICOFFLOAD_REQUIRE_OFFLOAD": "1"}).require_offload
    with pytest.raises(InputError, match="NICOFFLOAD_REQUIRE_OFFLOAD"):
        BackendConfig.from_env({"NICOFFLOAD_REQUIRE_OFFLOAD": "maybe"})
    with pytest.raises(InputError, match="NICOFFLOAD_MODE"):
        BackendConfig.from_env({"NICOFFLOAD_MODE": "star"})
    with pytest.raises(InputError, match="NICOFFLOAD_TIMEOUT"):
        BackendConfig.from_env({"NICOFFLOAD_SERVICE": "http://h:1", "NICOFFLOAD_TIMEOUT": "soon"})
    assert (c.nonfinite, BackendConfig.from_env({"NICOFFLOAD_MODE": "ring", "NICOFFLOAD_NONFINITE": "nan"}).nonfinite
            ) == ("refuse", "nan")
    with pytest.raises(InputError, match="NICOFFLOAD_NONFINITE must be refuse or nan"):
        BackendConfig.from_env({"NICOFFLOAD_MODE": "ring", "NICOFFLOAD_NONFINITE": "ignore"})


class FakeService:
    """What the HTTP layer calls, without an aggregator."""

    started = 0.0

    def __init__(self):
        self.jobs_made = []

    def create_job(self, req):
        self.jobs_made.append(req)
        return JobGrant(job=len(self.jobs_made), world=req.world, aggregator="10.0.0.1", port=1, local_port=2,
                        group="239.77.0.1", slot_base=0, slots=8, elems=256, lease_s=30)

    def jobs(self):
        return {"jobs": [], "slots": 8, "free_slots": 8, "unattributed": {}}

    def remove_job(self, job):
        raise NotFoundError(f"job {job} is not registered")

    job = set_lr = remove_job

    def snapshot(self):
        return {"jobs": [], "unattributed": {}, "slots": 8, "free_slots": 8, "uptime_s": 1.0, "leases_expired": 0,
                "failovers_reported": 3}


def test_the_http_layer_token_and_limits():
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import TestClient, TestServer

    from nicoffload.service.http import make_app

    fake = FakeService()
    token = b"0123456789abcdef-token"

    async def go():
        app = make_app(fake, token, ThreadPoolExecutor(1))
        async with TestClient(TestServer(app)) as cl:
            ok = {"Authorization": "Bearer " + token.decode()}
            r = await cl.post("/v1/jobs", json={"world": 2})
            assert r.status == 401 and "bearer" in (await r.json())["error"]
            r = await cl.post("/v1/jobs", json={"world": 2}, headers={"Authorization": "Bearer 0123456789abcdef-tokeN"})
            assert r.status == 401
            assert fake.jobs_made == []
            r = await cl.post("/v1/jobs", json={"world": 2}, headers=ok)
            assert r.status == 201 and (await r.json())["job"] == 1
            r = await cl.post("/v1/jobs", data=b"{" * (MAX_JSON + 1),
                              headers={**ok, "Content-Type": "application/json"})
            assert r.status == 413
            r = await cl.delete("/v1/jobs/5", headers=ok)
            assert r.status == 404 and "job 5" in (await r.json())["error"]
            r = await cl.get("/v1/nothing-here", headers=ok)
            assert r.status == 404 and "error" in await r.json()
            r = await cl.get("/metrics")
            text = await r.text()
            assert r.status == 200 and "nicoffload_jobs 0.0" in text and "nicoffload_failovers_reported_total 3.0" in text
            # hostile requests: a 4xx with its reason, never a 500
            for path in ("/v1/jobs/%C2%B2", "/v1/jobs/" + "9" * 5000, "/v1/jobs/0x10"):
                r = await cl.get(path, headers=ok)
                assert r.status == 400 and "job id" in (await r.json())["error"], path
            r = await cl.post("/v1/jobs", data=b'{"world": 2, "lease_s": 1' + b"0" * 400 + b"}",
                              headers={**ok, "Content-Type": "application/json"})
            assert r.status == 400 and "finite" in (await r.json())["error"]
            r = await cl.post("/v1/jobs/1/lr", data=b'{"lr": Infinity}', headers={**ok, "Content-Type": "application/json"})
            assert r.status == 400 and "finite" in (await r.json())["error"]
            # a token that is not UTF-8 (raw bytes on the wire): refused like any wrong one
            reader, writer = await asyncio.open_connection(cl.host, cl.port)
            writer.write(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
            head = (await reader.read(200)).split(b"\r\n")[0]
            writer.close()
            assert head.startswith(b"HTTP/1.1 401"), head

    asyncio.run(go())


def test_a_url_that_is_not_the_service_is_named():
    """Something that answers, but not in HTTP (a wrong port) or not in JSON: one line naming the URL."""
    import socket
    import threading

    from nicoffload.service.client import ServiceClient, ServiceUnreachable

    srv = socket.create_server(("127.0.0.1", 0))
    answers = [b"SSH-2.0-OpenSSH_9.2\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\n<html"]

    def serve():
        for a in answers:
            c, _ = srv.accept()
            c.recv(4096)
            c.sendall(a)
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        for _ in answers:
            with pytest.raises(ServiceUnreachable, match=f"{url} .*service's URL"):
                ServiceClient(url, token="t", timeout=5).health()
    finally:
        srv.close()
    t.join(5)


def test_every_registered_engine_has_the_whole_interface():
    """Each engine the registry makes defines every member of the Engine protocol itself, with
    the protocol's parameters (mypy checks the types: docs/service.md, Engines)."""
    import inspect
    from types import SimpleNamespace

    from nicoffload.service.engine import Engine, UnknownEngine
    from nicoffload.service.engines import registry

    methods = {n: f for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")}
    assert {"grant", "describe", "stats", "traffic", "release", "admit", "refresh"} <= set(methods)
    assert registry.names() == ["xdp", "afxdp"] and registry.fallbacks() == ["afxdp"]
    for name in registry.names():
        eng = registry.create(name, SimpleNamespace(), LeaseBook(None))
        assert isinstance(eng, Engine) and eng.name == name and eng.title
        for m, f in methods.items():
            own = getattr(type(eng), m, None)
            assert inspect.isfunction(own) and own is not f, f"{name} lacks {m}"
            assert list(inspect.signature(own).parameters) == list(inspect.signature(f).parameters), (name, m)
    with pytest.raises(UnknownEngine, match="xdp, afxdp"):
        registry.create("dpdk", SimpleNamespace(), LeaseBook(None))


class FakeEngine:
    """An engine of ``room`` jobs, in memory."""

    def __init__(self, name: str, room: int):
        self.name, self.title, self.room, self.served = name, f"the {name} engine", room, {}
        self.keys: dict[int, tuple[int, str]] = {}
        self.shares: dict[int, int] = {}  # the slots each job was offered

    def refresh(self):
        pass

    def jobs(self):
        return sorted(self.served)

    def groups(self):
        return set(self.served.values())

    def check_free(self, job, group):
        from nicoffload.errors import AlreadyExistsError

        if job in self.served or group in self.groups():
            raise AlreadyExistsError(f"job {job} or group {group} is taken on {self.name}")

    def admit(self, p):
        from nicoffload.errors import CapacityError
        from nicoffload.service.engine import Admitted

        if len(self.served) >= self.room:
            raise CapacityError(f"{self.name} is full")
        self.served[p.job] = p.group
        self.keys[p.job] = (p.key, p.key_nonce)
        self.shares[p.job] = p.job_slots
        return Admitted(None, f"on {self.name} (after: {p.refused})")

    def grant(self, job):
        return JobGrant(job=job, world=1, aggregator="10.0.0.1", port=1, local_port=2, group=self.served[job],
                        slot_base=0, slots=self.shares[job], elems=256, lease_s=0, engine=self.name,
                        key_nonce=self.keys[job][1])

    def describe(self, job):
        return {"job": job, "engine": self.name}

    def slots(self, job):
        return 1

    def stats(self, job):
        return {"rx": len(self.served) if job is None else 7}

    def traffic(self, job):
        return 7

    def release(self, job):
        from nicoffload.service.engine import Released

        del self.served[job]
        return Released({"job": job, "engine": self.name}, "freed")

    def info(self):
        return {}

    def set_params(self, job, values):
        return {}

    def params(self, job):
        return []

    def set_lr(self, job, lr):
        return {}


def test_the_service_asks_each_jobs_engine_and_falls_back_in_order(tmp_path):
    from types import SimpleNamespace

    from nicoffload.errors import AlreadyExistsError, CapacityError
    from nicoffload.service.core import Service, ServiceConfig
    from nicoffload.service.engine import Engine

    def service(fallback):
        pool, spare = FakeEngine("xdp", 1), FakeEngine("afxdp", 1)
        assert isinstance(pool, Engine)
        agg = SimpleNamespace(table=SimpleNamespace(free_slots=lambda: 0))
        now = [0.0]
        book = LeaseBook(tmp_path / f"{fallback}.json", clock=lambda: now[0])
        return (Service(agg, book, ServiceConfig(fallback=fallback), engines=[pool, spare], token=TOKEN), pool,
                spare, now)

    svc, pool, spare, _ = service(None)
    g = svc.create_job(JobRequest(world=1, failovers=2))  # a group back from its fallback says so
    assert g.engine == "xdp" and svc.failovers_reported == 2
    assert "failovers" not in JobRequest(world=1).to_json()  # an older service is asked as before
    # the engine got the job's key, the grant only its nonce: the key derives from it and the token
    key, nonce = pool.keys[g.job]
    assert key and g.key_nonce == nonce and keys.derive(TOKEN, g.job, nonce) == key == g.spec(1.0, token=TOKEN).key
    assert str(key) not in json.dumps(g.to_json()) and f"{key:016x}" not in json.dumps(g.to_json())
    with pytest.raises(CapacityError, match="xdp is full"):  # no fallback: the refusal stands
        svc.create_job(JobRequest(world=1))
    svc, pool, spare, now = service("afxdp")
    a = svc.create_job(JobRequest(world=1, lease_s=5))
    # the pool is full: job a's id (or group) is still taken, not handed to the fallback beside it
    with pytest.raises(AlreadyExistsError):
        svc.create_job(JobRequest(world=1, job=a.job))
    b = svc.create_job(JobRequest(world=1, lease_s=5))
    assert (a.engine, b.engine, a.group != b.group) == ("xdp", "afxdp", True)
    assert (svc.job(b.job)["engine"], svc.stats(None)["rx"], svc.stats(b.job)["rx"]) == ("afxdp", 2, 7)
    with pytest.raises(CapacityError, match="afxdp is full"):
        svc.create_job(JobRequest(world=1))
    assert svc.remove_job(b.job)["engine"] == "afxdp" and spare.jobs() == [] and svc.leases.get(b.job) is None
    with pytest.raises(NotFoundError, match=f"registered: {a.job}"):
        svc.renew(b.job)
    now[0] += 6  # job a's ranks send nothing (its counter stands at 7): its lease runs out
    assert svc.reap() == [] and svc.leases.expired_total == 0  # first look at its traffic
    now[0] += 6
    assert svc.reap() == [a.job] and pool.jobs() == [] and svc.leases.expired_total == 1


def test_the_lanes_of_one_request_share_one_jobs_slots(tmp_path):
    """A host of 8 ranks asks for 8 lanes: together they take one job's share of the pool (the
    default pool holds four jobs' shares, so 8 lanes of a full share each could never be granted)."""
    from types import SimpleNamespace

    from nicoffload.jobspec import DEFAULT
    from nicoffload.service.core import Service, ServiceConfig

    pool = FakeEngine("xdp", 16)
    agg = SimpleNamespace(table=SimpleNamespace(free_slots=lambda: 0))
    svc = Service(agg, LeaseBook(tmp_path / "l.json"), ServiceConfig(), engines=[pool], token=TOKEN)
    g = svc.create_job(JobRequest(world=2, workers=["10.0.0.2", "10.0.0.3"], lanes=8))
    assert len(g.every_lane()) == 8 and sorted(pool.shares) == sorted(x.job for x in g.every_lane())
    assert set(pool.shares.values()) == {DEFAULT.slots // 8}
    one = svc.create_job(JobRequest(world=2, workers=["10.0.0.2", "10.0.0.3"]))
    assert pool.shares[one.job] == DEFAULT.slots  # a job of one lane: the whole share, as before


def test_a_short_pool_gives_later_jobs_smaller_shares_not_a_refusal():
    """The default pool (4096 slots, 1024 a job): three jobs take full shares, the next ones half
    of what is left, down to MIN_SHARE: eight groups of one job find room instead of four."""
    from nicoffload.jobspec import DEFAULT
    from nicoffload.service.xdp_pool import MIN_SHARE, share

    free, got = 4096, []
    while free:
        got.append(share(DEFAULT.slots, free))
        free -= got[-1]
    assert got == [1024, 1024, 1024, 512, 256, 128, MIN_SHARE, MIN_SHARE]
    assert share(1024, 8192) == 1024 and share(100, 150) == 75 and share(1024, 40) == 40
    assert all(1 <= share(j, f) <= min(j, f) for j in (1, 7, 64, 1024) for f in range(1, 3000, 37))
