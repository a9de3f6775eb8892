"""The layers hold: no module imports from a layer above its own (docs/architecture.md), and
no modules import each other in a circle.

Every import statement counts, inside functions and under TYPE_CHECKING too: a deferred import
is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Rank of each layer, by module prefix (the longest prefix wins). A module may import modules
#: of its own rank or below. The kernels (package `arle_kernels`) import nothing of arle's.
RANKS: dict[str, int] = {
    "arle_kernels": 0,
    # shared by every layer: they import only each other
    "arle": 1, "arle.config": 1, "arle.env": 1, "arle.errors": 1, "arle.logging": 1,
    "arle.sampling": 1, "arle.threads": 1,
    "arle.model": 2,
    "arle.executor": 3,
    "arle.engine": 4,
    # front ends and what serves only them
    "arle.server": 5, "arle.chat": 5, "arle.bench": 5, "arle.diagnostics": 5, "arle.paths": 5,
    "arle.gcwatch": 5,
    "arle.cli": 6, "arle.__main__": 6,
}


def rank(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANKS:
            return RANKS[".".join(parts[:n])]
    raise KeyError(f"{module}: in no layer; add it to RANKS in tests/test_layers.py")


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts[0] = "arle_kernels"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, name: str) -> set[str]:
    """The arle / arle_kernels modules that `path` (module `name`) imports, absolutely or
    relatively."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if node.module:
                found.add(base)
            else:  # `from . import plan`: the names are modules
                found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("arle", "arle_kernels")}


SOURCES = sorted([*ROOT.glob("arle/**/*.py"), *ROOT.glob("kernels/**/*.py")])


def test_the_source_tree_is_found() -> None:
    names = {module_name(p) for p in SOURCES}
    assert {"arle.engine.async_engine", "arle.executor.cuda", "arle_kernels.fused"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_upwards(path: Path) -> None:
    name = module_name(path)
    own = rank(name)
    upward = sorted(m for m in imported(path, name) if rank(m) > own)
    assert not upward, f"{module_name(path)} (rank {own}) imports from above: {upward}"


def test_the_check_sees_deferred_and_relative_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom . import plan\n\n\ndef f():\n"
                     "    from arle.engine.request import Delta\n    return Delta\n")
    found = imported(probe, "arle.executor.probe")
    assert found == {"arle.executor.plan", "arle.engine.request"}
    assert [m for m in found if rank(m) > rank("arle.executor.probe")] == ["arle.engine.request"]


def import_graph(sources: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of `sources` it imports, `from package import module` included."""
    names = {module_name(p, root): p for p in sources}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                edges.update(f"{node.module}.{a.name}" for a in node.names)
        edges |= imported(path, name)
        graph[name] = {m for m in edges if m in names and m != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle() -> None:
    """No two modules import each other, directly or through others, deferred imports and
    TYPE_CHECKING ones included: the modules of a circle can only be read together."""
    assert import_circles(import_graph(SOURCES)) == []


def test_the_circle_check_sees_a_deferred_circle(tmp_path: Path) -> None:
    (tmp_path / "arle" / "executor").mkdir(parents=True)
    (tmp_path / "arle" / "executor" / "a.py").write_text("from arle.executor import b\n")
    (tmp_path / "arle" / "executor" / "b.py").write_text("def f():\n    import arle.executor.c\n")
    (tmp_path / "arle" / "executor" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from arle.executor.a import X\n")
    graph = import_graph(sorted(tmp_path.glob("arle/**/*.py")), tmp_path)
    assert import_circles(graph) == [["arle.executor.a", "arle.executor.b", "arle.executor.c"]]
