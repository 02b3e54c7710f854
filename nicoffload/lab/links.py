"""The testbed's links as experiments need them: GRO on the workers' interfaces, and a record
of each link's offloads and XDP program."""
from __future__ import annotations

from contextlib import contextmanager

from nicoffload.ebpf import loader as bpf

_FEATURES = {"tx-tcp-segmentation": "tso", "tx-udp-segmentation": "udp_gso",
             "tx-generic-segmentation": "gso", "rx-gro": "gro"}


@contextmanager
def _ethtool(ns: str):
    from pyroute2.ethtool import Ethtool

    with bpf.netns(ns):
        e = Ethtool()
        try:
            yield e
        finally:
            e.close()


def _features(ns: str, ifc: str) -> dict:
    with _ethtool(ns) as e:
        f = e.get_features(ifc).features
        return {short: bool(f[k].enable) for k, short in _FEATURES.items() if k in f}


def link_state(tb) -> dict:
    """TSO/GSO/GRO and XDP of the links every system uses (w0's link and the aggregator's)."""
    w0, agg = tb.workers[0], tb.agg
    out = {}
    for ns, ifc, label in ((w0.netns, w0.iface, f"w0:{w0.iface}"), (tb.bridge_netns, w0.peer, f"br:{w0.peer}"),
                           (agg.netns, agg.iface, f"agg:{agg.iface}"), (tb.bridge_netns, agg.peer, f"br:{agg.peer}")):
        try:
            d = _features(ns, ifc)
            d["xdp_prog"] = bpf.xdp_prog_id(ifc, ns)
        except Exception as ex:  # informational only
            d = {"error": str(ex)}
        out[label] = d
    return out


def enable_gro(tb) -> None:
    """GRO on every worker's interface: veth then runs NAPI and UDP_GRO hands the worker
    batches of results (one receive for many datagrams)."""
    for w in tb.workers:
        with _ethtool(w.netns) as e:
            f = e.get_features(w.iface)
            if "rx-gro" in f.features and not f.features["rx-gro"].enable:
                f.features["rx-gro"].enable = True
                e.set_features(w.iface, f)
