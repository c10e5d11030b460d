"""The folder tree is the data flow: imports run down it and never in a circle.

`make lint` checks the layers with import-linter; these tests add what its
layers contract does not: no cycle between any two modules of the project, and
no package outside the contract (a new folder must be placed in a layer).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = CONFIG["root_packages"]


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_module_imports_another_that_imports_it_back() -> None:
    """Counting lazy imports inside functions too: a cycle broken by a late
    import is still a cycle a reader has to hold in their head."""
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y"]]


def test_every_package_of_the_project_sits_in_a_layer() -> None:
    layered = {
        name.strip()
        for contract in CONFIG["contracts"]
        if contract["type"] == "layers"
        for layer in contract["layers"]
        for name in layer.split("|")
    }
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert on_disk - {"tests"} <= layered, "a package outside the layers contract"
    assert set(PACKAGES) == layered


def test_every_test_module_has_a_name_of_its_own() -> None:
    """pytest imports test files by their base name (no packages under tests/):
    two files of one name in different folders stop the whole run at collection."""
    from collections import Counter

    root = Path(__file__).resolve().parents[2]
    names = Counter(path.name for path in (root / "tests").rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
