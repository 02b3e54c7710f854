"""What is installed is one namespace (nicoffload, with nicoffload.xdp / .packets / .testbed /
.lab), and it works three ways: a non-editable ``pip install .``, a plain checkout with nothing
installed, and the editable install the suite runs in. Each check runs in a fresh interpreter
whose import path holds only that copy (ahead of the editable install)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
from pathlib import Path
import nicoffload
from nicoffload.wire import proto
from nicoffload.packets import generators, hostile, layers
from nicoffload.testbed import topology
from nicoffload.lab.bench import plan
from nicoffload.cli.app import build_parser
from nicoffload.worker import Communicator
from nicoffload.agg import Aggregator
from nicoffload.ring import RingCommunicator, RingNode
from nicoffload.userspace import UserspaceAggregator
import nicoffload.ebpf.loader, nicoffload.datapath.transport, nicoffload.lab.jobs, nicoffload.cli.agg
where = Path(sys.argv[1]).resolve()
mods = (nicoffload, generators, hostile, layers, topology, plan, nicoffload.ebpf.loader,
        nicoffload.datapath.transport, nicoffload.lab.jobs, nicoffload.cli.agg, sys.modules[Communicator.__module__],
        sys.modules[Aggregator.__module__], sys.modules[RingCommunicator.__module__],
        sys.modules[UserspaceAggregator.__module__])
for m in mods:
    assert where in Path(m.__file__).resolve().parents, (m.__name__, m.__file__, where)
x = proto.xdp_dir().resolve()
assert where in x.parents, (x, where)
for f in sys.argv[2].split(","):  # every C file of xdp/: the programs and the headers they splice in
    assert (x / f).is_file(), f
assert proto.HDR_LEN == 48
build_parser()
print("ok", nicoffload.__version__)
"""


def _source_copy(dest: Path) -> Path:
    """The committed tree plus the working tree's changes, as a user's checkout would hold it."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    if not any(files):
        pytest.skip("not a git checkout")
    for f in filter(None, files):
        src = ROOT / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            (dest / f.decode()).write_bytes(src.read_bytes())
    return dest


def _run_check(path: Path, where: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(path)}
    c_files = ",".join(sorted(f.name for f in (ROOT / "xdp").iterdir() if f.suffix in (".c", ".h")))
    r = subprocess.run([sys.executable, "-c", CHECK, str(where), c_files], cwd="/", env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_plain_checkout_imports_from_its_own_tree(tmp_path):
    src = _source_copy(tmp_path / "checkout")
    assert "ok" in _run_check(src, src)


def test_a_non_editable_install_holds_everything(tmp_path):
    src = _source_copy(tmp_path / "src")
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(target), str(src)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    pkg = target / "nicoffload"
    for sub in ("xdp", "packets", "testbed", "lab"):
        assert (pkg / sub / "__init__.py").is_file(), f"nicoffload/{sub} missing from the install"
    assert not (target / "packets").exists() and not (target / "testbed").exists(), \
        "top-level packages named packets/testbed would clash with other projects"
    assert "ok" in _run_check(target, target)
    from importlib.metadata import distributions

    import nicoffload
    (dist,) = [d for d in distributions(path=[str(target)]) if d.metadata["Name"] == "nicoffload"]
    assert dist.version == nicoffload.__version__, "the built wheel's version is not nicoffload.__version__"


def test_the_installed_version_is_the_package_version():
    """One version: pyproject reads it from nicoffload/__init__.py (dynamic), so the installed
    metadata and ``nicoffload.__version__`` (what ``--version`` and the service print) agree."""
    from importlib.metadata import version

    import nicoffload
    assert version("nicoffload") == nicoffload.__version__


def test_every_subpackage_is_installed():
    """A subpackage missing from pyproject's list would be missing from a non-editable install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nicoffload").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (tests/ holds no packages: the kits beside them are
    imported by name), so two folders with one name break collection for the whole suite; a
    run of tests/unit alone does not collide, and this says so there."""
    seen: dict[str, Path] = {}
    for f in sorted((ROOT / "tests").rglob("*.py")):
        if f.name in ("conftest.py", "__init__.py"):
            continue
        assert f.name not in seen, f"{f.relative_to(ROOT)} and {seen[f.name].relative_to(ROOT)}: one basename"
        seen[f.name] = f
