"""The import layers of ``spmd_rl/``, read from the source (AST only: no module is imported here).

* ``spmd_rl/distributed/`` is the bottom layer: its modules import nothing of the package outside
  ``distributed/`` (engines, rollout, algorithms, reward, distillation, the trainer, planning and the
  run's groups live above it and register into it, never the other way).
* No import cycle among the modules of ``spmd_rl/``, every import counted: module level, inside
  functions, under ``TYPE_CHECKING``. Relative imports are resolved; ``from pkg import name`` where
  ``name`` is a submodule imports the submodule (else it reads ``pkg/__init__``); importing ``a.b.c``
  also imports ``a`` and ``a.b``. An importer's own parent packages are left out of that last rule:
  Python runs them before the importer, so they never wait on it (``data/__init__`` importing
  ``data.files``, which imports ``data.tasks``, is no loop). Reading a name from one's own package
  (``from spmd_rl.engine import ENGINES`` inside ``spmd_rl/engine/``) still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spmd_rl"

BOTTOM = "spmd_rl.distributed"
LOW_LAYERS = frozenset({"spmd_rl"})
"""Modules outside ``distributed/`` that it may import: the package's root alone (a docstring, no
imports). ``spmd_rl.config`` imports nothing of the package either and would qualify, but
``distributed/`` needs none of it: plain arguments suffice."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _in_bottom(name: str) -> bool:
    return name == BOTTOM or name.startswith(BOTTOM + ".")


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(importer: str, node: ast.AST) -> set[str]:
    """The ``spmd_rl`` modules one import statement runs (see the module docstring)."""
    named: list[str] = []  # modules imported as such (their parents come with them)
    read: list[str] = []  # packages a name is read from
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = importer if _is_package(importer) else importer.rpartition(".")[0]
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            if sub in MODULES:
                named.append(sub)
            else:
                read.append(module)
        if not named:
            read.append(module)
    own = set(_ancestors(importer))
    out = set(read)
    for name in named:
        out.add(name)
        out.update(a for a in _ancestors(name) if a not in own)
    return {m for m in out if m in MODULES and m != importer}


def _imports(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= _targets(name, node)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(_loop(graph, sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One import loop inside a strongly connected component, for the message."""
    inside = set(component)
    path, seen = [component[0]], {component[0]: 0}
    while True:
        nxt = sorted(graph[path[-1]] & inside)[0]
        if nxt in seen:
            return path[seen[nxt]:] + [nxt]
        seen[nxt] = len(path)
        path.append(nxt)


def test_the_graph_sees_imports_everywhere() -> None:
    """The reader itself: lazy, TYPE_CHECKING, relative and submodule imports are all edges."""
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .comm import RemoteFailure\n"
           "def f():\n    from spmd_rl.engine import lora\n    import spmd_rl.rollout.pool\n")
    edges: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            edges |= _targets("spmd_rl.distributed.bridge", node)
    assert edges == {"spmd_rl.distributed.comm", "spmd_rl.engine.lora", "spmd_rl.engine", "spmd_rl.rollout.pool",
                     "spmd_rl.rollout"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_distributed_is_the_bottom_layer() -> None:
    assert all(not _imports(m) for m in LOW_LAYERS), "a module the bottom layer may import imports the package"
    bad = {name: sorted(m for m in targets if not _in_bottom(m) and m not in LOW_LAYERS)
           for name, targets in GRAPH.items() if _in_bottom(name)}
    bad = {name: targets for name, targets in bad.items() if targets}
    assert not bad, f"spmd_rl/distributed/ imports upward (move the code above it, or register downward): {bad}"


def test_no_import_cycles() -> None:
    loops = _cycles(GRAPH)
    assert not loops, "import cycles in spmd_rl/: " + "; ".join(" -> ".join(loop) for loop in loops)
