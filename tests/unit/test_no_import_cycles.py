"""No import circle anywhere in the repository's Python (docs/architecture.md).

``src/checkfreq`` is import-linter's (``lint-imports``: the "no import cycles" contract of
pyproject.toml). Everything else is here: in each folder, the imports between its top-level modules,
read with :mod:`ast` (every import statement, those under ``if TYPE_CHECKING:`` and inside functions
included), form no cycle. A module names a sibling by its plain name (``from fault_train import ...``:
scripts, and ``tests/helpers.py``, run with their folder on ``sys.path``), by its folder's dotted path
(``from benchmarks.sim_counts import ...``) or relatively (``from . import ...``)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {"src", "__pycache__", "build", "dist", "node_modules"}
"""Folders not read: ``src`` is import-linter's; the others hold no source of the repository's."""
MUST_READ = {"benchmarks", "tests", "tests/scripts", ".ci"}
"""Folders whose modules import each other by name: were the walk to miss one, the test would say so."""

Graph = dict[str, set[str]]


def folders(root: Path) -> Iterator[Path]:
    """Every folder under ``root`` with Python modules in it, but hidden ones (``.ci`` read) and :data:`SKIPPED`."""
    for at, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED and (d == ".ci" or not d.startswith(".")))
        if any(f.endswith(".py") for f in files):
            yield Path(at)


def imported(module: Path, package: str, siblings: set[str]) -> set[str]:
    """The siblings (modules of its folder, ``package`` the folder's dotted path) that ``module`` imports."""
    found: set[str] = set()

    def named(dotted: str, names: list[str]) -> None:
        """An import of ``dotted`` (a module or a package), naming ``names`` from it (``from ... import``)."""
        for prefix in {"", package}:  # plain, or under the folder's dotted path
            if prefix and dotted == prefix:
                found.update(n for n in names if n in siblings)
            elif not prefix or dotted.startswith(prefix + "."):
                head = dotted[len(prefix) + 1 :].split(".")[0] if prefix else dotted.split(".")[0]
                if head in siblings:
                    found.add(head)

    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                named(alias.name, [])
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level == 1 and node.module is None:  # from . import sibling
                found.update(n for n in names if n in siblings)
            elif node.level == 1:  # from .sibling import name
                named(node.module, [])
            elif node.level == 0 and node.module is not None:
                named(node.module, names)
    found.discard(module.stem)
    return found


def import_graph(folder: Path, root: Path = ROOT) -> Graph:
    """Each top-level module of ``folder`` (by name) and the siblings it imports."""
    modules = {p.stem: p for p in folder.glob("*.py")}
    package = ".".join(folder.relative_to(root).parts)
    return {name: imported(path, package, set(modules) - {"__init__"}) for name, path in sorted(modules.items())}


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (its first module repeated at its end) for each group of modules that import each
    other around a loop (Tarjan's strongly connected components, then a path around each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_loop(graph, group) for group in groups]


def _loop(graph: Graph, group: set[str]) -> list[str]:
    """A path around ``group`` (strongly connected) from its first module back to it."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & group):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    raise AssertionError(f"{sorted(group)} is not a cycle")


FOLDERS = list(folders(ROOT))


def test_every_folder_that_imports_by_name_is_read() -> None:
    assert MUST_READ <= {f.relative_to(ROOT).as_posix() or "." for f in FOLDERS}


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f.relative_to(ROOT).as_posix() or ".")
def test_no_import_cycle(folder: Path) -> None:
    found = cycles(import_graph(folder))
    where = folder.relative_to(ROOT).as_posix()
    assert not found, f"import cycles in {where}/ (break each by concern): " + "; ".join(
        " -> ".join(cycle) for cycle in found
    )


def test_the_check_finds_every_kind_of_import(tmp_path: Path) -> None:
    """A cycle through each way of naming a sibling is found, and named; other imports make none."""
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    modules = {
        "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bench.b import B\n",
        "b": "def f():\n    import c\n",
        "c": "from . import a\nimport os.path\nfrom bench import d\n",
        "d": "from .e import x\nimport bench.e as e\n",
        "e": "import json\nfrom collections import d\n",
    }
    for name, text in modules.items():
        (folder / f"{name}.py").write_text(text)
    graph = import_graph(folder, tmp_path)
    assert graph == {"__init__": set(), "a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    (folder / "e.py").write_text("from bench.d import y\n")
    assert sorted(cycles(import_graph(folder, tmp_path))) == [["a", "b", "c", "a"], ["d", "e", "d"]]
