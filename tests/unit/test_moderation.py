"""The round stream's pauses (nicoffload.worker.moderation): behind a slow link a pass that found
few results waits for a batch, never long enough to drain the window; where results come fast,
at a call's start and at its tail there is no pause at all."""
from __future__ import annotations

import pytest

from nicoffload.worker.moderation import BATCH, MAX_PAUSE, MIN_PAUSE, Moderation


def paced(rate: float, n: int = 13, batches: int = 40) -> Moderation:
    """A moderation that has seen ``batches`` batches of ``n`` results at ``rate`` per second."""
    m = Moderation()
    m.start()
    t = 0.0
    for _ in range(batches):
        m.on_results(n, t)
        t += n / rate
    return m


def test_a_slow_link_with_a_full_window_waits_for_the_rest_of_a_batch():
    m = paced(36_000.0)  # 1 Gbit/s of 3.4 KiB records
    assert m.rate == pytest.approx(36_000.0, rel=0.01)
    # 19 results more take 528 us at that rate: capped at MAX_PAUSE
    assert m.pause(13, 600) == MAX_PAUSE
    m2 = paced(100_000.0)
    assert m2.pause(13, 600) == pytest.approx((BATCH - 13) / 100_000.0, rel=0.01)


def test_the_pause_never_exceeds_a_quarter_of_the_windows_drain():
    m = paced(200_000.0)
    inflight = 4 * BATCH  # drains in 640 us at that rate: a quarter is 160 us
    assert m.pause(0, inflight) == pytest.approx(inflight / (4 * 200_000.0), rel=0.01)
    assert m.pause(0, inflight) < (BATCH - 0) / 200_000.0


@pytest.mark.parametrize("new, inflight", [(BATCH, 1000), (BATCH + 5, 1000), (3, 4 * BATCH - 1), (0, 0)])
def test_no_pause_with_a_batch_in_hand_or_too_little_in_flight(new, inflight):
    assert paced(36_000.0).pause(new, inflight) == 0.0


def test_no_pause_where_results_come_fast_or_before_any_rate_is_known():
    assert paced(2_000_000.0).pause(1, 1000) == 0.0  # 15.5 us < MIN_PAUSE: not worth a sleep
    assert (BATCH - 1) / 2_000_000.0 < MIN_PAUSE
    m = Moderation()
    m.on_results(10, 1.0)  # one batch: no interval yet
    assert m.rate == 0.0 and m.pause(1, 1000) == 0.0


def test_a_new_call_does_not_count_the_time_between_calls():
    m = paced(36_000.0)
    rate = m.rate
    m.start()
    m.on_results(13, 1e6)  # the next call's first batch, long after the last
    assert m.rate == rate


def test_rest_sleeps_the_pause_and_says_when_the_loop_looks_again():
    m = paced(36_000.0)
    slept = []
    t = 10.0
    m.on_results(13, t - 13 / 36_000.0)
    back = m.rest(13, 600, t, sleep=slept.append)
    assert slept == [MAX_PAUSE] and back == pytest.approx(t + MAX_PAUSE)
    assert m.rest(BATCH, 600, t + 0.01, sleep=slept.append) == t + 0.01 and len(slept) == 1
