"""The import graph of pallas_core, ops and layers has no cycle (docs/design.md section 2).

Every ``import`` and ``from ... import`` in a module counts, those inside function
bodies included: an import deferred into a function still ties the two modules
together, it only hides the circle from Python's import machinery. The modules are
parsed with :mod:`ast`; nothing is imported, so the test is cheap.

Edges: ``import a.b`` and ``from a import b`` point at module ``a.b`` when it is one
of ours, else at ``a`` (a name defined in ``a``'s ``__init__``); relative imports are
resolved against the importing module's package. The implicit import of a parent
package (``import a.b`` runs ``a/__init__`` first) is not an edge: a package's
``__init__`` may gather its submodules without making each of them depend on all
the others.
"""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_core", "ops", "layers")


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the checked packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name ``from <level dots><target> import ...`` refers to inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _own(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None when it is not ours)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                targets = [f"{source}.{alias.name}" for alias in node.names if alias.name != "*"] or [source]
            for target in targets:
                own = _own(target, modules)
                if own is not None and own != module:
                    edges.add(own)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly
    connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, node, start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve():
    assert _resolve("ops.attention.calls", False, 1, "masking") == "ops.attention.masking"
    assert _resolve("ops.attention", True, 1, "calls") == "ops.attention.calls"
    assert _resolve("ops.attention.calls", False, 2, None) == "ops"


def test_function_level_imports_count():
    graph = import_graph()
    # pallas_core.triton.__init__ imports its backend inside a function only.
    assert "pallas_core.triton.backend" in graph["pallas_core.triton"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    found = [cycle for cycle in cycles(import_graph())
             if any(module.split(".")[0] == package for module in cycle)]
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)
