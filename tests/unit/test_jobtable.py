"""Admission and partitioning of the aggregator's slot pool among jobs (no BPF)."""
from __future__ import annotations

import pytest

from nicoffload.agg.jobtable import JobTable
from nicoffload.errors import AlreadyExistsError, CapacityError, InputError, NotFoundError
from nicoffload.wire import proto


def group(i: int) -> str:
    return f"239.77.0.{i}"


def test_shares_are_disjoint_and_first_fit():
    t = JobTable(1024)
    a = t.admit(1, 2, group(1), slots=256)
    b = t.admit(2, 4, group(2), slots=512)
    assert (a.slot_base, a.slot_count, a.index) == (0, 256, 0)
    assert (b.slot_base, b.slot_count, b.index) == (256, 512, 1)
    t.remove(1)
    c = t.admit(3, 2, group(3), slots=128)  # the hole job 1 left
    assert (c.slot_base, c.slot_count, c.index) == (0, 128, 0)
    assert t.free_ranges() == [(128, 128), (768, 256)]
    d = t.admit(4, 2, group(4))  # no size: the largest free range
    assert (d.slot_base, d.slot_count) == (768, 256)
    spans = sorted((e.slot_base, e.slot_base + e.slot_count) for e in t.entries.values())
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))


def test_a_full_pool_refuses_and_says_how_much_is_free():
    t = JobTable(100)
    t.admit(1, 2, group(1), slots=60)
    t.admit(2, 2, group(2), slots=30)
    with pytest.raises(CapacityError, match=r"asks for 20 slots.*largest free range of the pool holds 10"):
        t.admit(3, 2, group(3), slots=20)
    assert set(t.entries) == {1, 2}  # a refusal changes nothing
    t.admit(3, 2, group(3))
    with pytest.raises(CapacityError, match="no free slots"):
        t.admit(4, 2, group(4))


def test_the_first_job_without_a_size_takes_the_whole_pool():
    t = JobTable(64)
    assert t.admit(1, 2, group(1)).slot_count == 64
    with pytest.raises(CapacityError):
        t.admit(2, 2, group(2), slots=1)


def test_at_most_max_jobs():
    t = JobTable(proto.MAX_JOBS + 5)
    for j in range(proto.MAX_JOBS):
        t.admit(j, 1, group(j + 1), slots=1)
    assert sorted(e.index for e in t.entries.values()) == list(range(proto.MAX_JOBS))
    with pytest.raises(CapacityError, match=f"holds {proto.MAX_JOBS} jobs"):
        t.admit(99, 1, group(99), slots=1)


def test_ids_groups_and_addresses_must_not_collide():
    t = JobTable(64)
    t.admit(1, 2, group(1), ["10.0.0.1", "10.0.0.2"], slots=8)
    with pytest.raises(AlreadyExistsError):
        t.admit(1, 2, group(2), slots=8)
    with pytest.raises(InputError, match="already job 1's"):
        t.admit(2, 2, group(1), slots=8)
    with pytest.raises(InputError, match="same address"):
        t.admit(2, 2, group(2), ["10.0.0.3", "10.0.0.3"], slots=8)
    with pytest.raises(InputError, match="2 worker addresses given for 3"):
        t.admit(2, 3, group(2), ["10.0.0.3", "10.0.0.4"], slots=8)
    with pytest.raises(InputError, match="not an IPv4 multicast"):
        t.admit(2, 2, "10.1.1.1", slots=8)
    with pytest.raises(NotFoundError, match=r"registered: 1"):
        t.remove(7)


def test_the_table_round_trips_through_its_saved_form():
    t = JobTable(128)
    t.admit(5, 3, group(5), ["10.0.0.1", "10.0.0.2", "10.0.0.3"], slots=32)
    t.admit(6, 2, group(6), slots=16)
    u = JobTable.from_dicts(128, t.to_dicts())
    assert u.to_dicts() == t.to_dicts() and u.free_ranges() == t.free_ranges()


@pytest.mark.parametrize("slots", [0, -3])
def test_a_share_of_no_slots_is_bad_input_not_a_full_pool(slots):
    with pytest.raises(InputError, match="at least 1 slot"):
        JobTable(64).admit(1, 2, group(1), slots=slots)
