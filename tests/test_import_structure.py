"""No import circle among shardwise's modules, counting the imports made inside functions; and a
function-local import only where it defers a dependency.

A function-local import hides a dependency from the reader and from Python's import order, not
from the design: a lower layer that imports a higher one inside a function still depends on it.
So the graph here has an edge for every ``import``/``from ... import`` of a shardwise module
anywhere in a file (module level, inside functions, inside ``try``), except ``if TYPE_CHECKING:``
blocks (annotations only, never run), plus the edge from a module to each package above it
(importing ``shardwise.plan.memory`` runs ``shardwise/plan/__init__.py``). Pure AST, no import.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
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


# ------------------------------------------------------------------ function-local imports
# What a function-local import may defer (anything else is imported at the top of the module):
# * an optional dependency: every extra in pyproject.toml except the test-only ``dev`` one (by its
#   import name), plus pyarrow, which the ``datasets`` extra brings and the Parquet reader imports;
# * torch or numpy, in a module that loads without them: the commands, the launcher, the planner
#   and the config answer without importing torch (seconds on a cold start; see docs/architecture.md).
# A probe inside ``try: ... except ImportError`` (a kernel or platform feature) is allowed too.
IMPORT_NAMES = {"lightning-fabric": "lightning_fabric", "mlflow-skinny": "mlflow"}
HEAVY = {"torch", "numpy"}


def optional_imports() -> set[str]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    names = set()
    for extra, requirements in extras.items():
        if extra == "dev":
            continue
        for req in requirements:
            dist = req.split(">")[0].split("=")[0].split("<")[0].strip()
            names.add(IMPORT_NAMES.get(dist, dist.replace("-", "_")))
    return names | {"pyarrow"}


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if node.level:
        module = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                          + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]


def _is_probe(node: ast.AST) -> bool:
    """A ``try`` that catches ImportError: a feature or platform probe."""
    caught = ("ImportError", "ModuleNotFoundError")
    if not isinstance(node, ast.Try):
        return False
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(t, ast.Name) and t.id in caught for t in types):
            return True
    return False


class _ImportWalk:
    """One module's imports: those run when it loads, and those inside functions."""

    def __init__(self, name: str, path: Path, mods: dict[str, Path]) -> None:
        self.name, self.path, self.mods = name, path, mods
        self.at_load: set[str] = set()
        self.local: list[tuple[str, int, list[str], bool]] = []
        self.walk(ast.parse(path.read_text(encoding="utf-8")), in_function=False, probe=False)

    def walk(self, node: ast.AST, in_function: bool, probe: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    self.walk(sub, in_function, probe)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(self.name, self.path, child, self.mods)
                if in_function:
                    self.local.append((self.name, child.lineno, targets, probe))
                else:
                    self.at_load.update(targets)
            else:
                function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                self.walk(child, in_function or function, probe or _is_probe(child))


LocalImport = tuple[str, int, list[str], bool]  # module, line, targets, inside an ImportError probe


def _module_level_and_local(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[LocalImport]]:
    """(module -> what it imports when it loads, [(module, line, targets, inside an ImportError probe)]
    of the imports inside functions); ``TYPE_CHECKING`` blocks left out."""
    walks = [_ImportWalk(name, path, mods) for name, path in mods.items()]
    return {w.name: w.at_load for w in walks}, [entry for w in walks for entry in w.local]


def _external(target: str) -> set[str]:
    names = {target.split(".")[0]}
    if target.startswith("safetensors.torch"):
        names.add("torch")
    return names


def test_function_local_imports_only_defer_a_dependency():
    mods = _module_names()
    at_load, local = _module_level_and_local(mods)
    cache: dict[str, set[str]] = {}

    def loaded(module: str) -> set[str]:
        """The third-party packages ``module`` imports when it loads (through its shardwise imports too)."""
        if module not in cache:
            cache[module] = set()
            parts = module.split(".")
            out: set[str] = set()
            for target in at_load[module] | {".".join(parts[:i]) for i in range(1, len(parts))}:
                if target in mods:
                    out |= loaded(target) if target != module else set()
                else:
                    out |= _external(target)
            cache[module] = out
        return cache[module]

    deferrable = optional_imports() | HEAVY
    hoist = []
    for module, line, targets, probe in local:
        brings = set().union(*((loaded(t) | {t} if t in mods else _external(t)) for t in targets))
        if probe or (brings - loaded(module)) & deferrable:
            continue
        hoist.append(f"{mods[module].relative_to(REPO)}:{line} imports {', '.join(targets)}")
    assert not hoist, ("function-local imports that defer nothing (no optional dependency, and no torch/numpy "
                       "in a module that loads without them): import them at the top of the module.\n"
                       + "\n".join(hoist))
    assert len(local) > 20, "the walk found too few function-local imports: does it see them?"
