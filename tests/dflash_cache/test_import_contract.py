"""The package's import contract, read from the source with `ast` (nothing is imported):

* the phases (dflash_cache.extract, dflash_cache.train) never import each other: what both use lives
  in phase-neutral modules (dflash_cache.target, dflash_cache.data, dflash_cache.devices, ...);
* nothing else imports a phase except the command line (dflash_cache.cli), so the store in
  particular never does;
* the imports a module runs when it is imported form no cycle.

The layering rules count every import (at module level, inside functions, under TYPE_CHECKING); the
cycle rule counts only those that run at import time: module level, outside `if TYPE_CHECKING:`.
A failure names each offending edge as `importer -> imported (file:line)`.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dflash_cache"
PHASES = ("extract", "train")
ENTRY_POINTS = ("cli",)  # may import the phases: it is what runs them


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # file:line, the file relative to the root
    at_import: bool  # runs when the importer is imported

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.where})"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` under `root` by dotted name, through linked folders (the phases)."""
    found: dict[str, Path] = {}
    for folder, subfolders, files in os.walk(root / package, followlinks=True):
        here = Path(folder)
        subfolders[:] = sorted(d for d in subfolders if (here / d / "__init__.py").is_file())
        prefix = ".".join(here.relative_to(root).parts)
        for name in files:
            if name.endswith(".py"):
                found[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = here / name
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement, and whether it runs at import time."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, at_import: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append((node, at_import))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            at_import = False
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, at_import)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, at_import)

    visit(tree, True)
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the longest of its prefixes, that is a module of the package."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every import of a package module by a package module."""
    modules = package_modules(root, package)
    edges = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node, at_import in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the importer's package, up level - 1 more
                    parent = module.split(".")[: None if is_package else -1]
                    parent = parent[: len(parent) - (node.level - 1)]
                    base = ".".join([*parent, *([base] if base else [])])
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            for name in dict.fromkeys(names):
                target = _known(name, modules)
                if target is not None and target != module:
                    edges.append(Edge(module, target, f"{path.relative_to(root)}:{node.lineno}", at_import))
    return edges


def _phase(module: str, package: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == package and parts[1] in PHASES else None


def layering_violations(edges: list[Edge], package: str) -> list[Edge]:
    """Imports of a phase by the other phase, or by anything but a phase or the command line."""
    bad = []
    for e in edges:
        to = _phase(e.imported, package)
        if to is None:
            continue
        frm = _phase(e.importer, package)
        if frm is None and e.importer not in {f"{package}.{name}" for name in ENTRY_POINTS} or \
                frm is not None and frm != to:
            bad.append(e)
    return bad


def import_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """Each cycle among the imports that run at import time (one per strongly connected group), as
    the edges that close it."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.at_import:
            graph.setdefault(e.importer, {}).setdefault(e.imported, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(sorted(group), graph) for group in groups]


def _cycle_in(group: list[str], graph: dict[str, dict[str, Edge]]) -> list[Edge]:
    """One cycle through the group's first module, found breadth first inside the group."""
    start, members = group[0], set(group)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, e in sorted(graph.get(v, {}).items()):
                if w == start:
                    path = [e]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                if w in members and w not in came:
                    came[w] = e
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _shown(edges: list[Edge]) -> str:
    return "\n  ".join(map(str, edges))


def test_no_phase_imports_the_other_and_only_the_command_line_imports_a_phase():
    bad = layering_violations(import_edges(ROOT, PACKAGE), PACKAGE)
    assert not bad, ("imports across the phase boundary (move what both sides need into a phase-neutral module "
                     "such as dflash_cache.target, dflash_cache.data or dflash_cache.devices):\n  " + _shown(bad))


def test_no_import_cycle():
    cycles = import_cycles(import_edges(ROOT, PACKAGE))
    assert not cycles, "import cycles (at import time):\n" + "\n".join(
        f"  {' -> '.join([c[0].importer, *(e.imported for e in c)])}\n    {_shown(c)}" for c in cycles)


def test_the_package_is_seen_whole():
    """The walk follows the phase links and finds the modules the rules are about."""
    modules = package_modules(ROOT, PACKAGE)
    assert {"dflash_cache.cli", "dflash_cache.store.reader", "dflash_cache.extract.run", "dflash_cache.train.trainer",
            "dflash_cache.train.remote_code", "dflash_cache.target.model", "dflash_cache.data.dataset"} <= set(modules)
    edges = import_edges(ROOT, PACKAGE)
    assert any(e.importer == "dflash_cache.cli" and _phase(e.imported, PACKAGE) for e in edges)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_bad_edges_and_cycles(tmp_path):
    """A package with one of each mistake, and imports that are none (lazy, TYPE_CHECKING, relative)."""
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/cli.py": "def main():\n    from pkg.train import loop\n",
        "pkg/store/__init__.py": "",
        "pkg/store/reader.py": "def f():\n    from pkg.extract.run import go\n",
        "pkg/extract/__init__.py": "",
        "pkg/extract/run.py": "from ..store import reader\n",
        "pkg/train/__init__.py": "",
        "pkg/train/loop.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.extract import run\n",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "from pkg import c\n",
        "pkg/c.py": "from . import a\n",
        "pkg/lazy.py": "from pkg import a\ndef f():\n    import pkg.lazy2\n",
        "pkg/lazy2.py": "import pkg.lazy\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.typed2\n",
        "pkg/typed2.py": "import pkg.typed\n",
    })
    edges = import_edges(tmp_path, "pkg")
    assert sorted(map(str, layering_violations(edges, "pkg"))) == [
        "pkg.store.reader -> pkg.extract.run (pkg/store/reader.py:2)",
        "pkg.train.loop -> pkg.extract.run (pkg/train/loop.py:3)",
    ]
    assert [[str(e) for e in cycle] for cycle in import_cycles(edges)] == [[
        "pkg.a -> pkg.b (pkg/a.py:1)", "pkg.b -> pkg.c (pkg/b.py:1)", "pkg.c -> pkg.a (pkg/c.py:1)"]]
