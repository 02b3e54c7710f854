"""The soak's pure parts without root: nearest-rank percentiles and the call-time table, the
schedule of sizes and dtypes, seeded inputs, the check of a call's results, the summary and its
text, and the ``bench --soak`` command line."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from nicoffload.cli.app import build_parser
from nicoffload.cli.bench import _soak_config
from nicoffload.errors import InputError
from nicoffload.lab import reference, soak
from nicoffload.lab.soak import CallRecord, SoakConfig, SoakSummary
from nicoffload.wire import proto

E = proto.DEFAULT_ELEMS


# --- percentiles and the table ------------------------------------------------------------------
def test_percentiles_are_nearest_rank_values_that_happened():
    v = [7, 1, 3, 10, 2, 9, 4, 8, 6, 5]  # 1..10, unsorted
    assert [soak.percentile(v, p) for p in (0, 10, 11, 50, 90, 99, 100)] == [1, 1, 2, 5, 9, 10, 10]
    assert soak.percentile([0.25], 99) == 0.25
    assert math.isnan(soak.percentile([], 50))
    many = list(range(1, 126))  # 125 calls of a (size, dtype): p99 is the second slowest
    assert soak.percentile(many, 99) == 124 and soak.percentile(many, 90) == 113
    for bad in (-1, 100.5):
        with pytest.raises(InputError):
            soak.percentile(v, bad)


def test_distribution():
    d = soak.distribution([0.3, 0.1, 0.2, 0.4])
    assert d == {"count": 4, "min": 0.1, "median": 0.2, "p90": 0.4, "p99": 0.4, "max": 0.4, "mean": pytest.approx(0.25)}
    empty = soak.distribution([])
    assert empty["count"] == 0 and math.isnan(empty["max"]) and math.isnan(empty["mean"])


def rec(i, b, d, s, **kw) -> CallRecord:
    return CallRecord(i, b, d, s, **kw)


def test_time_table_groups_by_size_and_dtype_with_an_all_row_per_size():
    recs = [rec(0, 4096, "float32", 0.3), rec(1, 1 << 20, "int32", 0.2), rec(2, 4096, "int32", 0.1),
            rec(3, 4096, "int32", 0.5)]
    rows = soak.time_table(recs)
    assert [(r["bytes"], r["dtype"], r["count"]) for r in rows] == [
        (4096, "int32", 2), (4096, "float32", 1), (4096, "all", 3), (1 << 20, "int32", 1), (1 << 20, "all", 1)]
    assert rows[0]["max"] == 0.5 and rows[2]["median"] == 0.3
    assert soak.worst_call(recs).call == 3
    assert soak.worst_call([rec(0, 8, "int32", 0.1), rec(1, 8, "int32", 0.1)]).call == 0  # the first of equals
    assert soak.worst_call([]) is None


# --- configuration and schedule -----------------------------------------------------------------
def test_the_schedule_gives_every_size_and_dtype_pair_equally():
    cfg = SoakConfig(sizes=(1, 2, 3, 4), dtypes=("int32", "float32"))
    seq = [cfg.schedule(i) for i in range(1000)]
    counts = {p: seq.count(p) for p in set(seq)}
    assert len(counts) == 8 and set(counts.values()) == {125}
    assert all(seq[i][0] != seq[i + 1][0] for i in range(999))  # consecutive calls change size
    assert seq[:5] == [(1, "int32"), (2, "int32"), (3, "int32"), (4, "int32"), (1, "float32")]


@pytest.mark.parametrize("bad", [dict(calls=0), dict(sizes=()), dict(sizes=(4,)), dict(dtypes=("int64",)),
                                 dict(dtypes=()), dict(drop=1.5), dict(dup=-0.1), dict(sparsity=1.0),
                                 dict(call_limit=0)])
def test_bad_configurations_are_refused(bad):
    with pytest.raises(InputError):
        SoakConfig(**bad).validate()


def test_the_call_limit_defaults_to_three_timeouts():
    assert SoakConfig().limit == 3 * SoakConfig().spec.timeout
    assert SoakConfig(call_limit=2.5).limit == 2.5
    assert json.loads(json.dumps(SoakConfig().to_dict()))["call_limit"] == SoakConfig().limit


# --- inputs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", soak.DTYPES)
def test_inputs_are_seeded_per_call_with_zero_blocks(dtype):
    xs = soak.call_inputs(5, 17, 3, 64 << 10, dtype, 0.25)
    again = soak.call_inputs(5, 17, 3, 64 << 10, dtype, 0.25)
    other = soak.call_inputs(5, 18, 3, 64 << 10, dtype, 0.25)
    assert len(xs) == 3 and all(x.dtype == np.dtype(dtype) and x.size == (64 << 10) // x.itemsize for x in xs)
    assert all(np.array_equal(a, b) for a, b in zip(xs, again))
    assert not np.array_equal(xs[0], other[0])
    assert not np.array_equal(xs[0], xs[1])  # every rank its own
    blocks = np.stack([x.reshape(-1, E) for x in xs])
    zero = ~blocks.any(axis=2)
    assert 0.1 < zero.mean() < 0.4  # about a quarter of each rank's blocks
    assert (blocks != 0).any(axis=2)[~zero].all()  # zeros come in whole blocks (values are non-zero)
    assert (zero.sum(axis=0) < 3).any() and (zero.sum(axis=0) > 0).any()  # partial contributors


def test_int32_inputs_make_sums_that_wrap():
    xs = soak.call_inputs(0, 0, 3, 4096, "int32", 0.0)
    total = reference.exact_sum(xs)
    assert (np.abs(total) > np.iinfo(np.int32).max).any()


def test_a_ragged_size_zeroes_its_tail_block_whole():
    xs = soak.call_inputs(1, 3, 40, E * 4 * 3 + 40, "int32", 0.5)  # 3 blocks and 10 elements
    tails = [x[3 * E:] for x in xs]
    assert all(len(t) == 10 for t in tails)
    assert any(not t.any() for t in tails) and any(t.all() for t in tails)


# --- the check of a call ------------------------------------------------------------------------
def exact_outputs(xs, world=3):
    want = reference.exact_sum(xs).astype(xs[0].dtype)
    return [want.copy() for _ in range(world)]


def test_right_results_pass_and_any_wrong_element_is_named():
    xs = soak.call_inputs(2, 0, 3, 16 << 10, "int32", 0.25)
    outs = exact_outputs(xs)
    assert soak.check_call(xs, outs) == (-1, "", 0.0)
    outs[0][777] += 1
    rank, why, err = soak.check_call(xs, outs)
    assert rank == 0 and "not exact at 1 elements (first 777)" in why and err == 1.0
    outs = exact_outputs(xs)
    outs[2][5] ^= 1
    rank, why, _ = soak.check_call(xs, outs)
    assert rank == 2 and "rank 2's result differs from rank 0's at 1 elements (first at element 5)" in why


def test_floats_pass_within_their_bound_and_fail_beyond_it():
    xs = soak.call_inputs(3, 1, 3, 16 << 10, "float32", 0.25)
    outs = exact_outputs(xs)
    assert soak.check_call(xs, outs)[0] == -1
    bound = reference.quantized(xs, E).bound
    i = int(np.argmax(np.abs(outs[0])))
    outs[0][i] = np.float32(reference.exact_sum(xs)[i] + 4 * bound[i] + abs(outs[0][i]) * 1e-6)
    rank, why, _ = soak.check_call(xs, outs)
    assert rank == 0 and "outside the error bound" in why


def test_ranks_must_agree_bit_for_bit():
    xs = soak.call_inputs(4, 2, 2, 4096, "float32", 0.9)
    outs = exact_outputs(xs, 2)
    z = int(np.flatnonzero(outs[0] == 0)[0])
    outs[1][z] = -0.0  # the same value, other bits
    rank, why, _ = soak.check_call(xs, outs)
    assert rank == 1 and "same values, other bits" in why


# --- the summary --------------------------------------------------------------------------------
def summary(records, calls=None, **kw) -> SoakSummary:
    cfg = SoakConfig(calls=calls or len(records)).to_dict()
    return SoakSummary(cfg, 3, list(records), **kw)


def test_exact_only_when_every_call_ran_right():
    good = [rec(i, 4096, "int32", 0.001 * (i + 1), retransmissions=i, pulls=1) for i in range(4)]
    assert summary(good).exact
    assert not summary(good, calls=5).exact  # stopped early
    assert not summary(good, error="call 4: rank 1: ...").exact
    bad = good + [rec(4, 4096, "int32", 0.002, ok=False, bad_rank=2, reason="rank 2's result differs")]
    s = summary(bad)
    assert not s.exact and s.failures == [bad[4]]
    assert s.totals() == {"retransmissions": 6, "pulls": 4, "timeouts": 0}
    d = json.loads(json.dumps(s.to_dict()))
    assert d["first_failure"]["call"] == 4 and d["failures"] == 1 and d["worst"]["call"] == 3
    assert len(d["calls"]) == 5 and "calls" not in s.to_dict(records=False)


def test_the_table_says_what_happened():
    recs = [rec(i, 4096 if i % 2 else 1 << 20, "float32", 0.01 * (i + 1), retransmissions=i) for i in range(6)]
    faults = {h: {"ingress": {"seen": 100, "dropped": 2, "duplicated": 3, "passed": 101},
                  "egress": {"seen": 200, "dropped": 4, "duplicated": 5, "passed": 201}} for h in ("agg", "w0")}
    text = soak.format_summary(summary(recs, faults=faults, aggregator={"retx_answered": 7, "bad_len": 1,
                                                                        "pull_answered": 0}, mode="generic"))
    assert "6 of 6 AllReduces, 3 ranks, drop 2.00% and dup 2.00%" in text and "all exact" in text
    assert "  4KiB float32" in text and "  1MiB all" in text
    assert "worst: call 5, 4KiB float32: 60.0 ms with 5 retransmissions" in text
    assert "aggregator: retx_answered 7, malformed 1" in text and "pull_answered" not in text
    assert "  agg" in text and "  w0" in text
    wrong = recs + [rec(6, 4096, "int32", 0.001, ok=False, bad_rank=1, reason="why")]
    text = soak.format_summary(summary(wrong))
    assert "1 WRONG RESULT(S)" in text and "first wrong result: call 6 (4KiB int32), rank 1: why" in text
    assert "STOPPED after 6 calls: it broke" in soak.format_summary(summary(recs, calls=10, error="it broke"))


# --- the command line ---------------------------------------------------------------------------
def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_soak_options():
    workers, cfg = _soak_config(parse("--soak", "1000"))
    assert workers == 3 and cfg == SoakConfig(calls=1000)
    workers, cfg = _soak_config(parse("--soak", "20", "--workers", "4", "--sizes", "8KiB,2MiB", "--dtypes",
                                      "float64,int32", "--drop", "0.05", "--dup", "0", "--seed", "9",
                                      "--timeout", "4", "--sparsity", "0.5", "--mode", "native"))
    assert workers == 4
    assert (cfg.calls, cfg.sizes, cfg.dtypes, cfg.drop, cfg.dup, cfg.seed, cfg.spec.timeout, cfg.sparsity,
            cfg.mode) == (20, (8 << 10, 2 << 20), ("float64", "int32"), 0.05, 0.0, 9, 4.0, 0.5, "native")


@pytest.mark.parametrize("argv,says", [
    (["--rate", "1gbit"], "--soak does not take --rate"),
    (["--reps", "3", "--full"], "--soak does not take --reps, --full"),
    (["--dtype", "int32"], "--dtype (use --dtypes)"),
    (["--workers", "2,4"], "give one value of --workers"),
    (["--drop", "2"], "--drop is a probability"),
    (["--sizes", "4"], "at least 8 bytes"),
])
def test_soak_refuses_what_it_cannot_run(argv, says):
    with pytest.raises(InputError) as ei:
        _soak_config(parse("--soak", "10", *argv))
    assert says in str(ei.value)


def test_record_size_and_slots_reach_the_soak_and_are_checked():
    _, cfg = _soak_config(parse("--soak", "20", "--elems", "512", "--slots", "64"))
    assert (cfg.spec.elems, cfg.spec.slots) == (512, 64)
    assert _soak_config(parse("--soak", "20"))[1].spec == SoakConfig(calls=20).spec
    with pytest.raises(InputError, match="--elems must be even, 2..856"):
        _soak_config(parse("--soak", "20", "--elems", "859"))


@pytest.mark.parametrize("mode", [["--tenants", "2"], ["--torch-overhead"]])
def test_modes_with_their_own_jobs_refuse_a_record_size(mode):
    from nicoffload.cli.bench import _bench
    with pytest.raises(InputError, match="--elems, --slots go with the sweep, --paired and --soak"):
        _bench(parse(*mode, "--elems", "512", "--slots", "64"))


def test_soak_options_need_soak():
    from nicoffload.cli.bench import _bench
    with pytest.raises(InputError, match="--drop, --json go with --soak N"):
        _bench(parse("--drop", "0.1", "--json"))


def test_a_bad_dtype_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--soak", "10", "--dtypes", "int64")
    assert "bad dtypes 'int64'" in capsys.readouterr().err


# --- the loop, on communicators that sum in Python ----------------------------------------------
class FakeComm:
    """A rank that sums through shared memory: right, wrong at ``wrong_at`` calls, raising at
    ``raise_at``, or asleep for ``sleep`` seconds at ``sleep_at``."""

    def __init__(self, rank, shared, wrong_at=(), raise_at=-1, sleep_at=-1, sleep=0.0):
        self.rank, self.shared, self.calls = rank, shared, 0
        self.wrong_at, self.raise_at, self.sleep_at, self.sleep = set(wrong_at), raise_at, sleep_at, sleep
        self.last = None
        self.closed = False

    def join(self):
        self.shared["barrier"].wait(1)

    def allreduce(self, x, out):
        from nicoffload.worker.stream import CallStats

        i, self.calls = self.calls, self.calls + 1
        if i == self.sleep_at:
            time.sleep(self.sleep)
        if i == self.raise_at:
            raise ValueError("broken on purpose")
        b, ins = self.shared["barrier"], self.shared["inputs"]
        ins[self.rank] = x
        b.wait(1)
        out[...] = reference.exact_sum(ins).astype(x.dtype)
        if i in self.wrong_at:
            out.reshape(-1)[3] += 1
        b.wait(1)
        self.last = CallStats(seconds=0.001 * (i % 7 + 1), retransmissions=1, pulls=self.rank, timeouts=i % 2)
        return out

    def close(self):
        self.closed = True


def fake_run(calls, faults=None, world=3, cfg=None):
    """The soak loop on FakeComms (``faults``: rank -> FakeComm options): (summary, error, busy ranks)."""
    import threading

    shared = {"barrier": threading.Barrier(world), "inputs": [None] * world}
    comms = [FakeComm(r, shared, **(faults or {}).get(r, {})) for r in range(world)]
    cfg = cfg or SoakConfig(calls=calls, sizes=(4096, 1 << 16), dtypes=("int32", "float32"), watchdog=False)
    s = SoakSummary(cfg.to_dict(), world)
    ranks = soak._Ranks(comms)
    err = None
    try:
        soak._run_calls(ranks, cfg, s, world, E, None)
    except soak.SoakError as e:
        err = e
    finally:
        busy = ranks.stop(5.0)
    return s, err, busy


def test_the_loop_checks_every_call_and_sums_the_ranks_counters():
    s, err, busy = fake_run(40)
    assert err is None and busy == [] and s.exact and s.count == 40
    assert [r.call for r in s.records] == list(range(40))
    assert s.totals() == {"retransmissions": 120, "pulls": 40 * 3, "timeouts": 3 * 20}
    assert s.records[6].seconds == pytest.approx(0.007)  # the slowest rank's


def test_a_wrong_result_is_recorded_and_the_loop_goes_on():
    s, err, _ = fake_run(12, {2: dict(wrong_at={5})})
    assert err is None and s.count == 12 and not s.exact
    (f,) = s.failures
    assert f.call == 5 and f.bad_rank == 2 and "differs from rank 0's at 1 elements (first at element 3)" in f.reason
    s, _, _ = fake_run(12, {r: dict(wrong_at={7, 9}) for r in range(3)})
    assert [(f.call, f.bad_rank) for f in s.failures] == [(7, 0), (9, 0)]


def test_a_rank_that_raises_stops_the_loop_naming_the_call_the_rank_and_its_error():
    s, err, _ = fake_run(12, {1: dict(raise_at=6)})
    assert err is not None and s.count == 6
    msg = str(err)
    assert msg.startswith("soak stopped at call 6 (4KiB float32): rank 0: BrokenBarrierError; "
                          "rank 1: ValueError: broken on purpose; rank 2: BrokenBarrierError"), msg
    assert err.exit_code == 1 and err.summary is s


def test_a_call_past_its_limit_stops_the_loop_naming_the_ranks_still_inside():
    cfg = SoakConfig(calls=10, sizes=(4096,), call_limit=0.3, watchdog=False, spec=soak.DEFAULT.replace(timeout=1.0))
    t0 = time.monotonic()
    s, err, busy = fake_run(10, {2: dict(sleep_at=4, sleep=2.0)}, cfg=cfg)
    assert "call 4 (4KiB int32): rank(s) 0, 1, 2 still running after 0.3 s" in str(err)
    assert err.exit_code == 9 and s.count == 4 and busy == []  # the sleeper woke within stop's wait
    assert time.monotonic() - t0 < 5
