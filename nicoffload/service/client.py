"""A client of the aggregator service (the torch backend, ``agg job ... --service``): JSON over
HTTP with the bearer token, standard library only (ranks need nothing more). Every call has a
deadline; an unreachable service, a refused token and a refused request each raise the error a
person can act on, naming the URL."""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from nicoffload.errors import (AlreadyExistsError, CapacityError, InputError, NicoffloadError, NotFoundError,
                               PrivilegeError, SetupError, TimeoutError_)
from nicoffload.service.api import PREFIX, JobGrant, JobRequest


class ServiceUnreachable(SetupError):
    """The service did not answer (refused, unroutable, or silent past the deadline)."""


#: status -> the error class a refusal raises
_BY_STATUS = {400: InputError, 401: PrivilegeError, 403: PrivilegeError, 404: NotFoundError, 409: CapacityError,
              413: InputError, 415: InputError}


def read_token_file(path: str | Path) -> str:
    p = Path(path)
    try:
        token = p.read_text().strip()
    except OSError as e:
        raise SetupError(f"cannot read the service's token from {p}: {e.strerror or e}") from None
    if not token:
        raise InputError(f"the token file {p} is empty")
    return token


class ServiceClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise InputError(f"the service URL must look like http://HOST:PORT, not {url!r}")
        self.url = url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.token = token
        self.timeout = timeout

    @classmethod
    def from_files(cls, url: str, token_file: str | Path | None, timeout: float = 10.0) -> "ServiceClient":
        return cls(url, read_token_file(token_file) if token_file else None, timeout)

    # --- plumbing -----------------------------------------------------------------------------
    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None,
                content_type: str = "application/json", accept_bytes: bool = False):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                payload = r.read()
        except urllib.error.HTTPError as e:
            try:
                reason = json.loads(e.read().decode()).get("error") or e.reason
            except (ValueError, AttributeError, OSError):
                reason = e.reason
            cls = _BY_STATUS.get(e.code, NicoffloadError)
            if e.code == 409 and "already" in str(reason):
                cls = AlreadyExistsError
            what = "refused the token" if e.code == 401 else f"refused {method} {path}"
            raise cls(f"the nicoffload service at {self.url} {what} ({e.code}): {reason}") from None
        except (urllib.error.URLError, socket.timeout, ConnectionError, OSError) as e:
            why = getattr(e, "reason", e)
            if isinstance(why, socket.timeout) or isinstance(e, socket.timeout) or "timed out" in str(why):
                raise TimeoutError_(f"the nicoffload service at {self.url} did not answer {method} {path} "
                                    f"within {self.timeout:g}s") from None
            raise ServiceUnreachable(f"the nicoffload service at {self.url} is unreachable: {why}") from None
        except http.client.HTTPException as e:  # something answered, not in HTTP (a wrong port?)
            raise ServiceUnreachable(f"{self.url} does not answer as a nicoffload service ({type(e).__name__}: "
                                     f"{str(e).strip()[:100]!r}): is it the service's URL?") from None
        if accept_bytes:
            return payload
        try:
            return json.loads(payload.decode()) if payload else None
        except (UnicodeDecodeError, ValueError):
            raise ServiceUnreachable(f"{self.url} answered {method} {path} with something that is not JSON: "
                                     f"is it the service's URL?") from None

    # --- the API ------------------------------------------------------------------------------
    def health(self) -> dict:
        return self.request("GET", f"{PREFIX}/health")

    def info(self) -> dict:
        return self.request("GET", f"{PREFIX}/info")

    def create_job(self, req: JobRequest) -> JobGrant:
        return JobGrant.from_json(self.request("POST", f"{PREFIX}/jobs", req.to_json()))

    def jobs(self) -> dict:
        return self.request("GET", f"{PREFIX}/jobs")

    def job(self, job: int) -> dict:
        return self.request("GET", f"{PREFIX}/jobs/{job}")

    def remove_job(self, job: int) -> dict:
        return self.request("DELETE", f"{PREFIX}/jobs/{job}")

    def renew(self, job: int) -> dict:
        return self.request("POST", f"{PREFIX}/jobs/{job}/lease")

    def stats(self, job: int | None = None) -> dict:
        return self.request("GET", f"{PREFIX}/jobs/{job}/stats" if job is not None else f"{PREFIX}/stats")

    def set_params(self, job: int, values: np.ndarray) -> dict:
        a = np.ascontiguousarray(values, dtype="<f8")
        return self.request("PUT", f"{PREFIX}/jobs/{job}/params?dtype=float64", raw=a.tobytes(),
                            content_type="application/octet-stream")

    def params(self, job: int) -> np.ndarray:
        return np.frombuffer(self.request("GET", f"{PREFIX}/jobs/{job}/params", accept_bytes=True), dtype="<f8")

    def set_lr(self, job: int, lr: float) -> dict:
        return self.request("POST", f"{PREFIX}/jobs/{job}/lr", {"lr": lr})

    def metrics(self) -> str:
        return self.request("GET", "/metrics", accept_bytes=True).decode()
