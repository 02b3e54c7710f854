"""The slot algorithm under concurrency: two processes pinned to two CPUs run the contributions of
the same rounds through BPF_PROG_TEST_RUN in lock-step. The real build is exact every time; a
mutant built without the slot's spin lock (-DAR_MUTANT_NO_SLOT_LOCK, test only) must be caught,
so that the stress cannot quietly weaken into one that no longer sees races.

How the stress makes the two CPUs meet in the critical section:
- processes, not threads: each has its own interpreter, so neither waits for the other's GIL;
- a step is one program run per process: the first process sends a batch of one of ranks
  0..n/2-1, the second one of ranks n/2..n-1, both for the same ``2 * SLOTS`` rounds (every set of
  every slot once: a generation), small records so a run walks many of them;
- the first process's batches walk the rounds upwards, the second's downwards: whenever the two
  runs overlap in time, they meet on the same set, whatever their offset;
- after each step both spin on a shared counter (a barrier of well under a microsecond), so the
  next two runs start together; a generation's rounds are complete before the next generation
  reuses the sets;
- the ranks acknowledge every round of the stress up front, so no set's reuse waits for
  acknowledgements and every result carries the same gate.
"""
from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections import Counter

import numpy as np
import pytest

from nicoffload.agg.control import Aggregator
from nicoffload.ebpf import libbpf
from nicoffload.packets import generators as gen
from nicoffload.wire import proto
from nicoffload.wire.codec import encode_blocks

RANKS = 8           # split over the two processes
SLOTS = 16          # a generation is 2 * SLOTS rounds, one record each per rank and batch
ELEMS = 8           # small records: a batch of 32 records fits the test run's linear data
GENERATIONS = 50    # per pass: 1,600 rounds, 12,800 records, 400 program runs
OP = proto.OP_SUM
REAL_PASSES = 30    # passes of the real build (48,000 rounds), each exact
MUTANT_BUDGET_S = 10.0  # the mutant must be caught within this (measured: in the first pass, < 0.1 s)
STALL_S = 30.0      # a process that waits this long for its peer gives up

_GROUP = socket.inet_aton(gen.GROUP_IP)
_DST_AT = 14 + 16  # the IPv4 destination: after the Ethernet header, 16 bytes into IPv4
_ROUND_AT = {name: off for name, off, _ in proto.FIELDS}["round"]


def _round_of(record: bytes) -> int:
    return int.from_bytes(record[_ROUND_AT:_ROUND_AT + 4], "big")


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    return cpus[0], cpus[1]


def _load(mutant: bool) -> Aggregator:
    return Aggregator.for_test(RANKS, slots=SLOTS, elems=ELEMS, agg_ip=gen.AGG_IP, agg_mac=gen.AGG_MAC,
                               group=gen.GROUP_IP, worker_ips=[gen.worker_ip(r) for r in range(RANKS)],
                               defines={"AR_MUTANT_NO_SLOT_LOCK": 1} if mutant else None)


@pytest.fixture(scope="module")
def real_agg():
    agg = _load(mutant=False)
    yield agg
    agg.close()


@pytest.fixture(scope="module")
def mutant_agg():
    agg = _load(mutant=True)
    yield agg
    agg.close()


class Stress:
    """The frames of one pass and the results the aggregator must send for them.

    ``frames[p][step]``: what process p runs at a step (step = generation * RANKS/2 + i runs the
    batch of rank p * RANKS/2 + i for that generation's rounds)."""

    def __init__(self, epoch: int, seed: int = 7):
        rounds = GENERATIONS * 2 * SLOTS
        self.rounds = rounds
        #: every rank acknowledges every round of the pass from the start
        self.horizon = rounds
        rng = np.random.default_rng(seed)
        arrays = [rng.integers(-2**31, 2**31, size=rounds * ELEMS, dtype=np.int64).astype(np.int32)
                  for _ in range(RANKS)]
        slot, set_ = gen.slot_schedule(rounds, SLOTS)
        size = proto.record_size(ELEMS)
        gen_len = 2 * SLOTS
        half = RANKS // 2
        per_rank = []
        for r in range(RANKS):
            buf = bytes(encode_blocks(arrays[r].reshape(rounds, ELEMS), rank=r, job=1, epoch=epoch, slot=slot,
                                      set=set_, round=np.arange(rounds), mask=(1 << RANKS) - 1, ack=self.horizon,
                                      op=OP, key=gen.KEY))
            recs = [buf[i:i + size] for i in range(0, len(buf), size)]
            down = r >= half  # the second process walks each generation's rounds downwards
            per_rank.append([gen.batch(recs[g * gen_len:(g + 1) * gen_len][::-1 if down else 1], r)
                             for g in range(GENERATIONS)])
        self.frames = [[per_rank[p * half + i][g] for g in range(GENERATIONS) for i in range(half)]
                       for p in range(2)]
        self.want = gen.expected_results(arrays, slots=SLOTS, epoch=epoch, elems=ELEMS, op=OP, gate=self.horizon)

    def prime(self, agg: Aggregator, epoch: int) -> None:
        for r in range(RANKS):
            agg.run(gen.ack_frame(r, self.horizon, epoch=epoch))

    def run(self, agg: Aggregator, cpus: tuple[int, int]) -> list[tuple[int, bytes]]:
        """One pass from clean slots: (verdict, frame) of every program run of both processes."""
        agg.reset_slots()
        agg.reset_stats()
        return _lockstep(agg.prog.fd, self.frames, cpus)

    def discrepancies(self, outs: list[tuple[int, bytes]], st: dict[str, int]) -> list[str]:
        """What differs from an exact pass (empty: exact)."""
        size = proto.record_size(ELEMS)
        got: Counter = Counter()
        problems = []
        verdicts = Counter(v for v, _ in outs)
        if set(verdicts) - {libbpf.XDP_TX, libbpf.XDP_DROP}:
            problems.append(f"verdicts {dict(verdicts)}")
        for v, data in outs:
            if v != libbpf.XDP_TX:
                continue
            if data[_DST_AT:_DST_AT + 4] != _GROUP:
                problems.append(f"a result frame to {socket.inet_ntoa(data[_DST_AT:_DST_AT + 4])}, not the group")
            payload = data[proto.L2L4_LEN:]
            got.update(payload[i:i + size] for i in range(0, len(payload), size))
        want = Counter(self.want)
        if got != want:
            missing, extra = want - got, got - want
            rounds = sorted({_round_of(r) for r in (missing + extra).elements()})
            problems.append(f"{sum(missing.values())} of {len(self.want)} results missing, "
                            f"{sum(extra.values())} not expected (a wrong sum or header, or a second "
                            f"completion); rounds {rounds[:8]}{' ...' if len(rounds) > 8 else ''}")
        n = self.rounds
        expect = {"completed": n, "aggregated": n * RANKS, "records": n * RANKS,
                  "result_sent": verdicts[libbpf.XDP_TX], "dup_dropped": 0, "early": 0, "stale_round": 0,
                  "mismatch": 0}
        off = {k: (st[k], v) for k, v in expect.items() if st[k] != v}
        if off:
            problems.append("counters (got, want): " + ", ".join(f"{k} {g}/{w}" for k, (g, w) in off.items()))
        return problems


def _lockstep(fd: int, frames: list[list[bytes]], cpus: tuple[int, int]) -> list[tuple[int, bytes]]:
    """Run frames[0] in this process on cpus[0] and frames[1] in a forked child on cpus[1], one
    frame per step, both spinning on a shared counter after each step until the other is done."""
    shared = mmap.mmap(-1, 16)
    steps = memoryview(shared).cast("Q")

    def drive(me: int) -> list[tuple[int, bytes]]:
        other, outs = 1 - me, []
        deadline = time.monotonic() + STALL_S
        for step, frame in enumerate(frames[me], 1):
            o = libbpf.test_run(fd, frame)
            outs.append((o.verdict, o.data if o.verdict == libbpf.XDP_TX else b""))
            steps[me] = step
            spins = 0
            while steps[other] < step:
                spins += 1
                if not spins & 0xFFFF and time.monotonic() > deadline:
                    raise TimeoutError(f"process {other} stalled before step {step}")
        return outs

    fd_out, path = tempfile.mkstemp(prefix="nicoffload-lockstep-")
    os.close(fd_out)
    affinity = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            os.sched_setaffinity(0, {cpus[1]})
            result = drive(1)
            code = 0
        except BaseException:
            result = traceback.format_exc()
        finally:
            try:
                with open(path, "wb") as f:
                    pickle.dump(result, f)
            finally:
                os._exit(code)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        try:
            outs = drive(0)
        except BaseException:
            os.kill(pid, signal.SIGKILL)  # it would wait for this process until it stalls
            raise
        finally:
            os.sched_setaffinity(0, affinity)
            _reap(pid)
        with open(path, "rb") as f:
            theirs = pickle.load(f)
    finally:
        os.unlink(path)
    if isinstance(theirs, str):
        raise AssertionError(f"the second process failed:\n{theirs}")
    return outs + theirs


def _reap(pid: int) -> None:
    """Wait for the child; one that does not end within STALL_S is killed."""
    deadline = time.monotonic() + STALL_S
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_exact_when_two_cpus_hit_the_same_slots(real_agg, joined):
    cpus = _two_cpus()
    ep = joined(real_agg, RANKS)
    stress = Stress(ep)
    stress.prime(real_agg, ep)
    for p in range(REAL_PASSES):
        outs = stress.run(real_agg, cpus)
        assert stress.discrepancies(outs, real_agg.stats()) == [], f"pass {p}"


def test_the_stress_catches_a_build_without_the_slot_lock(mutant_agg, joined):
    """The mutation check: with the slot's lock compiled out, the same stress must see a wrong
    result (lost contributions, rounds that never complete, wrong sums) within MUTANT_BUDGET_S. If
    this fails, the stress above no longer proves the lock matters."""
    cpus = _two_cpus()
    ep = joined(mutant_agg, RANKS)
    stress = Stress(ep)
    stress.prime(mutant_agg, ep)
    start, passes = time.monotonic(), 0
    while True:
        passes += 1
        outs = stress.run(mutant_agg, cpus)
        if stress.discrepancies(outs, mutant_agg.stats()):
            return
        spent = time.monotonic() - start
        assert spent < MUTANT_BUDGET_S, (
            f"{passes} passes ({spent:.1f} s) of the stress without the slot's lock were all exact: "
            f"the stress no longer makes the two CPUs race on a slot")
