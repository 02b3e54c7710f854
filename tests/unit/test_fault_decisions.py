"""The fault injector's decisions without a kernel: the Python mirror of fault_hash against the C
of xdp/fault.c compiled by the host's C compiler, determinism of decide(), and what the injector
predicts from the configuration its testbed keeps (through the FaultSite protocol)."""
from __future__ import annotations

import re
import subprocess
from dataclasses import asdict

import pytest
from wirecheck import c_compiler

from nicoffload.errors import InputError, NotFoundError
from nicoffload.testbed.fault import FaultConfig, FaultInjector, decide, fault_hash
from nicoffload.testbed.topology import Topology
from nicoffload.wire import proto

SEEDS = (0, 1, 7, 2**63 + 5, 2**64 - 1)
CASES = [(seed, link, d, n) for seed in SEEDS for link in (0, 1, 63) for d in (0, 1) for n in (0, 1, 999, 2**40)]


def c_fault_hash(tmp_path, cases):
    """fault_hash as xdp/fault.c computes it: its GOLDEN, mix64 and fault_hash, compiled natively."""
    cc = c_compiler()
    src = (proto.xdp_dir() / "fault.c").read_text()
    m = re.search(r"^#define GOLDEN .*?^static __always_inline u64 fault_hash\(.*?^}\n", src, re.S | re.M)
    assert m, "xdp/fault.c: GOLDEN, mix64 and fault_hash not found"
    calls = "\n".join(f'    printf("%llu\\n", (unsigned long long)fault_hash({s}ULL, {l}ULL, {d}ULL, {n}ULL));'
                      for s, l, d, n in cases)
    c = tmp_path / "fh.c"
    c.write_text("#include <stdio.h>\ntypedef unsigned long long u64;\n#define __always_inline inline\n"
                 f"{m.group(0)}\nint main(void) {{\n{calls}\n    return 0;\n}}\n")
    subprocess.run([cc, "-O1", "-o", tmp_path / "fh", c], check=True)
    out = subprocess.run([tmp_path / "fh"], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def test_python_fault_hash_is_the_c_one(tmp_path):
    assert [fault_hash(*c) for c in CASES] == c_fault_hash(tmp_path, CASES)


def test_decisions_are_a_pure_function():
    a = [decide(5, 1, "ingress", n, 0.3, 0.2) for n in range(1000)]
    assert a == [decide(5, 1, 0, n, 0.3, 0.2) for n in range(1000)]
    assert a != [decide(6, 1, "ingress", n, 0.3, 0.2) for n in range(1000)]
    assert a != [decide(5, 2, "ingress", n, 0.3, 0.2) for n in range(1000)]
    assert a != [decide(5, 1, "egress", n, 0.3, 0.2) for n in range(1000)]
    assert abs(a.count("drop") / 1000 - 0.3) < 0.05
    assert all(decide(1, 1, 0, n, 1.0, 0) == "drop" for n in range(100))
    assert all(decide(1, 1, 0, n, 0, 0) == "pass" for n in range(100))


def test_fault_config_checks_its_values():
    c = FaultConfig(drop=0.5, directions=("egress",))
    assert c.probabilities("egress") == (0.5, 0.0) and c.probabilities("ingress") == (0.0, 0.0)
    assert FaultConfig(directions=(0, 1)).directions == ("ingress", "egress")
    for bad in (dict(drop=1.5), dict(dup=-0.1), dict(seed=-1), dict(seed=2**64), dict(port=0),
                dict(directions=("sideways",))):
        with pytest.raises(InputError):
            FaultConfig(**bad)


class Site:
    """A testbed as the injector sees it: a topology and a saved configuration."""

    def __init__(self, topology, config=None):
        self.topology = topology
        self.saved = dict(config or {})

    def load_fault_config(self):
        return dict(self.saved)

    def save_fault_config(self, config):
        self.saved = dict(config)


def as_saved(cfg: FaultConfig) -> dict:
    return {**asdict(cfg), "directions": list(cfg.directions)}


def test_the_injector_predicts_from_what_its_testbed_saved():
    topo = Topology.star("abc", 2)
    w1 = FaultConfig(drop=0.3, dup=0.1, seed=9, directions=("ingress",))
    faults = FaultInjector(Site(topo, {"w1": as_saved(w1)}))
    assert faults.configured() == {"w1": w1}
    assert faults.pin_dir.parts[-2:] == ("nco-abc-br", "fault")
    link = topo.host("w1").link_id
    want = [decide(9, link, "ingress", n, 0.3, 0.1) for n in range(10, 210)]
    assert faults.predict(1, "ingress", 200, start=10) == faults.predict("w1", 0, 200, start=10) == want
    assert set(want) == {"pass", "drop", "dup"}
    assert faults.predict("w1", "egress", 50) == ["pass"] * 50  # not a faulted direction
    assert faults.predict("w0", "ingress", 50) == ["pass"] * 50  # not a configured link
    with pytest.raises(NotFoundError):
        faults.stats("w0")
    with pytest.raises(InputError):
        faults.predict("w5", "ingress", 1)
