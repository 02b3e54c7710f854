"""The interface's checks, each a pure function of :class:`~nicoffload.doctor.link.LinkFacts`:
that it exists and is up, its driver and whether it runs native XDP, its MTU against the
records, the offloads that change what generic XDP sees, multicast and IGMP, rp_filter."""
from __future__ import annotations

from nicoffload.doctor.link import IFF_LOOPBACK, IFF_MULTICAST, IFF_UP, XDP_ACT, LinkFacts
from nicoffload.doctor.report import OK, Check, fail, ok, warn
from nicoffload.ebpf.loader import MAX_NATIVE_MTU
from nicoffload.wire import proto

#: drivers with native XDP in mainline Linux (ndo_bpf), for kernels whose netdev family does not
#: report XDP features (before 6.3)
NATIVE_XDP_DRIVERS = frozenset({
    "mlx4_en", "mlx5_core", "i40e", "ice", "ixgbe", "ixgbevf", "igb", "igc", "bnxt_en", "qede", "nfp", "sfc",
    "sfc_siena", "ena", "virtio_net", "veth", "tun", "hv_netvsc", "gve", "mana", "xen-netfront", "nicvf",
    "mvneta", "mvpp2", "dpaa2-eth", "fsl_enetc", "fec", "stmmac", "atlantic", "octeontx2-nicpf", "bond",
    "vmxnet3", "ionic", "idpf", "lan743x", "mtk_soc_eth", "netsec", "am65-cpsw-nuss", "cpsw", "tsnep", "txgbe",
})
#: the most int32 elements per record that fit the 3.5 KB frame native XDP takes without frags
#: (856 with wire version 3's header)
JUMBO_ELEMS = proto.max_elems_for_mtu(3500)
OFFLOADS = {"gro": "rx-gro", "gso": "tx-generic-segmentation", "lro": "rx-lro",
            "rx-udp-gro-forwarding": "rx-udp-gro-forwarding", "tx-udp-segmentation": "tx-udp-segmentation"}


def _where(f: LinkFacts) -> str:
    return f"{f.name}" + (f" in {f.netns}" if f.netns else "")


def _ip(f: LinkFacts, args: str) -> str:
    return f"ip {'-n ' + f.netns + ' ' if f.netns else ''}{args}"


def check_interface(f: LinkFacts, role: str | None) -> Check:
    if not f.exists and not f.missing:
        return fail("interface", f.error or f"{f.name} could not be read", "run it as root (sudo)")
    if f.missing == "namespace":
        return fail("interface", f.error, "name a namespace that `ip netns list` lists (--netns NS), or none")
    if not f.exists:
        return fail("interface", f.error or f"no interface {f.name!r}",
                    f"name one that `{_ip(f, 'link')}` lists (--iface IF, --netns NS)")
    what = f.driver or f.kind or "no driver named"
    desc = (f"{_where(f)}: {what}{' ' + f.bus if f.bus else ''}, {f.operstate or '?'}, MTU {f.mtu}, "
            f"{', '.join(f.ipv4) or 'no IPv4 address'}, {f.rx_queues} receive queue(s)")
    if not f.flags & IFF_UP:
        return warn("interface", desc + ": it is down", _ip(f, f"link set {f.name} up"))
    if not f.ipv4:
        return warn("interface", desc + ": the aggregator sends results from its address, a worker sends from it",
                    _ip(f, f"addr add ADDR/PREFIX dev {f.name}"))
    return ok("interface", desc)


def _acts(bits: int) -> str:
    return ", ".join(n for n, b in XDP_ACT.items() if bits & b) or "none"


def check_native_xdp(f: LinkFacts, role: str | None) -> Check:
    """Whether the driver runs XDP natively: the netdev family's feature bits where the kernel
    reports them, else the table of drivers known to (never found out by attaching)."""
    if f.xdp_features is not None:
        native, how = bool(f.xdp_features & XDP_ACT["basic"]), f"netdev XDP features: {_acts(f.xdp_features)}"
    else:
        native, how = f.driver in NATIVE_XDP_DRIVERS, f"driver {f.driver or f.kind or '?'} " \
                                                       f"{'is' if f.driver in NATIVE_XDP_DRIVERS else 'is not'} " \
                                                       f"in the table of native-XDP drivers"
    held = f"; an XDP program (id {f.xdp_prog}) is attached in {f.xdp_attached} mode" if f.xdp_attached else ""
    if native:
        note = ": auto picks generic on veth (it sees UDP_SEGMENT batches whole)" if f.driver == "veth" else ""
        c = ok("native-xdp", f"native XDP: yes ({how}){note}{held}")
    elif role == "worker":
        c = ok("native-xdp", f"native XDP: no ({how}): a worker needs XDP only in ring mode, where generic works{held}")
    else:
        c = warn("native-xdp", f"native XDP: no ({how}): the aggregator runs in generic (skb) mode here{held}",
                 "agg load/serve --mode generic (auto picks it), with rx-udp-gro-forwarding on for batches; "
                 "or a NIC whose driver has native XDP")
    if f.xdp_attached and role != "worker" and c.status == OK:
        c = warn("native-xdp", c.detail, "agg load refuses an interface holding another program: "
                                         "nicoffload agg status shows whether it is nicoffload's own")
    return c



def check_mtu(f: LinkFacts, role: str | None, elems: int) -> Check:
    need, jumbo = proto.mtu_for_elems(elems), proto.mtu_for_elems(JUMBO_ELEMS)
    if f.mtu < need:
        most = proto.max_elems_for_mtu(f.mtu)
        return fail("mtu", f"MTU {f.mtu} < {need}, what records of {elems} elements ({proto.record_size(elems)} "
                           f"bytes) need", f"{_ip(f, f'link set {f.name} mtu {need}')} on every host, or --elems "
                                           f"{most} or fewer")
    detail = f"MTU {f.mtu} carries records of {elems} elements ({need} bytes on the wire)"
    if elems < JUMBO_ELEMS:
        more = "fits" if f.mtu >= jumbo else f"needs MTU {jumbo} (jumbo frames)"
        detail += f"; --elems {JUMBO_ELEMS} (3.4x fewer records) {more}"
    if f.mtu > MAX_NATIVE_MTU and role != "worker" and f.xdp_can("rx-sg") is False:
        return warn("mtu", detail + f"; native XDP without multi-buffer support (rx-sg) refuses MTUs above "
                                    f"~{MAX_NATIVE_MTU}", f"{_ip(f, f'link set {f.name} mtu {MAX_NATIVE_MTU}')}, "
                                                          f"or --mode generic")
    return ok("mtu", detail)


def check_offloads(f: LinkFacts, role: str | None) -> Check:
    if not f.features:
        return warn("offloads", f"ethtool features of {f.name} could not be read",
                    f"ethtool -k {f.name} (GRO and GSO should be on, LRO off)")
    on = {k: f.features.get(v) for k, v in OFFLOADS.items()}
    detail = ", ".join(f"{k} {'on' if v else 'off' if v is not None else '?'}" for k, v in on.items())
    if on["lro"] and role != "worker":
        return warn("offloads", detail + ": drivers refuse native XDP while LRO is on",
                    f"ethtool -K {f.name} lro off")
    if on["gro"] is False:
        why = "a worker then receives results one datagram per call (no UDP GRO)" if role == "worker" else \
            "generic XDP then never sees a batch of records, and workers get results one datagram at a time"
        return warn("offloads", f"{detail}: {why}", f"ethtool -K {f.name} gro on")
    if on["gso"] is False and role != "aggregator":
        return warn("offloads", detail + ": a worker's UDP_SEGMENT sends are cut into datagrams before the device",
                    f"ethtool -K {f.name} gso on")
    if role != "worker" and not f.kind and not on["rx-udp-gro-forwarding"]:
        detail += (f"; generic XDP sees single datagrams from this NIC: `ethtool -K {f.name} rx-udp-gro-forwarding on`"
                   f" makes it see batches (--mode generic)")
    return ok("offloads", detail)


def check_multicast(f: LinkFacts, role: str | None) -> Check:
    unicast = "unicast delivery: agg serve --no-multicast, or agg job add --delivery unicast"
    if f.flags & IFF_LOOPBACK:
        return warn("multicast", f"{f.name} is a loopback device: ranks on other hosts cannot reach it", unicast)
    if not f.flags & IFF_MULTICAST:
        return warn("multicast", f"{f.name} has no MULTICAST flag: results cannot come by IP multicast",
                    f"{_ip(f, f'link set {f.name} multicast on')}, or {unicast}")
    version = f"IGMPv{f.force_igmp} (forced)" if f.force_igmp else "IGMP (version auto)"
    ig = f.igmp or {}
    if ig.get("querier") in ("V1", "V2"):
        heard = f"an IGMP{ig['querier'].lower()} querier answers on the link"
    else:
        heard = ("no IGMPv1/v2 querier heard (a v3 querier, or none: a switch that snoops IGMP without a querier "
                 "stops forwarding groups after a few minutes; if results stop arriving, use --delivery unicast)")
    return ok("multicast", f"MULTICAST on, {version}, {ig.get('groups', 0)} group(s) joined; {heard}")


def check_rp_filter(f: LinkFacts, role: str | None) -> Check:
    if f.rp_filter is None:
        return ok("rp_filter", "not readable here (no IPv4 configuration on the interface)")
    mode = max(f.rp_filter)  # the kernel takes the larger of conf/all and conf/IF
    name = {0: "off", 1: "strict", 2: "loose"}.get(mode, str(mode))
    detail = f"rp_filter {name} (all {f.rp_filter[0]}, {f.name} {f.rp_filter[1]})"
    if mode != 1:
        return ok("rp_filter", detail)
    if role == "aggregator":
        return ok("rp_filter", detail + ": XDP sees the records before the reverse-path filter")
    if f.default_route:
        return ok("rp_filter", detail + f": the default route leaves {f.name}, so results from any aggregator pass")
    return warn("rp_filter", detail + f": results are dropped unless the route back to the aggregator leaves {f.name}",
                f"sysctl -w net.ipv4.conf.{f.name}.rp_filter=2 net.ipv4.conf.all.rp_filter=2 (loose), "
                f"or a route to the aggregator through {f.name}")


def nic_checks(f: LinkFacts, role: str | None, elems: int) -> list[Check]:
    """Every interface check (only the first when the interface is missing)."""
    first = check_interface(f, role)
    if not f.exists:
        return [first]
    return [first, check_native_xdp(f, role), check_mtu(f, role, elems), check_offloads(f, role),
            check_multicast(f, role), check_rp_filter(f, role)]
