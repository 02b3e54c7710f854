"""The layers stay as the tree draws them (README, Layout): commands -> lab -> integrations ->
core subsystems -> the host data path -> wire and plumbing. Each subpackage may import only the
layers below it and the core subsystems it is declared to build on; packets/ and testbed/ sit
beside the core. A lazy import inside a function counts like any other."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the unit (first name under nicoffload, or a top-level module) -> its layer
LAYER = {
    "base": "base", "errors": "base", "jobspec": "base", "optim": "base", "_exports": "base", "collective": "base",
    "wire": "base", "ebpf": "base", "xdp": "base",
    "datapath": "datapath",
    "agg": "agg", "ring": "ring", "userspace": "userspace", "worker": "worker", "afxdp": "afxdp", "local": "local",
    "communicators": "factory", "fallback": "factory", "service": "service", "torch": "torch", "ddp": "torch",
    "packets": "packets", "testbed": "testbed",
    "lab": "lab", "cli": "cli", "doctor": "doctor",
}

#: what each layer may import (itself included)
ALLOWED = {
    "base": {"base"},
    "datapath": {"base", "datapath"},
    # the core subsystems: the XDP aggregator's control plane, the ring offload, the user-space
    # aggregator, and the worker library
    "agg": {"base", "agg"},
    "ring": {"base", "datapath", "ring"},
    "userspace": {"base", "datapath", "userspace"},
    # the AF_XDP engine (the XDP aggregator hands jobs to it as a process, importing nothing of it)
    "afxdp": {"base", "afxdp"},
    "worker": {"base", "datapath", "worker"},
    # the ranks of one host: shared memory, and the communicator over it and its lanes
    "local": {"base", "datapath", "local"},
    # the communicator factory (communicator(mode=...)), one floor above what it builds
    "factory": {"base", "datapath", "worker", "ring", "local", "factory"},
    # integrations: the aggregator service (over the XDP control plane), the torch backend (a
    # client of the service, over both communicators)
    "service": {"base", "agg", "service"},
    "torch": {"base", "datapath", "worker", "ring", "local", "factory", "service", "torch"},
    # beside the core: packet generators and the testbed
    "packets": {"base", "packets"},
    "testbed": {"base", "testbed"},
    # the read-only preflight of a host (nicoffload doctor): the kernel, the NIC, the limits; it
    # reads the AF_XDP engine's UMEM size from its source
    "doctor": {"base", "afxdp", "doctor"},
    "lab": {"base", "datapath", "agg", "ring", "userspace", "afxdp", "worker", "local", "factory", "service", "torch",
            "packets", "testbed", "lab"},
    "cli": {"base", "datapath", "agg", "ring", "userspace", "afxdp", "worker", "local", "factory", "service", "torch",
            "packets", "testbed", "lab", "doctor", "cli"},
}

#: documented entry points kept at an old home one floor down, resolved there on first use:
#: (module, the module it may import for them)
ALIASES = {("nicoffload.worker", "nicoffload.communicators")}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("packets", "testbed"):
        parts = ["nicoffload", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations only: never
    imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports(path: Path) -> set[str]:
    """Absolute names of the nicoffload modules ``path`` imports (anywhere in the file)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {n for n in out if n.split(".")[0] == "nicoffload"}


def layer(name: str) -> str:
    parts = name.split(".")
    unit = parts[1] if len(parts) > 1 else "base"
    if unit not in LAYER and len(parts) == 2:
        unit = "base"  # a name of the root package itself (__version__)
    return LAYER[unit]


FILES = sorted([*ROOT.glob("nicoffload/**/*.py"), *ROOT.glob("packets/*.py"), *ROOT.glob("testbed/*.py")])


def test_every_unit_has_a_layer():
    units = {p.name if p.is_dir() else p.stem for p in (ROOT / "nicoffload").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert units <= set(LAYER), f"give {sorted(units - set(LAYER))} a layer in LAYER"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_upward(path):
    me = module_name(path)
    mine = layer(me)
    bad = sorted(n for n in imports(path) if layer(n) not in ALLOWED[mine] and
                 not any(me == a and (n == b or n.startswith(b + ".")) for a, b in ALIASES))
    assert not bad, f"{module_name(path)} ({mine}) imports {bad}"


def test_no_folder_holds_more_than_15_modules():
    for d in [ROOT / "nicoffload", *(p for p in (ROOT / "nicoffload").rglob("*") if p.is_dir())]:
        mods = [p for p in d.glob("*.py") if p.stem not in ("__init__", "__main__")]
        assert len(mods) <= 15, f"{d.relative_to(ROOT)} holds {len(mods)} modules: split it"


def test_the_checker_sees_an_upward_import(tmp_path):
    """A core module that imports the lab, a command and the worker library is caught (relative
    imports resolved); its own subpackage and the wire are fine."""
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        (tmp_path / "nicoffload" / "agg").mkdir(parents=True)
        core = tmp_path / "nicoffload" / "agg" / "maps.py"
        core.write_text("from ..lab.bench import plan\nfrom ..cli import agg\nfrom .jobtable import JobTable\n"
                        "from nicoffload.wire import proto\n"
                        "def f():\n    from nicoffload.worker import Communicator\n")
        got = imports(core)
        assert {"nicoffload.lab.bench.plan", "nicoffload.cli.agg", "nicoffload.agg.jobtable.JobTable",
                "nicoffload.wire.proto", "nicoffload.worker.Communicator"} <= got
        bad = sorted(n for n in got if layer(n) not in ALLOWED[layer(module_name(core))])
        assert bad == ["nicoffload.cli", "nicoffload.cli.agg", "nicoffload.lab.bench", "nicoffload.lab.bench.plan",
                       "nicoffload.worker", "nicoffload.worker.Communicator"]
    finally:
        ROOT = saved


def _module_of(name: str, known: set[str]) -> str | None:
    """The module of ``known`` that an imported name lives in (``a.b.C`` -> ``a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports), one path per circle."""
    found, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                found.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def folder_graphs(files) -> dict[str, dict[str, set[str]]]:
    """Per folder, the imports between its own modules (a package's __init__ left out: it only
    maps names to its modules)."""
    mods = {module_name(p): p for p in files if p.name != "__init__.py"}
    graphs: dict[str, dict[str, set[str]]] = {}
    for m, p in mods.items():
        folder = m.rpartition(".")[0]
        peers = {n for n in mods if n.rpartition(".")[0] == folder}
        deps = {_module_of(n, peers) for n in imports(p)} - {None, m}
        graphs.setdefault(folder, {})[m] = {d for d in deps if d in peers}
    return graphs


def test_no_import_circle_inside_a_folder():
    circles = [c for g in folder_graphs(FILES).values() for c in cycles(g)]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_circle_checker_sees_a_circle():
    g = {"w.comm": {"w.hier"}, "w.hier": {"w.comm"}, "w.stream": set(), "w.shards": {"w.comm"}}
    assert cycles(g) == [["w.comm", "w.hier", "w.comm"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
