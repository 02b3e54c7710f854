"""The testbed's topology as pure data (no root, no namespaces): derived names and addresses,
validation, JSON round trip, host lookup, namespace prefixes, link rates."""
from __future__ import annotations

import json

import pytest

from nicoffload.errors import InputError
from nicoffload.testbed.topology import Link, Topology, format_rate, netns_prefix, parse_rate


def test_topology_is_pure_data():
    t = Topology.star("abc", 3, rate="100mbit", subnet=42, links={"w1": Link(rate="1gbit", queues=2)})
    names = [h.name for h in t.hosts]
    assert names == ["agg", "w0", "w1", "w2"]
    assert [h.rank for h in t.hosts] == [None, 0, 1, 2]
    assert t.hosts[0].ip == "10.200.42.1" and t.hosts[2].ip == "10.200.42.11"
    assert t.mcast_group == "239.77.42.1" and t.bridge_netns == "nco-abc-br"
    assert t.hosts[1].netns == "nco-abc-w0" and t.hosts[1].iface == "eth0"
    assert t.link_of("w0").rate == 100_000_000 and t.link_of("w1") == Link(1_000_000_000, 2)
    assert len({h.mac for h in t.hosts}) == 4
    assert all(len(h.peer) <= 15 for h in t.hosts)
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    # native XDP on veth refuses MTUs above 3506: a testbed prepared for it refuses them too
    for bad in (dict(workers=0), dict(workers=2, mtu=9000, agg_napi=True), dict(workers=2, mtu=9001),
                dict(workers=2, links={"w7": Link()})):
        with pytest.raises(InputError):
            Topology(name="x", **bad)
    with pytest.raises(InputError):
        Topology.star("Bad-Name", 2)


def test_subnet_comes_from_the_name_unless_given():
    t = Topology.star("abc", 1)
    assert t.subnet is None and t.with_subnet(7).mcast_group == "239.77.7.1"
    assert t.mcast_group == Topology.star("abc", 4).mcast_group  # stable: a function of the name
    assert t.hosts[0].peer == t.with_subnet(7).hosts[0].peer  # names do not depend on the subnet
    with pytest.raises(InputError):
        Topology.star("abc", 1, subnet=255)


def test_hosts_by_name_rank_or_host():
    t = Topology.star("abc", 3)
    w1 = t.hosts[2]
    assert t.host("w1") == t.host(1) == t.host(w1) == w1
    assert t.host("agg") == t.hosts[0]
    assert t.hosts_of(None) == t.hosts
    assert t.hosts_of("w0") == [t.hosts[1]]
    assert t.hosts_of([2, "agg"]) == [t.hosts[3], t.hosts[0]]
    for bad in ("w3", 3, "nope", True):
        with pytest.raises(InputError, match="hosts are agg, w0, w1, w2"):
            t.host(bad)


def test_the_aggregators_links_take_their_own_rate():
    t = Topology.star("abc", 4, rate="200mbit", agg_rate="800mbit", aggregators=2,
                      links={"agg1": Link(rate="1gbit")})
    assert [t.link_of(h).rate for h in ("agg", "agg1", "w0", "w3")] == [800_000_000, 10**9, 200_000_000, 200_000_000]
    assert Topology.star("abc", 4, rate="200mbit", agg_rate="unshaped").link_of("agg").rate is None
    assert Topology.star("abc", 4, rate="200mbit").link_of("agg").rate == 200_000_000  # default: the workers'


@pytest.mark.parametrize("given, want", [(None, None), ("1gbit", "1gbit"), ("unshaped", "unshaped"),
                                         ("4x", "800mbit"), ("2.5x", "500mbit")])
def test_testbed_up_reads_agg_rate_as_a_rate_or_a_multiple_of_the_workers(given, want):
    from types import SimpleNamespace

    from nicoffload.cli.testbed import _agg_rate

    assert _agg_rate(SimpleNamespace(agg_rate=given, rate="200mbit")) == want
    for bad, rate in (("fourx", "200mbit"), ("4x", "unshaped"), ("0x", "1gbit")):
        with pytest.raises(InputError):
            _agg_rate(SimpleNamespace(agg_rate=bad, rate=rate))


def test_netns_prefix_separates_testbeds_whose_names_share_a_start():
    a, ab = Topology.star("a", 1), Topology.star("ab", 1)
    assert all(ns.startswith(netns_prefix("a")) for ns in a.netns_names())
    assert not any(ns.startswith(netns_prefix("a")) for ns in ab.netns_names())  # "a" is not "ab"
    assert all(ns.startswith(netns_prefix("a", whole=False)) for ns in a.netns_names() + ab.netns_names())
    assert netns_prefix("", whole=False) == "nco-"
    with pytest.raises(InputError):
        netns_prefix("Bad-Name")


@pytest.mark.parametrize("text, bps", [
    ("100mbit", 100_000_000), ("1gbit", 10**9), ("500kbit", 500_000), ("2.5gbit", 2_500_000_000),
    ("1mbps", 8_000_000), (" 64 Kbit ", 64_000), (10**6, 10**6),
    (None, None), ("", None), ("unshaped", None), ("none", None), ("0", None), (0, None),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["fast", "10xbit", "-5mbit", "1kbit", "40gbit"])
def test_parse_rate_refuses(bad):
    with pytest.raises(InputError):
        parse_rate(bad)


@pytest.mark.parametrize("bps, text", [(None, "unshaped"), (0, "unshaped"), (10**9, "1gbit"),
                                       (250_000_000, "250mbit"), (64_000, "64kbit"), (12_345, "12345bit")])
def test_format_rate(bps, text):
    assert format_rate(bps) == text
    if bps:
        assert parse_rate(text) == bps
