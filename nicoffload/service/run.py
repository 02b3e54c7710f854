"""``nicoffload agg serve``: the aggregator as a service, in the foreground until SIGTERM/SIGINT.

It loads the XDP aggregator on the interface as an empty shared pool (or takes over the one an
earlier service left pinned there, with its jobs and leases), listens for the HTTP API (inside
the interface's network namespace with ``--netns``), reaps jobs whose lease ran out, and on
SIGTERM/SIGINT unloads the aggregator and leaves nothing (``--keep-loaded``: leaves it pinned
with its jobs for the next service, e.g. across an upgrade: running jobs never notice).

``--tls-cert FILE --tls-key FILE``: the API speaks HTTPS (the standard library's ssl); without
them it is plain HTTP, and a listener on any address but loopback warns at start that the token
crosses the network in clear.

``--fallback afxdp``: a job the XDP pool refuses is handed to the AF_XDP engine beside the
aggregator (one engine process per interface, :mod:`nicoffload.agg.fallback`). Unloading stops
the engine with the aggregator; ``--keep-loaded`` leaves it running with its jobs, and the next
service takes them over with the XDP ones.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import ssl
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from aiohttp import web

from nicoffload.agg import fallback
from nicoffload.agg.control import STATE_DIR, AggSpec, Aggregator, unload
from nicoffload.ebpf import loader as bpf
from nicoffload.errors import InputError, NotFoundError, PrivilegeError, SetupError
from nicoffload.jobspec import DEFAULT
from nicoffload.service.core import Service, ServiceConfig
from nicoffload.service.engines import registry as engines
from nicoffload.service.http import make_app
from nicoffload.service.leases import LeaseBook

log = logging.getLogger("nicoffload.service")

#: a token shorter than this is refused (it would be guessable)
MIN_TOKEN = 16
#: seconds between two passes of the lease reaper
REAP_EVERY = 1.0


@dataclass
class ServeOptions:
    iface: str
    listen: str
    token_file: str
    netns: str | None = None
    slots: int = 4096
    elems: int = DEFAULT.elems
    port: int = DEFAULT.port
    mode: str = "auto"
    lease_s: float = 30.0
    job_slots: int = DEFAULT.slots
    optimizer: bool = True
    keep_loaded: bool = False
    multicast: bool = True
    fallback: str | None = None  # "afxdp": jobs the XDP pool refuses go to the AF_XDP engine
    tls_cert: str | None = None  # the service's certificate chain (PEM): the API speaks HTTPS
    tls_key: str | None = None   # and its private key (PEM)


def read_token(path: str | Path) -> bytes:
    """The bearer token in ``path`` (one line, at least 16 characters, no spaces)."""
    p = Path(path)
    hint = f"create one: head -c 24 /dev/urandom | base64 > {p}; chmod 600 {p}"
    try:
        text = p.read_text().strip()
    except FileNotFoundError:
        raise NotFoundError(f"token file {p} does not exist; {hint}") from None
    except PermissionError:
        raise PrivilegeError(f"token file {p} is not readable by this user") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"token file {p} cannot be read as text: {e}") from None
    if len(text) < MIN_TOKEN or not text.isprintable() or any(c.isspace() for c in text):
        raise InputError(f"the token in {p} must be one word of at least {MIN_TOKEN} printable characters; {hint}")
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is readable by other users: chmod 600 %s", p, p)
    return text.encode()


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InputError(f"--listen takes ADDR:PORT (e.g. 10.0.0.100:7470), not {text!r}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise InputError(f"--listen: {host!r} is not an IPv4 address") from None
    return host, int(port)


def tls_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The server side of TLS (the standard library's ssl) for ``--tls-cert``/``--tls-key``, or
    None without them; a file that does not load is refused in one line."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise InputError("TLS takes both --tls-cert FILE and --tls-key FILE")
    for option, f in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(f).is_file():
            raise NotFoundError(f"{option} {f} does not exist")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except PermissionError:
        raise PrivilegeError(f"--tls-cert {cert} or --tls-key {key} is not readable by this user") from None
    except (ssl.SSLError, OSError) as e:
        raise InputError(f"--tls-cert {cert} with --tls-key {key} do not load as a PEM certificate chain and its "
                         f"private key: {getattr(e, 'reason', None) or e}") from None
    return ctx


def warn_if_clear(host: str, tls: bool) -> None:
    """Plain HTTP anywhere but on loopback: the token crosses the network in clear."""
    if not tls and not ipaddress.IPv4Address(host).is_loopback:
        log.warning("the API on %s speaks plain HTTP: the token crosses the network in clear (and with it every "
                    "job's key); give --tls-cert FILE --tls-key FILE, or listen on a management network only", host)


def lease_file(netns: str | None, iface: str) -> Path:
    return STATE_DIR / f"{netns or 'root'}__{iface}.leases.json"


def listen_socket(host: str, port: int, netns: str | None) -> socket.socket:
    """A listening TCP socket created inside ``netns`` (it stays there whatever thread uses it)."""
    with bpf.netns(netns):
        try:
            return socket.create_server((host, port), reuse_port=False, backlog=128)
        except OSError as e:
            where = f" in network namespace {netns}" if netns else ""
            raise SetupError(f"cannot listen on {host}:{port}{where}: {e.strerror}; is the address on an "
                             f"interface there, and the port free?") from None


def open_or_load(o: ServeOptions) -> tuple[Aggregator, bool]:
    """The aggregator an earlier service left on the interface (True), or a new empty pool."""
    try:
        agg = Aggregator.open(o.netns, o.iface)
    except NotFoundError:
        spec = AggSpec(o.netns, o.iface, 0, o.slots, o.elems, o.port, o.mode, optimizer=o.optimizer)
        return Aggregator.load(spec), False
    if not agg.status()["attached"]:
        raise SetupError(f"the aggregator recorded on {o.iface} is not attached; run: nicoffload agg unload "
                         f"--netns {o.netns} --iface {o.iface}")
    return agg, True


async def _serve(service: Service, sock: socket.socket, token: bytes, url: str,
                 ready: Callable[[str], None] | None, tls: ssl.SSLContext | None = None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nicoffload-service")
    runner = web.AppRunner(make_app(service, token, executor), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, ssl_context=tls)
    await site.start()
    log.info("listening on %s", url)
    if ready:
        ready(url)
    rc = 0

    async def reaper():
        nonlocal rc
        while not stop.is_set():
            try:
                await loop.run_in_executor(executor, service.reap)
            except NotFoundError as e:
                log.error("the aggregator is gone underneath the service (%s); stopping", str(e).splitlines()[0])
                rc = NotFoundError.exit_code
                stop.set()
            except Exception as e:  # never let upkeep die silently
                log.error("lease upkeep failed: %s", e)
            try:
                await asyncio.wait_for(stop.wait(), REAP_EVERY)
            except asyncio.TimeoutError:
                pass

    task = asyncio.create_task(reaper())
    await stop.wait()
    task.cancel()
    await runner.cleanup()
    executor.shutdown(wait=True)
    return rc


def serve(o: ServeOptions, ready: Callable[[str], None] | None = None) -> int:
    """Run the service until SIGTERM/SIGINT; returns the exit code."""
    token = read_token(o.token_file)
    host, port = parse_listen(o.listen)
    tls = tls_context(o.tls_cert, o.tls_key)
    bpf.require_root("nicoffload agg serve")
    if o.fallback is not None and o.fallback not in engines.fallbacks():
        raise InputError(f"--fallback takes {' or '.join(engines.fallbacks())}, not {o.fallback!r}")
    agg, adopted = open_or_load(o)
    leases = LeaseBook(lease_file(o.netns, o.iface))
    try:
        service = Service(agg, leases, ServiceConfig(lease_s=o.lease_s, job_slots=o.job_slots,
                                                     multicast=o.multicast, fallback=o.fallback), token=token)
        if adopted:
            taken = service.restore()
            log.info("took over the aggregator on %s (%s) with %s, %d leased", o.iface,
                     o.netns or "root namespace", service.served(), len(taken))
        else:
            leases.discard_file()
            log.info("loaded the aggregator on %s (%s): %s; a pool of %d slots x %d int32, port %d", o.iface,
                     o.netns or "root namespace", agg.spec.mode_reason, o.slots, o.elems, o.port)
        sock = listen_socket(host, port, o.netns)
        if o.fallback:
            log.info("a job the pool refuses goes to the AF_XDP engine beside the aggregator (--fallback %s)",
                     o.fallback)
        url = f"{'https' if tls else 'http'}://{host}:{port}"
        warn_if_clear(host, tls is not None)
        return asyncio.run(_serve(service, sock, token, url, ready, tls))
    finally:
        if o.keep_loaded:
            left = fallback.handed_off(o.netns, o.iface)
            agg.release()
            agg.close()
            log.info("left the aggregator on %s loaded with its jobs (--keep-loaded)%s", o.iface,
                     f", and its AF_XDP engine (pid {left[0]['pid']}) with {len(left)} job(s)" if left else "")
        else:
            agg.close()
            unload(o.netns, o.iface, missing_ok=True)
            leases.discard_file()
            log.info("unloaded the aggregator from %s; nothing left", o.iface)


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s nicoffload agg serve: %(message)s", datefmt="%H:%M:%S")
