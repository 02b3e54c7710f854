"""Unicast delivery on a fabric without multicast (``testbed up --no-multicast``): every result
goes to each rank's registered address as a copy that ``ar_fanout`` clones at the aggregator's
tc ingress. Exact int32 and float32 within the bound from 2 to 8 ranks, bit-identical under 2%
drop and 2% duplication on every link, the user-space aggregator too; a multicast job on such a
fabric fails saying that results do not arrive by multicast, never a hang nor a wrong sum; and
the fabric itself drops multicast frames."""
from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from e2ekit import save

from nicoffload.agg import control as aggregator
from nicoffload.ebpf import tc
from nicoffload.errors import ProtocolError
from nicoffload.jobspec import DEFAULT
from nicoffload.lab import reference
from nicoffload.lab.jobs import run_job
from nicoffload.wire import proto

E = proto.DEFAULT_ELEMS
UNICAST = DEFAULT.replace(delivery="unicast", timeout=20)


def saved(d, arrays):
    d.mkdir(parents=True, exist_ok=True)
    return save(d, arrays)


def inputs(world: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    f = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(world)]
    for r, a in enumerate(f):
        a[E * (r % 3):E * (r % 3 + 1)] = 0  # some zero blocks on some ranks (sparse rounds, pulls)
    i = [rng.integers(-2 ** 31, 2 ** 31 - 1, n, dtype=np.int64).astype(np.int32) for _ in range(world)]
    return f, i


@pytest.mark.parametrize("world", [2, 8])
def test_unicast_results_are_exact_without_multicast(make_testbed, tmp_path, world):
    tb = make_testbed(world, multicast=False)
    f, i = inputs(world, 40 * E + 3, world)
    for arrays, tag in ((i, "i"), (f, "f")):
        ins, outs = saved(tmp_path / tag, arrays)
        res = run_job(tb, ins, outs, "xdp", UNICAST)
        want = reference.quantized(arrays, E)
        for r in range(world):
            c = want.check(np.load(outs[r]))
            assert c.within_bound, (tag, r, c.reason)
        st = res.agg_stats
        # every result went out as one copy per rank, and none needed a retransmission
        assert st["copies"] == world * st["result_sent"] and st["tx_failed"] == 0, st
        assert res.totals("retransmissions") == 0
    assert aggregator.loaded(tb.agg.netns) == [] and tc.tc_ingress_names(tb.agg.iface, tb.agg.netns) == []


def test_unicast_under_drop_and_duplication_is_bit_identical(make_testbed, tmp_path):
    world = 3
    tb = make_testbed(world, multicast=False)
    f, _ = inputs(world, 300 * E, seed=11)
    ins, clean = saved(tmp_path / "clean", f)
    run_job(tb, ins, clean, "xdp", UNICAST)
    tb.faults.configure(drop=0.02, dup=0.02, seed=5)
    retx = 0
    for attempt in range(5):  # a few dozen GSO frames per run: 2% loss can miss them all (about 1 run in 30)
        _, lossy = saved(tmp_path / f"lossy{attempt}", f)
        res = run_job(tb, ins, lossy, "xdp", UNICAST, reps=3)
        for r in range(world):
            assert np.load(lossy[r]).tobytes() == np.load(clean[r]).tobytes(), (attempt, r)
        retx += res.totals("retransmissions")
        if retx:
            break
    assert retx > 0  # the faults bit
    # the user-space aggregator delivers by unicast the same way
    _, user = saved(tmp_path / "user", f)
    run_job(tb, ins, user, "userspace", UNICAST)
    for r in range(world):
        assert np.load(user[r]).tobytes() == np.load(clean[r]).tobytes(), r


def test_a_multicast_job_without_multicast_fails_saying_so(make_testbed, tmp_path):
    tb = make_testbed(2, multicast=False)
    f, _ = inputs(2, 64 * E, seed=3)
    ins, outs = save(tmp_path, f)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError, match="do not arrive by multicast"):
        run_job(tb, ins, outs, "xdp", DEFAULT.replace(timeout=20))
    assert time.monotonic() - t0 < 30  # not the 20 s timeout of a crawl, nor a hang
    # the fabric drops a multicast datagram on its way, and passes a unicast one
    got = []
    with tb.in_host(tb.workers[1]):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        rx.bind(("", 40999))
        rx.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                      socket.inet_aton("239.77.9.9") + socket.inet_aton(tb.workers[1].ip))
        rx.settimeout(0.5)
    with tb.in_host(tb.workers[0]):
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(tb.workers[0].ip))
    try:
        tx.sendto(b"group", ("239.77.9.9", 40999))
        tx.sendto(b"unicast", (tb.workers[1].ip, 40999))
        for _ in range(2):
            try:
                got.append(rx.recv(100))
            except socket.timeout:
                break
    finally:
        tx.close()
        rx.close()
    assert got == [b"unicast"]
