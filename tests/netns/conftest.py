"""Fixtures for end-to-end tests in network namespaces (root; auto-skipped otherwise).

``make_testbed(workers, **topology_kwargs)`` brings up a testbed named after the test's uid and
tears it down when the test ends, pass or fail (with the XDP aggregators recorded in its
namespaces); a final ``clean`` of that uid's prefix removes anything a crash in the middle of
``up`` could have left."""
from __future__ import annotations

import pytest


@pytest.fixture
def make_testbed(uid):
    from nicoffload.agg import control as aggregator
    from nicoffload.testbed import Testbed, Topology, clean

    made = []

    def make(workers: int = 2, suffix: str = "", **kwargs):
        tb = Testbed(Topology.star(f"t{uid}{suffix}", workers, **kwargs))
        made.append(tb)
        return tb.up()

    yield make
    errors = []
    # an aggregator a test loaded and did not unload (it failed first): its state file would stay
    for ns, iface in aggregator.loaded(f"nco-t{uid}"):
        try:
            aggregator.unload(ns, iface, missing_ok=True)
        except Exception as e:
            errors.append(e)
    for tb in reversed(made):
        try:
            tb.down()
        except Exception as e:  # keep tearing down the others
            errors.append(e)
    clean(f"t{uid}")
    if errors:
        raise errors[0]
    sweep_state(f"nco-t{uid}")


def sweep_state(netns_prefix: str) -> None:
    """Remove what aggregators and ring programs of the test's namespaces (all gone by now) left
    in their state directories, as `testbed clean` does, so that a later testbed that draws the
    same name finds none of it (a lock left this way once failed test_chaos); warn with the
    files, since a test should leave none."""
    import warnings

    from nicoffload.cli.testbed import remove_strays

    left = remove_strays(netns_prefix)
    if left:
        warnings.warn(f"the test's aggregators or ring programs left state files (removed): {left}")


@pytest.fixture(autouse=True)
def no_shared_memory_left():
    """Every test leaves /dev/shm as it found it: the ranks of one host unlink their segments as
    soon as they all have them mapped, whatever happens after."""
    from nicoffload.local.segment import PREFIX, SHM

    before = {p.name for p in SHM.glob(PREFIX + "*")}
    yield
    left = sorted({p.name for p in SHM.glob(PREFIX + "*")} - before)
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    assert not left, f"shared memory segments left behind: {left}"
