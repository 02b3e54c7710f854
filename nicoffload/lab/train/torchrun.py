"""Training scripts under torchrun on a testbed, with the aggregator as a service.

    ServiceProcess   ``nicoffload agg serve`` on the testbed's aggregator host (started from the
                     root namespace with --netns, as a user would), its URL and token; stopped with
                     SIGTERM (unloads) or killed (leaves the aggregator pinned for the next one)
    torchrun_specs   one ``torchrun --nnodes N --nproc-per-node K --node-rank R`` per worker host,
                     the master on worker 0, the NICOFFLOAD_* environment set
    host_commands    the same as commands a person runs (``nicoffload testbed up --ranks-per-host K``)
"""
from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from nicoffload.errors import SetupError, TimeoutError_
from nicoffload.lab.launcher import CLI, RankSpec

#: the port the testbed's service listens on (inside the aggregator's namespace)
SERVICE_PORT = 7470
#: torchrun's master port in the commands :func:`host_commands` shows
MASTER_PORT = 29500


def write_token(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "nicoffload.token"
    p.write_text(secrets.token_urlsafe(24) + "\n")
    p.chmod(0o600)
    return p


def free_port(tb, host) -> int:
    """A TCP port nobody listens on in ``host``'s namespace (for torchrun's master)."""
    with tb.in_host(host):
        s = socket.socket()
    try:
        s.bind(("", 0))
        return s.getsockname()[1]
    finally:
        s.close()


class ServiceProcess:
    """``nicoffload agg serve`` for the testbed's aggregator, in the foreground of a child."""

    def __init__(self, tb, token_file: Path, *, port: int = SERVICE_PORT, slots: int = 4096,
                 lease: float = 30.0, extra: list[str] | None = None, ready_timeout: float = 60.0, host=None,
                 tls: tuple[Path, Path, Path] | None = None):
        """``tls``: (certificate, its key, the CA that signed it): the service speaks HTTPS, and
        :meth:`env` names the CA for its clients."""
        self.tb, self.token_file, self.port = tb, Path(token_file), port
        agg = host or tb.agg  # the aggregator host it runs on (a testbed may have several)
        self.url = f"{'https' if tls else 'http'}://{agg.ip}:{port}"
        self.ca_file = Path(tls[2]) if tls else None
        self.argv = [*CLI, *service_args(tb, token_file, port, agg), "--slots", str(slots), "--lease", str(lease),
                     *(extra or [])]
        if tls:
            self.argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        self.ready_timeout = ready_timeout
        self.log: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServiceProcess":
        from nicoffload.testbed.signals import terminated_with

        self.log = []
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=terminated_with(os.getpid()))
        ready = threading.Event()

        def read(p=self.proc):
            for line in p.stdout:
                self.log.append(line.rstrip("\n"))
                if "ready at" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(self.ready_timeout) or self.proc.poll() is not None:
            self.kill()
            tail = " | ".join(self.log[-3:]) or "no output"
            raise SetupError(f"nicoffload agg serve did not come up within {self.ready_timeout:g}s: {tail}")
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM: the service unloads the aggregator and leaves nothing; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError_(f"nicoffload agg serve did not stop within {timeout:g}s of SIGTERM") from None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the aggregator stays pinned with its jobs (a crashed service)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def env(self) -> dict[str, str]:
        ca = {"NICOFFLOAD_CA_FILE": str(self.ca_file)} if self.ca_file else {}
        return {"NICOFFLOAD_SERVICE": self.url, "NICOFFLOAD_TOKEN_FILE": str(self.token_file), **ca}

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def service_args(tb, token_file, port: int = SERVICE_PORT, host=None) -> list[str]:
    """``agg serve ...`` for the aggregator of testbed ``tb`` (the arguments after ``nicoffload``)."""
    agg = host or tb.agg
    return ["agg", "serve", "--netns", agg.netns, "--iface", agg.iface, "--listen", f"{agg.ip}:{port}",
            "--token-file", str(token_file), "--port", str(tb.port)]


def host_commands(tb, nproc: int, script: str = "script.py", token_file: str = "/etc/nicoffload/token",
                  master_port: int = MASTER_PORT) -> dict:
    """What a person runs to train on testbed ``tb`` with ``nproc`` ranks per worker host: the
    service on the aggregator host (None with one worker host: its ranks need none) and, per
    host, ``nicoffload testbed exec NAME wI -- env ... torchrun ...`` (``argv``, and as one
    shell line in ``command``)."""
    H = len(tb.workers)
    service = None
    env = []
    if H > 1:
        service = ["nicoffload", *service_args(tb, token_file)]
        env = [f"NICOFFLOAD_SERVICE=http://{tb.agg.ip}:{SERVICE_PORT}", f"NICOFFLOAD_TOKEN_FILE={token_file}"]
    hosts = []
    for i, w in enumerate(tb.workers):
        argv = ["nicoffload", "testbed", "exec", tb.name, w.name, "--", "env", f"GLOO_SOCKET_IFNAME={w.iface}", *env,
                "torchrun", "--nnodes", str(H), "--nproc-per-node", str(nproc), "--node-rank", str(i),
                "--master-addr", tb.workers[0].ip, "--master-port", str(master_port), script]
        hosts.append({"host": w.name, "argv": argv, "command": shlex.join(argv)})
    return {"ranks_per_host": nproc, "world": H * nproc,
            "service": None if service is None else {"argv": service, "command": shlex.join(service)},
            "hosts": hosts}


def torchrun_specs(tb, script: str | Path, args: list[str] | None = None, env: dict[str, str] | None = None,
                   master_port: int | None = None, workers=None, nproc: int | list[int] = 1) -> list[RankSpec]:
    """One torchrun per worker host of ``tb`` (``workers``: a subset, in rank order), each
    running ``nproc`` ranks (``--nproc-per-node``; a list: host by host, unequal counts too)."""
    hosts = list(workers if workers is not None else tb.workers)
    per = list(nproc) if isinstance(nproc, (list, tuple)) else [nproc] * len(hosts)
    if len(per) != len(hosts):
        raise ValueError(f"{len(per)} rank counts for {len(hosts)} hosts")
    port = master_port or free_port(tb, hosts[0])
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"), **(env or {}))
    specs = []
    for r, w in enumerate(hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
                "--nproc-per-node", str(per[r]),
                "--node-rank", str(r), "--master-addr", hosts[0].ip, "--master-port", str(port),
                "--max-restarts", "0", str(script), *(args or [])]
        specs.append(RankSpec(f"node {r}", w, argv, dict(base, GLOO_SOCKET_IFNAME=w.iface)))
    return specs


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    """Poll ``predicate()`` until it returns something true; TimeoutError_ naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(every)
    raise TimeoutError_(f"{what} did not happen within {timeout:g}s")
