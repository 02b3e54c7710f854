"""Several ranks per host under torchrun (``--nproc-per-node K``), through the backend: shared
memory inside each host, each local rank's share through its own lane across hosts. Every
placement of the same four ranks returns the same bits: 4 hosts x 1 rank (the aggregator job as
it always was), 2 hosts x 2 ranks (two lanes at the service), 3 ranks beside 1 (hosts of unequal
counts: one lane), 1 host x 4 ranks (no service)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from nicoffload.lab.train.torchrun import ServiceProcess, write_token
from tests.netns.test_torch_backend import failed_checks, run

pytest.importorskip("torch")


def bits(out) -> dict[int, dict[str, bytes]]:
    got = {}
    for f in sorted(out.glob("bits*.npz")):
        with np.load(f) as z:
            got[int(f.stem[4:])] = {k: z[k].tobytes() for k in z.files}
    return got


def test_four_ranks_placed_four_ways_sum_to_the_same_bits(make_testbed, tmp_path):
    tb = make_testbed(4)
    with ServiceProcess(tb, write_token(tmp_path / "tok")) as svc:
        ref_out, two_out, one_out = tmp_path / "4x1", tmp_path / "2x2", tmp_path / "1x4"
        odd_out = tmp_path / "3+1"
        outcomes, ref = run(tb, svc, ref_out, ["--phases", "bits"])
        assert sorted(ref) == [0, 1, 2, 3], [o.describe() + o.stderr[-2000:] for o in outcomes]
        outcomes, two = run(tb, svc, two_out, ["--phases", "collectives,bits,ddp"], workers=tb.workers[:2], nproc=2)
        assert sorted(two) == [0, 1, 2, 3], [o.describe() + o.stderr[-2000:] for o in outcomes]
        # hosts of unequal rank counts: the collectives' own checks hold them to a 4-rank job's bound
        outcomes, odd = run(tb, svc, odd_out, ["--phases", "collectives,bits"], workers=tb.workers[:2], nproc=[3, 1])
        assert sorted(odd) == [0, 1, 2, 3], [o.describe() + o.stderr[-2000:] for o in outcomes]
    outcomes, one = run(tb, None, one_out, ["--phases", "bits"], workers=tb.workers[:1], nproc=4,
                        env={"NICOFFLOAD_SERVICE": "", "NICOFFLOAD_REQUIRE_OFFLOAD": "1"})
    assert sorted(one) == [0, 1, 2, 3], [o.describe() + o.stderr[-2000:] for o in outcomes]
    for reports in (ref, two, odd, one):
        assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert failed_checks(two) == []
    assert failed_checks(odd) == []
    assert "aggregator" in ref[0]["group"] and "shared memory" not in ref[0]["group"]
    assert "shared memory + aggregator across hosts (2 host(s) x 2 rank(s), 2 lane(s))" in two[0]["group"]
    assert "shared memory + aggregator across hosts (2 host(s) x 1-3 rank(s), 1 lane(s))" in odd[0]["group"]
    assert "shared memory (1 host(s) x 4 rank(s)" in one[0]["group"]
    want, b2, b1, b31 = bits(ref_out), bits(two_out), bits(one_out), bits(odd_out)
    assert sorted(want) == sorted(b2) == sorted(b1) == sorted(b31) == [0, 1, 2, 3]
    for r in range(4):
        assert sorted(want[r]) == sorted(b2[r]) == sorted(b1[r]) == sorted(b31[r])
        for case in want[r]:
            assert b2[r][case] == want[r][case], (r, case, "2 hosts x 2 ranks")
            assert b31[r][case] == want[r][case], (r, case, "3 ranks beside 1")
            assert b1[r][case] == want[r][case], (r, case, "1 host x 4 ranks")


def test_a_killed_local_rank_fails_the_other_host_naming_it(make_testbed, tmp_path):
    tb = make_testbed(2)
    out = tmp_path / "out"
    with ServiceProcess(tb, write_token(tmp_path / "tok")) as svc:
        outcomes, reports = run(tb, svc, out, ["--phases", "train", "--steps", "4000", "--die-rank", "3",
                                               "--die-at", "20"],
                                env={"NICOFFLOAD_LIVENESS": "3"}, workers=tb.workers[:2], nproc=2, timeout=150)
    died = float((out / "died3").read_text())
    # torchrun's agent takes a dead rank's local peers down with it (rank 2 here), and host 0's
    # agent takes its other rank down once the first of them fails: every report there is, is
    # host 0's, and names a rank of host 1 within NICOFFLOAD_LIVENESS
    assert reports and set(reports) <= {0, 1}, [o.describe() + o.stderr[-2000:] for o in outcomes]
    for r, d in reports.items():
        assert "rank 3" in d.get("error", "") or "rank 2" in d.get("error", ""), d
        assert d["error_at"] - died < 3 + 7, (r, d["error_at"] - died)


def test_hosts_of_five_ranks_get_five_lanes_that_share_one_jobs_slots(make_testbed, tmp_path):
    """Five lanes of a full job's slots each are more than the default pool holds (four): before
    the lanes shared one job's slots, such a group could not start at all (a 409 on every rank)."""
    tb = make_testbed(2)
    with ServiceProcess(tb, write_token(tmp_path / "tok")) as svc:
        outcomes, reports = run(tb, svc, tmp_path / "out", ["--phases", "collectives"], workers=tb.workers[:2],
                                nproc=5)
    assert sorted(reports) == list(range(10)), [o.describe() + o.stderr[-2000:] for o in outcomes]
    assert not any("error" in d for d in reports.values()), {r: d.get("error") for r, d in reports.items()}
    assert failed_checks(reports) == []
    assert "(2 host(s) x 5 rank(s), 5 lane(s))" in reports[0]["group"], reports[0]["group"]
