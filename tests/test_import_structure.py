"""No import circle among shardwise's modules, counting the imports made inside functions.

A function-local import hides a dependency from the reader and from Python's import order, not
from the design: a lower layer that imports a higher one inside a function still depends on it.
So the graph here has an edge for every ``import``/``from ... import`` of a shardwise module
anywhere in a file (module level, inside functions, inside ``try``), except ``if TYPE_CHECKING:``
blocks (annotations only, never run), plus the edge from a module to each package above it
(importing ``shardwise.plan.memory`` runs ``shardwise/plan/__init__.py``). Pure AST, no import.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "shardwise"

# The root package is the public facade (``shardwise.Session``, ``shardwise.ConfigError``) and every
# module sits under it, so its imports would put everything in one circle. It may import exactly
# these: the errors (which import nothing of shardwise) and, inside its ``__getattr__``, the Session,
# resolved on first use so that ``import shardwise`` (and every torch-free module under it: the
# config, the planner) does not import torch. Nothing inside the package reaches either through it.
FACADE = {"shardwise": {"shardwise.errors", "shardwise.runtime.session"}}


def _module_names() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every shardwise module ``name`` imports anywhere outside ``TYPE_CHECKING`` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
               for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub``.
            out |= {f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names}
    return {m for m in out if m in mods and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the shardwise modules it imports (explicitly, or as a package above one)."""
    mods = _module_names()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    for facade, allowed in FACADE.items():
        assert graph[facade] <= allowed, (f"{facade}/__init__.py imports {sorted(graph[facade] - allowed)}: the "
                                          "public facade may import only " + ", ".join(sorted(allowed)))
        graph[facade] = set()
    for name in list(graph):
        for target in list(graph[name]) + [name]:
            parts = target.split(".")
            graph[name] |= {".".join(parts[:i]) for i in range(1, len(parts))} - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_circle_counting_function_local_imports():
    graph = import_graph()
    assert len(graph) > 150, "the walk found too few modules: is SRC right?"
    found = circles(graph)
    detail = []
    for component in found:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        detail.append(f"{len(component)} modules: " + "; ".join(edges))
    assert not found, ("import circles (function-local imports count; break each by moving the shared rule "
                       "down a layer, never by hiding the import):\n" + "\n".join(detail))


def test_the_graph_sees_function_local_and_package_edges():
    """The walk must see what it claims to: a function-local import, and a package's own imports
    (a test that missed them would pass on any tree)."""
    graph = import_graph()
    # verify.cmd_verify's arguments are checked by preflight, imported inside the function.
    assert "shardwise.preflight" in graph["shardwise.verify"]
    assert "shardwise.plan" in graph["shardwise.plan.memory"]  # the package above a module
    planted = {"a.x": {"a.y"}, "a.y": {"a.x"}, "a": set()}
    assert circles(planted) == [["a.x", "a.y"]]
