"""The ring program (xdp/ring.c) through BPF_PROG_TEST_RUN on built frames: the add and the
rewrite to the next node, the final stored and sent on as a GATHER, the GATHER stored and sent
on (or consumed by the node that stores it last), duplicates, calls that are stale or ahead,
records the host has not staged (parked), NACKs (restart at the origin, a stored final sent
again, unanswered), PING/PONG, the host's wake-up through the ring buffer, every malformed reason
counted, foreign traffic passed, and the host's own kernel (hop.process_datagram)
agreeing with the program byte for byte. Frames are built and read with tests/bpf/ringkit.py."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest
from ringkit import (CALL, E, MACS, O, PEERS, REC, WORLD, conserved, frame, fresh, hdr, nonzero, payload, rand,
                     records, stage, stored, tag)

from nicoffload.ebpf import libbpf
from nicoffload.packets import generators as gen
from nicoffload.ring import hop
from nicoffload.ring.layout import (
    EV_DONE,
    EV_WINDOW,
    FLAG_RESTART,
    FLAG_SKIP,
    ST_EXPECTED,
    ST_OWN_WAKE,
    STATS,
    TYPE_GATHER,
    TYPE_NACK,
    TYPE_PING,
    TYPE_PONG,
    TYPE_REDUCE,
)
from nicoffload.ring.node import RingNode
from nicoffload.wire import codec, proto


@pytest.fixture(scope="module")
def nodes():
    """Rank 0, 1 and 2 of a ring of three (loaded, not attached), compiled once."""
    made = {r: RingNode.for_test(r, WORLD, PEERS, MACS, elems=E, capacity=64) for r in range(WORLD)}
    yield made
    for n in made.values():
        n.close()


@pytest.fixture
def node(nodes):
    """Rank 1 (predecessor rank 0, successor rank 2), fresh: call CALL, nothing staged or stored."""
    n = nodes[1]
    fresh(n)
    return n


# --- the data path ------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [proto.OP_SUM, proto.OP_SUM64, proto.OP_MAX])
def test_reduce_adds_own_record_and_goes_to_the_next_node(node, op):
    mine, theirs = rand((4, E), 1), rand((4, E), 2)
    if op == proto.OP_SUM64:  # lanes that cannot carry, as the fixed point sends them
        mine, theirs = mine & 0x3FFFFFFF, theirs & 0x3FFFFFFF
    stage(node, mine, range(4), op=op)
    out = node.run(frame(records(0, [0, 1, 2, 3], theirs, origin=0, op=op)))
    assert out.verdict == libbpf.XDP_TX
    d = out.data
    want = {proto.OP_SUM: (mine.astype(np.int64) + theirs).astype(np.int32),
            proto.OP_SUM64: (mine.view("<u8") + theirs.view("<u8")).view("<i4"),
            proto.OP_MAX: np.maximum(mine, theirs)}[op]
    for i in range(4):
        h = hdr(d, i)
        assert (h["type"], h["rank"], h["epoch"], h["slot"], h["mask"], h["flags"]) == (TYPE_REDUCE, 1, CALL, i, 1, 0)
        assert np.array_equal(payload(d, i), want[i])
    # the frame is addressed to rank 2, from rank 1, with a valid IPv4 checksum
    assert d[0:6] == bytes.fromhex(MACS[2].replace(":", "")) and d[6:12] == bytes.fromhex(MACS[1].replace(":", ""))
    assert socket.inet_ntoa(d[26:30]) == PEERS[1] and socket.inet_ntoa(d[30:34]) == PEERS[2]
    words = struct.unpack("!10H", d[14:34])
    assert (sum(words) + (sum(words) >> 16)) & 0xFFFF == 0xFFFF
    assert struct.unpack("!HH", d[34:38]) == (proto.DEFAULT_PORT, proto.DEFAULT_PORT)
    assert struct.unpack("!H", d[40:42])[0] != 0  # a batch keeps a (pseudo-header) checksum
    st = node.stats()
    assert nonzero(st) == {"rx": 1, "records": 4, "reduced": 4, "forwarded": 4}
    assert conserved(st)
    assert all(tag(node.maps.result, k) != CALL for k in range(4))  # nothing stored on the way


def test_last_adder_stores_the_final_and_sends_it_on_as_a_gather(node):
    # rank 1 adds last for records whose origin is rank 2 (their reduce came 2 -> 0 -> 1)
    mine, partial = rand((2, E), 3), rand((2, E), 4)
    stage(node, np.concatenate([np.zeros((5, E), np.int32), mine]).reshape(-1), [5, 6], origin_of=lambda k: 2)
    out = node.run(frame(records(0, [5, 6], np.concatenate([np.zeros((5, E), np.int32), partial]), origin=2)))
    assert out.verdict == libbpf.XDP_TX
    total = (mine.astype(np.int64) + partial).astype(np.int32)
    for i, k in enumerate((5, 6)):
        assert hdr(out.data, i)["type"] == TYPE_GATHER
        assert np.array_equal(payload(out.data, i), total[i])
        assert tag(node.maps.result, k) == CALL and np.array_equal(stored(node, k), total[i])
    st = node.stats()
    assert st["final"] == 2 and st["forwarded"] == 2 and conserved(st)
    assert node.maps.state[proto.C["AR_RING_ST_STORED"]] == 2
    # the same reduce again (a duplicate on the way): nothing is stored twice, nothing goes on
    out = node.run(frame(records(0, [5, 6], np.concatenate([np.zeros((5, E), np.int32), partial]), origin=2)))
    assert out.verdict == libbpf.XDP_DROP
    st = node.stats()
    assert st["dup"] == 2 and conserved(st)
    assert node.maps.state[proto.C["AR_RING_ST_STORED"]] == 2


def test_gather_is_stored_and_sent_on_and_consumed_by_the_last_storer(nodes):
    n1, n2 = nodes[1], nodes[2]
    final = rand((3, E), 5)
    # origin 1: rank 0 adds last, sends the GATHER to rank 1 (its origin), then 2 stores it last
    fresh(n1)
    out = n1.run(frame(records(0, [0, 1, 2], final, origin=1, type_=TYPE_GATHER)))
    assert out.verdict == libbpf.XDP_TX and [hdr(out.data, i)["type"] for i in range(3)] == [TYPE_GATHER] * 3
    assert all(np.array_equal(stored(n1, k), final[k]) for k in range(3))
    own = proto.C["AR_RING_ST_OWN_STORED"]
    assert n1.maps.state[own] == 3  # its own chunk came back: its send window opens
    fresh(n2)
    out = n2.run(frame(out.data[proto.L2L4_LEN:], src=1, dst=2))
    assert out.verdict == libbpf.XDP_DROP  # rank 2 = origin - 2 + 3: the last to store them
    assert all(np.array_equal(stored(n2, k), final[k]) for k in range(3))
    st = n2.stats()
    assert nonzero(st) == {"rx": 1, "records": 3, "gathered": 3} and conserved(st)
    # the same GATHER again: a duplicate, dropped
    out = n1.run(frame(records(0, [0, 1, 2], final, origin=1, type_=TYPE_GATHER)))
    assert out.verdict == libbpf.XDP_DROP and n1.stats()["dup"] == 3


def test_a_dropped_record_stays_in_place_marked_skip_and_the_next_node_skips_it(nodes):
    n1, n2 = nodes[1], nodes[2]
    final = rand((3, E), 6)
    fresh(n1)
    # origin 1: the finals go 0 -> 1 -> 2; rank 1 holds record 1 already
    n1.run(frame(records(0, [1], final, origin=1, type_=TYPE_GATHER)))
    out = n1.run(frame(records(0, [0, 1, 2], final, origin=1, type_=TYPE_GATHER)))
    assert out.verdict == libbpf.XDP_TX
    assert [hdr(out.data, i)["flags"] for i in range(3)] == [0, FLAG_SKIP, 0]
    assert n1.stats()["dup"] == 1
    fresh(n2)
    out2 = n2.run(frame(out.data[proto.L2L4_LEN:], src=1, dst=2))
    assert out2.verdict == libbpf.XDP_DROP  # rank 2 stores them last
    st = n2.stats()
    assert st["records"] == 2 and st["gathered"] == 2 and conserved(st)
    assert tag(n2.maps.result, 1) != CALL and tag(n2.maps.result, 0) == tag(n2.maps.result, 2) == CALL


# --- calls ---------------------------------------------------------------------------------------
def test_an_earlier_calls_records_are_stale(node):
    stage(node, rand((2, E)), [0, 1])
    out = node.run(frame(records(0, [0, 1], rand((2, E), 1), origin=0, call=CALL - 1)))
    assert out.verdict == libbpf.XDP_DROP
    st = node.stats()
    assert st["stale"] == 2 and conserved(st)


@pytest.mark.parametrize("case", ["later call", "not staged", "last not staged"])
def test_records_the_host_is_not_ready_for_are_parked_untouched(node, case):
    call = CALL + 1 if case == "later call" else CALL
    if case == "last not staged":
        stage(node, rand((3, E)), [0, 1])
    f = frame(records(0, [0, 1, 2], rand((3, E), 2), origin=0, call=call))
    out = node.run(f)
    assert out.verdict == libbpf.XDP_PASS and out.data == f
    st = node.stats()
    assert st["parked"] == 3 and conserved(st)


def test_a_gather_of_the_current_call_needs_nothing_staged(node):
    out = node.run(frame(records(0, [3], rand((4, E), 3), origin=1, type_=TYPE_GATHER)))
    assert out.verdict == libbpf.XDP_TX and node.stats()["gathered"] == 1


# --- recovery ------------------------------------------------------------------------------------
def test_nack_restart_at_the_origin_sends_its_own_record_again(node):
    # rank 0 adds last for records whose origin is rank 1: when it misses one it asks rank 1 (its
    # successor) to restart the reduce from rank 1's own record
    mine = rand((2, E), 7)
    stage(node, mine, [0, 1], origin_of=lambda k: 1)
    nack = records(0, [0, 1], np.zeros((2, E), np.int32), origin=1, type_=TYPE_NACK)
    for j in range(2):
        nack[j * REC + O["flags"]] = FLAG_RESTART
    out = node.run(frame(nack, src=0))
    assert out.verdict == libbpf.XDP_TX
    for i in range(2):
        h = hdr(out.data, i)
        assert (h["type"], h["flags"], h["rank"], h["mask"], h["epoch"]) == (TYPE_REDUCE, 0, 1, 2, CALL)
        assert np.array_equal(payload(out.data, i), mine[i])
    assert out.data[30:34] == socket.inet_aton(PEERS[2])
    st = node.stats()
    assert st["restarted"] == 2 and conserved(st)


def test_nack_for_a_final_sends_the_stored_one_again(node):
    final = rand((1, E), 8)
    node.run(frame(records(0, [4], np.concatenate([np.zeros((4, E), np.int32), final]), origin=0,
                           type_=TYPE_GATHER)))
    node.reset_stats()
    # rank 2 (the successor) misses record 4 and asks its predecessor, rank 1
    nack = records(2, [4], np.zeros((5, E), np.int32), origin=0, type_=TYPE_NACK)
    out = node.run(frame(nack, src=2))
    assert out.verdict == libbpf.XDP_TX
    h = hdr(out.data)
    assert (h["type"], h["rank"], h["slot"]) == (TYPE_GATHER, 1, 4)
    assert np.array_equal(payload(out.data), final[0])
    assert out.data[30:34] == socket.inet_aton(PEERS[2])
    assert node.stats()["resent"] == 1
    # what is not stored (or not staged) cannot be answered
    out = node.run(frame(records(2, [5], np.zeros((6, E), np.int32), origin=0, type_=TYPE_NACK), src=2))
    assert out.verdict == libbpf.XDP_DROP
    st = node.stats()
    assert st["unanswered"] == 1 and conserved(st)


def test_ping_is_answered_with_the_nodes_call_and_progress(node):
    node.maps.state[ST_EXPECTED] = 9
    node.run(frame(records(0, [2], rand((3, E)), origin=0, type_=TYPE_GATHER)))
    ping = codec.encode_blocks(np.zeros((1, 0), np.int32), rank=2, job=1, epoch=CALL, slot=0, set=0, round=0, mask=0,
                               count=0, type=TYPE_PING)
    out = node.run(frame(ping, src=2))
    assert out.verdict == libbpf.XDP_TX
    h = hdr(out.data)
    assert (h["type"], h["rank"], h["epoch"], h["slot"], h["round"]) == (TYPE_PONG, 1, CALL, 1, 9)
    assert out.data[0:6] == bytes.fromhex(MACS[2].replace(":", "")) and out.data[30:34] == socket.inet_aton(PEERS[2])
    assert node.stats()["ping"] == 1
    # a PONG is for the host: it passes
    pong = bytearray(ping)
    pong[O["type"]] = TYPE_PONG
    assert node.run(frame(pong, src=2)).verdict == libbpf.XDP_PASS


def test_the_host_is_woken_when_the_call_is_complete_and_when_its_window_opens(node):
    fresh(node, expected=3)
    st = node.maps.state
    st[ST_OWN_WAKE] = 1
    ev = node.maps.events
    node.run(frame(records(0, [0], rand((1, E)), origin=1, type_=TYPE_GATHER)))  # own chunk: the window
    assert ev.drain() == [(CALL, EV_WINDOW)]
    node.run(frame(records(0, [1], rand((2, E)), origin=0, type_=TYPE_GATHER)))
    assert ev.drain() == []
    node.run(frame(records(0, [2], rand((3, E)), origin=0, type_=TYPE_GATHER)))
    assert ev.drain() == [(CALL, EV_DONE)]
    assert node.stats()["wakeups"] == 2


# --- what is not ours, and what is malformed -----------------------------------------------------
def _bad(data, **fields):
    b = bytearray(data)
    for name, value in fields.items():
        off = O[name]
        code = dict((n, c) for n, _, c in proto.FIELDS)[name]
        b[off:off + struct.calcsize("!" + code)] = struct.pack("!" + code, value)
    return bytes(b)


def malformed():
    good = bytes(records(0, [0], rand((1, E)), origin=0))
    two = bytes(records(0, [0, 1], rand((2, E)), origin=0))
    return [
        ("bad_magic", frame(_bad(good, magic=0x1234))),
        ("bad_version", frame(_bad(good, version=1))),
        ("bad_job", frame(_bad(good, job=99))),
        ("bad_rank", frame(_bad(good, rank=7))),
        ("bad_src", frame(_bad(good, rank=2))),                      # rank 2's record from rank 0's address
        ("bad_hop", gen.frame(_bad(good, rank=2), src_mac=MACS[2], dst_mac=MACS[1], src_ip=PEERS[2],
                              dst_ip=PEERS[1])),                     # a REDUCE from the successor
        ("bad_slot", frame(_bad(good, slot=64, round=64))),
        ("bad_slot", frame(_bad(good, round=3))),
        ("bad_origin", frame(_bad(good, mask=3))),
        ("bad_origin", frame(_bad(good, mask=8))),
        ("bad_origin", frame(_bad(good, mask=0))),
        ("bad_len", frame(_bad(good, count=0))),
        ("bad_len", frame(_bad(good, count=E + 1))),
        ("bad_len", frame(good + b"\0" * 8)),
        ("bad_op", frame(_bad(good, op=proto.OP_OR))),
        ("bad_flags", frame(_bad(good, flags=FLAG_RESTART))),
        ("bad_mixed", frame(two[:REC] + _bad(two[REC:], epoch=CALL + 1))),
        ("bad_mixed", frame(two[:REC] + _bad(two[REC:], type=TYPE_NACK))),
        ("bad_truncated", frame(good[:20])),
    ]


@pytest.mark.parametrize("why,f", malformed(), ids=[m[0] for m in malformed()])
def test_malformed_records_are_counted_by_reason_and_dropped(node, why, f):
    stage(node, rand((2, E)), [0, 1])
    out = node.run(f)
    st = node.stats()
    assert st[why] >= 1, nonzero(st)
    assert conserved(st), nonzero(st)
    if why != "bad_mixed":
        assert out.verdict == libbpf.XDP_DROP
    assert not {k for k, v in st.items() if v and k.startswith("bad_")} - {why}


def test_foreign_traffic_passes_untouched(node):
    good = bytes(records(0, [0], rand((1, E)), origin=0))
    result = codec.encode_blocks(np.zeros((1, E), np.int32), rank=proto.RANK_AGG, job=1, slot=0, set=0, round=0,
                                 mask=7, type=proto.TYPE_RESULT)
    for f in (gen.frame(good, src_mac=MACS[0], dst_mac=MACS[1], src_ip=PEERS[0], dst_ip=PEERS[1], dport=9),
              gen.frame(good, src_mac=MACS[0], dst_mac=MACS[1], src_ip=PEERS[0], dst_ip="10.0.0.99"),
              frame(result)):
        out = node.run(f)
        assert out.verdict == libbpf.XDP_PASS and out.data == f
    st = node.stats()
    assert st["passed"] == 3 and st["records"] == 0


# --- the host's kernel does what the program does -------------------------------------------------
@pytest.mark.parametrize("case", ["reduce", "final", "gather", "nack"])
def test_host_processing_matches_the_program(nodes, case):
    n = nodes[1]
    fresh(n)
    mine, theirs = rand((4, E), 11), rand((4, E), 12)
    origin, type_ = {"reduce": (0, TYPE_REDUCE), "final": (2, TYPE_REDUCE), "gather": (1, TYPE_GATHER),
                     "nack": (1, TYPE_NACK)}[case]
    stage(n, mine, range(4), origin_of=lambda k: origin)
    buf = records(0, range(4), theirs, origin=origin, type_=type_)
    if case == "nack":
        for j in range(4):
            buf[j * REC + O["flags"]] = FLAG_RESTART
    # the host's kernel, on copies of the maps
    local = np.array(n.maps.local, copy=True)
    result = np.array(n.maps.result, copy=True)
    st = np.zeros(16, np.uint32)
    cnt = np.zeros(len(STATS), np.int64)
    out = np.zeros(8 * REC, np.uint8)
    io = np.zeros(hop.IO_WORDS, np.int64)
    addrs = np.array([int.from_bytes(socket.inet_aton(ip), "little") for ip in PEERS], np.int64)
    pongs, pings = np.zeros((WORLD, 4), np.int64), np.zeros(4, np.int64)
    hop.process_datagram(buf, 0, len(buf), addrs[0], addrs, REC, E, 1, WORLD, 1, CALL, 64, local, result, out,
                        out.copy(), st, cnt, np.zeros(REC, np.uint8), np.zeros(1, np.int64), pongs, pings, io)
    prog = n.run(frame(buf))
    assert prog.verdict == libbpf.XDP_TX
    assert bytes(out[:io[hop.IO_OUT] * REC]) == prog.data[proto.L2L4_LEN:]
    assert np.array_equal(result, n.maps.result)
    host = {k: int(v) for k, v in zip(STATS, cnt) if v}
    assert host == {k: v for k, v in nonzero(n.stats()).items() if k not in ("wakeups",)}
