"""Hostile traffic at a live ring (the ring offload's side of issue 9): four ranks run int32
AllReduces back to back (reps of one job, every result checked) while the testbed's aggregator
host, no member of the ring, sends rank 1's node thousands of datagrams to the ring's port from
its own address: garbage, records cut short, records of another job, of a rank outside the ring, claiming
the predecessor's rank and the current calls, GATHERs, NACKs and PINGs, and two-record datagrams
beyond the MTU (IP fragments, passed to the stack and left to the host's checks). Every result is
exact; rank 1's program counts each kind once under its own bad_* reason, and the job's own
traffic counts no bad_* on the other nodes. Spoofing a member's address is beyond this (docs/protocol.md §11)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from e2ekit import save
from test_ring_e2e import E, ints, nothing_left, results, ring_spec

from nicoffload.lab.jobs import run_workers
from nicoffload.lab.links import enable_gro
from nicoffload.lab.rings import RingPrograms
from nicoffload.ring import node as ring

FLOOD = r"""
import json, socket, struct, sys, time
import numpy as np
from nicoffload.wire import codec, proto
from nicoffload.ring.layout import TYPE_REDUCE, TYPE_GATHER, TYPE_NACK, TYPE_PING
dst, port, job, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
E = proto.DEFAULT_ELEMS
def recs(rank, job_, call, type_, k=0, n=1):
    x = np.arange(n * E, dtype=np.int32).reshape(n, E)
    return codec.encode_blocks(x, rank=rank, job=job_, epoch=call, slot=k, set=0, round=k, mask=1, count=E,
                               type=type_)
kinds = {
    "garbage": lambda c: bytes(range(256)) * 3,
    "short": lambda c: recs(0, job, c, TYPE_REDUCE)[:proto.HDR_LEN - 3],
    "cut": lambda c: recs(0, job, c, TYPE_REDUCE)[:-7],
    "other_job": lambda c: recs(0, job + 1, c, TYPE_REDUCE),
    "bad_rank": lambda c: recs(9, job, c, TYPE_REDUCE),
    "as_pred": lambda c: recs(0, job, c, TYPE_REDUCE),
    "fragmented": lambda c: recs(0, job, c, TYPE_REDUCE, n=2),  # beyond the MTU: IP fragments
    "gather": lambda c: recs(0, job, c, TYPE_GATHER, k=1),
    "nack": lambda c: recs(2, job, c, TYPE_NACK, k=3),
    "ping": lambda c: recs(2, job, c, TYPE_PING),
}
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = dict.fromkeys(kinds, 0)
end = time.monotonic() + seconds
i = 0
print("go", flush=True)
while time.monotonic() < end:
    for name, make in kinds.items():
        for c in (1, 2, 3, 4, 5, 6, 7, 8):  # the job's first calls, so the records look current
            try:
                s.sendto(make(c), (dst, port))
                sent[name] += 1
            except OSError:
                pass
    i += 1
    if i % 4 == 0:
        time.sleep(0.001)
print(json.dumps(sent), flush=True)
"""


def test_hostile_datagrams_at_a_live_ring_change_no_result(make_testbed, tmp_path):
    tb = make_testbed(4)
    enable_gro(tb)
    xi = ints(4, 6 * E + 3, seed=11)
    ins, outs = save(tmp_path, xi)
    spec = ring_spec(tb).replace(timeout=10.0)
    want = np.sum(np.stack(xi).astype(np.int64), axis=0).astype(np.int32)
    with RingPrograms(tb, spec) as progs:
        w1 = tb.workers[1]
        flood = tb.popen(tb.agg, [sys.executable, "-c", FLOOD, w1.ip, str(tb.port), str(spec.job), "6"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert flood.stdout.readline().strip() == "go", flood.stderr.read()
        except BaseException:
            flood.kill()
            raise
        try:
            run_workers(tb, ins, outs, spec, reps=6)
        finally:
            out, err = flood.communicate(timeout=60)
        sent = json.loads(out.strip().splitlines()[-1])
        for y in results(outs):
            assert np.array_equal(y, want)
        counts = [n.stats() for n in progs.nodes]
    assert sum(sent.values()) > 5000, sent
    c1 = counts[1]
    # each kind under its reason, once (at most what was sent; a frame the veth backlog dropped
    # under load is the only way to count fewer)
    by_reason = {"bad_magic": ["garbage"], "bad_truncated": ["short"], "bad_job": ["other_job"],
                 "bad_rank": ["bad_rank"], "bad_src": ["cut", "as_pred", "gather", "nack", "ping"]}
    for reason, kinds in by_reason.items():
        n = sum(sent[k] for k in kinds)
        assert 0.98 * n <= c1[reason] <= n, (reason, c1[reason], n, c1)
    assert not {k: v for k, v in c1.items() if k.startswith("bad_") and k not in by_reason and v}, c1
    # datagrams beyond the MTU arrive as IP fragments, which the program passes to the stack: the
    # worker's socket gets them reassembled and its own record checks take over (results exact above)
    assert c1["passed"] >= 2 * 0.98 * sent["fragmented"], c1
    for r in (0, 2, 3):
        assert not {k: v for k, v in counts[r].items() if k.startswith("bad_") and v}, (r, counts[r])
    nothing_left(tb)
    assert not ring.loaded(f"nco-{tb.name}-")
