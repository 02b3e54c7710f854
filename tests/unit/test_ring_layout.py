"""The ring offload's layout and schedule without root: chunks, origins, who adds and stores last,
the staging order, where a missing record is asked for; and the whole protocol simulated in one
process with the host's kernel (hop.process_datagram, what the user-space ring runs and
what xdp/ring.c mirrors), with records lost and duplicated on every hop: every node ends with
the exact sum."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from nicoffload.datapath import encode
from nicoffload.ring import hop
from nicoffload.ring import kernels as rk
from nicoffload.ring import layout as L
from nicoffload.wire import codec, proto

E = 8
REC = proto.record_size(E)


@pytest.mark.parametrize("records", [0, 1, 2, 5, 17, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_chunks_tile_the_call_and_are_balanced(records, world):
    b = L.chunk_bounds(records, world)
    assert b[0] == 0 and b[-1] == records and (np.diff(b) >= 0).all()
    assert np.diff(b).max() - np.diff(b).min() <= 1
    o = L.origins(records, world)
    for k in range(records):
        assert b[o[k]] <= k < b[o[k] + 1]
    assert np.array_equal(L.origin_masks(records, world), 1 << o)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_a_journey_visits_every_node_adds_each_once_and_stores_at_every_node(world):
    """Follow one record of each origin by the rules the program applies (its masks)."""
    for o in range(world):
        node, adds, stores = (o + 1) % world, [o], []
        kind = "reduce"
        for _ in range(2 * world):
            me, nxt, last = L.masks_of(node, world)
            if kind == "reduce":
                adds.append(node)
                if 1 << o == nxt:  # it adds last: the sum is final
                    assert node == L.last_adder(o, world)
                    stores.append(node)
                    kind = "gather"
            else:
                stores.append(node)
                if 1 << o == last:
                    assert node == L.last_storer(o, world)
                    break
            node = (node + 1) % world
        assert sorted(adds) == list(range(world))
        assert sorted(stores) == list(range(world))
        assert len(adds) + len(stores) - 1 == 2 * (world - 1) + 1  # 2(N-1) hops


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_staging_order_covers_every_record_once_in_arrival_order(world):
    for rank in range(world):
        order = L.staging_order(20, world, rank)
        ks = [k for lo, hi in order for k in range(lo, hi)]
        assert sorted(ks) == list(range(20))
        b = L.chunk_bounds(20, world)
        origins = [int(L.origins(20, world)[lo]) for lo, _ in order]
        assert [L.hops_from_origin(o, rank, world) for o in origins] == \
            sorted(L.hops_from_origin(o, rank, world) for o in origins[:-1]) + [0]
        assert order[-1] == (int(b[rank]), int(b[rank + 1])) or b[rank] == b[rank + 1]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_missing_record_is_asked_from_a_node_that_had_it_first(world):
    """The first node to hold a final is the last adder: it asks the origin to restart the
    reduce; every other node asks its predecessor, which stores the final before it."""
    for o in range(world):
        chain = [(L.last_adder(o, world) + i) % world for i in range(world)]  # the order of stores
        for rank in range(world):
            peer, restart = L.nack_target(o, rank, world)
            if rank == chain[0]:
                assert restart and peer == o
            else:
                assert not restart and chain.index(peer) == chain.index(rank) - 1


def test_segments_of_a_large_tensor():
    assert L.segments(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert L.segments(0, 4) == [(0, 0)]
    assert L.link_bytes(1000, 4) == 1500 and L.link_bytes(1000, 1) == 0


def test_state_words_and_counters_come_from_the_header():
    assert L.STATS == proto._named("RING_STAT")
    assert set(L.OUTCOMES) < set(L.STATS) and "records" not in L.OUTCOMES
    assert len({L.ST_CALL, L.ST_EXPECTED, L.ST_STORED, L.ST_HOST_STORED, L.ST_OWN_STORED, L.ST_HOST_OWN,
                L.ST_OWN_WAKE}) == 7
    assert max(L.ST_CALL, L.ST_OWN_WAKE) < L.ST_WORDS


# --- the protocol, simulated --------------------------------------------------------------------
class Node:
    """One node's buffers and state, processed by the host's kernel."""

    def __init__(self, rank, world, cap):
        self.rank, self.world = rank, world
        self.local = np.zeros(cap * REC, np.uint8)
        self.result = np.zeros(cap * REC, np.uint8)
        self.st = np.zeros(L.ST_WORDS, np.uint32)
        self.cnt = np.zeros(len(L.STATS), np.int64)
        self.out = np.zeros(4096 * REC, np.uint8)
        self.late = np.zeros_like(self.out)
        self.stash = np.zeros(cap * REC, np.uint8)
        self.stash_src = np.zeros(cap, np.int64)
        self.io = np.zeros(hop.IO_WORDS, np.int64)
        self.cap = cap


def _template(rank):
    return np.frombuffer(codec.encode_blocks(np.zeros((1, 0), np.int32), rank=rank, job=1, epoch=0, slot=0, set=0,
                                             round=0, mask=0, count=0, type=L.TYPE_REDUCE), np.uint8).copy()


def simulate(xs, world, call=5, drop=0.0, dup=0.0, seed=0, max_rounds=400):
    """Every node stages its data, sends its own chunk; frames travel one hop per step (each one
    dropped with ``drop``, duplicated with ``dup``); a node that has stalled asks again as the
    communicator does. Returns every node's result and the nodes."""
    rng = np.random.default_rng(seed)
    n = xs[0].size
    K = -(-n // E)
    addrs = np.arange(1, world + 1, dtype=np.int64) * 1000
    nodes = [Node(r, world, K) for r in range(world)]
    masks = L.origin_masks(K, world)
    for nd, x in zip(nodes, xs):
        encode.encode_int(nd.local, REC, E, _template(nd.rank), x, np.arange(K), 0, 1 << 40, np.arange(K), masks,
                           proto.OP_SUM, 0)
        rk.set_tags(nd.local, REC, 0, K, call)
        nd.st[L.ST_CALL], nd.st[L.ST_EXPECTED] = call, K
    b = L.chunk_bounds(K, world)
    wire = [(r, (r + 1) % world, nodes[r].local[k * REC:min(b[r + 1], k + 4) * REC].copy())
            for r in range(world) for k in range(b[r], b[r + 1], 4)]
    stalled = dropped = 0
    for _ in range(max_rounds):
        nxt_wire = []
        for src, dst, frame in wire:
            if rng.random() < drop:
                dropped += 1
                continue
            copies = 2 if rng.random() < dup else 1
            for _c in range(copies):
                nd = nodes[dst]
                nd.io[:] = 0
                for j in range(0, len(frame) // REC):  # one record per frame, as GRO segments arrive
                    hop.process_datagram(frame, j * REC, REC, addrs[src], addrs, REC, E, dst, world, 1, call, K,
                                        nd.local, nd.result, nd.out, nd.late, nd.st, nd.cnt, nd.stash, nd.stash_src,
                                        np.zeros((world, 4), np.int64), np.zeros(4, np.int64), nd.io)
                m = int(nd.io[hop.IO_OUT])
                for j in range(0, m, 4):  # batches of up to 4 records go on
                    nxt_wire.append((dst, (dst + 1) % world, nd.out[j * REC:min(m, j + 4) * REC].copy()))
        wire = nxt_wire
        if wire:
            continue
        missing = [(nd, np.array([k for k in range(K) if rk.count_tagged(nd.result[k * REC:], REC, 1, call) == 0]))
                   for nd in nodes]
        if all(len(m) == 0 for _, m in missing):
            break
        stalled += 1
        org = L.origins(K, world)
        for nd, miss in missing:
            for o in np.unique(org[miss]) if len(miss) else ():
                peer, restart = L.nack_target(int(o), nd.rank, world)
                which = miss[org[miss] == o]
                buf = np.zeros(len(which) * REC, np.uint8)
                rk.build_nacks(nd.local, REC, which, restart, nd.rank, buf)
                wire.append((nd.rank, peer, buf))
    out = []
    for nd in nodes:
        y = np.zeros(K * E, np.int32)
        rk.decode(nd.result, REC, E, K, 0, np.zeros(K, np.int32), 0, y, np.zeros(0, np.float32),
                  np.zeros(0, np.float64), 0)
        out.append(y[:n])
    return out, nodes, stalled if not drop else (stalled, dropped)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_ring_sums_exactly(world):
    rng = np.random.default_rng(world)
    xs = [rng.integers(-(1 << 31), (1 << 31) - 1, 101, dtype=np.int64).astype(np.int32) for _ in range(world)]
    want = (np.sum([x.astype(np.int64) for x in xs], axis=0)).astype(np.int32)
    out, nodes, stalled = simulate(xs, world)
    assert stalled == 0
    for y in out:
        assert np.array_equal(y, want)
    for nd in nodes:
        c = dict(zip(L.STATS, nd.cnt))
        assert c["records"] == sum(c[k] for k in L.OUTCOMES)
        assert c["final"] + c["gathered"] == -(-101 // E)  # every record stored once per node


@pytest.mark.parametrize("seed", range(6))
def test_losses_and_duplicates_on_every_hop_still_give_the_exact_sum(seed):
    world = 3 + seed % 3
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-1000, 1000, 203).astype(np.int32) for _ in range(world)]
    want = np.sum(xs, axis=0, dtype=np.int64).astype(np.int32)
    out, nodes, (stalled, dropped) = simulate(xs, world, drop=0.1, dup=0.1, seed=seed)
    for y in out:
        assert np.array_equal(y, want)
    assert dropped and stalled > 0  # the losses were recovered by asking again
    assert sum(int(dict(zip(L.STATS, nd.cnt))["dup"]) for nd in nodes) > 0


def test_peer_addresses_are_compared_as_stored_in_a_sockaddr():
    ip = "10.200.7.11"
    assert int.from_bytes(socket.inet_aton(ip), "little") == np.frombuffer(socket.inet_aton(ip), np.uint32)[0]


def test_ring_peers_are_dotted_quads_once_each():
    """One check for every list of hosts (a job's workers, a ring's peers): inet_aton's
    shorthands such as 10.1 (= 10.0.0.1) would name another host than the one written."""
    from nicoffload.agg.jobtable import JobTable
    from nicoffload.errors import InputError
    from nicoffload.ring.node import RingSpec

    def spec(peers):
        return RingSpec("ns", "eth0", 0, len(peers), peers, 1, 40000, 256, 64, "generic")

    spec(["10.0.0.1", "10.0.0.2"]).validate()
    for bad, msg in ((["10.0.0.1", "10.2"], "--peers: '10.2' is not an IPv4 address"),
                     (["10.0.0.1", "10.0.0.1"], "names an address twice")):
        with pytest.raises(InputError, match=msg):
            spec(bad).validate()
    with pytest.raises(InputError, match="worker address '10.2' is not an IPv4 address"):
        JobTable(64).admit(1, 2, "239.1.1.1", ["10.0.0.1", "10.2"], slots=8)
