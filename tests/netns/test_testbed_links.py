"""The testbed's links carry traffic as a network would: unicast and multicast between the hosts,
XDP_TX from the aggregator, shaped rates, and the seeded fault injector's drops and duplicates."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

from nicoffload.ebpf import loader as nbpf
from nicoffload.testbed import Link

N = 2000  # packets per fault run
SO_RCVBUFFORCE = 33


# --- helpers ----------------------------------------------------------------------------------
def receiver(tb, host, port, bind_ip="0.0.0.0"):
    s = tb.socket(host)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
    s.bind((bind_ip, port))
    return s


def send_numbered(tb, host, dst, port, n, sport=0):
    """n datagrams carrying their sequence number, from one CPU so the link numbers them in order."""
    s = tb.socket(host)
    s.bind(("0.0.0.0", sport))
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(old)})
    try:
        for i in range(n):
            s.sendto(struct.pack("!I", i) + b"\xab" * 60, (dst, port))
    finally:
        os.sched_setaffinity(0, old)
        s.close()


def drain(sock, quiet=0.25):
    """Sequence numbers received until the socket stays quiet for ``quiet`` seconds."""
    got = []
    sock.settimeout(quiet)
    try:
        while True:
            got.append(struct.unpack("!I", sock.recv(4096)[:4])[0])
    except socket.timeout:
        pass
    return got


# --- reachability ----------------------------------------------------------------------------------
def test_unicast_to_aggregator_and_multicast_to_every_worker(make_testbed):
    tb = make_testbed(3)
    rx = receiver(tb, "agg", tb.port)
    for w in tb.workers:  # the first packet must arrive: static neighbours, no ARP
        s = tb.socket(w)
        s.sendto(f"hello from {w.rank}".encode(), (tb.agg.ip, tb.port))
        s.close()
    rx.settimeout(2)
    got = {(d, a[0]) for d, a in (rx.recvfrom(100) for _ in tb.workers)}
    assert got == {(f"hello from {w.rank}".encode(), w.ip) for w in tb.workers}
    rx.close()

    socks = []
    for w in tb.workers:
        s = receiver(tb, w, tb.port)
        mreq = socket.inet_aton(tb.mcast_group) + socket.inet_aton(w.ip)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        socks.append(s)
    tx = tb.socket("agg")
    tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(tb.agg.ip))
    # the bridge snoops IGMP: a member's report may still be on its way when the first datagram
    # is sent (on a loaded machine), so send until every member has one, as a protocol would
    pending = set(range(len(socks)))
    for _ in range(50):
        tx.sendto(b"result", (tb.mcast_group, tb.port))
        for i in list(pending):
            socks[i].settimeout(0.1)
            try:
                data, addr = socks[i].recvfrom(100)
            except socket.timeout:
                continue
            assert data == b"result" and addr[0] == tb.agg.ip
            pending.discard(i)
        if not pending:
            break
    assert not pending, f"workers {sorted(pending)} never received the group's datagram"
    for s in socks:
        s.close()
    tx.close()


REFLECT = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>
int reflect(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = data + sizeof(*eth);
    struct udphdr *udp = (void *)ip + sizeof(*ip);
    unsigned char mac[ETH_ALEN];
    __be32 a; __be16 p;
    if ((void *)(udp + 1) > end) return XDP_PASS;
    if (eth->h_proto != __builtin_bswap16(ETH_P_IP) || ip->ihl != 5 || ip->protocol != IPPROTO_UDP) return XDP_PASS;
    if (udp->dest != __builtin_bswap16(PORT)) return XDP_PASS;
    __builtin_memcpy(mac, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
    a = ip->saddr; ip->saddr = ip->daddr; ip->daddr = a;
    p = udp->source; udp->source = udp->dest; udp->dest = p;
    udp->check = 0;  /* veth hands XDP a partial (offloaded) checksum: send none instead */
    return XDP_TX;
}
"""


def test_xdp_tx_from_the_aggregator_reaches_the_worker(make_testbed):
    """The reason for the NAPI XDP_PASS on p-agg: XDP_TX out of the aggregator's veth."""
    tb = make_testbed(1, agg_napi=True)
    b = nbpf.compile_bpf("reflect", {"PORT": tb.port}, text=REFLECT)
    att = nbpf.attach_xdp(nbpf.load_func(b, "reflect", "XDP"), tb.agg.iface, tb.agg.netns, "native")
    try:
        s = tb.socket("w0")
        s.bind(("0.0.0.0", 40000))
        s.settimeout(2)
        for i in range(20):
            s.sendto(b"ping%d" % i, (tb.agg.ip, tb.port))
        got = [s.recvfrom(100) for _ in range(20)]
        assert [d for d, _ in got] == [b"ping%d" % i for i in range(20)]
        assert {a for _, a in got} == {(tb.agg.ip, tb.port)}
        s.close()
    finally:
        att.detach()
        b.cleanup()


def test_shaped_link_delivers_its_rate(make_testbed):
    rate = 100_000_000
    tb = make_testbed(1, links={"w0": Link(rate=rate)})
    srv = tb.socket("agg", type=socket.SOCK_STREAM)
    srv.bind((tb.agg.ip, 5201))
    srv.listen(1)
    cl = tb.socket("w0", type=socket.SOCK_STREAM)
    stop = threading.Event()

    def blast():
        cl.connect((tb.agg.ip, 5201))
        cl.settimeout(0.5)
        buf = b"\0" * 65536
        while not stop.is_set():
            try:
                cl.send(buf)
            except OSError:
                break

    t = threading.Thread(target=blast, daemon=True)
    t.start()
    conn, _ = srv.accept()
    conn.settimeout(2)
    warm = time.monotonic() + 0.2
    while time.monotonic() < warm:
        conn.recv(1 << 20)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < 1.0:
        n += len(conn.recv(1 << 20))
    elapsed = time.monotonic() - t0
    stop.set()
    conn.close()
    t.join(3)
    cl.close()
    srv.close()
    goodput = n * 8 / elapsed
    assert 0.8 * rate <= goodput <= 1.2 * rate, f"{goodput / 1e6:.1f} Mbit/s on a {rate / 1e6:.0f} Mbit/s link"


# --- fault injector -------------------------------------------------------------------------------
def test_drops_are_seeded_and_replayable(make_testbed):
    tb = make_testbed(1)
    rx = receiver(tb, "agg", tb.port)
    runs = []
    for seed in (11, 11, 12):
        tb.faults.configure("w0", drop=0.2, seed=seed, directions=["ingress"])
        send_numbered(tb, "w0", tb.agg.ip, tb.port, N)
        got = drain(rx)
        expect = [n for n, d in enumerate(tb.faults.predict("w0", "ingress", N)) if d == "pass"]
        assert sorted(got) == expect  # exactly the predicted packets
        assert abs((N - len(got)) / N - 0.2) < 0.04
        stats = tb.faults.stats("w0")["ingress"]
        assert stats == {"seen": N, "dropped": N - len(got), "duplicated": 0, "passed": len(got)}
        assert tb.faults.stats("w0")["egress"]["seen"] == 0
        runs.append(set(got))
    assert runs[0] == runs[1]  # same seed, same packets
    assert runs[0] != runs[2]  # another seed, other packets
    rx.close()


def test_duplicates_at_the_configured_rate(make_testbed):
    tb = make_testbed(1)
    rx = receiver(tb, "agg", tb.port)
    tb.faults.configure("agg", dup=0.25, seed=3, directions=["egress"])  # towards the aggregator
    send_numbered(tb, "w0", tb.agg.ip, tb.port, N)
    got = drain(rx)
    dups = {n for n, d in enumerate(tb.faults.predict("agg", "egress", N)) if d == "dup"}
    assert set(got) == set(range(N))
    extra = len(got) - N
    assert abs(extra / N - 0.25) < 0.04
    assert extra == len(dups)
    assert {n for n in set(got) if got.count(n) == 2} == dups
    assert tb.faults.stats("agg")["egress"] == {"seen": N, "dropped": 0, "duplicated": extra, "passed": N}
    rx.close()


def test_only_allreduce_traffic_is_touched(make_testbed):
    tb = make_testbed(1)
    tb.faults.configure("w0", drop=1.0, seed=1)
    ar = receiver(tb, "agg", tb.port)
    other = receiver(tb, "agg", tb.port + 1)
    send_numbered(tb, "w0", tb.agg.ip, tb.port, 200)
    send_numbered(tb, "w0", tb.agg.ip, tb.port + 1, 200)
    assert drain(ar, 0.15) == []
    assert sorted(drain(other, 0.15)) == list(range(200))
    ar.close()
    other.close()
    # from the AllReduce source port counts too (results come from it)
    back = receiver(tb, "w0", 40001)
    send_numbered(tb, "agg", tb.host("w0").ip, 40001, 50, sport=tb.port)
    assert drain(back, 0.15) == []
    send_numbered(tb, "agg", tb.host("w0").ip, 40001, 50, sport=tb.port + 2)
    assert len(drain(back, 0.15)) == 50
    s = tb.faults.stats("w0")
    assert s["ingress"]["seen"] == s["ingress"]["dropped"] == 200
    assert s["egress"]["seen"] == s["egress"]["dropped"] == 50
    back.close()
    tb.faults.remove("w0")
    ar = receiver(tb, "agg", tb.port)
    send_numbered(tb, "w0", tb.agg.ip, tb.port, 20)
    assert sorted(drain(ar, 0.15)) == list(range(20))
    ar.close()

