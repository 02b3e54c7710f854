"""The engines a service has, registered by name (the :class:`~nicoffload.service.engine.Engine`
interface's registry, filled here, beside it: the implementations import the interface, and only
this module imports them): ``xdp`` (the XDP slot pool: admits first) and ``afxdp`` (the AF_XDP
engine: ``agg serve --fallback afxdp``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from nicoffload.service.afxdp_engine import AfxdpEngine
from nicoffload.service.engine import Engine, EngineRegistry
from nicoffload.service.leases import LeaseBook
from nicoffload.service.xdp_pool import XdpPool

if TYPE_CHECKING:
    from nicoffload.agg.control import Aggregator


def _xdp(agg: Aggregator, leases: LeaseBook) -> Engine:
    return XdpPool(agg, leases)


def _afxdp(agg: Aggregator, leases: LeaseBook) -> Engine:
    return AfxdpEngine(agg, leases)


registry = EngineRegistry()
registry.register("xdp", _xdp)
registry.register("afxdp", _afxdp)
