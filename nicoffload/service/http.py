"""The service's HTTP API on aiohttp: routes, the bearer token, one-line JSON errors, size limits.
Every handler runs its :class:`~nicoffload.service.core.Service` call on the service's one
worker thread, so requests never interleave on the maps and the event loop never blocks on them.

    GET    /v1/health                  liveness (no token)
    GET    /metrics                    Prometheus text format (no token)
    GET    /v1/info                    the aggregator: address, port, pool, elements, deliveries
    GET    /v1/jobs                    every job with its share, epoch state, lease and counters
    POST   /v1/jobs                    admit a job (JSON, :class:`~nicoffload.service.api.JobRequest`);
                                       with --fallback afxdp one the pool refuses goes to the AF_XDP
                                       engine (its grant says engine "afxdp")
    GET    /v1/jobs/{job}              one job
    DELETE /v1/jobs/{job}              remove it (its slots are free at once)
    POST   /v1/jobs/{job}/lease        renew its lease
    GET    /v1/jobs/{job}/stats        its counters
    GET    /v1/stats                   every row's counters summed
    PUT    /v1/jobs/{job}/params       an optimizer job's parameters (raw little-endian, ?dtype=float32|float64)
    GET    /v1/jobs/{job}/params       ... read back (float64)
    POST   /v1/jobs/{job}/lr           {"lr": x}: its learning rate from the next step on
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from nicoffload import __version__
from nicoffload.errors import (AlreadyExistsError, CapacityError, InputError, NicoffloadError, NotFoundError,
                               PrivilegeError)
from nicoffload.service import metrics
from nicoffload.service.api import MAX_JSON, MAX_PARAMS_BYTES, PREFIX, JobRequest, finite_number
from nicoffload.service.core import Service

log = logging.getLogger("nicoffload.service")

#: paths anyone may GET without the token
OPEN = {f"{PREFIX}/health", "/metrics"}
#: the error classes and their status
STATUS = ((NotFoundError, 404), (AlreadyExistsError, 409), (CapacityError, 409), (PrivilegeError, 403),
          (InputError, 400))

SERVICE = web.AppKey("service", Service)
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
TOKEN = web.AppKey("token", bytes)
REGISTRY = web.AppKey("registry", object)


def _error(status: int, reason: str, **headers) -> web.Response:
    return web.json_response({"error": reason}, status=status, headers=headers or None)


@web.middleware
async def errors(request: web.Request, handler):
    """Every failure is a JSON body with one line of reason; nothing expected becomes a 500."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.content_type == "application/json":
            raise
        reason = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        return _error(e.status, reason, **{k: v for k, v in e.headers.items() if k == "WWW-Authenticate"})
    except NicoffloadError as e:
        status = next((s for cls, s in STATUS if isinstance(e, cls)), 500)
        if status == 500:
            log.error("%s %s failed: %s", request.method, request.path, e)
        return _error(status, str(e).splitlines()[0])
    except (ValueError, TypeError, OverflowError) as e:
        # a request no check foresaw (its values, not the service, are at fault): a 400 with why
        log.warning("%s %s: a request the checks missed: %s: %s", request.method, request.path,
                    type(e).__name__, e)
        return _error(400, f"malformed request: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


@web.middleware
async def auth(request: web.Request, handler):
    """The bearer token on every request but the open GETs, compared in constant time."""
    if request.method == "GET" and request.path in OPEN:
        return await handler(request)
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return _error(401, "a bearer token is required (Authorization: Bearer <token>)",
                      **{"WWW-Authenticate": 'Bearer realm="nicoffload"'})
    # header bytes that are not UTF-8 arrive as surrogates: compared as bytes, they just differ
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), request.app[TOKEN]):
        log.warning("refused %s %s from %s: wrong token", request.method, request.path, request.remote)
        return _error(401, "wrong token", **{"WWW-Authenticate": 'Bearer realm="nicoffload", error="invalid_token"'})
    return await handler(request)


async def _call(request: web.Request, fn, *args):
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[EXECUTOR], fn, *args)


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length,
                                            text=f"the body holds {request.content_length} bytes; at most {limit}")
    body = bytearray()
    while True:
        chunk = await request.content.read(min(1 << 20, limit + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body),
                                                text=f"the body holds more than {limit} bytes")


async def _json(request: web.Request):
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text=f"send JSON (Content-Type: application/json), not "
                                                f"{request.content_type or 'no content type'}")
    body = await _read_body(request, MAX_JSON)
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"malformed JSON: {e}") from None


def _job_id(request: web.Request) -> int:
    text = request.match_info["job"]
    if not re.fullmatch(r"[0-9]{1,10}", text) or not 1 <= int(text) <= 0xFFFFFFFF:
        raise InputError(f"job id must be 1..{0xFFFFFFFF}, not {text[:40]!r}")
    return int(text)


# --- handlers ---------------------------------------------------------------------------------
async def health(request):
    s = request.app[SERVICE]
    return web.json_response({"ok": True, "version": __version__,
                              "uptime_s": round(time.monotonic() - s.started, 3)})


async def info(request):
    return web.json_response(await _call(request, request.app[SERVICE].info))


async def list_jobs(request):
    return web.json_response(await _call(request, request.app[SERVICE].jobs))


async def create_job(request):
    req = JobRequest.from_json(await _json(request))
    grant = await _call(request, request.app[SERVICE].create_job, req)
    return web.json_response(grant.to_json(), status=201)


async def get_job(request):
    return web.json_response(await _call(request, request.app[SERVICE].job, _job_id(request)))


async def delete_job(request):
    return web.json_response(await _call(request, request.app[SERVICE].remove_job, _job_id(request)))


async def renew(request):
    return web.json_response(await _call(request, request.app[SERVICE].renew, _job_id(request)))


async def job_stats(request):
    return web.json_response(await _call(request, request.app[SERVICE].stats, _job_id(request)))


async def all_stats(request):
    return web.json_response(await _call(request, request.app[SERVICE].stats, None))


async def put_params(request):
    job = _job_id(request)
    dtype = request.query.get("dtype", "float64")
    if dtype not in ("float32", "float64"):
        raise InputError(f"dtype must be float32 or float64, not {dtype!r}")
    body = await _read_body(request, MAX_PARAMS_BYTES)
    size = np.dtype(dtype).itemsize
    if len(body) % size:
        raise InputError(f"{len(body)} bytes are not a whole number of {dtype} values")
    values = np.frombuffer(body, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.float64)
    return web.json_response(await _call(request, request.app[SERVICE].set_params, job, values))


async def get_params(request):
    values = await _call(request, request.app[SERVICE].params, _job_id(request))
    return web.Response(body=values.astype("<f8").tobytes(), content_type="application/octet-stream")


async def set_lr(request):
    d = await _json(request)
    lr = d.get("lr") if isinstance(d, dict) else None
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not finite_number(lr):
        raise InputError('the body must be {"lr": <a finite number>}')
    return web.json_response(await _call(request, request.app[SERVICE].set_lr, _job_id(request), float(lr)))


async def prometheus(request):
    body = await _call(request, metrics.exposition, request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(service: Service, token: bytes, executor: ThreadPoolExecutor) -> web.Application:
    app = web.Application(middlewares=[errors, auth], client_max_size=MAX_PARAMS_BYTES)
    app[SERVICE], app[TOKEN], app[EXECUTOR] = service, token, executor
    app[REGISTRY] = metrics.registry(service.snapshot)
    p = PREFIX
    app.add_routes([
        web.get(f"{p}/health", health), web.get("/metrics", prometheus), web.get(f"{p}/info", info),
        web.get(f"{p}/jobs", list_jobs), web.post(f"{p}/jobs", create_job),
        web.get(f"{p}/jobs/{{job}}", get_job), web.delete(f"{p}/jobs/{{job}}", delete_job),
        web.post(f"{p}/jobs/{{job}}/lease", renew), web.get(f"{p}/jobs/{{job}}/stats", job_stats),
        web.get(f"{p}/stats", all_stats),
        web.put(f"{p}/jobs/{{job}}/params", put_params), web.get(f"{p}/jobs/{{job}}/params", get_params),
        web.post(f"{p}/jobs/{{job}}/lr", set_lr),
    ])
    return app
