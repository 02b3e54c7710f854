"""The round stream's congestion window, without sockets: how it opens on results, how a loss
episode cuts it once, its bounds, and what it converges to behind a shared bottleneck (synthetic
event sequences, one step per round trip)."""
from __future__ import annotations

import pytest

from nicoffload.worker.congestion import DECREASE, FLOOR, INITIAL, QUEUE_MIN, RECENT, Window


def limited(cap: int = 1024, **kw) -> Window:
    w = Window(cap, **kw)
    w.limited = True
    return w


def round_trip(w: Window) -> None:
    """A round trip in which every round of the window gets its result."""
    w.on_results(w.size)


def test_slow_start_doubles_per_round_trip_up_to_the_cap():
    w = limited(1024)
    sizes = [w.size]
    for _ in range(6):
        round_trip(w)
        sizes.append(w.size)
    assert sizes == [INITIAL, 128, 256, 512, 1024, 1024, 1024]
    assert w.full and w.room(1000) == 24 and w.room(2000) == 0


def test_a_window_that_does_not_limit_the_sends_does_not_grow():
    w = Window(1024)
    w.limited = False  # a small call, or the gate held the stream
    for _ in range(10):
        w.on_results(64)
    assert w.size == INITIAL


def test_congestion_avoidance_opens_by_the_increase_per_round_trip():
    w = limited(1024, initial=100, increase=2.0)
    w.ssthresh = 100.0
    for _ in range(10):
        round_trip(w)
    assert w.size == pytest.approx(120, abs=1)


def test_a_loss_episode_cuts_once_however_many_of_its_rounds_are_found_lost():
    w = limited(1024, initial=400)
    assert w.on_loss(latest_lost=1000, sent_edge=1300)
    assert w.size == int(400 * DECREASE) and w.cuts == 1
    # rounds sent before the cut, found lost later (by the gap, then by a timeout): same episode
    assert not w.on_loss(latest_lost=1100, sent_edge=1400)
    assert not w.on_loss(latest_lost=1299, sent_edge=1500)
    assert w.size == 200 and w.cuts == 1
    # a round sent under the cut window is lost: a new episode
    assert w.on_loss(latest_lost=1300, sent_edge=1600)
    assert w.size == 100 and w.cuts == 2 and w.ssthresh == 100


def test_after_a_cut_the_window_grows_linearly_not_by_slow_start():
    w = limited(1024, initial=400)
    w.on_loss(10, 20)
    round_trip(w)
    assert w.cwnd == pytest.approx(201.0)


def test_the_window_stays_between_its_floor_and_its_cap():
    w = limited(32, initial=1000)
    assert w.size == 32
    for k in range(20):
        w.on_loss(100 * k + 50, 100 * k + 100)
    assert w.size == FLOOR
    w = limited(FLOOR - 1)  # a job of fewer slots than the floor: the floor is the cap
    assert w.size == w.floor == FLOOR - 1


def test_a_new_epoch_starts_new_episodes():
    w = limited(1024, initial=400)
    assert w.on_loss(5000, 6000)
    # the numbering started again from 0 (a new epoch): round 10 is not part of the old episode
    assert w.on_loss(10, 50)
    assert w.cuts == 2


def measured(w: Window, *rtts: float) -> Window:
    for rtt in rtts:
        w.on_results(1, rtt)
    return w


def test_a_loss_without_a_queue_leaves_the_window_where_it_was():
    # round trips as short as ever (a frame lost at random, a fault): no cut
    w = measured(limited(1024, initial=512), 0.0005, 0.004, 0.0006, *[0.0007] * RECENT)
    size = w.size
    assert not w.queued() and not w.on_loss(100, 200)
    assert w.size == size and w.cuts == 0 and w.random_losses == 1
    # the same episode stays answered; a later one behind a standing queue cuts
    assert not w.on_loss(150, 260)
    measured(w, *[0.0005 + QUEUE_MIN + 0.010] * RECENT)  # every recent round trip 10 ms longer
    size = w.size
    assert w.queued() and w.on_loss(300, 400) and w.size == size // 2


def test_one_short_round_trip_among_the_recent_ones_means_no_queue():
    w = measured(limited(1024), 0.0002, *[0.015] * (RECENT - 1), 0.0003)  # a CPU stall spoils most samples
    assert not w.queued()
    measured(w, *[0.015] * RECENT)
    assert w.queued()


def test_a_queue_is_judged_against_the_floor_of_the_round_trip():
    w = measured(limited(1024), 0.030, *[0.045] * RECENT)  # 30 ms of path: 15 ms more is no queue yet
    assert not w.queued()
    measured(w, *[0.061] * RECENT)
    assert w.queued()


def test_without_measurements_every_loss_counts_as_congestion():
    w = limited(1024, initial=512)
    assert w.queued() and w.on_loss(1, 2)


def test_bad_parameters_are_refused():
    for kw in ({"cap": 0}, {"cap": 8, "decrease": 1.0}, {"cap": 8, "increase": 0}):
        with pytest.raises(ValueError):
            Window(**kw)


def _share(ranks: list[Window], capacity: int, trips: int, edge: list[int]) -> list[list[int]]:
    """``trips`` round trips of ``ranks`` behind one bottleneck that holds ``capacity`` rounds in
    flight (its pipe and its queue): while their windows fit, every round gets its result; a
    round trip that overflows it loses rounds of every rank (tail drop of the batches on a shared
    queue), and each finds the loss. Returns each round trip's window sizes."""
    sizes = []
    for _ in range(trips):
        over = sum(w.size for w in ranks) > capacity
        for i, w in enumerate(ranks):
            sent = w.size
            edge[i] += sent
            if over:
                w.on_loss(edge[i] - 1, edge[i])
                w.on_results(sent // 2)
            else:
                w.on_results(sent)
        sizes.append([w.size for w in ranks])
    return sizes


def test_one_rank_behind_a_bottleneck_saws_between_half_and_all_of_it():
    w = limited(1024)
    sizes = _share([w], capacity=300, trips=400, edge=[0])
    late = [s[0] for s in sizes[100:]]
    assert min(late) >= 300 * DECREASE - 2 and max(late) <= 302
    assert w.cuts >= 2


def test_ranks_sharing_a_bottleneck_converge_to_equal_shares():
    a, b = limited(1024, initial=600), limited(1024, initial=16)
    a.ssthresh = b.ssthresh = 16.0  # both past slow start: AIMD alone
    sizes = _share([a, b], capacity=400, trips=3000, edge=[0, 0])
    wa, wb = zip(*sizes[-200:])
    assert abs(sum(wa) - sum(wb)) / (sum(wa) + sum(wb)) < 0.05
    assert 400 * DECREASE * 0.9 <= (sum(wa) + sum(wb)) / 200 <= 400
