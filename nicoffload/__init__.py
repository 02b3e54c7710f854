"""nicoffload: eBPF/XDP in-network AllReduce on any Linux NIC.

One namespace: the project keeps the BPF C, the scapy layers and the testbed in top-level folders
(``xdp/``, ``packets/``, ``testbed/``); installed, they are ``nicoffload.xdp``,
``nicoffload.packets`` and ``nicoffload.testbed``. In a plain checkout (nothing installed) the
finder below maps the same names onto those folders, so ``import nicoffload.testbed`` works from
the source tree too.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.2.0"

#: subpackages that live in a top-level folder of the source tree
MAPPED = {"xdp": "xdp", "packets": "packets", "testbed": "testbed"}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``nicoffload.<name>`` in ``<checkout>/<folder>`` when it is not installed inside
    the package (a plain checkout, or an editable install); an installed package holds them."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, name = fullname.partition(".")
        if pkg != __name__ or name not in MAPPED:
            return None
        folder = self.root / MAPPED[name]
        init = folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(folder)])


def _install_finder() -> None:
    here = Path(__file__).resolve().parent
    if all((here / name / "__init__.py").is_file() for name in MAPPED):
        return  # an installed package: the subpackages are inside it
    root = here.parent
    if any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        return
    # first: the subpackages come from the tree this package was imported from, even when
    # another copy of nicoffload is installed (an editable install of this tree maps the same)
    sys.meta_path.insert(0, _SourceTreeFinder(root))


_install_finder()
