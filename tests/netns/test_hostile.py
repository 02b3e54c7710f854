"""Hostile traffic during a live job (issue 9): two ranks run AllReduces back to back (float32 and
int32, 4 MiB each) while a third host of the testbed, registered in no job, floods the
aggregator through a raw socket with at least 100,000 frames of :func:`attacks.attack`: every
malformed kind (most from a rank's spoofed address, so that the checks behind the source check
are reached), foreign traffic, records of jobs that are not registered, records claiming a
rank of the job from the attacker's own address, and everything a rank sends from the rank's own
address without the job's key (``bad_key``; tests/netns/test_spoofed_key.py on its own). Every result is exact (int32) or within the
documented bound (float32), and every hostile frame is counted exactly once by its reason, in
its row (row 0 or the job's), while the job's own traffic counts no bad_* at all.

Delivery: a raw socket sends any frame as it is; the frames cut short of their IP/UDP lengths
and the ones below Ethernet's 60 bytes cross the veths and the bridge untouched (no bridge
netfilter, no padding) and the XDP program sees them first (generic mode, before the IP stack).
The only frames the default testbed could not carry are the two-record batches (a worker's
UDP_SEGMENT send arrives whole; a raw frame must fit the MTU): the testbed's MTU is raised to
hold them. Nothing is dropped on the way: the counters add up to exactly what was sent.

``passed`` also counts what else reaches the aggregator's interface and is not ours: with
static neighbours and IPv6 off that is IGMP only (the bridge's querier, reports to link-local
groups); a packet socket behind the XDP program sees exactly what it passed, and the frames it
sees from anyone but the attacker bound the slack."""
from __future__ import annotations

import contextlib
import ctypes
import json
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from scapy.layers.l2 import Ether

from nicoffload.agg.control import Aggregator, AggSpec
from nicoffload.ebpf import libbpf
from nicoffload.lab import reference
from nicoffload.packets import attacks
from nicoffload.packets import generators as gen
from nicoffload.wire import keys, proto
from nicoffload.worker.comm import Communicator

W = 2                     # ranks of the job; one more host attacks
JOB = 3
SLOTS = 128
N = 1 << 20               # elements per AllReduce: 4 MiB of float32 or int32
MIN_FRAMES = 100_000      # hostile frames at least
QUIET_CALLS = 8           # AllReduces measured before the attack
ATTACK_CALLS = 8          # AllReduces that start and end inside the attack, at least
OTHER_JOBS = (JOB + 1, 0, 0xFFFFFFFF)
#: the largest hostile frame is a batch of two records
MTU = 20 + 8 + 2 * proto.record_size(proto.DEFAULT_ELEMS)
BAD = [s for s in proto.STATS if s.startswith("bad_")]

FLOOD = """\
import json, pickle, select, sys
from nicoffload.packets import generators as gen
from nicoffload.packets import attacks
frames = pickle.loads(open(sys.argv[1], "rb").read())
stop = lambda: bool(select.select([sys.stdin], [], [], 0)[0])  # a line, or EOF
f = attacks.flood("eth0", frames, min_frames=int(sys.argv[2]), stop=stop,
                  on_start=lambda t: print(t, flush=True))
print(json.dumps(f._asdict()), flush=True)
"""


# --- the live job ----------------------------------------------------------------------------------


class LiveJob:
    """The job's ranks, one thread each, AllReduce after AllReduce in lock-step (a barrier between
    calls decides for every rank whether another one starts) until :meth:`stop`. Every result is
    checked against its reference; ``calls`` holds each call's input set, start and the time
    each rank had its result (``time.monotonic()``)."""

    def __init__(self, comms: list[Communicator], inputs: list[list[np.ndarray]]):
        self.comms = comms
        self.inputs = inputs
        self.expected = [reference.quantized(ins) for ins in inputs]
        self.calls: list[dict] = []
        self.failures: list[tuple] = []
        self.errors: list[tuple] = []
        self._stop = threading.Event()
        self._go = True
        self._barrier = threading.Barrier(len(comms), action=self._next, timeout=60)
        self._threads = [threading.Thread(target=self._run, args=(r,), daemon=True) for r in range(len(comms))]

    def __enter__(self) -> "LiveJob":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _next(self) -> None:  # one thread, once every rank is done with the previous call
        self._go = not self._stop.is_set()
        if self._go:
            self.calls.append({"set": len(self.calls) % len(self.inputs), "start": time.monotonic(),
                               "ends": [None] * len(self.comms)})

    def _run(self, r: int) -> None:
        try:
            self.comms[r].join()
            while True:
                self._barrier.wait()
                if not self._go:
                    return
                k = len(self.calls) - 1
                call = self.calls[k]
                out = self.comms[r].allreduce(self.inputs[call["set"]][r])
                call["ends"][r] = time.monotonic()
                check = self.expected[call["set"]].check(out)
                if not check.within_bound:
                    self.failures.append((k, r, str(out.dtype), check.reason))
        except threading.BrokenBarrierError:
            pass  # another rank failed: its error is recorded
        except BaseException as e:
            self.errors.append((r, repr(e)))
            self._barrier.abort()

    def done(self) -> list[dict]:
        """Calls every rank has finished."""
        return [c for c in self.calls if None not in c["ends"]]

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s ({len(self.done())} calls done)"
            time.sleep(0.01)

    def between(self, t0: float, t1: float) -> list[dict]:
        """Finished calls that started at t0 or later and ended by t1."""
        return [c for c in self.done() if c["start"] >= t0 and max(c["ends"]) <= t1]


def call_time(c: dict) -> float:
    return max(c["ends"]) - c["start"]


def make_inputs(seed: int) -> list[list[np.ndarray]]:
    """Input sets, float32 and int32 in turn, two of each (consecutive calls differ)."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(2):
        sets.append([(rng.standard_normal(N) * rng.choice([1e-3, 1.0, 1e3], N)).astype(np.float32) for _ in range(W)])
        sets.append([rng.integers(-(1 << 28), 1 << 28, N, dtype=np.int32) for _ in range(W)])
    return sets


# --- what else reaches the aggregator's stack ------------------------------------------------------

SKF_AD_PKTTYPE = -0x1000 + 4
SO_ATTACH_FILTER = 26


class Bystanders:
    """A packet socket on the aggregator's interface that takes what the XDP program passed
    (taps run after generic XDP) from anyone but ``mac`` (a classic BPF filter, so the attacker's
    own foreign frames never fill its buffer), incoming only. Frames from the aggregator's own
    MAC are its results passed up to ar_fanout (unicast delivery): not bystanders either."""

    def __init__(self, tb, mac: str):
        self.tb, self.mac = tb, bytes.fromhex(mac.replace(":", ""))
        self.own = bytes.fromhex(tb.agg.mac.replace(":", ""))
        self.frames: list[bytes] = []

    def __enter__(self) -> "Bystanders":
        hi, lo = struct.unpack("!IH", self.mac)
        ohi, olo = struct.unpack("!IH", self.own)
        prog = [  # (code, jt, jf, k)
            (0x20, 0, 0, SKF_AD_PKTTYPE & 0xFFFFFFFF),  # ld pkttype
            (0x15, 9, 0, socket.PACKET_OUTGOING),       # outgoing: drop
            (0x20, 0, 0, 6),                            # ld [6]: source MAC, first 4 bytes
            (0x15, 0, 2, hi),                           # not the attacker's: next check
            (0x28, 0, 0, 10),                           # ldh [10]: last 2 bytes
            (0x15, 5, 0, lo),                           # the attacker: drop
            (0x20, 0, 0, 6),                            # ld [6] again
            (0x15, 0, 2, ohi),                          # not the aggregator's own: accept
            (0x28, 0, 0, 10),                           # ldh [10]
            (0x15, 1, 0, olo),                          # the aggregator's own results: drop
            (0x06, 0, 0, 0xFFFF),                       # accept
            (0x06, 0, 0, 0),                            # drop
        ]
        self._insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
        fprog = struct.pack("HL", len(prog), ctypes.addressof(self._insns))
        with self.tb.in_host(self.tb.agg):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # receives nothing until bound
        self.sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        self.sock.bind((self.tb.agg.iface, 0x0003))  # ETH_P_ALL
        self.sock.setblocking(False)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.frames.append(self.sock.recv(65536))
        self.sock.close()

    def describe(self) -> list[str]:
        return [Ether(f).summary() for f in self.frames]


# --- counters ------------------------------------------------------------------------------------


def snapshot(agg) -> dict[str, dict[str, int]]:
    return {"row0": agg.unattributed(), "job": agg.stats(JOB), "all": agg.stats()}


def delta(a: dict, b: dict) -> dict[str, dict[str, int]]:
    return {row: {k: b[row][k] - a[row][k] for k in a[row]} for row in a}


def link(tb, host, dev: str = "eth0") -> dict:
    out = tb.run(host, ["ip", "-s", "-j", "link", "show", dev], capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)[0]["stats64"]
    return {"rx": s["rx"]["packets"], "rx_dropped": s["rx"]["dropped"], "tx": s["tx"]["packets"],
            "tx_dropped": s["tx"]["dropped"]}


def expected_counts(frames: list[attacks.AttackFrame], passes: int) -> dict[str, Counter]:
    want = {"row0": Counter(), "job": Counter()}
    for f in frames:
        row = want["job" if f.job_row else "row0"]
        for name in (f.reason, *f.also):
            row[name] += passes
    return want


# --- the tests -------------------------------------------------------------------------------------


def test_each_attack_frame_alone_is_counted_by_its_reason():
    """Every distinct frame of the attack once through BPF_PROG_TEST_RUN: dropped (foreign:
    passed untouched), counted by its reason in its row and nowhere else, no slot, epoch, nonce
    or acknowledgement touched. The flood below sends these very frames."""
    ips = ["10.0.0.1", "10.0.0.2"]
    with contextlib.closing(Aggregator.for_test(W, slots=8, job=JOB, worker_ips=ips)) as agg:
        joins = [gen.frame(gen.join_record(r, W, gen.nonce_of(r), job=JOB), src_mac=gen.worker_mac(r),
                           dst_mac=gen.AGG_MAC, src_ip=ips[r], dst_ip=gen.AGG_IP) for r in range(W)]
        assert [agg.run(f).verdict for f in joins][-1] == libbpf.XDP_TX
        state = agg.job_state(JOB)
        assert state["epoch"]
        frames = attacks.attack(job=JOB, epoch=state["epoch"], worker_ips=ips, slots=8, attacker_ip="10.0.0.9",
                                attacker_mac="02:00:00:00:00:09", other_jobs=OTHER_JOBS)
        assert {f.reason for f in frames} >= set(BAD) | {"passed"}
        assert {f.kind for f in frames} == {"malformed", "foreign", "wrong_job", "spoofed_rank", "spoofed_key"}
        wrong = []
        for f in frames:
            agg.reset_stats()
            out = agg.run(f.frame)
            rows = {"row0": agg.unattributed(), "job": agg.stats(JOB)}
            mine, other = ("job", "row0") if f.job_row else ("row0", "job")
            got = {k: v for k, v in rows[mine].items() if v and k not in ("rx", "records")}
            verdict = libbpf.XDP_PASS if f.kind == "foreign" else libbpf.XDP_DROP
            if (out.verdict, got, any(rows[other].values())) != (verdict, {f.reason: 1, **{a: 1 for a in f.also}}, False):
                wrong.append((f.kind, f.what, out.verdict, got, {k: v for k, v in rows[other].items() if v}))
        assert not wrong, wrong
        assert agg.job_state(JOB) == state
        assert not any(s["used"] for i in range(8) for s in agg.slot(i)["sets"])


@pytest.mark.parametrize("delivery", ["multicast", "unicast"])
def test_hostile_traffic_during_a_live_job(make_testbed, tmp_path, delivery):
    """With unicast delivery on a fabric without multicast (issue 18), the same guarantees hold."""
    tb = make_testbed(W + 1, mtu=MTU, multicast=delivery == "multicast")
    ranks, attacker = tb.workers[:W], tb.workers[W]
    group = tb.topology.group_of(JOB)
    inputs = make_inputs(seed=9)
    key = keys.new_key()
    with Aggregator.load(AggSpec(tb.agg.netns, tb.agg.iface, slots=SLOTS)) as agg, contextlib.ExitStack() as stack:
        agg.add_job(JOB, W, group, [h.ip for h in ranks], slots=SLOTS, delivery=delivery, key=key)
        comms = []
        for r, h in enumerate(ranks):
            with tb.in_host(h):
                comms.append(stack.enter_context(Communicator(r, W, tb.agg.ip, group=group, local_ip=h.ip, job=JOB,
                                                              slots=SLOTS, timeout=20, delivery=delivery, key=key)))
        job = stack.enter_context(LiveJob(comms, inputs))
        job.wait(lambda: len(job.done()) >= 1, 30, "the job's first AllReduce")
        epoch = agg.job_state(JOB)["epoch"]
        assert epoch and all(c.epoch == epoch for c in comms)

        frames = attacks.attack(job=JOB, epoch=epoch, worker_ips=[h.ip for h in ranks], slots=SLOTS,
                                attacker_ip=attacker.ip, attacker_mac=attacker.mac, dst_ip=tb.agg.ip,
                                dst_mac=tb.agg.mac, other_jobs=OTHER_JOBS, key=key)
        assert max(len(f.frame) for f in frames) <= 14 + tb.topology.mtu
        path = tmp_path / "frames.pickle"
        path.write_bytes(pickle.dumps([f.frame for f in frames]))

        # quiet: the job alone counts no bad_* and nothing passes but the bystanders' frames
        with Bystanders(tb, attacker.mac) as quiet_bg:
            q0 = snapshot(agg)
            n0 = len(job.done())
            job.wait(lambda: len(job.done()) >= n0 + QUIET_CALLS, 60, "the quiet AllReduces")
            q1 = snapshot(agg)
        quiet = job.done()[n0:n0 + QUIET_CALLS]
        dq = delta(q0, q1)
        assert {row: {k: dq[row][k] for k in BAD + ["stale_epoch"] if dq[row][k]} for row in dq} == \
            {"row0": {}, "job": {}, "all": {}}
        assert 0 <= dq["row0"]["passed"] <= len(quiet_bg.frames), quiet_bg.describe()

        # the attack: from the attacker's namespace, until ATTACK_CALLS AllReduces ran inside it
        with Bystanders(tb, attacker.mac) as bg:
            a0, links0 = snapshot(agg), {h: link(tb, h) for h in ("agg", attacker.name)}
            proc = tb.popen(attacker, [sys.executable, "-c", FLOOD, str(path), str(MIN_FRAMES)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ready = select.select([proc.stdout], [], [], 30)[0]
            line = proc.stdout.readline() if ready else ""
            assert line, f"the flood did not start: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}"
            started = float(line)
            job.wait(lambda: len(job.between(started, float("inf"))) >= ATTACK_CALLS, 60, "AllReduces under attack")
            out, err = proc.communicate(timeout=60)  # closes its stdin: the flood ends after this pass
            assert proc.returncode == 0, err
            flood = attacks.Flood(**json.loads(out.splitlines()[-1]))
            want = expected_counts(frames, flood.passes)
            unattributed = sum(v for k, v in want["row0"].items() if k != "passed")
            # the flood's frames are handled in its own sends; give stragglers time to arrive
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                now = agg.unattributed()
                if (now["rx"] - a0["row0"]["rx"] >= unattributed
                        and now["passed"] - a0["row0"]["passed"] >= want["row0"]["passed"]):
                    break
                time.sleep(0.05)
            a1, links1 = snapshot(agg), {h: link(tb, h) for h in ("agg", attacker.name)}
        job.stop()

    assert not job.errors, job.errors
    assert not job.failures, job.failures[:5]
    d = delta(a0, a1)
    links = {h: {k: links1[h][k] - links0[h][k] for k in links0[h]} for h in links0}
    sent = {kind: flood.passes * n for kind, n in Counter(f.kind for f in frames).items()}
    context = f"flood {flood}, links {links}, bystanders {bg.describe()}"
    assert flood.frames >= MIN_FRAMES and sum(sent.values()) == flood.frames

    # every hostile frame counted exactly once, by its reason, in its row; nothing anywhere else
    wrong = {}
    for name in BAD + ["stale_epoch"]:
        got = (d["row0"][name], d["job"][name], d["all"][name])
        exp = (want["row0"][name], want["job"][name], want["row0"][name] + want["job"][name])
        if got != exp:
            wrong[name] = {"got (row 0, job, all rows)": got, "sent": exp}
    assert not wrong, f"{wrong}; {context}"
    assert d["row0"]["rx"] == d["row0"]["records"] == unattributed, context
    # foreign frames pass, plus at most what the packet socket saw pass from others
    assert want["row0"]["passed"] <= d["row0"]["passed"] <= want["row0"]["passed"] + len(bg.frames), context
    assert len(bg.frames) <= 10, bg.describe()
    # no hostile JOIN touched the epoch
    assert (d["job"]["epoch_formed"], d["job"]["join"], d["job"]["stale_join"]) == (0, 0, 0)
    assert all(c.epoch == epoch for c in comms)

    # every result exact (int32) or within the bound (float32), while under attack too
    during = job.between(flood.started, flood.ended)
    assert len(during) >= ATTACK_CALLS and {c["set"] % 2 for c in during} == {0, 1}, len(during)
    reasons = Counter()
    for f in frames:
        reasons[f.reason] += flood.passes
    seconds = flood.ended - flood.started
    print(f"\nhostile frames: {flood.frames} in {flood.passes} passes of {len(frames)} distinct, {seconds:.2f} s, "
          f"{flood.rate:,.0f} frames/s, pushed back {flood.pushed_back}; by kind {dict(sent)}\n"
          f"by reason {dict(sorted(reasons.items()))}, plus stale_epoch {want['job']['stale_epoch']}\n"
          f"row 0 {dict((k, d['row0'][k]) for k in BAD + ['passed'] if d['row0'][k])}\n"
          f"job row {dict((k, d['job'][k]) for k in BAD + ['stale_epoch'] if d['job'][k])}\n"
          f"bystanders passed: quiet {quiet_bg.describe()}, attack {bg.describe()}; links {links}\n"
          f"AllReduce of {N * 4 >> 20} MiB (float32/int32 in turn): quiet {len(quiet)} calls, "
          f"mean {np.mean([call_time(c) for c in quiet]):.3f} s; under attack {len(during)} calls, "
          f"mean {np.mean([call_time(c) for c in during]):.3f} s, max {max(call_time(c) for c in during):.3f} s; "
          f"{len(job.done())} calls in all, every result exact or within its bound")
