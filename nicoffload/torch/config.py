"""The backend's configuration, from the environment torchrun already sets plus a few
``NICOFFLOAD_*`` variables (one line each in the README):

    NICOFFLOAD_SERVICE=http://HOST:PORT   the aggregator service (aggregator mode, groups across
                                          hosts; a group on one host needs none); URL1,URL2,...:
                                          a job at each, every tensor sharded over their aggregators
    NICOFFLOAD_TOKEN_FILE=PATH            the service's bearer token
    NICOFFLOAD_MODE=aggregator|ring       ring: the ring offload, peers from the rendezvous, no service
    NICOFFLOAD_LOCAL_IP=ADDR              this rank's address (default: the one that routes to the
                                          service, or to MASTER_ADDR in ring mode)
    NICOFFLOAD_TIMEOUT=SECONDS            how long a collective waits without progress (default: the
                                          process group's timeout)
    NICOFFLOAD_LIVENESS=SECONDS           a rank whose heartbeat stopped this long is gone: the others
                                          fail naming it (default 10)
    NICOFFLOAD_LEASE=SECONDS              the job's lease at the service (default: the service's)
    NICOFFLOAD_LANES=auto|16|32           bits per fixed-point lane of float sums (aggregator mode):
                                          auto (the default) sums bfloat16/float16 tensors in 16-bit
                                          lanes and float32/float64 in 32-bit ones; 16 or 32: every
                                          float tensor
    NICOFFLOAD_FAILOVER=SECONDS           the aggregator silent this long in a call: the group
                                          finishes it and the following ones through gloo, in
                                          the aggregator's fixed point (default 3; 0: never)
    NICOFFLOAD_REJOIN=SECONDS             on that fallback, rank 0 asks the service for a job
                                          again this often, and the group goes back (default 30)
    NICOFFLOAD_REQUIRE_OFFLOAD=1          a group that would take the gloo path fails at
                                          init_process_group instead (default 0: a warning)
    NICOFFLOAD_DEVICE_PATH=auto|host|device  where float sums are encoded: CUDA tensors on the GPU
                                          (auto), everything on the CPU (host), CPU tensors through
                                          the GPU's code too (device); read by torch/device/path.py
    NICOFFLOAD_NONFINITE=refuse|nan       a NaN or an Inf in a rank's float tensor: refuse the call on
                                          every rank (RefusedError, the default), or give every rank
                                          a tensor of NaN, as a sum with gloo holds NaN or Inf (what
                                          AMP's GradScaler needs to skip an overflowing step)
    NICOFFLOAD_METRICS_PORT=P|auto        every rank serves Prometheus text on P + LOCAL_RANK (auto:
                                          any free port); NICOFFLOAD_METRICS_ADDR binds another
                                          address (read by nicoffload.torch.metrics)
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from nicoffload.errors import InputError, SetupError

MODES = ("aggregator", "ring")
LANES = ("auto", "16", "32")
NONFINITE = ("refuse", "nan")


@dataclass(frozen=True)
class BackendConfig:
    mode: str = "aggregator"
    service: str | None = None
    token_file: str | None = None
    local_ip: str | None = None
    timeout: float | None = None
    liveness: float = 10.0
    lease_s: float | None = None
    lanes: str = "auto"
    nonfinite: str = "refuse"
    require_offload: bool = False
    failover: float = 3.0    # seconds of the aggregator's silence before the group takes the fallback (0: never)
    rejoin: float = 30.0     # seconds between rank 0's requests for a job again, on the fallback

    @classmethod
    def from_env(cls, env=None) -> "BackendConfig":
        env = os.environ if env is None else env
        mode = env.get("NICOFFLOAD_MODE", "aggregator").strip() or "aggregator"
        if mode not in MODES:
            raise InputError(f"NICOFFLOAD_MODE must be aggregator or ring, not {mode!r}")
        lanes = env.get("NICOFFLOAD_LANES", "auto").strip() or "auto"
        if lanes not in LANES:
            raise InputError(f"NICOFFLOAD_LANES must be auto, 16 or 32, not {lanes!r}")
        if lanes == "16" and mode == "ring":
            raise InputError("NICOFFLOAD_LANES=16 is for the aggregator mode: the ring sums in 32-bit lanes")
        nonfinite = env.get("NICOFFLOAD_NONFINITE", "refuse").strip() or "refuse"
        if nonfinite not in NONFINITE:
            raise InputError(f"NICOFFLOAD_NONFINITE must be refuse or nan, not {nonfinite!r}")
        # the aggregator mode needs it for a job across hosts; a group on one host does without
        service = env.get("NICOFFLOAD_SERVICE") or None
        return cls(mode=mode, service=service, token_file=env.get("NICOFFLOAD_TOKEN_FILE") or None,
                   local_ip=env.get("NICOFFLOAD_LOCAL_IP") or None,
                   timeout=_seconds(env, "NICOFFLOAD_TIMEOUT"),
                   liveness=_seconds(env, "NICOFFLOAD_LIVENESS") or 10.0,
                   lease_s=_seconds(env, "NICOFFLOAD_LEASE", zero_ok=True), lanes=lanes, nonfinite=nonfinite,
                   require_offload=_flag(env, "NICOFFLOAD_REQUIRE_OFFLOAD"),
                   failover=(_seconds(env, "NICOFFLOAD_FAILOVER", zero_ok=True) or 0.0)
                   if env.get("NICOFFLOAD_FAILOVER") else 3.0, rejoin=_seconds(env, "NICOFFLOAD_REJOIN") or 30.0)

    def route_target(self) -> str:
        """The host this rank's traffic goes to: the service's (aggregator mode) or the master's."""
        if self.mode == "aggregator" and self.service:
            return urlsplit(self.service.split(",")[0].strip()).hostname or ""
        master = os.environ.get("MASTER_ADDR")
        if not master:
            raise SetupError(f"NICOFFLOAD_MODE={self.mode} without NICOFFLOAD_SERVICE needs MASTER_ADDR (torchrun sets "
                             f"it) or NICOFFLOAD_LOCAL_IP")
        return master

    def resolve_local_ip(self) -> str:
        if self.local_ip:
            return self.local_ip
        return local_ip_towards(self.route_target())


def _flag(env, name: str) -> bool:
    text = (env.get(name) or "0").strip().lower()
    if text not in ("0", "1", "true", "false", "yes", "no", ""):
        raise InputError(f"{name} must be 1 or 0, not {text!r}")
    return text in ("1", "true", "yes")


def _seconds(env, name: str, zero_ok: bool = False) -> float | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        v = float(text)
    except ValueError:
        raise InputError(f"{name} must be a number of seconds, not {text!r}") from None
    if not (v > 0 or (zero_ok and v == 0)):
        raise InputError(f"{name} must be positive, not {text!r}")
    return v


def local_ip_towards(host: str) -> str:
    """The address of the interface that routes to ``host`` (no packet is sent)."""
    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError as e:
        raise SetupError(f"no route from this host to {host} ({e.strerror or e}); set NICOFFLOAD_LOCAL_IP") from None
