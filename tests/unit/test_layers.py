"""The layers stay as the README draws them: the core (flat modules of nicoffload/) imports
nothing above it; packets/ and testbed/ sit beside the core and import only it; the lab imports
no command; no library module imports a command (cli*.py)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("packets", "testbed"):
        parts = ["nicoffload", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the nicoffload modules ``path`` imports (anywhere in the file)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {n for n in out if n.startswith("nicoffload")}


def layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "core"
    second = parts[1]
    if second.startswith("cli"):
        return "cli"
    if second in ("lab", "packets", "testbed", "xdp"):
        return second
    return "core"


#: what each layer may import
ALLOWED = {
    "core": {"core", "xdp"},
    "packets": {"core", "packets"},
    "testbed": {"core", "testbed"},
    "lab": {"core", "packets", "testbed", "lab"},
    "cli": {"core", "packets", "testbed", "lab", "cli"},
}

FILES = sorted([*ROOT.glob("nicoffload/**/*.py"), *ROOT.glob("packets/*.py"), *ROOT.glob("testbed/*.py")])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_upward(path):
    mine = layer(module_name(path))
    bad = sorted(n for n in imports(path) if layer(n) not in ALLOWED[mine])
    assert not bad, f"{module_name(path)} ({mine}) imports {bad}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """A core module that imports the lab and a command is caught (relative imports resolved)."""
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        (tmp_path / "nicoffload").mkdir()
        core = tmp_path / "nicoffload" / "codec.py"
        core.write_text("from .lab import plan\nfrom . import cli_agg\nfrom .errors import InputError\n")
        got = imports(core)
        assert {"nicoffload.lab.plan", "nicoffload.cli_agg", "nicoffload.errors"} <= got
        bad = sorted(n for n in got if layer(n) not in ALLOWED[layer(module_name(core))])
        assert bad == ["nicoffload.cli_agg", "nicoffload.lab", "nicoffload.lab.plan"]
    finally:
        ROOT = saved
