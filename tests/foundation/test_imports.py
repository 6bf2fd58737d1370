"""Import structure of `h3lab/`: no import cycle between its modules, and the session loads no front end.

The cycle check reads every module under `h3lab/` with `ast` (nothing is imported) and draws an edge A -> B for each
`import` / `from ... import` in A that names an `h3lab` module B, relative imports resolved against A's package. It
counts **module-level and function-level imports alike** (an import inside a function, a method or a `try` block is
an edge): a lazy import only moves the cycle to run time, where a partially initialised module fails the same way,
and two modules that need each other are one module in two files. Not counted: imports under `if TYPE_CHECKING:`
(never executed). Resolution of `from P import N`:
- `P.N` is a module: the edge goes to `P.N`;
- `N` is bound at module level of package `P`'s `__init__` (an assignment, a def, an eager import): the edge goes
  to `P`;
- `N` is a lazy attribute of `P` (PEP 562: a module-level `__getattr__` that imports it under `if name == "N"` /
  `if name in (...)`, or imports a module bound as `N`): the edge goes to the modules that branch imports -- the
  dependency a lazy re-export stands for -- and the imports inside `__getattr__` are not edges of `P` itself (they
  run when a caller asks for the name, after `P` finished importing);
- anything else (a module that does not exist, e.g. an optional room): the edge goes to `P`.
A submodule's implicit import of its parent package is not an edge (Python runs the parent first; the parent's own
edges are in the graph).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "h3lab"


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    eager_names: set[str] = field(default_factory=set)  # bound at module level (a package's re-exports)
    lazy: dict[str, list[str]] = field(default_factory=dict)  # PEP 562 name -> modules its __getattr__ imports


def _modules(root: Path, package: str) -> dict[str, Module]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        out[name] = Module(name, path, is_package, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, skip_getattr: bool = False):
    """Every Import / ImportFrom under `node`, except under `if TYPE_CHECKING:` and (optionally) inside a top-level
    `def __getattr__`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for n in child.orelse:  # the `else:` of a TYPE_CHECKING test does run
                yield from _imports_of(n)
            continue
        if skip_getattr and isinstance(child, ast.FunctionDef) and child.name == "__getattr__":
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def _base(module: Module, node: ast.ImportFrom) -> str | None:
    """The absolute module a `from X import ...` names (relative levels resolved against `module`'s package)."""
    if node.level == 0:
        return node.module
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _names_tested(test: ast.expr) -> set[str]:
    """The names an `if name == "X"` / `if name in ("X", "Y")` test of a PEP 562 `__getattr__` selects."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and len(test.comparators) == 1):
        return set()
    right = test.comparators[0]
    if isinstance(test.ops[0], ast.Eq) and isinstance(right, ast.Constant):
        return {right.value}
    if isinstance(test.ops[0], ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in right.elts if isinstance(e, ast.Constant)}
    return set()


def _bind_names(modules: dict[str, Module]) -> None:
    for module in modules.values():
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.eager_names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                module.eager_names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                module.eager_names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                for branch in ast.walk(node):
                    names = _names_tested(branch.test) if isinstance(branch, ast.If) else set()
                    for imp in (i for stmt in getattr(branch, "body", []) for i in _imports_of(stmt)):
                        targets = _targets(modules, module, imp, lazy=False)
                        bound = {a.asname or a.name for a in imp.names}
                        for name in names | bound:
                            module.lazy.setdefault(name, []).extend(targets)


def _targets(modules: dict[str, Module], module: Module, node: ast.AST, lazy: bool = True) -> list[str]:
    """The `h3lab` modules an import statement depends on (see the module docstring)."""
    out = []
    if isinstance(node, ast.Import):
        out = [a.name for a in node.names]
    else:
        base = _base(module, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in modules:
                out.append(sub)
            elif lazy and base in modules and alias.name not in modules[base].eager_names \
                    and modules[base].lazy.get(alias.name):
                out.extend(modules[base].lazy[alias.name])
            else:
                out.append(base)
    return [t for t in out if t in modules]


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, str]]:
    """module -> {imported module: "path:line" of the first import statement that makes the edge}."""
    modules = _modules(root, package)
    _bind_names(modules)
    graph: dict[str, dict[str, str]] = {}
    for module in modules.values():
        edges = graph.setdefault(module.name, {})
        for node in _imports(module.tree, skip_getattr=module.is_package):
            for target in _targets(modules, module, node):
                if target != module.name:
                    edges.setdefault(target, f"{module.path.relative_to(root)}:{node.lineno}")
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        members, start = set(component), min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats: that closes a cycle
            nxt = sorted(w for w in graph[path[-1]] if w in members)
            step = next((w for w in nxt if w not in seen), None)
            if step is None or start in nxt:
                cycles.append(path + [start] if start in nxt else path[path.index(nxt[0]):] + [nxt[0]])
                break
            path.append(step)
            seen.add(step)
    return sorted(cycles)


def describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    edges = "; ".join(f"{a} -> {b} at {graph[a][b]}" for a, b in zip(cycle, cycle[1:]))
    return " -> ".join(cycle) + f"  ({edges})"


def test_no_import_cycles_under_h3lab():
    graph = import_graph()
    assert "h3lab.app.session" in graph and "h3lab.checkpoint.loader" in graph and len(graph) > 30
    cycles = find_cycles(graph)
    assert not cycles, "import cycles under h3lab/:\n" + "\n".join(describe(c, graph) for c in cycles)


def _write_package(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_check_sees_function_level_lazy_and_relative_imports(tmp_path):
    """The scanner itself: it must find the cycles it claims to count and ignore what it claims not to."""
    _write_package(tmp_path, {
        "__init__.py": """
            from .base import VERSION
            def __getattr__(name):
                if name == "Engine":
                    from .engine import Engine
                    return Engine
                raise AttributeError(name)
            """,
        "base.py": "VERSION = '1'\n",
        "engine.py": """
            from . import VERSION          # eager name of the package: no cycle
            class Engine:
                def report(self):
                    from .front import show  # function-level: counted
                    return show()
            """,
        "front.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .engine import Engine  # never executed: not counted
            from .sub import tool
            def show():
                return tool()
            """,
        "sub/__init__.py": "",
        "sub/tool.py": """
            def tool():
                from .. import Engine       # a lazy attribute: stands for pkg.engine
                return Engine
            """,
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.base": "pkg/__init__.py:2"}  # the __getattr__ import is not the package's edge
    assert set(graph["pkg.engine"]) == {"pkg", "pkg.front"}
    assert set(graph["pkg.front"]) == {"pkg.sub.tool"}  # `from .sub import tool` is the submodule
    assert set(graph["pkg.sub.tool"]) == {"pkg.engine"}
    cycles = find_cycles(graph)
    assert cycles == [["pkg.engine", "pkg.front", "pkg.sub.tool", "pkg.engine"]]
    text = describe(cycles[0], graph)
    assert "pkg.engine -> pkg.front at pkg/engine.py:5" in text and "pkg/sub/tool.py:3" in text

    (tmp_path / "pkg" / "sub" / "tool.py").write_text("def tool():\n    return None\n")
    assert find_cycles(import_graph(tmp_path, "pkg")) == []


FRONT_ENDS = ("h3lab.frontends", "h3lab.research.plots", "prompt_toolkit", "ipywidgets", "matplotlib")


def test_importing_the_session_loads_no_front_end():
    probe = (
        "import sys, h3lab.app.session\n"
        f"print(sorted(m for m in {FRONT_ENDS!r} if any(k == m or k.startswith(m + '.') for k in sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"`import h3lab.app.session` loaded front ends: {proc.stdout.strip()}"


# ------------------------------------------------------------------------------------------------ the layer table
# Rooms, bottom layer first: a room may import only the rooms it lists, all of them below it (so no import runs up a
# layer). A module belongs to the room of its longest matching prefix. docs/ARCHITECTURE.md ("Layers") holds the same
# table; the test reads it back.
LAYERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # room -> (module prefixes, rooms it may import)
    "base": (("h3lab", "h3lab.errors", "h3lab.io_utils", "h3lab.hashing", "h3lab.config"), ()),
    "schema": (("h3lab.schema",), ("base",)),
    "execution": (("h3lab.execution",), ("base",)),
    "checkpoint": (("h3lab.checkpoint",), ("base",)),
    "run": (("h3lab.run",), ("base", "execution")),
    "model": (("h3lab.model",), ("base", "checkpoint", "execution")),
    "adapters": (("h3lab.adapters",), ("base", "execution", "model", "run", "schema")),
    "stochastic": (("h3lab.stochastic",), ("base", "run", "schema")),
    "presets": (("h3lab.presets",), ("base", "execution", "run", "schema")),
    "settings": (("h3lab.schema.generation_settings", "h3lab.schema.builtin", "h3lab.schema.argv"), ("base",
        "execution", "presets", "schema")),
    "distributed": (("h3lab.distributed",), ("base", "checkpoint", "execution", "model", "run")),
    "shapes": (("h3lab.shapes",), ("base", "checkpoint")),
    "training": (("h3lab.training",), ("adapters", "base", "checkpoint", "execution", "model", "run", "schema",
        "settings", "shapes", "stochastic")),
    "components": (("h3lab.components",), ("base", "checkpoint", "distributed", "execution", "model", "presets",
        "run")),
    "research": (("h3lab.research",), ("base", "checkpoint", "components", "distributed", "execution", "model", "run",
        "settings", "shapes", "training")),
    "app": (("h3lab.app",), ("adapters", "base", "checkpoint", "components", "execution", "model", "presets",
        "research", "run", "schema", "settings", "stochastic", "training")),
    "frontends": (("h3lab.frontends", "h3lab.__main__", "h3lab.schema.train_flags", "h3lab.schema.encode_flags",
        "h3lab.schema.cli_flags"), ("adapters", "app", "base", "checkpoint", "components", "distributed", "execution",
        "model", "presets", "research", "run", "schema", "settings", "shapes", "stochastic", "training")),
}
# The modules that may import the strict kernels (`h3kernels`): the runtime's op table, the device digest of
# hashing, and the distributed room's strict collectives and row-parallel tree.
KERNEL_IMPORTERS = {"h3lab.execution.runtime", "h3lab.execution.fast", "h3lab.hashing",
                    "h3lab.distributed.collectives", "h3lab.distributed.placement", "h3lab.distributed.shards"}


def room_of(module: str) -> str | None:
    best = None
    for room, (prefixes, _) in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (room, prefix)
    return best[0] if best else None


def test_every_import_follows_the_layer_table():
    graph = import_graph()
    order = list(LAYERS)
    for room, (_, allowed) in LAYERS.items():  # the table itself: every allowed room is below
        up = [r for r in allowed if order.index(r) >= order.index(room)]
        assert not up, f"layer table: {room} may import {up}, which are not below it"
    unplaced = sorted(m for m in graph if room_of(m) is None)
    assert not unplaced, f"modules in no room of the layer table: {unplaced}"
    bad = []
    for a, targets in graph.items():
        ra = room_of(a)
        for b, where in targets.items():
            rb = room_of(b)
            if rb != ra and rb not in LAYERS[ra][1]:
                bad.append(f"{a} ({ra}) -> {b} ({rb}) at {where}")
    assert not bad, "imports outside the layer table:\n" + "\n".join(bad)


def test_only_the_declared_modules_import_the_kernels():
    importers = set()
    for module in _modules(ROOT, PACKAGE).values():
        for node in _imports(module.tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if getattr(node, "level", 0) == 0 and any(n == "h3kernels" or n.startswith("h3kernels.") for n in names):
                importers.add(module.name)
    stray = sorted(importers - KERNEL_IMPORTERS)
    assert not stray, f"h3kernels imported outside the declared modules: {stray}"


def _architecture_table() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The "Layers" table of docs/ARCHITECTURE.md: room -> (modules, rooms it may import), in its row order."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    table = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("room", "") or set(cells[0]) <= {"-"}:
            continue
        modules = tuple(m.strip("`") for m in cells[1].split(", "))
        allowed = () if cells[2] in ("—", "-") else tuple(r.strip() for r in cells[2].split(", "))
        table[cells[0]] = (modules, allowed)
    return table


# The generation path applies adapters through `h3lab.adapters`; in the session layer only the RL report, clip
# encoding and sealed-run verification import `h3lab.training`.
INFERENCE = ("h3lab.adapters", "h3lab.app.generation", "h3lab.app.pipeline", "h3lab.app.prepared", "h3lab.app.phases",
             "h3lab.app.reruns", "h3lab.app.rollout", "h3lab.app.keep", "h3lab.app.results", "h3lab.app.request_checks",
             "h3lab.app.memory_plan")


def test_inference_never_imports_training():
    graph = import_graph()
    bad = sorted(f"{a} -> {b} at {where}" for a, targets in graph.items() if a.startswith(INFERENCE)
                 for b, where in targets.items() if b == "h3lab.training" or b.startswith("h3lab.training."))
    assert not bad, "inference imports h3lab.training:\n" + "\n".join(bad)


def test_the_architecture_notes_hold_the_layer_table():
    assert _architecture_table() == LAYERS, "docs/ARCHITECTURE.md's Layers table differs from LAYERS"
