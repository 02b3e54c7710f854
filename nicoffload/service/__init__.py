"""The aggregator as a service (``nicoffload agg serve``, docs/service.md): an XDP aggregator
shared by jobs that ask for a place over an authenticated HTTP API, with leases that free the
slots of dead runs and Prometheus metrics.

    api           requests and answers as data: a job request checked field by field, the grant
                  every rank builds its communicator from
    core          the logic: admit, remove, renew, list, reap; the snapshot the metrics read
    engine        what a job runs on: the Engine interface, its errors, the registry's class
    engines       the registry of the engines a service has (xdp, afxdp)
    xdp_pool      the XDP program's slot pool as an engine ("xdp")
    afxdp_engine  the AF_XDP engine beside it ("afxdp", ``--fallback afxdp``)
    leases        the lease book (persisted, so a restarted service keeps its jobs)
    metrics       the Prometheus collector over the aggregator's per-job counters
    http          the routes on aiohttp: the bearer token, size limits, one-line JSON errors
    run           ``agg serve``: load or take over the aggregator, listen (in a namespace), signals
    client        the client (standard library only) the torch backend and the CLI use
"""
from __future__ import annotations

from nicoffload._exports import lazy_exports

_NAMES = {"ServiceClient": "client", "ServiceUnreachable": "client", "JobRequest": "api", "JobGrant": "api",
          "ServeOptions": "run", "serve": "run"}
__all__ = list(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)
