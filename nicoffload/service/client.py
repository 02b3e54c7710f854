"""A client of the aggregator service (the torch backend, ``agg job ... --service``): JSON over
HTTP or HTTPS with the bearer token, standard library only (ranks need nothing more). An
``https://`` service's certificate is verified against ``NICOFFLOAD_CA_FILE`` (or ``ca_file``),
else the system's CAs, with its host name. Every call has a deadline; an unreachable service, a
certificate that does not verify, a refused token and a refused request each raise the error a
person can act on, naming the URL."""
from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
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


#: the environment variable naming the CA file a service's certificate is verified against
CA_ENV = "NICOFFLOAD_CA_FILE"


def tls_client_context(ca_file: str | Path | None) -> ssl.SSLContext:
    """Certificate and host name verification against ``ca_file`` (PEM), else the system's CAs."""
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except FileNotFoundError:
        raise SetupError(f"the CA file {ca_file} ({CA_ENV}) does not exist") from None
    except (ssl.SSLError, OSError) as e:
        raise SetupError(f"the CA file {ca_file} ({CA_ENV}) does not load as PEM certificates: "
                         f"{getattr(e, 'reason', None) or e}") from None


class ServiceClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 10.0,
                 ca_file: str | Path | None = None):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise InputError(f"the service URL must look like http://HOST:PORT or https://HOST:PORT, not {url!r}")
        self.url = url.rstrip("/")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file if ca_file is not None else (os.environ.get(CA_ENV) or None)
        self._tls = tls_client_context(self.ca_file) if u.scheme == "https" else None

    @classmethod
    def from_files(cls, url: str, token_file: str | Path | None, timeout: float = 10.0,
                   ca_file: str | Path | None = None) -> "ServiceClient":
        return cls(url, read_token_file(token_file) if token_file else None, timeout, ca_file)

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
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._tls) as r:
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
            raise self._not_answered(e, method, path) from None
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

    def _not_answered(self, e: BaseException, method: str, path: str) -> NicoffloadError:
        """The error for a request that got no HTTP answer: a certificate that does not verify,
        TLS that failed, a deadline, or a service that cannot be reached."""
        why = getattr(e, "reason", e)
        if isinstance(why, ssl.SSLCertVerificationError):
            against = f"the CA file {self.ca_file} ({CA_ENV})" if self.ca_file else "the system's CAs"
            return SetupError(f"the nicoffload service at {self.url} presented a certificate that {against} does "
                              f"not verify ({why.verify_message}): refused; set {CA_ENV} to the CA that signed the "
                              f"service's certificate")
        if isinstance(why, ssl.SSLError):
            return ServiceUnreachable(f"the nicoffload service at {self.url}: TLS failed "
                                      f"({why.reason or why}): does it speak HTTPS?")
        if isinstance(why, socket.timeout) or isinstance(e, socket.timeout) or "timed out" in str(why):
            return TimeoutError_(f"the nicoffload service at {self.url} did not answer {method} {path} "
                                 f"within {self.timeout:g}s")
        return ServiceUnreachable(f"the nicoffload service at {self.url} is unreachable: {why}")

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
